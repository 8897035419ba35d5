"""LoRA for tests without training: GGUF files written straight from numpy (random A and B on
every attention and FFN weight of a base GGUF, large enough to change what the model says),
and a non-zero B for an attached Adapter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from retrograd.gguf.adapter import LoRAWeights, write_adapter
from retrograd.gguf.file import GGUFFile

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TARGETS += ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # expert stacks: a pair per expert


def random_adapter(model: Path, path: Path, *, seed: int = 0, rank: int = 4, scale: float = 0.05) -> Path:
    base = GGUFFile(model)
    shapes = {name: t.shape for name, t in base.tensors.items()}
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (*stack, n_out, n_in) in ((n, s) for n, s in shapes.items() if n.endswith(".weight") and n.split(".")[-2] in TARGETS):
        a = rng.standard_normal((*stack, rank, n_in), dtype=np.float32) / np.sqrt(n_in)
        b = rng.standard_normal((*stack, n_out, rank), dtype=np.float32) * scale
        tensors[name] = LoRAWeights(a, b)
    return write_adapter(
        path, tensors, arch=base.get_str("general.architecture"), alpha=float(rank), base_shapes=shapes
    )


def randomise_b(adapter, scale: float = 0.05, seed: int = 1):
    """Give every LoRA of an attached Adapter a random B (PEFT starts it at zero, which would
    make the adapter invisible), as after some training. Returns the adapter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in adapter.layers.values():
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=generator) * scale)
    return adapter
