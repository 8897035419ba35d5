"""Group advantages, reward shaping, the KL schedule and agentic intermediate returns,
each against formulas written out here, independently of the code under test."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from retrograd.errors import ConfigError
from retrograd.objectives.advantages import STD_EPSILON, add_intermediate_returns, group_advantages
from retrograd.objectives.shaping import (
    KL_MULTIPLIER_BOUNDS,
    adapt_kl_multiplier,
    kl_coefficient,
    overlong_penalty,
)

NAN = float("nan")
# four groups of G = 4; member 3 of group 1 failed (NaN reward, not live)
REWARDS = torch.tensor(
    [[1.0, 0.0, 0.5, 2.0], [0.3, 1.3, -0.7, NAN], [4.0, -1.0, 0.0, 0.25], [0.0, 1.0, 1.0, 3.0]],
    dtype=torch.float64,
)
LIVE = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)


def live_values(g: int) -> list[tuple[int, float]]:
    return [(i, float(REWARDS[g, i])) for i in range(REWARDS.shape[1]) if LIVE[g, i]]


def reference(baseline: str, scale: str) -> torch.Tensor:
    """Plain-Python GRPO advantages: loops, statistics.stdev, no tensors."""
    every_live = [r for g in range(REWARDS.shape[0]) for _, r in live_values(g)]
    out = torch.zeros_like(REWARDS)
    for g in range(REWARDS.shape[0]):
        members = live_values(g)
        values = [r for _, r in members]
        for i, r in members:
            others = [v for j, v in members if j != i]
            centred = r - sum(others) / len(others) if baseline == "leave_one_out" else r - sum(values) / len(values)
            divisor = {
                "none": 1.0,
                "group": statistics.stdev(values) + 1e-4,
                "batch": statistics.stdev(every_live) + 1e-4,
            }
            out[g, i] = centred / divisor[scale]
    return out


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("scale", ["none", "group", "batch"])
def test_advantages_match_the_written_out_formula(baseline, scale):
    result = group_advantages(REWARDS, LIVE, baseline=baseline, scale_rewards=scale)
    assert not result.dead.any()
    torch.testing.assert_close(result.advantages, reference(baseline, scale), rtol=0, atol=1e-12)
    assert (result.advantages[~LIVE] == 0).all()


def test_leave_one_out_is_mean_centred_times_n_over_n_minus_one():
    rloo = group_advantages(REWARDS, LIVE, baseline="leave_one_out").advantages
    centred = group_advantages(REWARDS, LIVE, baseline="mean").advantages
    n_live = LIVE.sum(-1, keepdim=True).double()
    torch.testing.assert_close(rloo, centred * n_live / (n_live - 1), rtol=0, atol=1e-12)


def test_trl_formula_for_full_groups():
    """TRL _generate_and_score_completions (huggingface/trl@d2b69d769dab6f77acbfd33252bcd7d22765571b,
    trl/trainer/grpo_trainer.py; later versions add scale_rewards="batch" with rewards.std()
    over the whole batch): advantages = (r - group mean) / (std + 1e-4), torch's unbiased std.
    Restated here for groups where every member is live."""
    rewards = REWARDS[[0, 3]]
    flat = rewards.reshape(-1)
    group_mean = rewards.mean(1).repeat_interleave(4)
    group_std = rewards.std(1).repeat_interleave(4)
    trl_group = (flat - group_mean) / (group_std + 1e-4)
    trl_batch = (flat - group_mean) / (flat.std() + 1e-4)
    live = torch.ones_like(rewards, dtype=torch.bool)
    ours_group = group_advantages(rewards, live, scale_rewards="group").advantages.reshape(-1)
    ours_batch = group_advantages(rewards, live, scale_rewards="batch").advantages.reshape(-1)
    torch.testing.assert_close(ours_group, trl_group, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours_batch, trl_batch, rtol=0, atol=1e-12)
    assert STD_EPSILON == 1e-4


def test_dead_groups_get_zero_and_are_reported():
    rewards = torch.tensor(
        [
            [1.0, 2.0, 3.0, 4.0],  # one live member -> dead
            [0.5, 0.5, 0.5, 0.5],  # all equal -> dead (zero std)
            [1.0, 2.0, 3.0, 4.0],  # nothing live -> dead
            [7.0, 1.0, 1.0, 9.0],  # live members 1 and 2 equal, the differing ones are not live -> dead
            [NAN, 0.0, 1.0, 0.0],  # alive: a failed member does not poison it
        ],
        dtype=torch.float64,
    )
    live = torch.tensor([[0, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    for scale in ("none", "group", "batch"):
        result = group_advantages(rewards, live, baseline="leave_one_out", scale_rewards=scale)
        assert result.dead.tolist() == [True, True, True, True, False]
        assert (result.advantages[:4] == 0).all()
        assert torch.isfinite(result.advantages).all()
        assert result.advantages[4, 0] == 0 and (result.advantages[4, 1:] != 0).all()
    d = result.diagnostics
    assert d["batch/dead_group_fraction"] == pytest.approx(4 / 5)
    assert d["batch/zero_std_group_fraction"] == pytest.approx(2 / 5)
    assert d["batch/trained_fraction"] == pytest.approx(3 / 20)


def test_diagnostics_follow_live_members():
    result = group_advantages(REWARDS, LIVE)
    live = [float(r) for r in REWARDS[LIVE]]
    d = result.diagnostics
    assert d["reward/mean"] == pytest.approx(statistics.mean(live))
    assert d["reward/std"] == pytest.approx(statistics.stdev(live))
    assert (d["reward/min"], d["reward/max"]) == (min(live), max(live))
    group_stds = [statistics.stdev([r for _, r in live_values(g)]) for g in range(4)]
    assert d["reward/group_std"] == pytest.approx(statistics.mean(group_stds))
    assert d["batch/advantage_abs_mean"] == pytest.approx(
        statistics.mean(abs(a) for a in reference("mean", "none")[LIVE].tolist())
    )
    assert d["batch/trained_fraction"] == pytest.approx(14 / 16)


def test_unknown_variant_names_the_key():
    with pytest.raises(ConfigError, match=r"grpo.baseline = 'median': expected one of leave_one_out, mean"):
        group_advantages(REWARDS, LIVE, baseline="median")
    with pytest.raises(ConfigError, match="grpo.scale_rewards"):
        group_advantages(REWARDS, LIVE, scale_rewards="std")


def test_overlong_penalty_is_dapo_eq13():
    """DAPO (arXiv 2503.14476, eq. 13) with L_max = 10, L_cache = 4, scaled by 2."""
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10])
    expected = [0.0, 0.0, 0.0, -0.5, -1.0, -1.5, -2.0]  # (6 - |y|) / 4 * 2 past 6 tokens
    assert overlong_penalty(lengths, max_new_tokens=10, buffer_tokens=4, max_penalty=2.0).tolist() == expected


def test_kl_warmup_ramps_linearly_from_zero():
    ramp = [kl_coefficient(0.1, update, warmup_updates=4) for update in range(7)]
    assert ramp == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    assert kl_coefficient(0.1, 0, warmup_updates=0) == pytest.approx(0.1)
    assert kl_coefficient(0.1, 2, warmup_updates=4, multiplier=4.0) == pytest.approx(0.2)


def test_kl_controller_doubles_halves_and_holds():
    assert adapt_kl_multiplier(1.0, measured_kl=0.2, target=0.1) == 2.0  # above 1.5 x target
    assert adapt_kl_multiplier(1.0, measured_kl=0.06, target=0.1) == 0.5  # below target / 1.5
    assert adapt_kl_multiplier(1.0, measured_kl=0.14, target=0.1) == 1.0
    assert adapt_kl_multiplier(1.0, measured_kl=0.07, target=0.1) == 1.0
    multiplier = 1.0
    for _ in range(20):  # a long run of zero KL (the adapter starts at the base model)
        multiplier = adapt_kl_multiplier(multiplier, measured_kl=0.0, target=0.1)
    assert multiplier == KL_MULTIPLIER_BOUNDS[0]
    for _ in range(int(math.log2(1 / KL_MULTIPLIER_BOUNDS[0]))):
        multiplier = adapt_kl_multiplier(multiplier, measured_kl=1.0, target=0.1)
    assert multiplier == 1.0


def test_intermediate_returns_hand_built():
    """Row 0: trainable tokens 1..6, steps start at 3 (reward 1) and 6 (reward 0.5), one
    padding step with a NaN reward. Tokens 1-3 see both steps (1.5), tokens 4-6 only the
    second (0.5); the mean over tokens 1..6 is 1.0. Row 1: one step at 2 (reward -2),
    trainable tokens 0..3 -> returns -2, -2, -2, 0, mean -1.5."""
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 1:7] = True
    mask[1, 0:4] = True
    starts = torch.tensor([[3, 6, 0], [2, 0, 0]])
    step_rewards = torch.tensor([[1.0, 0.5, NAN], [-2.0, 0.0, 0.0]], dtype=torch.float64)
    step_live = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([0.25, -1.0], dtype=torch.float64)
    out = add_intermediate_returns(advantages, mask, starts, step_rewards, step_live)
    expected = torch.zeros(2, 8, dtype=torch.float64)
    expected[0, 1:7] = 0.25 + torch.tensor([0.5, 0.5, 0.5, -0.5, -0.5, -0.5], dtype=torch.float64)
    expected[1, 0:4] = -1.0 + torch.tensor([-0.5, -0.5, -0.5, 1.5], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
