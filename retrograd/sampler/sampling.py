"""Drawing one token from one row of llama.cpp logits, in numpy, with the sequence's own RNG.

The token is drawn at the request's temperature and top-p. The log-probability returned
with it is that of the distribution the token was actually drawn from, computed in float64
from llama.cpp's float32 logits: `log_softmax(logits / T)[t]` over the full vocabulary, or,
with top_p < 1, over the nucleus renormalised. With top_p = 1 it is exactly what torch's
scoring at the same temperature computes (the trained policy is the tempered softmax), so
GRPO's ratios, KL and distillation gaps refer to the policy that produced the samples; with
a nucleus it is the behaviour probability that truncated importance sampling corrects.

Each draw consumes exactly one `rng.random()`, so a sequence's tokens depend only on its
seed, its context and the logits, never on which other sequences share the batch.

Cost (it runs once per token, between llama_decode calls that wait for it): a cumulative sum
over the whole vocabulary is a chain of dependent float64 additions (160 us for SmolLM2's
49152 tokens, 60% of a draw); the draw instead sums blocks of BLOCK weights (vectorised), finds
the block holding the draw, and runs the cumulative sum inside that block only. The nucleus
sorts only the tokens above a weight floor whose mass already reaches top_p (a full stable
sort of the vocabulary took 4.9 ms a draw), lowering the floor until it does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from retrograd.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """How one turn or completion is generated."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.max_new_tokens, (int, np.integer)) and self.max_new_tokens >= 1):
            raise ConfigError(f"sampler: max_new_tokens {self.max_new_tokens!r} must be an integer >= 1")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"sampler: temperature {self.temperature!r} must be a finite number > 0")
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"sampler: top_p {self.top_p!r} must be in (0, 1]")


BLOCK = 1024  # tokens per partial sum of the draw's cumulative search
NUCLEUS_FLOORS = (1e-3, 1e-6, 1e-9, 0.0)  # weights relative to the most likely token's


def sample_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> tuple[int, float]:
    """logits [V] float32 -> (token, its log-prob under the distribution it was drawn from)."""
    x = logits.astype(np.float64)
    x -= x.max()
    if sampling.temperature != 1.0:
        x /= sampling.temperature  # [V] tempered, max 0
    weights = np.exp(x)  # [V] unnormalised, max 1
    if sampling.top_p < 1.0:
        candidates, cdf = _nucleus(weights, sampling.top_p)
        pick = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
        token, total = int(candidates[pick]), cdf[-1]
    else:
        token, total = _draw(weights, rng.random())
    return token, float(x[token] - math.log(total))


def _draw(weights: np.ndarray, u: float) -> tuple[int, float]:
    """The token where the cumulative weight first exceeds u * total, and the total."""
    block_cdf = np.cumsum(np.add.reduceat(weights, np.arange(0, len(weights), BLOCK)))  # [ceil(V / BLOCK)]
    total = float(block_cdf[-1])
    target = u * total
    k = min(int(np.searchsorted(block_cdf, target, side="right")), len(block_cdf) - 1)
    block = weights[k * BLOCK : (k + 1) * BLOCK]
    before = float(block_cdf[k - 1]) if k else 0.0
    j = min(int(np.searchsorted(np.cumsum(block), target - before, side="right")), len(block) - 1)
    return k * BLOCK + j, total


def _nucleus(weights: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of most likely tokens whose weight reaches top_p of the total, most
    likely first (ties in id order), and their cumulative weights [keep]."""
    goal = top_p * float(weights.sum())
    for floor in NUCLEUS_FLOORS:
        above = np.flatnonzero(weights >= floor)  # id order: the stable sort keeps ties in it
        order = above[np.argsort(-weights[above], kind="stable")]
        cdf = np.cumsum(weights[order])
        if cdf[-1] >= goal:  # every token outside `above` is less likely than all in it
            break
    keep = min(int(np.searchsorted(cdf, goal)) + 1, len(cdf))
    return order[:keep], cdf[:keep]
