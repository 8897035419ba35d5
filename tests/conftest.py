"""Shared fixtures: real model files (bundled SmolLM2, Gemma-3) and tiny GGUFs written by
the tests themselves (once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

import retrograd  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads its OpenMP runtime)
import torch

from gguf_factory import write_f32_copy, write_tiny_model
from retrograd.bundled import default_model_path, gemma3_path

torch.set_num_threads(2)
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return gemma3_path()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_dir):
    """tiny_model("qwen3") -> path of a random F32 qwen3 GGUF (written once)."""
    made: dict[tuple, Path] = {}

    def make(name: str, **kw) -> Path:
        key = (name, tuple(sorted(kw.items())))
        if key not in made:
            suffix = "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
            made[key] = write_tiny_model(model_dir / f"tiny-{name}{suffix}.gguf", name, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2_f32(model_dir, smollm2) -> Path:
    return write_f32_copy(smollm2, model_dir / "smollm2-f32.gguf")


@pytest.fixture(scope="session")
def ordinary_text() -> str:
    return (DATA / "ordinary_text.txt").read_text()
