"""The GRPO policy loss: PPO clip (asymmetric, DAPO clip-higher) with a dual clip, token
or sequence (GSPO) importance ratios, k3 KL to a reference, truncated importance
sampling against the llama.cpp sampler, and three normalisations.

Per active token (retrograd notes 4.2; peers notes 3.1), with r the importance ratio,
A the advantage and eps_low / eps_high the clip ranges:

    objective = min(A r, A clip(r, 1 - eps_low, 1 + eps_high))
    objective = max(objective, dual_clip * A)            if A < 0 (Ye et al. 2020)
    d = clamp(logp_ref - logp, -5, 5);  kl = e^d - d - 1  (Schulman's k3)
    loss_t = -objective * tis_t + beta * kl

and loss = sum_t weight_t * loss_t, where the normalisation picks weight_t from counts
of the whole minibatch (one optimizer step). Because every weight depends only on those
counts and on the token's own sequence, summing the losses of the micro-batches of a
minibatch gives exactly the loss, and the gradient, of one call on the whole minibatch.

Shapes: B sequences, T token positions; `mask` marks trainable completion tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from retrograd.objectives import pick

LOG_RATIO_CLAMP = 10.0  # retrograd clamps log-ratios at +-10 before exp (weights.rs)
KL_LOG_RATIO_CLAMP = 5.0  # and the k3 log-ratio at +-5


@dataclass(frozen=True)
class PolicyLossOptions:
    clip_range_low: float  # r below 1 - low is clipped when A < 0
    clip_range_high: float  # r above 1 + high is clipped when A > 0 (DAPO: 0.28 > 0.2)
    importance_sampling_level: str = "token"  # "token" | "sequence" (GSPO)
    loss_normalization: str = "budget"  # "budget" (Dr. GRPO) | "token" (DAPO) | "sequence" (GRPO)
    dual_clip: float = 3.0  # A < 0 and r > dual_clip: objective = dual_clip * A
    tis_cap: float | None = None  # truncated IS weight cap; None = no correction


@dataclass(frozen=True)
class MinibatchCounts:
    """Counts over the whole minibatch that one optimizer step covers, shared by all its
    micro-batches."""

    n_sequences: int  # rows, trainable or not
    n_tokens: int  # trainable (mask) tokens
    budget_tokens: int  # max_new_tokens; for agentic GRPO the trajectory token budget

    @classmethod
    def of(cls, masks: Iterable[torch.Tensor], budget_tokens: int) -> MinibatchCounts:
        """From the [b, t] masks of the micro-batches that make up the minibatch."""
        masks = list(masks)
        return cls(sum(m.shape[0] for m in masks), sum(int(m.bool().sum()) for m in masks), budget_tokens)


# --- importance ratios: (log_ratio [B, T] zero off the mask, mask [B, T]) -> log r [B, T]


def token_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO: one ratio per token, r_t = pi(y_t) / pi_old(y_t)."""
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, eq. 7): one ratio per sequence, the geometric mean of its
    token ratios, s = exp(mean_t(logp - logp_old)), shared by all its tokens."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    mean = log_ratio.sum(-1, keepdim=True) / lengths  # [B, 1]
    return mean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(log_ratio)  # [B, T]


# --- normalisations: (mask [B, T], counts) -> weight of each token's loss [B, T]


def budget_weights(mask: torch.Tensor, counts: MinibatchCounts) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, eq. 3): total / (n_sequences * max_new_tokens), a
    constant, so no length bias. Our default."""
    return mask / (counts.n_sequences * counts.budget_tokens)  # [B, T]


def token_weights(mask: torch.Tensor, counts: MinibatchCounts) -> torch.Tensor:
    """DAPO (Yu et al. 2025, eq. 10): total / trainable tokens of the minibatch."""
    return mask / counts.n_tokens  # [B, T]


def sequence_weights(mask: torch.Tensor, counts: MinibatchCounts) -> torch.Tensor:
    """Original GRPO (Shao et al. 2024, eq. 3): mean over sequences of each sequence's
    token mean."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    return mask / (lengths * counts.n_sequences)  # [B, T]


IMPORTANCE_RATIOS = {"token": token_log_ratio, "sequence": sequence_log_ratio}
NORMALIZATIONS = {"budget": budget_weights, "token": token_weights, "sequence": sequence_weights}


def k3_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): e^d - d - 1 with d = ref - logp, d
    clamped at +-5 as retrograd does. Non-negative, zero when the two agree."""
    d = (ref_logp - logp).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)  # [B, T]
    return d.exp() - d - 1.0  # [B, T]


def policy_loss(
    logp: torch.Tensor,  # [B, T] current policy, differentiable
    old_logp: torch.Tensor,  # [B, T] behaviour policy rescored in torch, no grad
    advantages: torch.Tensor,  # [B] per sequence, or [B, T] per token
    mask: torch.Tensor,  # [B, T] trainable completion tokens
    counts: MinibatchCounts,
    options: PolicyLossOptions,
    *,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,  # [B, T] base model (adapter off), needed when beta > 0
    sampler_logp: torch.Tensor | None = None,  # [B, T] llama.cpp's logprobs, needed with tis_cap
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch and its diagnostics; see the module docstring.

    Diagnostics: policy/surrogate_loss, policy/kl_loss and policy/total_loss (= surrogate +
    beta * kl_loss = the loss) are this micro-batch's share of the minibatch value, under
    the loss normalisation; policy/kl (with a reference only) is the mean k3 estimate per
    active token, whatever the normalisation, the number the adaptive KL controller and the
    divergence guard read; the fractions and the ratio mean cover this call's active tokens
    too (policy/active_tokens; under GSPO each token carries its sequence's ratio); merge
    micro-batches with `merge_diagnostics`."""
    assert logp.shape == old_logp.shape == mask.shape, (logp.shape, old_logp.shape, mask.shape)
    assert beta == 0.0 or ref_logp is not None, "beta > 0 needs ref_logp"
    assert (options.tis_cap is None) == (sampler_logp is None), "tis_cap and sampler_logp go together"
    active = mask.bool()  # [B, T]
    assert active.any(), "a micro-batch needs at least one trainable token"
    weights_mask = active.to(logp.dtype)  # [B, T]
    advantages = (advantages[:, None] if advantages.dim() == 1 else advantages).expand_as(logp)  # [B, T]
    advantages = torch.where(active, advantages.detach(), 0.0)  # [B, T]

    log_ratio = torch.where(active, logp - old_logp.detach(), 0.0)  # [B, T]
    choose_ratio = pick(IMPORTANCE_RATIOS, options.importance_sampling_level, "grpo.importance_sampling_level")
    ratio = choose_ratio(log_ratio, weights_mask).exp()  # [B, T]
    low, high = 1.0 - options.clip_range_low, 1.0 + options.clip_range_high
    objective = torch.minimum(advantages * ratio, advantages * ratio.clamp(low, high))  # [B, T]
    dual = options.dual_clip * advantages  # [B, T]
    objective = torch.where(advantages < 0, torch.maximum(objective, dual), objective)  # [B, T]
    surrogate = -objective  # [B, T]
    if options.tis_cap is not None:
        # TRL's vLLM correction: behaviour (torch) over sampler (llama.cpp), capped, on
        # the policy term only, not on the KL
        tis = torch.where(active, old_logp - sampler_logp, 0.0).detach().exp().clamp(max=options.tis_cap)  # [B, T]
        surrogate = surrogate * tis  # [B, T]
    kl = torch.zeros_like(logp)  # [B, T]
    if ref_logp is not None:
        kl = k3_kl(torch.where(active, ref_logp.detach(), logp), logp)  # [B, T]

    choose_weights = pick(NORMALIZATIONS, options.loss_normalization, "grpo.loss_normalization")
    weights = choose_weights(weights_mask, counts)  # [B, T]
    surrogate_loss = (weights * surrogate).sum()  # []
    kl_loss = (weights * kl).sum()  # []
    loss = surrogate_loss + beta * kl_loss  # []

    with torch.no_grad():
        clipped_high = active & (advantages > 0) & (ratio > high)  # [B, T]
        clipped_low = active & (advantages < 0) & (ratio < low)  # [B, T]
        clipped_dual = active & (advantages < 0) & (ratio > options.dual_clip)  # [B, T]
        n_active = int(active.sum())
        live_ratios = ratio[active]  # [n_active]
        diagnostics = {
            "policy/surrogate_loss": surrogate_loss.item(),
            "policy/kl_loss": kl_loss.item(),
            "policy/total_loss": loss.item(),
            "policy/clip_fraction": int((clipped_high | clipped_low | clipped_dual).sum()) / n_active,
            "policy/clip_low_fraction": int(clipped_low.sum()) / n_active,
            "policy/clip_high_fraction": int(clipped_high.sum()) / n_active,
            "policy/dual_clip_fraction": int(clipped_dual.sum()) / n_active,
            "policy/ratio_mean": live_ratios.mean().item(),
            "policy/ratio_min": live_ratios.min().item(),
            "policy/ratio_max": live_ratios.max().item(),
            "policy/active_tokens": float(n_active),
        }
        if ref_logp is not None:
            diagnostics["policy/kl"] = kl[active].double().mean().item()
        if options.tis_cap is not None:
            diagnostics["policy/tis_weight_mean"] = tis[active].mean().item()
            diagnostics["policy/tis_capped_fraction"] = int((tis[active] >= options.tis_cap).sum()) / n_active
    return loss, diagnostics


# How each diagnostic combines over micro-batches: loss shares add up, rates are
# token-weighted means, extremes stay extremes.
MERGE_RULES = {
    "policy/surrogate_loss": "sum",
    "policy/kl_loss": "sum",
    "policy/total_loss": "sum",
    "policy/kl": "token_mean",
    "policy/active_tokens": "sum",
    "policy/clip_fraction": "token_mean",
    "policy/clip_low_fraction": "token_mean",
    "policy/clip_high_fraction": "token_mean",
    "policy/dual_clip_fraction": "token_mean",
    "policy/ratio_mean": "token_mean",
    "policy/tis_weight_mean": "token_mean",
    "policy/tis_capped_fraction": "token_mean",
    "policy/ratio_min": "min",
    "policy/ratio_max": "max",
}


def merge_diagnostics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """The minibatch's diagnostics from those of its micro-batches (policy_loss calls)."""
    tokens = [part["policy/active_tokens"] for part in parts]
    total_tokens = sum(tokens)
    combine = {
        "sum": sum,
        "token_mean": lambda values: sum(v * n for v, n in zip(values, tokens)) / total_tokens,
        "min": min,
        "max": max,
    }
    return {key: combine[MERGE_RULES[key]]([part[key] for part in parts]) for key in parts[0]}
