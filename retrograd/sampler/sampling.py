"""Drawing one token from one row of llama.cpp logits, in numpy, with the sequence's own RNG.

The token is drawn at the request's temperature and top-p. The log-probability returned
with it is always the one GRPO compares with torch's scoring: the token's log-softmax over
the FULL vocabulary at temperature 1, of llama.cpp's float32 logits, computed in float64
(`logit[t] - logsumexp(logits)`); temperature and top-p never enter it.

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
    """logits [V] float32 -> (token, log-prob of token at temperature 1 over all V)."""
    x = logits.astype(np.float64)  # [V]
    top = x.max()
    log_z = top + math.log(np.exp(x - top).sum())
    weights = np.exp((x - top) / sampling.temperature)  # [V] unnormalised, max 1
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
    return token, float(x[token] - log_z)
