"""Forward+backward speed of the architectures beyond llama (smollm3, gemma2, granite, olmo2, lfm2, phi3)
against llama of the same width and depth, so a slow path in one of them shows.

    python benchmarks/dense_variants.py              # 512 tokens (~1 min on 2 cores)
    python benchmarks/dense_variants.py --tokens 1024

Each architecture is a random F32 GGUF written by tests/gguf_factory.py with one shared shape
(its own features kept: gemma2's soft-caps and 16-token window, granite's multipliers, lfm2's conv layers,
olmo2's norms, smollm3's NoPE layer, phi3's fused projections). One step = one sequence through the model, a rank-8
LoRA on every projection, chunked cross-entropy and its backward; after a warm-up, 7 rounds
over all models in turn (noise from other processes hits each alike), median per model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import retrograd  # noqa: F401  (before torch: sets the OpenMP wait policy)

# isort: split
import torch
from retrograd.kernels.chunked_logprobs import token_logprobs

from retrograd.lora import attach_lora
from retrograd.model.base import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# isort: split
from gguf_factory import TINY_ARCHS, write_tiny_model

# gemma3 for reference: gemma2 without the attention soft-cap (GELU, sandwich norms, windows alike)
ARCHS = ("llama", "smollm3", "gemma2", "granite", "olmo2", "gemma3", "lfm2", "phi3")
# olmo2 fixes the head size at n_embd / n_head, so every model uses that; every head is untied
# (a tied head alone costs ~30% of a step at this size, whatever the architecture)
SHAPE = dict(n_layer=4, n_embd=256, n_head=8, n_head_kv=2, head_dim=32, n_ff=768, tied=False)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(2)
    steps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            name = f"bench-{arch}"
            TINY_ARCHS[name] = TINY_ARCHS[arch] | SHAPE
            steps[arch] = train_step(write_tiny_model(Path(tmp) / f"{name}.gguf", name), args.tokens)
        speeds = tokens_per_second(steps, args.tokens)
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    print(f"\nForward+backward tokens/s, {args.tokens} tokens, F32, {shape}, vocabulary 49152")
    print(f"{'arch':<8} {'tok/s':>8} {'vs llama':>9}")
    for arch, speed in speeds.items():
        print(f"{arch:<8} {speed:8.0f} {speed / speeds['llama']:9.2f}")


if __name__ == "__main__":
    main()
