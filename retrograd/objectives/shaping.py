"""What changes rewards before baselining, and beta between updates.

- The DAPO soft overlong penalty ([grpo.overlong_penalty]) is added to the rewards
  after mask_truncated removes members and before the baseline.
- The KL schedule ([grpo.kl_schedule]) sets the effective beta of each update: a linear
  warm-up from 0, times a multiplier that an adaptive controller moves after each
  update to chase a target KL. The recipe stores the multiplier in its checkpoint.
"""

from __future__ import annotations

import torch

KL_ADAPT_TOLERANCE = 1.5  # the KL may sit within [target / 1.5, target * 1.5] without a change
KL_ADAPT_FACTOR = 2.0  # outside it, beta doubles or halves (PPO paper, sec. 4)
KL_MULTIPLIER_BOUNDS = (2.0**-6, 2.0**6)  # so six updates always undo a run of zero-KL halvings


def overlong_penalty(
    lengths: torch.Tensor,  # [...] completion lengths in tokens
    max_new_tokens: int,
    buffer_tokens: int,
    max_penalty: float,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), scaled by max_penalty:
    0 up to max_new_tokens - buffer_tokens, then a linear ramp down to -max_penalty at
    max_new_tokens (the budget, which a completion never exceeds). Returns float64 of
    lengths' shape, to add to the rewards."""
    free = max_new_tokens - buffer_tokens
    excess = (lengths.double() - free).clamp(min=0.0)  # [...]
    return -max_penalty * (excess / buffer_tokens).clamp(max=1.0)  # [...]


def kl_coefficient(beta: float, update: int, warmup_updates: int, multiplier: float = 1.0) -> float:
    """Effective beta for the 0-based `update`: beta * min(1, update / warmup_updates) *
    multiplier. The ramp starts at 0 on update 0 and reaches beta at update
    warmup_updates; warmup_updates = 0 means no ramp."""
    ramp = 1.0 if warmup_updates == 0 else min(1.0, update / warmup_updates)
    return beta * ramp * multiplier


def adapt_kl_multiplier(multiplier: float, measured_kl: float, target: float) -> float:
    """The adaptive KL penalty of Schulman et al. 2017 (PPO, sec. 4): after an update
    whose measured KL (policy/kl) is above target * 1.5, beta doubles; below
    target / 1.5, it halves; otherwise it stays. The multiplier is kept within
    KL_MULTIPLIER_BOUNDS so a long zero-KL start cannot drive beta to nothing."""
    if measured_kl > target * KL_ADAPT_TOLERANCE:
        multiplier *= KL_ADAPT_FACTOR
    elif measured_kl < target / KL_ADAPT_TOLERANCE:
        multiplier /= KL_ADAPT_FACTOR
    low, high = KL_MULTIPLIER_BOUNDS
    return min(high, max(low, multiplier))
