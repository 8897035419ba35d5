"""Rewards -> advantages for GRPO groups, and the agentic intermediate returns.

A batch holds n_groups prompts with G sampled completions each. `live` marks the
members that take part; completions removed by mask_truncated and failed rollouts are
not live (their rewards may be anything, NaN included). A group is *dead* when fewer
than two members are live or all live rewards are exactly equal: it has no learning
signal, gets zero advantages, and the recipe skips it (no reference scoring, no
KL-only steps) and counts it (retrograd notes 4.2, step 5).

Order, as in Dr. GRPO / TRL: subtract the baseline, then divide by the scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrograd.objectives import pick

STD_EPSILON = 1e-4  # TRL divides by (std + 1e-4), std with Bessel's correction; we do the same


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: torch.Tensor  # [n_groups, G]; zero on dead groups and on members that are not live
    dead: torch.Tensor  # [n_groups] bool
    diagnostics: dict[str, float]


def mean_baseline(rewards: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean(live r) (GRPO, Shao et al. 2024)."""
    n_live = live.sum(-1, keepdim=True).clamp(min=1)  # [n_groups, 1]
    mean = (rewards * live).sum(-1, keepdim=True) / n_live  # [n_groups, 1]
    return (rewards - mean) * live  # [n_groups, G]


def leave_one_out_baseline(rewards: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean of the *other* live rewards = n/(n-1) (r_i - mean) for n live
    members (RLOO: Kool et al. 2019; Ahmadian et al. 2024)."""
    n_live = live.sum(-1, keepdim=True)  # [n_groups, 1]
    return mean_baseline(rewards, live) * n_live / (n_live - 1).clamp(min=1)  # [n_groups, G]


def _unbiased_std(rewards: torch.Tensor, live: torch.Tensor, dim) -> torch.Tensor:
    n_live = live.sum(dim, keepdim=True)  # [n_groups, 1] or [1, 1]
    mean = (rewards * live).sum(dim, keepdim=True) / n_live.clamp(min=1)  # same
    variance = ((rewards - mean).square() * live).sum(dim, keepdim=True) / (n_live - 1).clamp(min=1)
    return variance.sqrt()


def no_scale(rewards: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, sec. 3.1): the std division biases towards easy and
    hard prompts, so do not divide. Our default."""
    return torch.ones_like(rewards[:, :1])  # [n_groups, 1]


def group_scale(rewards: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Original GRPO: divide by the std of the group's live rewards (+ STD_EPSILON)."""
    return _unbiased_std(rewards, live, -1) + STD_EPSILON  # [n_groups, 1]


def batch_scale(rewards: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """PPO-Lite / TRL scale_rewards="batch": divide by the std of every live reward in the
    batch, dead groups included (TRL takes the whole batch too), + STD_EPSILON."""
    return _unbiased_std(rewards, live, (0, 1)) + STD_EPSILON  # [1, 1]


BASELINES = {"mean": mean_baseline, "leave_one_out": leave_one_out_baseline}
REWARD_SCALES = {"none": no_scale, "group": group_scale, "batch": batch_scale}


def baseline_name(name: str) -> str:
    """The config's baseline as BASELINES names it: "rloo" is the leave-one-out baseline."""
    return "leave_one_out" if name == "rloo" else name


def group_advantages(
    rewards: torch.Tensor,  # [n_groups, G]
    live: torch.Tensor,  # [n_groups, G] bool
    baseline: str = "mean",
    scale_rewards: str = "none",
) -> GroupAdvantages:
    """Per-completion advantages for whole groups; see the module docstring."""
    assert rewards.shape == live.shape and rewards.dim() == 2, (rewards.shape, live.shape)
    live = live.bool()  # [n_groups, G]
    rewards = torch.where(live, rewards, 0.0)  # [n_groups, G]; NaN of failed members gone
    weights = live.to(rewards.dtype)  # [n_groups, G]
    n_live = live.sum(-1)  # [n_groups]
    highest = torch.where(live, rewards, -torch.inf).amax(-1)  # [n_groups]
    lowest = torch.where(live, rewards, torch.inf).amin(-1)  # [n_groups]
    zero_std = (n_live >= 2) & (highest == lowest)  # [n_groups]
    dead = (n_live < 2) | zero_std  # [n_groups]

    centred = pick(BASELINES, baseline, "grpo.baseline")(rewards, weights)  # [n_groups, G]
    scale = pick(REWARD_SCALES, scale_rewards, "grpo.scale_rewards")(rewards, weights)  # [n_groups or 1, 1]
    trained = live & ~dead[:, None]  # [n_groups, G]
    advantages = torch.where(trained, centred / scale, 0.0)  # [n_groups, G]
    return GroupAdvantages(advantages, dead, _diagnostics(rewards, live, trained, dead, zero_std, advantages))


def _diagnostics(rewards, live, trained, dead, zero_std, advantages) -> dict[str, float]:
    """Reward and batch statistics (retrograd's reward/* and batch/* names); reward
    statistics cover live members and read 0 when nothing is live."""
    live_rewards = rewards[live]  # [n_live]
    spread = _unbiased_std(rewards, live.to(rewards.dtype), -1).squeeze(-1)  # [n_groups]
    has_pairs = live.sum(-1) >= 2  # [n_groups]
    any_live = live_rewards.numel() > 0
    return {
        "reward/mean": live_rewards.mean().item() if any_live else 0.0,
        "reward/min": live_rewards.min().item() if any_live else 0.0,
        "reward/max": live_rewards.max().item() if any_live else 0.0,
        "reward/std": live_rewards.std().item() if live_rewards.numel() > 1 else 0.0,
        "reward/group_std": spread[has_pairs].mean().item() if has_pairs.any() else 0.0,
        "batch/dead_group_fraction": dead.double().mean().item(),
        "batch/zero_std_group_fraction": zero_std.double().mean().item(),
        "batch/trained_fraction": trained.double().mean().item(),
        "batch/advantage_abs_mean": advantages[trained].abs().mean().item() if trained.any() else 0.0,
    }


def add_intermediate_returns(
    advantages: torch.Tensor,  # [B] group advantage of each trajectory
    mask: torch.Tensor,  # [B, T] trainable tokens
    step_starts: torch.Tensor,  # [B, S] long: token index where each step starts
    step_rewards: torch.Tensor,  # [B, S]
    step_live: torch.Tensor,  # [B, S] bool: False for padding steps
) -> torch.Tensor:
    """Per-token advantages for agentic GRPO (retrograd notes 4.6): each trainable token
    gets the sum of the rewards of the steps that start at or after it (a reward-to-go
    with gamma = 1), centred on its mean over the trajectory's trainable tokens, plus the
    trajectory's group advantage. A step starts at the first token after the call that
    earned its reward, so the call's own tokens are credited. Returns [B, T], zero
    outside the mask."""
    live_mask = mask.bool()  # [B, T]
    positions = torch.arange(mask.shape[1], device=mask.device)  # [T]
    counted = step_live.bool()[:, None, :] & (step_starts[:, None, :] >= positions[None, :, None])  # [B, T, S]
    rewards = torch.where(step_live.bool(), step_rewards, 0.0)  # [B, S]
    returns = (counted * rewards[:, None, :]).sum(-1)  # [B, T]
    weights = live_mask.to(returns.dtype)  # [B, T]
    mean = (returns * weights).sum(-1, keepdim=True) / weights.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    return torch.where(live_mask, advantages[:, None] + returns - mean, 0.0)  # [B, T]
