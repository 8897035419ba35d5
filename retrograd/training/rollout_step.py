"""One policy-gradient update on sampled rollouts, shared by GRPO, agentic GRPO and
on-policy distillation: they differ in how rollouts and advantages are made, not here.

Per update: `epochs` passes over `minibatches` shuffled minibatches, one optimizer step
each, micro-batches packed with each group's prompt once. The ratios need the behaviour
log-probs (the policy as it sampled): until the first optimizer step nothing has moved, so
the first step's own forward gives them for its samples, and a teacher-forced pass scores
only the samples of later minibatches. With beta > 0 the reference log-probs come from a
pass with the adapter switched off, except while the adapter is still zero (B = 0 at
initialisation): then the reference is the policy, and the behaviour log-probs serve as
both. Every log-prob is at the sampling temperature (LogprobOptions). It also measures how
far llama.cpp's sampling log-probs are from torch's on the same tokens, and hands back
torch's log-probs of every sample before the update (rollouts.jsonl).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from retrograd.kernels.optim import Optimizer
from retrograd.objectives.policy import MinibatchCounts, PolicyLossOptions, k3_kl, merge_diagnostics, policy_loss
from retrograd.training.batches import LogprobOptions
from retrograd.training.distributed import Ranks
from retrograd.training.duty_cycle import DutyCycle
from retrograd.training.optim import Schedule, clip_gradients
from retrograd.training.scoring import Passes, Rollout, plan_passes, plan_shared, rollout_logprobs, scored_micro_batches
from retrograd.training.timeline import PhaseClock

KL_DIVERGENCE_LIMIT = 50.0  # retrograd's divergence guard, on policy/kl (nats per token)


@dataclass(frozen=True)
class TrainSample:
    rollout: Rollout  # prompt, tokens and which of them the policy produced
    advantages: torch.Tensor | None  # [] one per sample, [n] one per scored token, or None: see advantages_given
    sampler_logprobs: torch.Tensor  # [n] llama.cpp's log-probs of the scored tokens

    @property
    def n_scored(self) -> int:
        return self.sampler_logprobs.shape[0]

    def advantages_given(self, proximal_logprobs: torch.Tensor) -> torch.Tensor:
        """[n] per scored token, given torch's log-probs of them before the update (the
        proximal policy). A sample whose advantages depend on the policy itself (on-policy
        distillation's log p_T - log p_S) overrides this and carries advantages = None."""
        return self.advantages.expand(self.n_scored)


@dataclass(frozen=True)
class UpdateResult:
    diagnostics: dict  # the update's merged policy diagnostics
    step_diagnostics: list[dict]  # merged per optimizer step
    policy_logprobs: list[torch.Tensor]  # [n] per sample: torch's log-probs before the update


class PolicyOptimizer:
    """The optimizer side of a rollout recipe; `global_step` is saved with the checkpoint."""

    reuse_first_forward = True  # False: a behaviour pass and a reference pass every update (tests compare)

    def __init__(self, setup, optimizer: Optimizer, loss_options: PolicyLossOptions, schedule: Schedule,
                 logprob_options: LogprobOptions, duty: DutyCycle, micro_batch: int, seed: int, ranks: Ranks = Ranks()):
        self.setup, self.optimizer, self.loss_options = setup, optimizer, loss_options
        self.schedule, self.options, self.duty = schedule, logprob_options, duty
        self.micro_batch, self.seed, self.ranks = micro_batch, seed, ranks
        self.merging = setup.merging(ranks.spread, rollouts=True)
        self.params = setup.adapter.parameters()
        self.global_step = 0
        self.total_steps = schedule.total_steps  # re-planned at every update (Schedule.total_from)

    def update(self, update: int, samples: list[TrainSample], *, beta: float, epochs: int, minibatches: int,
               budget_tokens: int, timing: PhaseClock, kl_reference: str = "base") -> UpdateResult:
        """Train on `samples`: `epochs` passes of up to `minibatches` optimizer steps; the
        phases (behavior_scoring, reference, optimizer) are timed on `timing`. The KL term
        (beta > 0) pulls toward the base model (the adapter off), or with kl_reference =
        "behavior" toward the policy that sampled the batch (PPO's trust region)."""
        model = self.setup.model.transformer
        rollouts = [s.rollout for s in samples]
        minibatches = min(minibatches, len(samples))  # np.array_split would leave the rest empty
        self.total_steps = self.schedule.total_from(update, self.global_step, epochs * minibatches)
        steps = [
            sorted(int(i) for i in minibatch)  # groups stay adjacent: prompts packed once
            for epoch in range(epochs)
            for minibatch in np.array_split(np.random.default_rng([self.seed, update, epoch]).permutation(len(samples)), minibatches)
        ]
        # log-probs before any step: the first step's forward fills in its own samples
        old: list[torch.Tensor | None] = [None] * len(samples)
        parts, per_step = [], []
        passes = self.passes(rollouts)
        later = sorted(set(range(len(samples))) - set(steps[0])) if self.reuse_first_forward else list(range(len(samples)))
        if len(steps) > 1 and later:
            for i, logp in zip(later, self._score([rollouts[i] for i in later], passes, timing, "behavior_scoring")):
                old[i] = logp
        ref = None
        if beta > 0:
            if kl_reference == "behavior" or (self.reuse_first_forward and adapter_is_zero(self.setup.adapter)):
                ref = old  # the reference is the behaviour policy; filled in as `old` is
            else:
                with self.setup.adapter.disabled():
                    ref = self._score(rollouts, passes, timing, "reference")
        with timing.phase("optimizer"):
            for idx in steps:
                step_parts = self._step(model, samples, idx, old, ref, beta, budget_tokens)
                parts.extend(step_parts)
                per_step.append(merge_diagnostics(step_parts))

        before = [o.cpu() for o in old]
        merged = merge_diagnostics(parts)
        for k in ("policy/surrogate_loss", "policy/kl_loss", "policy/total_loss"):
            merged[k] /= len(per_step)  # shares add up per step; report the update's mean step
        merged |= logprob_mismatch(torch.cat([s.sampler_logprobs for s in samples]), torch.cat(before)) | {
            "optimizer/learning_rate": self.optimizer.param_groups[0]["lr"],
            "batch/trained_tokens": float(sum(s.n_scored for s in samples)),
            "system/threads": float(self.setup.cpu.threads),
        }
        kl = merged.get("policy/kl", 0.0)
        if kl > KL_DIVERGENCE_LIMIT or not math.isfinite(kl):
            raise self.setup.diverged(
                f"update {update + 1}: the KL to the reference is {kl:.3g} nats per token (limit {KL_DIVERGENCE_LIMIT:g}); "
                "lower training.lr or raise the kl_coefficient"
            )
        return UpdateResult(merged, per_step, before)

    def passes(self, rollouts: list[Rollout]) -> Passes:
        return plan_passes(rollouts, self.micro_batch, self.merging, self.setup.model.transformer.checkpoint_every)

    def _score(self, rollouts, passes: Passes, timing: PhaseClock, phase: str) -> list[torch.Tensor]:
        """Log-probs without gradients; under torchrun each rank scores its share."""
        mine = self.ranks.share(rollouts)
        self.setup.cpu.adjust()
        with timing.phase(phase), self.duty.burst():
            scored = rollout_logprobs(self.setup.model.transformer, [rollouts[i] for i in mine], self.options,
                                      passes.score, self.setup.device)
        out: list[torch.Tensor | None] = [None] * len(rollouts)
        for share in self.ranks.gather(dict(zip(mine, scored))):
            for i, logp in share.items():
                out[i] = logp.to(self.setup.device)
        return out

    def _step(self, model, samples, idx, old, ref, beta, budget_tokens) -> list[dict]:
        """One optimizer step on samples `idx`. A sample whose `old` log-probs are still
        unknown is in the update's first step: this forward is the policy as it sampled, so
        it fills them in (and `ref`'s, when that is the same list)."""
        lr = self.schedule.apply(self.optimizer, self.global_step, self.total_steps)
        self.setup.cpu.adjust()
        counts = MinibatchCounts(len(idx), sum(samples[i].n_scored for i in idx), budget_tokens)
        parts = []
        rollouts = [samples[i].rollout for i in idx]
        passes = self.passes(rollouts)  # per step: whether merging pays depends on the minibatch
        micro_batches = plan_shared(rollouts, passes.train)
        mine = [micro_batches[k] for k in self.ranks.share(micro_batches)]  # all of them on one rank
        scored = scored_micro_batches(model, rollouts, mine, self.options, self.setup.device)
        filled: dict[int, torch.Tensor] = {}
        with self.duty.burst(), model.checkpointed(passes.checkpoint_every):
            t0 = time.perf_counter()
            for k, (micro, logp, mask) in enumerate(scored):
                chosen = [idx[j] for j in micro.rollouts]
                for row, i in enumerate(chosen):
                    if old[i] is None:
                        old[i] = filled[i] = logp[row][mask[row]].detach().float()
                old_logp = padded([old[i] for i in chosen], mask)
                sampler_logp = padded([samples[i].sampler_logprobs for i in chosen], mask)
                advantages = padded([samples[i].advantages_given(old[i]) for i in chosen], mask)
                loss, diag = policy_loss(
                    logp, old_logp, advantages, mask, counts, self.loss_options, beta=beta,
                    ref_logp=None if ref is None else padded([ref[i] for i in chosen], mask),
                    sampler_logp=sampler_logp if self.loss_options.tis_cap is not None else None,
                )
                loss.backward()
                parts.append(diag)
                self.setup.detail(
                    f"step {self.global_step + 1} micro-batch {k + 1}/{len(mine)}: {len(chosen)} sequences, "
                    f"{int(mask.sum())} scored tokens, loss share {diag['policy/total_loss']:.5f}, lr {lr:.3g}, "
                    f"{time.perf_counter() - t0:.2f} s"
                )
                t0 = time.perf_counter()
            if self.ranks.spread:  # every rank needs all parts, and the log-probs the others filled in
                gathered = self.ranks.gather((parts, {i: t.cpu() for i, t in filled.items()}))
                parts = [part for rank_parts, _ in gathered for part in rank_parts]
                for _, rank_filled in gathered:
                    for i, t in rank_filled.items():
                        old[i] = t.to(self.setup.device)
                self.ranks.sum_gradients(self.params)
            if not math.isfinite(sum(p["policy/total_loss"] for p in parts)):
                raise self.setup.diverged(f"step {self.global_step + 1}: the loss is not finite; stopped without updating the adapter — try a lower training.lr")
            clip_gradients(self.params, self.schedule.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return parts


def logprob_mismatch(sampler_logp: torch.Tensor, policy_logp: torch.Tensor) -> dict[str, float]:
    """How far llama.cpp's log-probs of the tokens it sampled ([n]) are from torch's ([n]),
    both at the sampling temperature. The tokens are llama.cpp's samples, so the k3
    estimator with the ratio p_torch / p_llama.cpp is unbiased for KL(llama.cpp || torch)
    (the ratio the other way round would estimate chi^2 - KL)."""
    sampler_logp, policy_logp = sampler_logp.double(), policy_logp.double()
    return {
        "policy/logprob_mismatch_abs_mean": (sampler_logp - policy_logp).abs().mean().item(),
        "policy/logprob_mismatch_kl": k3_kl(policy_logp, sampler_logp).mean().item(),
    }


def adapter_is_zero(adapter) -> bool:
    """Every LoRA B still zero: the adapted model computes exactly the base model."""
    return not any(layer.lora_b.any() for layer in adapter.layers.values())


def padded(vectors: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Per-sample vectors -> [B, T] aligned with `mask` (zeros elsewhere)."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[mask] = torch.cat([v.to(mask.device, torch.float32) for v in vectors])
    return out
