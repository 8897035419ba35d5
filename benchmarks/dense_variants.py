"""Forward+backward speed of each architecture beyond llama (the names in ARCHS)
against llama of the same width and depth, so a slow path in one of them shows: the table and the
measurement behind the architecture rows of benchmarks/base_model.py, which prints them.

    python benchmarks/base_model.py --archs              # these rows alone, 512 tokens (~1 min on 2 cores)
    python benchmarks/base_model.py --archs --tokens 1024

Each architecture is a random F32 GGUF written by tests/gguf_factory.py with one shared shape
(its own features kept: gemma2's soft-caps and 16-token window, granite's multipliers, lfm2's conv layers,
olmo2's norms, smollm3's NoPE layer, phi3's fused projections). One step = one sequence through the model, a rank-8
LoRA on every projection, chunked cross-entropy and its backward; after a warm-up, 7 rounds
over all models in turn (noise from other processes hits each alike), median per model.
A new architecture is one more name in ARCHS (a TINY_ARCHS entry of tests/gguf_factory.py).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import retrograd  # noqa: F401  (before torch: sets the OpenMP wait policy)

# isort: split
import torch

from retrograd.kernels.chunked_logprobs import token_logprobs
from retrograd.model.base import load_model
from retrograd.model.lora import attach_lora

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# isort: split
from gguf_factory import TINY_ARCHS, write_tiny_model

# gemma3 for reference: gemma2 without the attention soft-cap (GELU, sandwich norms, windows alike)
ARCHS = ("llama", "smollm3", "gemma2", "granite", "olmo2", "gemma3", "lfm2", "phi3")
ARCHS += ("mistral3",)  # YaRN angles and attention temperature (from position 64 on)
# olmo2 fixes the head size at n_embd / n_head, so every model uses that; every head is untied
# (a tied head alone costs ~30% of a step at this size, whatever the architecture)
SHAPE = dict(n_layer=4, n_embd=256, n_head=8, n_head_kv=2, head_dim=32, n_ff=768, tied=False)
# a mixture of experts at "the same width": each token's experts do llama's FFN work (2 used x 384 = n_ff),
# from 4x llama's FFN weights (8 experts)
ARCHS += ("qwen3moe",)
SHAPE_OF = {"qwen3moe": dict(experts=(8, 2, 384))}
# lfm2moe: lfm2's conv layers (0 and 2), a dense FFN in layer 0, mixtures as qwen3moe's in the rest (sigmoid, selection bias)
ARCHS += ("lfm2moe",)
SHAPE_OF |= {"lfm2moe": dict(experts=(8, 2, 384))}
# gpt-oss: attention with sinks (explicit, not SDPA), a 16-token window on layers 0 and 2, YaRN, biases on q/k/v/o,
# router and experts, mixtures as qwen3moe's (softmax over the picked, clamped SwiGLU)
ARCHS += ("gpt-oss",)
SHAPE_OF |= {"gpt-oss": dict(experts=(8, 2, 384))}


def train_step(path: Path, n_tokens: int):
    """One LoRA training step on `path`'s model, as a function to time."""
    m = load_model(path)
    t = m.transformer
    attach_lora(t, ["auto"], rank=8, alpha=16.0, seed=0)
    ids = torch.randint(0, m.spec.n_vocab, (n_tokens + 1,), generator=torch.Generator().manual_seed(0))

    def step():
        lp, _ = token_logprobs(t(ids[:-1]), t.output, ids[1:], compute_dtype=t.compute_dtype)
        (-lp.mean()).backward()

    step()  # warm-up
    return step


def tokens_per_second(steps: dict, n_tokens: int, rounds: int = 7) -> dict[str, float]:
    """Round-robin over the models, so load from other processes hits them all alike; median per model."""
    times = {arch: [] for arch in steps}
    for _ in range(rounds):
        for arch, step in steps.items():
            start = time.perf_counter()
            step()
            times[arch].append(time.perf_counter() - start)
    return {arch: n_tokens / sorted(t)[rounds // 2] for arch, t in times.items()}


def architecture_rows(n_tokens: int) -> list[str]:
    """The table: tokens/s of each architecture in ARCHS and its ratio to llama's."""
    torch.set_num_threads(2)
    steps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            name = f"bench-{arch}"
            TINY_ARCHS[name] = TINY_ARCHS[arch] | SHAPE | SHAPE_OF.get(arch, {})
            steps[arch] = train_step(write_tiny_model(Path(tmp) / f"{name}.gguf", name), n_tokens)
        speeds = tokens_per_second(steps, n_tokens)
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    rows = [f"Forward+backward tokens/s per architecture, {n_tokens} tokens, F32, {shape}, vocabulary 49152",
            f"{'arch':<8} {'tok/s':>8} {'vs llama':>9}"]
    return rows + [f"{arch:<8} {speed:8.0f} {speed / speeds['llama']:9.2f}" for arch, speed in speeds.items()]
