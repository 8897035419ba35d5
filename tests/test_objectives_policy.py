"""The GRPO policy loss against a token-by-token reference written out here, against
TRL's published formulas (restated, not imported), and under micro-batch accumulation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from retrograd.errors import ConfigError
from retrograd.objectives.policy import MinibatchCounts, PolicyLossOptions, merge_diagnostics, policy_loss

B, T, BUDGET = 4, 6, 8
LOW, HIGH = 0.2, 0.28


def fixed_batch(seed: int = 0, spread: float = 0.4) -> dict[str, torch.Tensor]:
    """Float64 logprobs with ratios on both sides of the clip range (a per-row drift
    so that sequence ratios clip too), mixed-sign advantages, rows of different
    lengths, and garbage (NaN) outside the mask."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1  # [B, T]
    drift = torch.tensor([[0.3], [-0.3], [0.0], [-0.25]], dtype=torch.float64)  # [B, 1]
    logp = old + drift + torch.randn(B, T, generator=g, dtype=torch.float64) * spread  # [B, T]
    mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool
    )
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5  # [B, T]
    sampler = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6  # [B, T]
    for t in (old, ref, sampler):
        t[~mask] = float("nan")
    return {
        "logp": logp,
        "old": old,
        "ref": ref,
        "sampler": sampler,
        "mask": mask,
        "adv": torch.tensor([0.7, -1.1, 0.0, -0.4], dtype=torch.float64),
        "token_adv": torch.randn(B, T, generator=g, dtype=torch.float64),
    }


def reference_loss(data, advantages, level, normalization, beta=0.0, tis_cap=None, dual_clip=3.0):
    """Token by token: the PPO clip written piecewise by the sign of A, dual clip,
    k3 KL, TIS, and each normalisation's denominator, with autograd on `logp`."""
    logp, old, ref, sampler, mask = data["logp"], data["old"], data["ref"], data["sampler"], data["mask"]
    n_sequences, n_tokens = mask.shape[0], int(mask.sum())
    total = torch.zeros((), dtype=torch.float64)
    for b in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[b, t]]
        seq_log_ratio = sum(logp[b, t] - old[b, t] for t in tokens) / len(tokens)
        for t in tokens:
            a = float(advantages[b] if advantages.dim() == 1 else advantages[b, t])
            log_r = seq_log_ratio if level == "sequence" else logp[b, t] - old[b, t]
            r = torch.exp(torch.clamp(log_r, -10, 10))
            if a > 0:
                objective = a * torch.clamp(r, max=1 + HIGH)
            elif a < 0:
                objective = a * torch.clamp(torch.clamp(r, min=1 - LOW), max=dual_clip)
            else:
                objective = 0.0 * r
            weight = 1.0 if tis_cap is None else min(math.exp(float(old[b, t] - sampler[b, t])), tis_cap)
            d = torch.clamp(ref[b, t] - logp[b, t], -5, 5)
            token_loss = -objective * weight + beta * (torch.exp(d) - d - 1)
            denominator = {
                "budget": n_sequences * BUDGET,
                "token": n_tokens,
                "sequence": len(tokens) * n_sequences,
            }[normalization]
            total = total + token_loss / denominator
    return total


def ours(data, advantages, level, normalization, beta=0.0, tis_cap=None, rows=slice(None), logp=None):
    options = PolicyLossOptions(
        LOW, HIGH, importance_sampling_level=level, loss_normalization=normalization, tis_cap=tis_cap
    )
    counts = MinibatchCounts.of([data["mask"]], BUDGET)
    return policy_loss(
        (data["logp"] if logp is None else logp)[rows],
        data["old"][rows],
        advantages[rows],
        data["mask"][rows],
        counts,
        options,
        beta=beta,
        ref_logp=data["ref"][rows] if beta else None,
        sampler_logp=data["sampler"][rows] if tis_cap else None,
    )


CASES = list(
    itertools.product(
        ["token", "sequence"],  # importance_sampling_level
        ["budget", "token", "sequence"],  # loss_normalization
        [(0.0, None), (0.05, None), (0.05, 2.0)],  # (beta, tis_cap)
        ["adv", "token_adv"],
    )
)


@pytest.mark.parametrize("level,normalization,extras,adv_key", CASES)
def test_loss_and_gradient_match_the_reference(level, normalization, extras, adv_key):
    beta, tis_cap = extras
    data = fixed_batch()
    logp = data["logp"].clone().requires_grad_(True)
    loss, diagnostics = ours(data, data[adv_key], level, normalization, beta, tis_cap, logp=logp)
    (grad,) = torch.autograd.grad(loss, logp)
    logp_ref = data["logp"].clone().requires_grad_(True)
    expected = reference_loss({**data, "logp": logp_ref}, data[adv_key], level, normalization, beta, tis_cap)
    (expected_grad,) = torch.autograd.grad(expected, logp_ref)
    assert abs(loss.item() - expected.item()) <= 1e-12
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    assert diagnostics["policy/total_loss"] == pytest.approx(
        diagnostics["policy/surrogate_loss"] + beta * diagnostics["policy/kl_loss"], abs=1e-12
    )
    assert (grad[~data["mask"]] == 0).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalization", ["budget", "token", "sequence"])
def test_micro_batches_accumulate_to_the_one_call_gradient(level, normalization):
    """Split the minibatch 1 + 3 rows, the second micro-batch trimmed to its own width,
    with the counts of the whole minibatch: summed losses and gradients equal one call."""
    data = fixed_batch(seed=1)
    options = PolicyLossOptions(
        LOW, HIGH, importance_sampling_level=level, loss_normalization=normalization, tis_cap=2.0
    )
    parts = [(slice(0, 1), slice(None)), (slice(1, 4), slice(0, 5))]
    counts = MinibatchCounts.of([data["mask"][r, c] for r, c in parts], BUDGET)
    assert counts == MinibatchCounts(4, int(data["mask"].sum()), BUDGET)

    def call(logp, rows, cols):
        def cut(key):
            return data[key][rows, cols]

        return policy_loss(
            logp[rows, cols], cut("old"), cut("token_adv"), cut("mask"), counts, options,
            beta=0.1, ref_logp=cut("ref"), sampler_logp=cut("sampler"),
        )  # fmt: skip

    whole_logp = data["logp"].clone().requires_grad_(True)
    whole_loss, whole_diag = call(whole_logp, slice(None), slice(None))
    whole_loss.backward()

    split_logp = data["logp"].clone().requires_grad_(True)
    split_losses, split_diags = [], []
    for rows, cols in parts:
        loss, diag = call(split_logp, rows, cols)
        loss.backward()
        split_losses.append(loss.item())
        split_diags.append(diag)
    assert sum(split_losses) == pytest.approx(whole_loss.item(), abs=1e-12)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad, rtol=0, atol=1e-12)
    merged = merge_diagnostics(split_diags)
    assert merged.keys() == whole_diag.keys()
    for key in merged:
        assert merged[key] == pytest.approx(whole_diag[key], abs=1e-12), key


def test_gspo_ratio_is_the_exp_of_the_mean_log_ratio():
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.tensor([[0.3, -0.1, 0.4, 9.0]], dtype=torch.float64, requires_grad=True)
    options = PolicyLossOptions(0.5, 0.5, importance_sampling_level="sequence", loss_normalization="token")
    loss, diag = policy_loss(logp, old, torch.tensor([1.0]), mask, MinibatchCounts(1, 3, 4), options)
    s = math.exp((0.3 - 0.1 + 0.4) / 3)  # the masked 9.0 does not count
    assert diag["policy/ratio_min"] == pytest.approx(s) and diag["policy/ratio_max"] == pytest.approx(s)
    assert loss.item() == pytest.approx(-s)  # three tokens of -A s, divided by 3 tokens
    loss.backward()  # loss = -(1/3) * 3 s and ds/dlogp_t = s/3 for each live token
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 3, -s / 3, -s / 3, 0.0]], dtype=torch.float64))


def test_log_ratios_are_clamped_at_ten():
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.tensor([[14.0, -13.0]], dtype=torch.float64)
    old = torch.zeros(1, 2, dtype=torch.float64)
    options = PolicyLossOptions(LOW, HIGH)
    _, diag = policy_loss(logp, old, torch.tensor([1.0]), mask, MinibatchCounts(1, 2, 2), options)
    assert diag["policy/ratio_max"] == pytest.approx(math.exp(10))
    assert diag["policy/ratio_min"] == pytest.approx(math.exp(-10))
    seq = PolicyLossOptions(LOW, HIGH, importance_sampling_level="sequence")
    _, diag = policy_loss(logp * 2, old, torch.tensor([1.0]), mask, MinibatchCounts(1, 2, 2), seq)
    assert diag["policy/ratio_max"] == pytest.approx(math.exp(1))  # mean of 28 and -26


def test_dual_clip_and_clip_fractions_hand_built():
    """Eight tokens, one sequence each, clip 0.2 / 0.28 and dual clip 3:
    A>0 r=1.5 (high clip), A>0 r=0.5 (kept), A<0 r=0.5 (low clip), A<0 r=1.5 (kept),
    A<0 r=4 (dual clip: objective 3A, no gradient), A<0 r=2.5 (kept, below 3),
    A=0 r=2 (nothing), A>0 r=1.1 (kept)."""
    ratios = [1.5, 0.5, 0.5, 1.5, 4.0, 2.5, 2.0, 1.1]
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -2.0, -1.0, 0.0, 2.0], dtype=torch.float64)
    logp = torch.tensor([[math.log(r)] for r in ratios], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(8, 1, dtype=torch.float64)
    mask = torch.ones(8, 1, dtype=torch.bool)
    loss, diag = policy_loss(logp, old, advantages, mask, MinibatchCounts(8, 8, 1), PolicyLossOptions(LOW, HIGH))
    objectives = [1.28, 0.5, -0.8, -1.5, -6.0, -2.5, 0.0, 2.2]
    assert loss.item() == pytest.approx(-sum(objectives) / 8)
    loss.backward()
    # gradient of -A r / 8 w.r.t. log r is -A r / 8 where the token is not clipped out
    kept = [0.0, 0.5, 0.0, -1.5, 0.0, -2.5, 0.0, 2.2]
    torch.testing.assert_close(logp.grad[:, 0], -torch.tensor(kept, dtype=torch.float64) / 8)
    assert diag["policy/clip_high_fraction"] == pytest.approx(1 / 8)
    assert diag["policy/clip_low_fraction"] == pytest.approx(1 / 8)
    assert diag["policy/dual_clip_fraction"] == pytest.approx(1 / 8)
    assert diag["policy/clip_fraction"] == pytest.approx(3 / 8)
    assert diag["policy/ratio_mean"] == pytest.approx(sum(ratios) / 8)


def test_tis_weights_are_capped_and_detached():
    data = fixed_batch(seed=3)
    _, diag = ours(data, data["adv"], "token", "budget", tis_cap=1.5)
    live = data["mask"]
    weights = (data["old"][live] - data["sampler"][live]).exp()
    assert diag["policy/tis_capped_fraction"] == pytest.approx((weights >= 1.5).double().mean().item())
    assert diag["policy/tis_weight_mean"] == pytest.approx(weights.clamp(max=1.5).mean().item())


# TRL's _compute_loss, restated from huggingface/trl@d2b69d769dab6f77acbfd33252bcd7d22765571b
# trl/trainer/grpo_trainer.py (loss types grpo, bnpo, dr_grpo) and, for dapo and the vLLM
# importance-sampling correction, from the later _compute_loss (as vendored in Axolotl's
# GRPO trainer): per_token_kl = e^(ref-logp) - (ref-logp) - 1; coef_1 = exp(log ratio),
# token- or sequence-level (masked mean of the log ratio); coef_2 = clamp(coef_1, 1-eps_low,
# 1+eps_high); per_token_loss = -min(coef_1 A, coef_2 A), times the IS ratio, plus beta kl;
#   grpo:    ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
#   dr_grpo: (ptl * mask).sum() / (ptl.size(0) * max_completion_length)
#   dapo:    (ptl * mask).sum() / (num_items_in_batch / num_processes), num_items_in_batch =
#            active tokens of the globally accumulated batch.
# Where TRL differs: it has no dual clip and no clamps on the log ratios (the data below keep
# r < 3, |log r| < 10 and |ref - logp| < 5, where the two agree); its grpo/bnpo/dr_grpo
# divide each micro-batch by gradient_accumulation_steps, so equal-size micro-batches are
# needed for them to match a whole-minibatch call, whereas ours take minibatch counts; its
# dapo counts tokens over all processes and accumulation steps, as our "token" does with
# MinibatchCounts over the micro-batches of one step.
def trl_loss(data, advantages, level, loss_type, beta, is_ratio):
    logp, old, ref, mask = data["logp"], data["old"], data["ref"], data["mask"].double()
    old = torch.nan_to_num(old)
    ref = torch.nan_to_num(ref)
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - LOW, 1 + HIGH)
    a = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a) * is_ratio + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * BUDGET)
    num_items_in_batch, num_processes = mask.sum(), 1
    return (per_token_loss * mask).sum() / (num_items_in_batch / num_processes)


@pytest.mark.parametrize("loss_type,normalization", [("dr_grpo", "budget"), ("dapo", "token"), ("grpo", "sequence")])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("tis_cap", [None, 1.7])
def test_matches_trl_formula(loss_type, normalization, level, tis_cap):
    data = fixed_batch(seed=2, spread=0.3)
    live = data["mask"]
    assert (data["logp"] - data["old"])[live].exp().max() < 3
    assert (data["ref"] - data["logp"])[live].abs().max() < 5
    is_ratio = torch.ones(B, T, dtype=torch.float64)
    if tis_cap is not None:  # TRL: exp(old - sampling logps), truncated at the cap
        is_ratio = torch.nan_to_num(data["old"] - data["sampler"]).exp().clamp(max=tis_cap)
    for adv_key in ("token_adv", "adv"):
        logp_trl = data["logp"].clone().requires_grad_(True)
        expected = trl_loss({**data, "logp": logp_trl}, data[adv_key], level, loss_type, 0.04, is_ratio)
        (expected_grad,) = torch.autograd.grad(expected, logp_trl)
        logp = data["logp"].clone().requires_grad_(True)
        loss, diag = ours(data, data[adv_key], level, normalization, beta=0.04, tis_cap=tis_cap, logp=logp)
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)

    # TRL's clip metrics: low = coef_1 < 1 - eps_low and A < 0; high = coef_1 > 1 + eps_high and A > 0
    ratio = (data["logp"] - data["old"]).exp()
    if level == "sequence":
        ratio = ((data["logp"] - data["old"]).nan_to_num() * live).sum(-1, keepdim=True) / live.sum(-1, keepdim=True)
        ratio = ratio.exp().expand(B, T)
    a = data["adv"][:, None]  # the last call's advantages
    low = ((ratio < 1 - LOW) & (a < 0))[live].double().mean().item()
    high = ((ratio > 1 + HIGH) & (a > 0))[live].double().mean().item()
    assert diag["policy/clip_low_fraction"] == pytest.approx(low)
    assert diag["policy/clip_high_fraction"] == pytest.approx(high)
    assert diag["policy/clip_fraction"] == pytest.approx(low + high)
    assert 0 < low + high < 1


def test_kl_is_k3_clamped_at_five():
    mask = torch.ones(1, 3, dtype=torch.bool)
    logp = torch.zeros(1, 3, dtype=torch.float64)
    ref = torch.tensor([[0.5, -7.0, 6.0]], dtype=torch.float64)
    counts, options = MinibatchCounts(1, 3, 3), PolicyLossOptions(LOW, HIGH)
    _, diag = policy_loss(logp, logp, torch.tensor([0.0]), mask, counts, options, beta=1.0, ref_logp=ref)
    expected = sum(math.exp(d) - d - 1 for d in (0.5, -5.0, 5.0)) / 3
    assert diag["policy/kl"] == pytest.approx(expected)


@pytest.mark.parametrize("normalization", ["budget", "token", "sequence"])
def test_kl_metric_is_the_per_token_mean_whatever_the_normalization(normalization):
    """policy/kl is what the KL controller and the divergence guard read: the mean k3 over
    the completion tokens, the same number under every loss normalisation and however the
    minibatch is cut into micro-batches; only policy/kl_loss (its share of the loss) moves."""
    data = fixed_batch()
    live = data["mask"]
    d = (data["ref"] - data["logp"]).clamp(-5, 5)
    expected = (d.exp() - d - 1)[live].mean().item()
    counts = MinibatchCounts(live.shape[0], int(live.sum()), BUDGET)
    options = PolicyLossOptions(LOW, HIGH, loss_normalization=normalization)
    parts = []
    for rows in (slice(0, 1), slice(1, None)):
        _, diag = policy_loss(data["logp"][rows], data["old"][rows], data["adv"][rows], live[rows], counts, options,
                              beta=0.1, ref_logp=data["ref"][rows])
        parts.append(diag)
    merged = merge_diagnostics(parts)
    assert merged["policy/kl"] == pytest.approx(expected, rel=1e-12)
    weights = {"budget": 1 / (counts.n_sequences * BUDGET), "token": 1 / counts.n_tokens}.get(normalization)
    if weights is not None:  # the loss share is the normalised sum, not the mean
        assert merged["policy/kl_loss"] == pytest.approx((d.exp() - d - 1)[live].sum().item() * weights, rel=1e-12)


def test_kl_metric_is_absent_without_a_reference():
    data = fixed_batch()
    counts = MinibatchCounts(data["mask"].shape[0], int(data["mask"].sum()), BUDGET)
    _, diag = policy_loss(data["logp"], data["old"], data["adv"], data["mask"], counts, PolicyLossOptions(LOW, HIGH))
    assert "policy/kl" not in diag and diag["policy/kl_loss"] == 0.0


def test_unknown_normalization_names_the_key():
    data = fixed_batch()
    with pytest.raises(ConfigError, match="grpo.loss_normalization = 'bnpo'"):
        ours(data, data["adv"], "token", "bnpo")
    with pytest.raises(ConfigError, match="grpo.importance_sampling_level"):
        ours(data, data["adv"], "group", "budget")
