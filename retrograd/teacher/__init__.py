"""The distillation teacher: a GGUF that shares the student's tokenizer, scored through
llama.cpp or torch, and the top-k sidecar that offline distillation trains from.

- vocabulary.py: the tokenizer check (vocabulary equality, witness sentences) and the
  tokenizer fingerprint.
- scoring.py: the teacher's log-probs of given tokens and its top-k per position.
- sidecar.py: the `.topk` file format, its fingerprints and the refusal of a stale one.
"""

from retrograd.teacher.scoring import (
    BACKENDS,
    LlamaCppTeacher,
    TeacherOptions,
    TeacherScores,
    TorchTeacher,
    gather_at,
    open_teacher,
    pack_rollouts,
)
from retrograd.teacher.sidecar import (
    Sidecar,
    SidecarHeader,
    check_sidecar,
    corpus_fingerprint,
    read_sidecar,
    row_offsets,
    write_sidecar,
)
from retrograd.teacher.vocabulary import check_same_tokenizer, read_vocabulary, tokenizer_fingerprint

__all__ = [
    "BACKENDS",
    "LlamaCppTeacher",
    "Sidecar",
    "SidecarHeader",
    "TeacherOptions",
    "TeacherScores",
    "TorchTeacher",
    "check_same_tokenizer",
    "check_sidecar",
    "corpus_fingerprint",
    "gather_at",
    "open_teacher",
    "pack_rollouts",
    "read_sidecar",
    "read_vocabulary",
    "row_offsets",
    "tokenizer_fingerprint",
    "write_sidecar",
]
