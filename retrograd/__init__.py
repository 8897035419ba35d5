"""retrograd: fine-tune GGUF models with LoRA on the frozen, quantized base."""

import os

# torch and llama.cpp each bring an OpenMP thread pool, and they take turns in one process
# (and share the machine with whatever else runs): spinning idle threads would steal the
# cores the other pool needs. Passive waiting measured 3-10x faster under such sharing.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"


def load_model(path=None, **kwargs):
    """Load a GGUF base model for torch (see retrograd.model.base.load_model)."""
    from retrograd.model.base import load_model as _load

    return _load(path, **kwargs)
