"""retrograd: fine-tune GGUF models with LoRA on the frozen, quantized base."""

import os

__version__ = "0.1.0"

# torch's CPU allocator puts tensors of 2 MiB and more on transparent huge pages when asked
# (read at its first large allocation). Activations are freed and reallocated every pass;
# on 4 KiB pages glibc's heap fragments and a 0.5B SFT run's peak RSS grew 2.8 -> 1.8 GiB
# smaller with huge pages, at equal or better speed (benchmarks/sft_vs_trl.py, README).
# A user's own setting wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def load_model(path=None, **kwargs):
    """Load a GGUF base model for torch (see retrograd.model.base.load_model)."""
    from retrograd.model.base import load_model as _load

    return _load(path, **kwargs)
