"""Preference losses as pure functions of summed log-probabilities.

For a pair, S is the policy's summed log-prob of an answer's trained tokens, R the
reference's (the base with the adapter off, or the adapter as the run started), n the
answer's token count and l = S / n its mean; c and r mark chosen and rejected. Each
function returns the loss per pair and TRL's implicit rewards (its `rewards/chosen` and
`rewards/rejected` metrics), detached:

    dpo    m = beta (S_c - R_c) - beta (S_r - R_r)
           L = -(1 - eps) log sigmoid(m) - eps log sigmoid(-m)        (eps: label smoothing, conservative
           DPO as in the Rust retrograd and TRL before 1.x; TRL 1.16's sigmoid loss ignores it)
    ipo    h = (S_c - R_c) / n_c - (S_r - R_r) / n_r,   L = (h - 1 / (2 beta))^2
    simpo  L = -log sigmoid(beta (l_c - l_r) - gamma_beta_ratio * beta)      (no reference; TRL's CPO
           loss "simpo" with cpo_alpha = 0 and simpo_gamma = gamma_beta_ratio * beta)
    orpo   z = (l_c - l_r) - (log(1 - e^l_c) - log(1 - e^l_r))
           L = -l_c - beta log sigmoid(z)                                     (no reference)
    kto    (one answer and a label) L = w_d (1 - sigmoid(beta (S - R - z0)))   desirable
                                    L = w_u (1 - sigmoid(beta (z0 - S + R)))   undesirable
           z0 = max(0, mean (S' - R')) over mismatched prompt/answer pairs, detached

Rewards are beta (S - R) for dpo, ipo and kto, beta l for simpo and orpo. The mean loss of a step is the mean over its pairs (orpo's NLL term is each pair's
mean token NLL, the Rust retrograd's; TRL averages it over the tokens of the whole batch,
which equals it for pairs of equal length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ORPO_MAX_MEAN_LOGP = -1e-6  # log(1 - e^l) is -inf at l = 0: a mean above this is clamped (no gradient)


@dataclass(frozen=True)
class PairLogps:
    """[P] tensors for P pairs; the reference is None for the reference-free losses."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    n_chosen: torch.Tensor
    n_rejected: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None


Loss = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # loss [P], rewards chosen [P], rewards rejected [P]


def dpo(p: PairLogps, beta: float, label_smoothing: float = 0.0) -> Loss:
    chosen, rejected = beta * (p.chosen - p.ref_chosen), beta * (p.rejected - p.ref_rejected)
    m = chosen - rejected
    loss = -(1 - label_smoothing) * F.logsigmoid(m) - label_smoothing * F.logsigmoid(-m)
    return loss, chosen.detach(), rejected.detach()


def ipo(p: PairLogps, beta: float) -> Loss:
    chosen, rejected = p.chosen - p.ref_chosen, p.rejected - p.ref_rejected
    loss = (chosen / p.n_chosen - rejected / p.n_rejected - 1 / (2 * beta)) ** 2
    return loss, beta * chosen.detach(), beta * rejected.detach()


def simpo(p: PairLogps, beta: float, gamma_beta_ratio: float) -> Loss:
    chosen, rejected = p.chosen / p.n_chosen, p.rejected / p.n_rejected
    loss = -F.logsigmoid(beta * (chosen - rejected - gamma_beta_ratio))
    return loss, beta * chosen.detach(), beta * rejected.detach()


def orpo(p: PairLogps, beta: float) -> Loss:
    chosen, rejected = p.chosen / p.n_chosen, p.rejected / p.n_rejected
    c, r = chosen.clamp(max=ORPO_MAX_MEAN_LOGP), rejected.clamp(max=ORPO_MAX_MEAN_LOGP)
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    loss = -chosen - beta * F.logsigmoid(log_odds)
    return loss, beta * chosen.detach(), beta * rejected.detach()


def kto_reference_point(mismatched: torch.Tensor, ref_mismatched: torch.Tensor) -> torch.Tensor:
    """z0: the batch's KL estimate from answers scored after other records' prompts."""
    return (mismatched - ref_mismatched).mean().clamp(min=0).detach()


def kto(logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor, beta: float,
        desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (loss [B], rewards [B]) for B labelled answers (`desirable` a bool [B])."""
    ratio = logps - ref
    loss = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio))))
    return loss, beta * ratio.detach()


def pair_loss(p: PairLogps, loss: str, *, beta: float, label_smoothing: float = 0.0, gamma_beta_ratio: float = 0.5) -> Loss:
    """The paired losses by their config name."""
    if loss == "dpo":
        return dpo(p, beta, label_smoothing)
    if loss == "ipo":
        return ipo(p, beta)
    if loss == "simpo":
        return simpo(p, beta, gamma_beta_ratio)
    if loss == "orpo":
        return orpo(p, beta)
    raise ValueError(f"not a paired preference loss: {loss!r}")

