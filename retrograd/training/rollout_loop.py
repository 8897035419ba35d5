"""The rollout loop that grpo, agent_grpo and distill's on_policy mode share (issue 14): for
now the warm-up step before the first update and the cutting of logged texts."""

from __future__ import annotations

import time

from retrograd.memory import rss_bytes
from retrograd.training.batches import LogprobOptions
from retrograd.training.scoring import Rollout, micro_batch_logprobs


def warm_up(setup) -> dict:
    """One forward+backward on a few tokens before the first update (compiles the
    dequantization kernels), so update timings measure steady work."""
    t0, r0 = time.perf_counter(), rss_bytes()
    ids = tuple(range(10, 42))
    model = setup.model.transformer
    logp, _ = micro_batch_logprobs(model, [Rollout(0, ids[:16], ids[16:])], LogprobOptions(), setup.device)
    logp.sum().backward()
    for p in setup.adapter.parameters():
        p.grad = None
    return {"warm-up (compile + probe step)": (time.perf_counter() - t0, rss_bytes() - r0)}


def cut_text(text: str, cap: int) -> str:
    """A text for rollouts.jsonl, cut to [observe].max_text_chars (0: whole)."""
    return text if not cap or len(text) <= cap else text[:cap] + " […]"
