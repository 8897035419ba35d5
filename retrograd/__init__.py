"""retrograd: fine-tune GGUF models with LoRA on the frozen, quantized base."""

import os

__version__ = "0.1.0"

# torch's CPU allocator puts tensors of 2 MiB and more on transparent huge pages when asked
# (read at its first large allocation). Activations are freed and reallocated every pass,
# and on 4 KiB pages glibc's heap fragments: a 0.5B SFT run peaked at 2.8 GiB on small pages
# and 1.8 GiB on huge ones, at equal or better speed (README, "Huge pages").
# A user's own setting wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def load_model(path=None, **kwargs):
    """Load a GGUF base model for torch (see retrograd.model.base.load_model)."""
    from retrograd.model.base import load_model as _load

    return _load(path, **kwargs)
