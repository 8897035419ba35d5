"""Distillation objectives against formulas written out here and TRL's GKD loss
(restated, not imported)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from retrograd.objectives.distill import generalized_jsd, teacher_advantages, teacher_diagnostics, topk_cross_entropy
from retrograd.objectives.policy import MinibatchCounts, PolicyLossOptions, policy_loss
from retrograd.recipes.distill.on_policy import TeacherSample
from retrograd.teacher import TeacherScores
from retrograd.training.scoring import Rollout

N, K, V = 6, 4, 11


def topk_batch(seed: int = 0, k: int = K) -> dict[str, torch.Tensor]:
    """Student full-vocabulary log-softmax gathered at the teacher's top-k ids; the last
    position is padding (masked, with NaN teacher entries)."""
    g = torch.Generator().manual_seed(seed)
    student_logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2  # [N, V]
    teacher_logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2  # [N, V]
    teacher_full = teacher_logits.log_softmax(-1)  # [N, V]
    teacher_logp, ids = teacher_full.topk(k, dim=-1)  # [N, k]
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    teacher_logp[~mask] = float("nan")
    return {
        "student_logits": student_logits,
        "student_logp": student_logits.log_softmax(-1).gather(-1, ids),
        "teacher_logp": teacher_logp,
        "mask": mask,
    }


def test_teacher_advantages_and_metrics():
    teacher = torch.tensor([[-0.5, -9.0, -1.0, 0.0], [-2.0, -0.1, -3.0, -1.0]], dtype=torch.float64)
    student = torch.tensor([[-1.5, -1.0, -0.2, -4.0], [-0.5, -7.5, -3.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    advantages = teacher_advantages(teacher, student, weight_clip=5.0)
    diag = teacher_diagnostics(teacher, student, mask, weight_clip=5.0)
    # teacher - student: 1.0, -8.0 (clipped to -5), -0.8, (masked: 4.0) | -1.5, 7.4 (clipped to 5), 0.0, 0.0
    expected = torch.tensor([[1.0, -5.0, -0.8, 4.0], [-1.5, 5.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    minus_a = [-1.0, 5.0, 0.8, 1.5, -5.0, 0.0, 0.0]
    assert diag["distill/teacher_kl_mean"] == pytest.approx(sum(minus_a) / 7)
    assert diag["distill/teacher_kl_p95"] == pytest.approx(float(np.percentile(minus_a, 95)))
    assert diag["distill/advantage_clipped_fraction"] == pytest.approx(2 / 7)


def test_on_policy_distillation_is_ratio_one_reinforce():
    """distill_epochs = 1: behaviour logprobs are the current ones, so the ratio is 1 and
    the gradient is -A_t / (n_sequences x max_new_tokens) on each trainable token."""
    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(3, 5, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    teacher = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 8
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 1, 1, 0]], dtype=torch.bool)
    advantages = teacher_advantages(teacher, logp.detach(), weight_clip=2.0)
    options = PolicyLossOptions(0.2, 0.28)
    loss, diag = policy_loss(logp, logp.detach(), advantages, mask, MinibatchCounts(3, 10, 7), options)
    loss.backward()
    gap = (teacher - logp.detach()).clamp(-2.0, 2.0) * mask
    torch.testing.assert_close(logp.grad, -gap / (3 * 7), rtol=0, atol=1e-12)
    assert diag["policy/ratio_min"] == diag["policy/ratio_max"] == 1.0
    assert diag["policy/clip_fraction"] == 0.0


def expected_distillation_gradient(student_logits, stale_logp, teacher_logp, student_term: str) -> torch.Tensor:
    """E over tokens x ~ mu (the stale sampler) of the gradient of one token's reverse-KL
    loss, enumerated exactly, with TIS weight pi / mu (tis_cap 2, not reached) and
    distill_epochs = 1 (ratio 1). The advantage is the one the policy update trains on
    (`TeacherSample.advantages_given`, handed the proximal log-prob), or, for
    student_term = "sampler", log T - log mu."""
    theta = student_logits.clone().requires_grad_(True)
    expected = torch.zeros_like(theta)
    every = torch.ones(1, 1, dtype=torch.bool)
    options = PolicyLossOptions(0.2, 0.28, tis_cap=2.0)
    for x in range(len(theta)):
        logp = theta.log_softmax(-1)[x].view(1, 1)
        proximal, sampler = logp.detach(), stale_logp[x].view(1, 1)
        sample = TeacherSample(Rollout(0, (0,), (x,)), None, sampler[0], TeacherScores(teacher_logp[x].view(1)), 5.0)
        if student_term == "proximal":
            advantages = sample.advantages_given(proximal[0]).view(1, 1)
        else:
            advantages = teacher_advantages(teacher_logp[x].view(1, 1), sampler, 5.0)
        loss, diag = policy_loss(logp, proximal, advantages, every, MinibatchCounts(1, 1, 1), options,
                                 sampler_logp=sampler)
        assert diag["policy/tis_capped_fraction"] == 0.0
        (grad,) = torch.autograd.grad(loss, theta)
        expected += stale_logp[x].exp() * grad
    return expected


@pytest.mark.parametrize("drift", [0.0, 0.2])
def test_stale_samples_with_tis_give_the_on_policy_reverse_kl_gradient(drift):
    """An exact categorical probe (6 outcomes, float64) of asynchronous on-policy
    distillation: tokens drawn from a stale adapter mu, trained with TIS weights pi / mu.
    With the advantage log T - log pi (pi: the proximal policy, as trained) the expected
    gradient of the loss is grad KL(pi || T), the on-policy one, to rounding; with
    log T - log mu it would be grad KL(pi || T) - grad KL(pi || mu), 20% off at
    KL(mu || pi) = 0.009."""
    g = torch.Generator().manual_seed(0)
    student = torch.randn(6, generator=g, dtype=torch.float64)  # the current adapter's logits
    teacher = torch.randn(6, generator=g, dtype=torch.float64).log_softmax(-1)
    stale = (student + drift * torch.randn(6, generator=g, dtype=torch.float64)).log_softmax(-1)  # the sampler's
    theta = student.clone().requires_grad_(True)
    logp = theta.log_softmax(-1)
    kl_to_teacher = (logp.exp() * (logp - teacher)).sum()
    (on_policy,) = torch.autograd.grad(kl_to_teacher, theta, retain_graph=True)  # grad KL(pi || T)
    trained = expected_distillation_gradient(student, stale, teacher, "proximal")
    torch.testing.assert_close(trained, on_policy, rtol=0, atol=1e-9)
    sampler = expected_distillation_gradient(student, stale, teacher, "sampler")
    (away_from_sampler,) = torch.autograd.grad((logp.exp() * (logp - stale)).sum(), theta)  # grad KL(pi || mu)
    torch.testing.assert_close(sampler, on_policy - away_from_sampler, rtol=0, atol=1e-9)
    relative_error = ((sampler - on_policy).norm() / on_policy.norm()).item()
    kl_stale = (stale.exp() * (stale - logp.detach())).sum().item()
    if drift:
        assert kl_stale == pytest.approx(0.0093, abs=1e-4) and relative_error > 0.15, relative_error
    else:
        assert kl_stale == 0.0 and relative_error < 1e-12  # in step, the two advantages are one


def test_topk_cross_entropy_matches_the_written_out_formula():
    data = topk_batch()
    student = data["student_logp"].clone().requires_grad_(True)
    loss, diag = topk_cross_entropy(student, data["teacher_logp"], data["mask"], n_tokens=5)
    loss.backward()
    expected, expected_grad = 0.0, torch.zeros(N, K, dtype=torch.float64)
    for n in range(5):
        mass = sum(math.exp(float(data["teacher_logp"][n, j])) for j in range(K))
        for j in range(K):
            p = math.exp(float(data["teacher_logp"][n, j])) / mass
            expected += -p * float(data["student_logp"][n, j]) / 5
            expected_grad[n, j] = -p / 5
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(student.grad, expected_grad, rtol=0, atol=1e-12)
    teacher_mass = data["teacher_logp"][:5].exp().sum(-1).mean().item()
    assert diag["distill/teacher_topk_mass"] == pytest.approx(teacher_mass)
    assert 0 < diag["distill/student_topk_mass"] < 1


def reference_jsd(log_s: list[float], log_t: list[float], beta: float) -> float:
    """GKD eq. 1 written out on one position, after renormalising over the k ids."""
    s = [math.exp(v) for v in log_s]
    t = [math.exp(v) for v in log_t]
    s = [v / sum(s) for v in s]
    t = [v / sum(t) for v in t]

    def kl(p, q):
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))

    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    m = [beta * ti + (1 - beta) * si for ti, si in zip(t, s)]
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_jsd_matches_the_written_out_formula(beta):
    data = topk_batch(seed=1)
    loss, _ = generalized_jsd(data["student_logp"], data["teacher_logp"], data["mask"], n_tokens=5, beta=beta)
    expected = sum(
        reference_jsd(data["student_logp"][n].tolist(), data["teacher_logp"][n].tolist(), beta) for n in range(5)
    )
    assert loss.item() == pytest.approx(expected / 5, abs=1e-12)


def trl_generalized_jsd(student_logits, teacher_logits, mask, beta):
    """TRL GKDTrainer.generalized_jsd_loss (huggingface/trl@a9fa292c2d1df64c6f0189ebe32d37b46ce64438,
    trl/trainer/gkd_trainer.py), restated at temperature 1 with reduction "batchmean" and a
    label mask: log-softmax both; beta 0 -> kl_div(student, teacher), beta 1 ->
    kl_div(teacher, student) (F.kl_div(input, target) is KL(target || input)); otherwise
    the mixture log M = logsumexp(log p_S + log(1 - beta), log p_T + log beta) and
    beta KL(T || M) + (1 - beta) KL(S || M); sum over the vocabulary and the unmasked
    positions, divided by their count."""
    s = F.log_softmax(student_logits, dim=-1)
    t = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s + torch.log(1 - b), t + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(m, t, reduction="none", log_target=True)
        kl_student = F.kl_div(m, s, reduction="none", log_target=True)
        jsd = b * kl_teacher + (1 - b) * kl_student
    return jsd[mask].sum() / mask.sum()


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_jsd_matches_trl_on_the_full_vocabulary(beta):
    """With k = V the teacher's top-k is the whole vocabulary (in its own order), so
    TRL's full-vocabulary loss must agree in value and gradient."""
    data = topk_batch(seed=2, k=V)
    g = torch.Generator().manual_seed(9)
    teacher_logits = torch.randn(N, V, generator=g, dtype=torch.float64)
    teacher_logp, ids = teacher_logits.log_softmax(-1).topk(V, dim=-1)
    logits = data["student_logits"].clone().requires_grad_(True)
    loss, diag = generalized_jsd(logits.log_softmax(-1).gather(-1, ids), teacher_logp, data["mask"], 5, beta)
    (grad,) = torch.autograd.grad(loss, logits)
    logits_trl = data["student_logits"].clone().requires_grad_(True)
    expected = trl_generalized_jsd(logits_trl, teacher_logits, data["mask"], beta)
    (expected_grad,) = torch.autograd.grad(expected, logits_trl)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    assert diag["distill/jsd"] == loss.item()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_on_top_k_is_trl_on_the_renormalised_k_ids(beta):
    """k < V: TRL's loss fed the k gathered values as logits (its log-softmax renormalises
    them) is our top-k restriction, values and gradients."""
    data = topk_batch(seed=3)
    student = data["student_logp"].clone().requires_grad_(True)
    loss, _ = generalized_jsd(student, data["teacher_logp"], data["mask"], 5, beta)
    (grad,) = torch.autograd.grad(loss, student)
    student_trl = data["student_logp"].clone().requires_grad_(True)
    expected = trl_generalized_jsd(student_trl, torch.nan_to_num(data["teacher_logp"]), data["mask"], beta)
    (expected_grad,) = torch.autograd.grad(expected, student_trl)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("objective", ["ce", "jsd"])
def test_top_k_losses_accumulate_over_micro_batches(objective):
    data = topk_batch(seed=4)

    def call(student, rows):
        if objective == "ce":
            return topk_cross_entropy(student[rows], data["teacher_logp"][rows], data["mask"][rows], n_tokens=5)
        return generalized_jsd(student[rows], data["teacher_logp"][rows], data["mask"][rows], 5, beta=0.5)

    whole = data["student_logp"].clone().requires_grad_(True)
    call(whole, slice(None))[0].backward()
    split = data["student_logp"].clone().requires_grad_(True)
    for rows in (slice(0, 2), slice(2, N)):
        call(split, rows)[0].backward()
    torch.testing.assert_close(split.grad, whole.grad, rtol=0, atol=1e-12)
    assert torch.isfinite(whole.grad).all() and (whole.grad[~data["mask"]] == 0).all()
