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
normalisation change the sft losses by > 1e-2 and the grpo ratios by > 1e-1.

Rollouts. What llama.cpp samples is not portable: its quantised dot products sum in another
order with AVX2 than with AVX-512 (on the Q4_1 SmolLM2, one log-prob in eight moves by ~1e-2),
a near tie flips a draw, and the rest of that completion differs (reward/mean 0.049 on a Xeon,
0.015 on a Zen 3). The rollout runs therefore replay the completions recorded in
tests/golden_rollouts/NAME.json (tokens, llama.cpp log-probs, finish) through the real sampler
object, after checking that the recipe asked for exactly the recorded prompts, seeds and
lengths; the rewards are still computed by the reward script. The sampler itself is tested
against llama.cpp in test_sampler.py.

To regenerate after an intended change: RETROGRAD_GOLDEN_PRINT=1 pytest -s tests/test_golden_losses.py
samples afresh, rewrites tests/golden_rollouts/ and prints the new values; paste them here with
the reason (and the CPU) in the commit message.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import pytest

import retrograd.recipes.distill.on_policy
import retrograd.recipes.grpo
from retrograd.config import load_config
from retrograd.recipes import distill, grpo, sft
from retrograd.sampler import Completion
from retrograd.training.report import SilentReporter

EXAMPLES = Path(__file__).parents[1] / "examples"
ROLLOUTS = Path(__file__).parent / "golden_rollouts"
RECORD = bool(os.environ.get("RETROGRAD_GOLDEN_PRINT"))
TOLERANCE = {"sft": 2e-4, "distill": 2e-4, "grpo": 2e-3}  # relative; see the module docstring
THREADS = int(os.environ.get("RETROGRAD_GOLDEN_THREADS", "2"))  # another count shows the spread

# name -> {metric: [value per step or update]}: CPU, float32, threads = 2, torch 2.13 (sft: Xeon, AVX-512)
GOLDEN = {
    "sft": {"train/loss": [2.1837048530578613, 1.7676514387130737, 1.234580636024475]},
    "grpo": {  # on the rollouts in golden_rollouts/grpo.json, sampled on an AMD EPYC (Zen 3, AVX2)
        "policy/total_loss": [0.0025372132658958435],
        "policy/ratio_min": [0.6850185990333557],
        "policy/ratio_max": [1.4863765239715576],
        "reward/mean": [0.01498435806913908],
    },
    "distill": {  # advantages from torch's log-probs before the update (issue 22); rollouts in golden_rollouts/distill.json, AMD EPYC
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


class Replay:
    """A sampler whose generate() answers each call with the next recorded one (or, when
    recording, samples and keeps what it drew); everything else is the real sampler's."""

    def __init__(self, sampler, calls: list[dict] | None):
        self.sampler, self.calls, self.recorded = sampler, calls, []

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def generate(self, requests):
        asked = [{"prompt": list(r.prompt), "seeds": list(r.seeds), "max_new_tokens": r.sampling.max_new_tokens} for r in requests]
        if self.calls is None:
            groups = self.sampler.generate(requests)
            self.recorded.append({"requests": asked, "groups": [[asdict(c) for c in g] for g in groups]})
            return groups
        i = len(self.recorded)
        assert i < len(self.calls), f"the recipe sampled {i + 1} times; the recording holds {len(self.calls)}"
        assert asked == self.calls[i]["requests"], f"generate call {i + 1} asks for other prompts, seeds or lengths than recorded"
        self.recorded.append(self.calls[i])
        return [[Completion(**c) for c in g] for g in self.calls[i]["groups"]]


def replaying(monkeypatch, module, name: str) -> None:
    """Routes `module`'s rollout sampler through a Replay of tests/golden_rollouts/NAME.json."""
    path = ROLLOUTS / f"{name}.json"
    opened = module.open_rollout_sampler

    @contextmanager
    def replay(*args, **kwargs):
        with opened(*args, **kwargs) as sampler:
            replay = Replay(sampler, None if RECORD else json.loads(path.read_text()))
            try:
                yield replay
            finally:
                if RECORD:
                    path.parent.mkdir(exist_ok=True)
                    path.write_text(json.dumps(replay.recorded) + "\n")

    monkeypatch.setattr(module, "open_rollout_sampler", replay)


def first(cfg: Path, recipe, n: int) -> list[dict]:
    with pytest.raises(Enough):
        recipe.run(load_config(cfg), StopAfter(n))
    return [json.loads(line) for line in (cfg.parent / "out/adapter.metrics.jsonl").read_text().splitlines()]


def check(name: str, observed: dict[str, list[float]]) -> None:
    if RECORD:
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


def test_smoke_grpo_first_update(tmp_path, monkeypatch):
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
    replaying(monkeypatch, retrograd.recipes.grpo, "grpo")
    updates = [r for r in first(cfg, grpo, 1) if "reward/mean" in r]
    assert [(r["train/update"], r["step"]) for r in updates] == [(1, 2)]  # one update, two optimizer steps
    check("grpo", {k: [r[k] for r in updates] for k in GOLDEN["grpo"]})


def test_on_policy_distillation_first_three_updates(tmp_path, tiny_model, monkeypatch):
    from test_distill import write_config

    cfg = write_config(tmp_path, tiny_model("llama"), tiny_model("llama", seed=1), updates=3)
    cfg.write_text(cfg.read_text().replace("threads = 2", f"threads = {THREADS}"))
    replaying(monkeypatch, retrograd.recipes.distill.on_policy, "distill")
    rows = [r for r in first(cfg, distill, 3) if "train/loss" in r]
    assert [r["train/update"] for r in rows] == [1, 2, 3]
    check("distill", {k: [r[k] for r in rows] for k in GOLDEN["distill"]})
