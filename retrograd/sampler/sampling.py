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


def sample_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> tuple[int, float]:
    """logits [V] float32 -> (token, its log-prob under the distribution it was drawn from)."""
    x = (logits.astype(np.float64) - float(logits.max())) / sampling.temperature  # [V] tempered, max 0
    weights = np.exp(x)  # [V] unnormalised, max 1
    if sampling.top_p < 1.0:
        order = np.argsort(-weights, kind="stable")  # [V] most likely first
        cdf = np.cumsum(weights[order])  # [V]
        keep = int(np.searchsorted(cdf, sampling.top_p * cdf[-1])) + 1  # smallest nucleus reaching top_p
        candidates = order[:keep]
        cdf = cdf[:keep]
    else:
        candidates = None
        cdf = np.cumsum(weights)  # [V]
    pick = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
    token = int(candidates[pick]) if candidates is not None else pick
    return token, float(x[token] - math.log(cdf[-1]))
