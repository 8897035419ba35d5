"""Is the teacher's tokenizer the student's? Distillation compares the two models' log-probs
token id by token id, so the ids must mean the same strings and a text must split the same
way in both. The chat templates may differ (each model's prompt is rendered with its own).

Two checks: the vocabularies are equal (pieces, token types, tokenizer model and
pre-tokenizer, BPE merges), read from the GGUF metadata; and a set of witness sentences
(code, digits, whitespace runs, several scripts, emoji) tokenizes identically through
llama.cpp in both. The vocabulary's hash is the tokenizer fingerprint that the top-k sidecar
records."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from retrograd.errors import ConfigError
from retrograd.gguf.file import GGUFFile
from retrograd.gguf.spec import read_spec
from retrograd.model.tokenizer import Tokenizer

WITNESSES = (
    "The quick brown fox jumps over the lazy dog.",
    "   leading spaces,\ttabs\tand\n\nblank lines\n",
    "Numbers 0 7 42 1234567890, 3.14159 and -273.15; dates 2024-02-29.",
    "def area(r):\n    return {'pi_r2': 3.14 * r ** 2, \"ok\": None}  # code\n",
    "café naïve Straße, 東京タワー, Привет мир, مرحبا, नमस्ते, 🙂👍🏽",
    "https://example.com/a?b=c&d=e#frag <b>bold</b> user@example.org",
    "UPPER lower MiXeD camelCase snake_case kebab-case ALL_CAPS_123",
)
METADATA_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


@dataclass(frozen=True)
class Vocabulary:
    path: Path
    n_vocab: int  # rows of the output head
    entries: dict  # METADATA_KEYS -> value (None when absent)

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for key in METADATA_KEYS:
            h.update(repr((key, self.entries[key])).encode("utf-8", "surrogatepass"))
        h.update(str(self.n_vocab).encode())
        return h.hexdigest()[:32]


def read_vocabulary(path: Path) -> Vocabulary:
    f = GGUFFile(path)
    return Vocabulary(Path(path), read_spec(f).n_vocab, {key: f.get(key) for key in METADATA_KEYS})


def tokenizer_fingerprint(path: Path) -> str:
    return read_vocabulary(path).fingerprint


def check_same_tokenizer(student: Path, teacher: Path, *, student_tokenizer: Tokenizer | None = None,
                         names: tuple[str, str] = ("distill.teacher_path", "the student")) -> None:
    """One ConfigError line naming the first difference between the two tokenizers; `names`
    says what the second and the first file are."""
    a, b = GGUFFile(student), GGUFFile(teacher)
    where = f"{names[0]} {teacher.name} and {names[1]} {student.name}"
    n_a, n_b = read_spec(a).n_vocab, read_spec(b).n_vocab
    if n_a != n_b:  # before reading any vocabulary: Gemma's takes seconds
        raise ConfigError(f"{where} do not share a tokenizer: {n_b} vs {n_a} vocabulary entries")
    for key in METADATA_KEYS:
        entry_a, entry_b = a.get(key), b.get(key)
        if entry_a != entry_b:
            raise ConfigError(f"{where} do not share a tokenizer: {key} differs{_first_difference(entry_a, entry_b)}")
    tokenize_a = student_tokenizer or Tokenizer(student)
    tokenize_b = Tokenizer(teacher)
    for n, text in enumerate(WITNESSES):
        if tokenize_a.encode(text, add_bos=False) != tokenize_b.encode(text, add_bos=False):
            raise ConfigError(f"{where} tokenize witness sentence {n + 1} ({text[:30]!r}...) differently")


def _first_difference(student, teacher) -> str:
    if not isinstance(student, list) or not isinstance(teacher, list):
        return f" ({teacher!r} vs {student!r})"
    if len(student) != len(teacher):
        return f" ({len(teacher)} vs {len(student)} entries)"
    i = next(i for i, (x, y) in enumerate(zip(student, teacher)) if x != y)
    return f" (first at entry {i}: {teacher[i]!r} vs {student[i]!r})"
