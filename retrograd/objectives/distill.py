"""Distillation objectives (retrograd notes 4.4; peers notes 3.2).

- On-policy: the teacher scores the student's own samples and each token gets the
  advantage A_t = clamp(logp_teacher - logp_student, +-weight_clip), fed to
  `policy.policy_loss`, with logp_student torch's under the adapter before the update
  (the proximal policy). Its expectation over student samples is minus the reverse KL,
  so the policy gradient descends KL(student || teacher) (Agarwal et al. 2024;
  Thinking Machines, "On-Policy Distillation", 2025). With distill_epochs = 1 the ratio
  is 1 and the clip never binds.
- Offline top-k: cross-entropy against the teacher's top-k distribution.
- GKD's generalized JSD, restricted to the teacher's top-k ids.

The two top-k losses take N flattened token positions with K teacher ids each:
`student_logp` [N, K] is the student's full-vocabulary log-softmax gathered at the
teacher's ids, `teacher_logp` [N, K] the teacher's top-k logprobs (all finite), `mask`
[N] the trained positions. They sum over positions and divide by `n_tokens`, the trained
positions of the whole minibatch, so micro-batches accumulate exactly.
"""

from __future__ import annotations

import math

import torch


def teacher_advantages(
    teacher_logp: torch.Tensor,  # [...] teacher's logprob of the student's tokens
    proximal_logp: torch.Tensor,  # [...] the student's, torch's before the update
    weight_clip: float,
) -> torch.Tensor:
    """Per-token on-policy distillation advantages clamp(log p_T - log p_S, ±weight_clip),
    detached, the shape of the inputs.

    log p_S must be the policy being trained (the proximal policy), not the sampler's
    log-prob: with samples from a sampler mu and the importance weight pi / mu (tis_cap),
    E_mu[(pi / mu) A grad log pi] = E_pi[A grad log pi], which is -grad KL(pi || T) when A =
    log T - log pi, but -grad KL(pi || T) + grad KL(pi || mu) when A = log T - log mu: an
    asynchronous run's older sampling adapter would push the student away from itself."""
    return (teacher_logp - proximal_logp).detach().clamp(-weight_clip, weight_clip)


def teacher_diagnostics(
    teacher_logp: torch.Tensor,  # [B, T]
    proximal_logp: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T] trainable tokens
    weight_clip: float,
) -> dict[str, float]:
    """distill/teacher_kl_mean (mean of -A over tokens, nats), distill/teacher_kl_p95 (its
    95th percentile, linear interpolation) and distill/advantage_clipped_fraction, for the
    advantages A of `teacher_advantages`."""
    active = mask.bool()  # [B, T]
    assert active.any(), "on-policy distillation needs at least one trainable token"
    gap = (teacher_logp - proximal_logp)[active].double()  # [n_active]
    divergence = -teacher_advantages(teacher_logp, proximal_logp, weight_clip)[active].double()  # [n_active]
    return {
        "distill/teacher_kl_mean": divergence.mean().item(),
        "distill/teacher_kl_p95": torch.quantile(divergence, 0.95).item(),
        "distill/advantage_clipped_fraction": (gap.abs() > weight_clip).double().mean().item(),
    }


def topk_cross_entropy(
    student_logp: torch.Tensor,  # [N, K] student log-softmax at the teacher's ids
    teacher_logp: torch.Tensor,  # [N, K] teacher's top-k logprobs
    mask: torch.Tensor,  # [N]
    n_tokens: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """-sum_j p_j log q(v_j) with p the teacher's top-k probabilities renormalised over
    the k ids and q the student's full distribution (Hinton et al. 2015, restricted to
    the teacher's top-k as retrograd's distill-teacher sidecar stores it)."""
    active = mask.bool()  # [N]
    teacher_logp = torch.where(active[:, None], teacher_logp, 0.0)  # [N, K]; padding rows stay finite
    teacher_p = teacher_logp.softmax(-1)  # [N, K]
    per_token = -(teacher_p * student_logp).sum(-1)  # [N]
    loss = torch.where(active, per_token, 0.0).sum() / n_tokens  # []
    with torch.no_grad():
        diagnostics = {
            "distill/topk_ce": loss.item(),
            "distill/teacher_topk_mass": teacher_logp[active].exp().sum(-1).mean().item(),
            "distill/student_topk_mass": student_logp[active].exp().sum(-1).mean().item(),
            "distill/active_tokens": float(active.sum()),
        }
    return loss, diagnostics


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)  # [N]


def generalized_jsd(
    student_logp: torch.Tensor,  # [N, K] student log-softmax at the teacher's ids
    teacher_logp: torch.Tensor,  # [N, K] teacher's top-k logprobs
    mask: torch.Tensor,  # [N]
    n_tokens: int,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GKD's generalized JSD (Agarwal et al. 2024, eq. 1) with both distributions
    renormalised over the teacher's k ids: with M = beta p_T + (1 - beta) p_S,
    JSD_beta = beta KL(p_T || M) + (1 - beta) KL(p_S || M). As in TRL, beta = 0 is the
    forward KL(p_T || p_S) and beta = 1 the reverse KL(p_S || p_T), computed directly
    (the mixture form vanishes at the endpoints)."""
    active = mask.bool()  # [N]
    log_s = torch.where(active[:, None], student_logp, 0.0).log_softmax(-1)  # [N, K]
    log_t = torch.where(active[:, None], teacher_logp, 0.0).log_softmax(-1)  # [N, K]
    if beta == 0.0:
        per_token = _kl(log_t, log_s)  # [N]
    elif beta == 1.0:
        per_token = _kl(log_s, log_t)  # [N]
    else:
        log_m = torch.stack([log_t + math.log(beta), log_s + math.log(1.0 - beta)]).logsumexp(0)  # [N, K]
        per_token = beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)  # [N]
    loss = torch.where(active, per_token, 0.0).sum() / n_tokens  # []
    return loss, {"distill/jsd": loss.item(), "distill/active_tokens": float(active.sum())}
