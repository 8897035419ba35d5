"""Golden losses: the first steps of the smoke SFT and GRPO examples and of a small on-policy
distillation run, on the CPU in float32, pinned to the numbers a correct build produced.

Every other test compares two computations with each other or checks a property; a change
that makes the loss wrong in a deterministic way (a mask shifted by one token, a wrong
normalisation, a learning rate applied twice) can pass them all. These fail it.

The runs are the example configs themselves (`examples/smoke_tiny_sft.toml`,
`examples/smoke_tiny_grpo.toml`) with only paths, `compute_dtype = "f32"` and
`threads = 2` changed, stopped after their first steps or updates by the reporter, so the
learning-rate schedule is that of the full run. The distillation run is
`tests/test_distill.py`'s tiny llama pair (seeded, written by the tests).

Tolerance. The numbers are deterministic on one machine (the same ops in the same order)
but not across machines: BLAS kernels and thread counts sum in different orders, so each
float32 operation may differ in its last bits (~1e-7 relative), and optimizer steps carry that
forward. Measured between 1 and 2 threads (different GEMM partitions), same machine:
  sft      steps 1-3: 0, 1.3e-7, 4.1e-7 relative
  distill  updates 1-3: 0 (a 64-wide model: one GEMM partition either way)
  grpo     update 1: 6.5e-5 (total_loss), 2.7e-5 (ratio_min). The second epoch's loss is a small
           difference (ratios near 1, advantages summing to ~0), and Adam's first step is
           ~lr * sign(g): gradient entries at rounding-noise level flip sign between machines
           and move the per-token log-probs, so the rounding noise is amplified ~100x.
           Update 2 samples with the updated adapter, and on 1 thread llama.cpp already drew
           different tokens there (reward/mean 0.0412 vs 0.0391): it is not pinned.
So: rel 2e-4 for sft and distill (500x the spread), rel 2e-3 for grpo (30x). A real change
moves these by far more: a mask shifted by one token, a doubled learning rate or another loss
normalisation change the sft losses by > 1e-2 and the grpo ratios by > 1e-1. The rollout runs
also depend on the tokens llama.cpp samples: those are pinned through reward/mean, which moves
only if a sampled token does (a near-tie in llama.cpp's own float sums on another CPU; then
regenerate, as below).

To regenerate after an intended change: RETROGRAD_GOLDEN_PRINT=1 pytest -s tests/test_golden_losses.py
prints the new values; paste them here with the reason in the commit message.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from retrograd.config import load_config
from retrograd.recipes import distill, grpo, sft
from retrograd.training.report import SilentReporter

EXAMPLES = Path(__file__).parents[1] / "examples"
TOLERANCE = {"sft": 2e-4, "distill": 2e-4, "grpo": 2e-3}  # relative; see the module docstring
THREADS = int(os.environ.get("RETROGRAD_GOLDEN_THREADS", "2"))  # another count shows the spread

# name -> {metric: [value per step or update]}: CPU, float32, threads = 2 (Xeon, AVX-512, torch 2.13 + MKL)
GOLDEN = {
    "sft": {"train/loss": [2.1837048530578613, 1.7676514387130737, 1.234580636024475]},
    "grpo": {
        "policy/total_loss": [0.00010791269596666098],
        "policy/ratio_min": [0.5309744477272034],
        "policy/ratio_max": [1.5361207723617554],
        "reward/mean": [0.04874704347116875],
    },
    "distill": {  # advantages against torch's log-probs before the update, not llama.cpp's (issue 22); AMD EPYC
        "train/loss": [4.645203590393066, 4.687089443206787, 4.743165493011475],
        "distill/teacher_kl_mean": [4.645203638076782, 4.687088894844055, 4.743165524800618],
    },
}


class Enough(Exception):
    pass


class StopAfter(SilentReporter):
    """Ends a run (by raising) once its progress bar reaches `n` steps or updates: the
    metrics of those are written, nothing after them runs."""

    def __init__(self, n: int):
        self.n = n

    def advance(self, done: int, status: str) -> None:
        if done >= self.n:
            raise Enough


def example_copy(tmp: Path, name: str, replacements: dict[str, str], training: str) -> Path:
    """The example config with its paths moved into `tmp` and `training` keys added."""
    text = (EXAMPLES / name).read_text()
    for old, new in replacements.items():
        assert old in text, f"{name} no longer contains {old!r}: update this test"
        text = text.replace(old, new)
    text = text.replace("[training]\n", f"[training]\n{training}\n", 1)
    cfg = tmp / name
    cfg.write_text(text)
    return cfg


def first(cfg: Path, recipe, n: int) -> list[dict]:
    with pytest.raises(Enough):
        recipe.run(load_config(cfg), StopAfter(n))
    return [json.loads(line) for line in (cfg.parent / "out/adapter.metrics.jsonl").read_text().splitlines()]


def check(name: str, observed: dict[str, list[float]]) -> None:
    if os.environ.get("RETROGRAD_GOLDEN_PRINT"):
        print(f"\n{name}: {json.dumps(observed)}", file=sys.stderr)
    for key, expected in GOLDEN[name].items():
        assert observed[key] == pytest.approx(expected, rel=TOLERANCE[name], abs=1e-9), (name, key, observed[key], expected)


def test_smoke_sft_first_three_steps(tmp_path):
    cfg = example_copy(
        tmp_path,
        "smoke_tiny_sft.toml",
        {
            'path = "../out/smoke_sft/smoke_sft.gguf"': 'path = "out/adapter.gguf"',
            'data = "data/arithmetic_train.jsonl"': f'data = "{EXAMPLES / "data/arithmetic_train.jsonl"}"',
            'data = "data/arithmetic_eval.jsonl"': f'data = "{EXAMPLES / "data/arithmetic_eval.jsonl"}"',
            'directory = "../out/smoke_sft/checkpoints"': 'directory = "ckpt"',
        },
        f'compute_dtype = "f32"\nthreads = {THREADS}',
    )
    rows = [r for r in first(cfg, sft, 3) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    check("sft", {"train/loss": [r["train/loss"] for r in rows]})


def test_smoke_grpo_first_update(tmp_path):
    """Two epochs over 16 completions: the first step at ratio 1, the second after it."""
    cfg = example_copy(
        tmp_path,
        "smoke_tiny_grpo.toml",
        {
            'path = "../out/smoke_grpo/smoke_grpo.gguf"': 'path = "out/adapter.gguf"',
            'prompts = "data/smoke_rl_prompts.jsonl"': f'prompts = "{EXAMPLES / "data/smoke_rl_prompts.jsonl"}"',
            'reward_command = ["python3", "examples/smoke_rl_reward.py"]':
                f'reward_command = ["{sys.executable}", "{EXAMPLES / "smoke_rl_reward.py"}"]',
            'data = "data/smoke_rl_eval.jsonl"': f'data = "{EXAMPLES / "data/smoke_rl_eval.jsonl"}"',
            'directory = "../out/smoke_grpo/checkpoints"': 'directory = "ckpt"',
        },
        f'compute_dtype = "f32"\nthreads = {THREADS}',
    )
    updates = [r for r in first(cfg, grpo, 1) if "reward/mean" in r]
    assert [(r["train/update"], r["step"]) for r in updates] == [(1, 2)]  # one update, two optimizer steps
    check("grpo", {k: [r[k] for r in updates] for k in GOLDEN["grpo"]})


def test_on_policy_distillation_first_three_updates(tmp_path, tiny_model):
    from test_distill import write_config

    cfg = write_config(tmp_path, tiny_model("llama"), tiny_model("llama", seed=1), updates=3)
    cfg.write_text(cfg.read_text().replace("threads = 2", f"threads = {THREADS}"))
    rows = [r for r in first(cfg, distill, 3) if "train/loss" in r]
    assert [r["train/update"] for r in rows] == [1, 2, 3]
    check("distill", {k: [r[k] for r in rows] for k in GOLDEN["distill"]})
