"""retrograd: fine-tune GGUF models with LoRA on the frozen, quantized base."""

__version__ = "0.1.0"


def load_model(path=None, **kwargs):
    """Load a GGUF base model for torch (see retrograd.model.base.load_model)."""
    from retrograd.model.base import load_model as _load

    return _load(path, **kwargs)
