"""On-policy distillation on the rollout loop: the student samples on llama.cpp, the teacher
scores every sampled token (`produce`), and the student trains on reverse-KL advantages
through the shared policy update or on GKD's generalized JSD through its own update (`plan`
and `train`; see the package docstring)."""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, replace

import numpy as np
import torch

from retrograd.config import Config
from retrograd.data import Prompt, completion_seed, evenly_spaced, load_prompts, order_name, prompt_index
from retrograd.errors import ConfigError
from retrograd.objectives.distill import generalized_jsd, teacher_advantages, teacher_diagnostics
from retrograd.objectives.policy import PolicyLossOptions, k3_kl
from retrograd.recipes.common import open_chat, open_rollout_sampler, prepare, rollout_sampler_options
from retrograd.recipes.distill.common import (
    apply_step,
    distill_signature,
    require_teacher,
    student_path,
    teacher_chat,
    teacher_options,
)
from retrograd.runtime.memory import rss_bytes
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.teacher import TeacherScores, check_same_tokenizer, gather_at, open_teacher, pack_rollouts
from retrograd.training.duty_cycle import for_generation
from retrograd.training.report import Reporter
from retrograd.training.rollout_loop import (
    RolloutResult,
    Trainer,
    cut_text,
    make_policy,
    on_rank_zero,
    run_rollouts,
)
from retrograd.training.rollout_recipe import Batch, Decision, Evaluation, RolloutRecipe, TrainPlan
from retrograd.training.rollout_step import PolicyOptimizer, TrainSample, UpdateResult
from retrograd.training.scoring import Rollout, plan, rollout_logprobs
from retrograd.training.timeline import PhaseClock

PHASES = ("generation", "teacher", "reference", "optimizer", "adapter_refresh")


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors of different lengths -> ([B, T] left-aligned, zeros after; mask [B, T])."""
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width)  # [B, T]
    mask = torch.zeros(len(rows), width, dtype=torch.bool)  # [B, T]
    for i, r in enumerate(rows):
        values[i, : len(r)] = r
        mask[i, : len(r)] = True
    return values, mask


@dataclass(frozen=True)
class Completion:
    """One sampled completion and the teacher's scores of its tokens."""

    group: int
    prompt: Prompt  # the student's rendering
    teacher_prompt: tuple[int, ...]  # the teacher's rendering of the same conversation
    tokens: tuple[int, ...]
    sampler_logprobs: torch.Tensor  # [n] llama.cpp's log-probs of the student when it sampled them
    truncated: bool
    teacher: TeacherScores

    @property
    def rollout(self) -> Rollout:
        return Rollout(self.group, self.prompt.ids, self.tokens)


@dataclass(frozen=True)
class TeacherSample(TrainSample):
    """A training sample that carries the teacher's scores of its tokens (the jsd loss reads
    their top-k). Its reverse-KL advantages need the student's log-probs before the update,
    which the policy update computes: `advantages` is None."""

    teacher: TeacherScores
    weight_clip: float

    def advantages_given(self, proximal_logprobs: torch.Tensor) -> torch.Tensor:
        teacher_logp = self.teacher.logprobs.to(proximal_logprobs.device)  # [n]
        return teacher_advantages(teacher_logp, proximal_logprobs, self.weight_clip)


def sampler_options(cfg: Config) -> SamplerOptions:
    return rollout_sampler_options(cfg, cfg.distill.prompts_per_update * cfg.distill.samples_per_prompt)


def run_on_policy(cfg: Config, reporter: Reporter, resume) -> RolloutResult:
    d, t = cfg.distill, cfg.training
    baseline_rss = rss_bytes()
    teacher_path = require_teacher(cfg)
    chat = open_chat(cfg)
    check_same_tokenizer(student_path(cfg), teacher_path, student_tokenizer=chat.tokenizer)
    if d.loss == "jsd" and d.topk > chat.tokenizer.n_vocab:
        raise ConfigError(f"distill.topk = {d.topk} is more than the {chat.tokenizer.n_vocab}-token vocabulary")
    budget = t.ctx - d.sampling.max_new_tokens
    prompts = load_prompts(d.prompts, chat, max_tokens=budget)
    reporter.message(f"prompts: {prompts.description}")
    t_chat = teacher_chat(teacher_path, chat)
    teacher_prompts = load_prompts(d.prompts, t_chat, max_tokens=budget)
    eval_prompts = eval_teacher = ()
    if cfg.evaluation:
        ev = cfg.evaluation
        eval_prompts = evenly_spaced(load_prompts(ev.data, chat, max_tokens=budget), ev.max_examples)
        eval_teacher = evenly_spaced(load_prompts(ev.data, t_chat, max_tokens=budget), ev.max_examples)
    setup = prepare(cfg, reporter, chat)
    t0, r0 = time.perf_counter(), rss_bytes()
    options = teacher_options(cfg, setup.device, setup.precision, d.samples_per_prompt, setup.model.spec.n_vocab,
                              temperature=d.sampling.temperature)
    with on_rank_zero(setup.device, lambda: closing(open_teacher(teacher_path, d.teacher_backend, options))) as teacher:
        init = setup.timings | {f"teacher ({d.teacher_backend})": (time.perf_counter() - t0, rss_bytes() - r0)}
        reporter.message(f"teacher {teacher_path.name} through {d.teacher_backend}")
        t0, r0 = time.perf_counter(), rss_bytes()
        with on_rank_zero(setup.device, lambda: open_rollout_sampler(cfg, setup.model.path, sampler_options(cfg))) as sampler:
            init |= {"llama.cpp sampler": (time.perf_counter() - t0, rss_bytes() - r0)}
            loss_options = PolicyLossOptions(clip_range_low=d.clip_range_low, clip_range_high=d.clip_range_high,
                                             tis_cap=d.tis_cap)
            policy = make_policy(cfg, setup, loss_options, updates=d.updates, steps_per_update=d.distill_epochs,
                                 temperature=d.sampling.temperature, reporter=reporter)
            rollouts = OnPolicyRollouts(cfg, sampler, teacher, policy, (prompts, teacher_prompts),
                                        (eval_prompts, eval_teacher))
            data_files = {"distill.prompts": d.prompts} | (
                {"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {})
            trainer = Trainer(setup, sampler, policy, reporter, distill_signature(setup, data_files), init, baseline_rss)
            return run_rollouts(cfg, rollouts.recipe(), trainer, resume)


class OnPolicyRollouts:
    """What on-policy distillation hands the rollout loop: sampled completions scored by the
    teacher, their per-token advantages, and the update of the configured loss."""

    def __init__(self, cfg: Config, sampler: Sampler, teacher, policy: PolicyOptimizer, prompts, eval_prompts):
        self.cfg, self.d, self.sampler, self.teacher, self.policy = cfg, cfg.distill, sampler, teacher, policy
        self.setup = policy.setup
        self.prompts, self.teacher_prompts = prompts
        self.eval_prompts, self.eval_teacher_prompts = eval_prompts
        self.sampling = Sampling(self.d.sampling.max_new_tokens, self.d.sampling.temperature, self.d.sampling.top_p)

    def recipe(self) -> RolloutRecipe:
        d = self.d
        return RolloutRecipe(
            name=f"distill on_policy ({d.loss})",
            plan_line=(f"updates={d.updates}, distill_epochs={d.distill_epochs}, prompts={len(self.prompts)}, "
                       f"prompts_per_update={d.prompts_per_update}, samples_per_prompt={d.samples_per_prompt}"),
            updates=d.updates, epochs_label="distill_epochs", epochs=d.distill_epochs, minibatches=1,
            budget_tokens=d.sampling.max_new_tokens, phases=PHASES,
            columns=("loss", "teacher_kl", "clipped", "kl", "lr", "tok/s"), loss_key="train/loss",
            produce=self.produce, plan=self.plan, record=self.record, row=self.row,
            status=lambda m: f"teacher_kl={m.get('distill/teacher_kl_mean', float('nan')):.3f}",
            evaluate=self.evaluate if self.eval_prompts else None,
            train={"reverse_kl": self.train_reverse_kl, "jsd": self.train_jsd}[d.loss],
        )

    # ---------------------------------------------------------------- producing rollouts

    def produce(self, update: int, cursor: int, clock: PhaseClock) -> Batch:
        """samples_per_prompt completions of each of prompts_per_update prompts from the
        stream at `cursor`, and the teacher's scores of their tokens (top-k too for jsd)."""
        d = self.d
        chosen = [prompt_index(cursor + k, len(self.prompts), order=order_name(d.prompt_order), seed=self.cfg.lora.seed)
                  for k in range(d.prompts_per_update)]
        requests = [GroupRequest(self.prompts[i].ids,
                                 [completion_seed(d.sampling.seed, cursor + k, j) for j in range(d.samples_per_prompt)],
                                 self.sampling)
                    for k, i in enumerate(chosen)]
        with clock.phase("generation"), for_generation(self.policy.duty, self.sampler).burst():
            groups = self.sampler.generate(requests)
        sampled = [(g, i, c) for g, (i, group) in enumerate(zip(chosen, groups)) for c in group]
        with clock.phase("teacher"):
            to_score = [Rollout(g, self.teacher_prompts[i].ids, tuple(c.tokens)) for g, i, c in sampled]
            scores = self.teacher.score(to_score, topk=d.topk if d.loss == "jsd" else 0)
        completions = tuple(
            Completion(g, self.prompts[i], self.teacher_prompts[i].ids, tuple(c.tokens), torch.tensor(c.logprobs),
                       c.finish == "length", s)
            for (g, i, c), s in zip(sampled, scores)
        )
        lengths = [len(c.tokens) for c in completions]
        metrics = {
            "completions/length_mean": float(np.mean(lengths)),
            "completions/length_min": float(min(lengths)),
            "completions/length_max": float(max(lengths)),
            "completions/truncation_fraction": float(np.mean([c.truncated for c in completions])),
        }
        return Batch(update, completions, cursor + d.prompts_per_update, metrics)

    # ---------------------------------------------------------------- training samples

    def plan(self, batch: Batch, state: dict, clock: PhaseClock) -> TrainPlan:
        """The completions mask_truncated leaves in; their per-token advantages are made in
        the update, from the student's log-probs before it (TeacherSample), so a decision
        carries none."""
        d, completions = self.d, batch.rollouts
        trained = [k for k, c in enumerate(completions) if not (d.mask_truncated and c.truncated)]
        samples = [TeacherSample(completions[k].rollout, None, completions[k].sampler_logprobs, completions[k].teacher,
                                 d.weight_clip) for k in trained]
        decisions = tuple(Decision(0.0, True) if k in trained else Decision(0.0, False, "truncated")
                          for k in range(len(completions)))
        metrics = {"batch/trained_fraction": len(trained) / len(completions)}
        return TrainPlan(
            tuple(samples), tuple(trained), decisions, metrics, beta=d.kl_coefficient, state=state,
            note="every completion was truncated (distill.mask_truncated); nothing to train",
        )

    # ---------------------------------------------------------------- the two losses

    def train_reverse_kl(self, update: int, samples: list[TeacherSample], beta: float,
                         clock: PhaseClock) -> UpdateResult:
        """The sampled-token estimator of the reverse KL's gradient, through the shared policy update."""
        d = self.d
        result = self.policy.update(update, samples, beta=beta, epochs=d.distill_epochs, minibatches=1,
                                    budget_tokens=d.sampling.max_new_tokens, timing=clock)
        teacher = self.teacher_diagnostics(samples, result.policy_logprobs)
        return replace(result, diagnostics=result.diagnostics | teacher | {"train/loss": result.diagnostics["policy/total_loss"]})

    def train_jsd(self, update: int, samples: list[TeacherSample], beta: float, clock: PhaseClock) -> UpdateResult:
        """GKD's generalized JSD over the teacher's top-k at each sampled position (+ beta x
        the k3 KL to the base on the sampled tokens), divided by samples x max_new_tokens;
        one step per epoch."""
        d, setup, policy = self.d, self.setup, self.policy
        model = setup.model.transformer
        rollouts = [s.rollout for s in samples]
        passes = policy.passes(rollouts)
        ref = None
        if beta > 0:
            with clock.phase("reference"), setup.adapter.disabled():
                ref = rollout_logprobs(model, rollouts, policy.options, passes.score, setup.device)
        denominator = len(samples) * d.sampling.max_new_tokens
        n_tokens = sum(len(r.tokens) for r in rollouts)
        total = policy.schedule.total_from(update, policy.global_step, d.distill_epochs)
        before: list[torch.Tensor | None] = [None] * len(samples)  # the student before this update's steps
        per_step: list[dict] = []
        with clock.phase("optimizer"):
            for epoch in range(d.distill_epochs):
                lr = policy.schedule.apply(policy.optimizer, policy.global_step, total)
                step = dict.fromkeys(("distill/jsd", "train/loss") + (("policy/kl",) if ref is not None else ()), 0.0)
                with policy.duty.burst(), model.checkpointed(passes.checkpoint_every):
                    for micro in plan(rollouts, passes.train):
                        batch, order = pack_rollouts([rollouts[i] for i in micro], setup.device)
                        chosen = [micro[k] for k in order]  # sample indices in packed order
                        teacher = [samples[i].teacher for i in chosen]
                        teacher_ids = torch.cat([t.topk_ids for t in teacher]).to(setup.device)  # [N, K]
                        teacher_logp = torch.cat([t.topk_logprobs for t in teacher]).to(setup.device)  # [N, K]
                        ids = torch.cat([batch.targets[:, None], teacher_ids], 1)  # [N, 1 + K]: the sampled token first
                        logp, _ = gather_at(model, batch, ids, policy.options)  # [N, 1 + K]
                        every = torch.ones(len(ids), dtype=torch.bool, device=setup.device)  # [N]
                        loss, diag = generalized_jsd(logp[:, 1:], teacher_logp, every, denominator, d.jsd_beta)
                        if epoch == 0:
                            sampled = logp[:, 0].detach().float().cpu().split([len(rollouts[i].tokens) for i in chosen])
                            for i, lp in zip(chosen, sampled):
                                before[i] = lp
                        if ref is not None:
                            ref_logp = torch.cat([ref[i] for i in chosen]).to(setup.device)  # [N]
                            kl = k3_kl(ref_logp, logp[:, 0])  # [N]
                            loss = loss + beta * kl.sum() / denominator
                            step["policy/kl"] += kl.sum().item() / n_tokens  # per token, as the policy update has it
                        loss.backward()
                        step["distill/jsd"] += diag["distill/jsd"]
                        step["train/loss"] += loss.item()
                    apply_step(setup, policy.optimizer, policy.params, step["train/loss"], policy.global_step,
                               policy.schedule.max_grad_norm)
                policy.global_step += 1
                per_step.append(step)
        means = {k: sum(s[k] / d.distill_epochs for s in per_step) for k in per_step[0]}
        diagnostics = means | self.teacher_diagnostics(samples, before) | {
            "optimizer/learning_rate": lr, "batch/trained_tokens": float(n_tokens)}
        return UpdateResult(diagnostics, per_step, before)

    def teacher_diagnostics(self, samples: list[TeacherSample], proximal: list[torch.Tensor]) -> dict:
        """distill/teacher_kl_* and the clipped fraction of the update's tokens, from the
        student's log-probs before the update (`proximal`, one [n] per sample)."""
        teacher_logp, mask = padded([s.teacher.logprobs for s in samples])  # [B, T]
        proximal_logp, _ = padded(proximal)  # [B, T]
        return teacher_diagnostics(teacher_logp, proximal_logp, mask, self.d.weight_clip)

    # ---------------------------------------------------------------- reporting, evaluation

    def record(self, c: Completion, decision: Decision, policy_logprobs: list | None, update: int, cap: int) -> dict:
        text = self.setup.model.tokenizer.decode(list(c.tokens), special=False)
        return {
            "update": update + 1, "group": c.group, "source": c.prompt.source, "prompt": cut_text(c.prompt.text, cap),
            "completion": cut_text(text, cap), "tokens": len(c.tokens), "truncated": c.truncated,
            "teacher_kl_mean": (c.sampler_logprobs - c.teacher.logprobs).mean().item(),
            "prompt_ids": list(c.prompt.ids), "completion_ids": list(c.tokens),
            "sampler_logprobs": c.sampler_logprobs.tolist(), "policy_logprobs": policy_logprobs,
            "teacher_logprobs": c.teacher.logprobs.tolist(),
        }

    def row(self, m: dict) -> dict:
        return {"loss": m.get("train/loss"), "teacher_kl": m.get("distill/teacher_kl_mean"),
                "clipped": m.get("distill/advantage_clipped_fraction"), "kl": m.get("policy/kl"),
                "lr": m.get("optimizer/learning_rate"), "tok/s": m["train/tokens_per_second"]}

    def evaluate(self, update: int) -> Evaluation:
        """Mean log p_S - log p_T over the tokens of one completion per held-out prompt (fixed
        seeds): lower is better."""
        d = self.d
        requests = [GroupRequest(p.ids, [completion_seed(d.sampling.seed + 1, i, 0)], self.sampling)
                    for i, p in enumerate(self.eval_prompts)]
        completions = [group[0] for group in self.sampler.generate(requests)]
        rollouts = [Rollout(i, self.eval_teacher_prompts[i].ids, tuple(c.tokens)) for i, c in enumerate(completions)]
        teacher = self.teacher.score(rollouts)
        gap = torch.cat([torch.tensor(c.logprobs) - s.logprobs for c, s in zip(completions, teacher)]).double()  # [n]
        value = gap.mean().item()
        line = f"eval update {update + 1}/{d.updates}: teacher_kl {value:.4f} nats/token over {gap.numel()} tokens"
        metrics = {"eval/teacher_kl_mean": value, "eval/tokens": gap.numel()}
        return Evaluation(value, metrics, line, higher_is_better=False)
