"""On-policy distillation: the student samples on llama.cpp, the teacher scores every sampled
token, and the student trains on reverse-KL advantages or GKD's generalized JSD (see the
package docstring)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np
import torch

from retrograd.config import Config
from retrograd.data import Prompt, completion_seed, evenly_spaced, load_prompts, order_name, prompt_index
from retrograd.errors import ConfigError
from retrograd.memory import rss_bytes
from retrograd.objectives.distill import generalized_jsd, teacher_advantages
from retrograd.objectives.policy import PolicyLossOptions, k3_kl
from retrograd.recipes.common import (
    Setup,
    open_chat,
    prepare,
    resume_point,
    rollout_sampler_options,
)
from retrograd.recipes.distill.common import (
    DistillResult,
    apply_step,
    distill_signature,
    require_teacher,
    student_path,
    teacher_chat,
    teacher_options,
)
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.teacher import (
    TeacherScores,
    check_same_tokenizer,
    gather_at,
    open_teacher,
    pack_rollouts,
)
from retrograd.training.batches import LogprobOptions
from retrograd.training.duty_cycle import for_device
from retrograd.training.metrics import MetricsSink
from retrograd.training.optim import Schedule, build_optimizer
from retrograd.training.report import Reporter
from retrograd.training.rollout_loop import warm_up
from retrograd.training.rollout_run import RunTotals, resume_rollouts, rollout_outputs
from retrograd.training.rollout_step import PolicyOptimizer, TrainSample
from retrograd.training.scoring import Rollout, plan, rollout_logprobs
from retrograd.training.state import RecipeLoop, track_evaluation

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


@dataclass
class Member:
    """One sampled completion."""

    group: int
    prompt: Prompt  # the student's rendering
    teacher_prompt: tuple[int, ...]  # the teacher's rendering of the same conversation
    tokens: tuple[int, ...]
    sampler_logprobs: torch.Tensor  # [n] llama.cpp's log-probs of the student when it sampled them
    truncated: bool
    teacher: TeacherScores | None = None
    policy_logprobs: torch.Tensor | None = None  # [n] torch's before the update, when trained

    @property
    def rollout(self) -> Rollout:
        return Rollout(self.group, self.prompt.ids, self.tokens)


def sampler_options(cfg: Config) -> SamplerOptions:
    return rollout_sampler_options(cfg, cfg.distill.prompts_per_update * cfg.distill.samples_per_prompt)


def run_on_policy(cfg: Config, reporter: Reporter, resume) -> DistillResult:
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
        eval_prompts = evenly_spaced(
            load_prompts(cfg.evaluation.data, chat, max_tokens=budget), cfg.evaluation.max_examples
        )
        eval_teacher = evenly_spaced(
            load_prompts(cfg.evaluation.data, t_chat, max_tokens=budget), cfg.evaluation.max_examples
        )
    setup = prepare(cfg, reporter, chat)
    teacher = open_teacher(
        teacher_path,
        d.teacher_backend,
        teacher_options(cfg, setup.device, setup.precision, d.samples_per_prompt, setup.model.spec.n_vocab,
                        temperature=d.sampling.temperature),
    )
    reporter.message(f"teacher {teacher_path.name} through {d.teacher_backend}")
    try:
        with Sampler(setup.model.path, sampler_options(cfg)) as sampler:
            loop = OnPolicyLoop(
                cfg, setup, sampler, teacher, (prompts, teacher_prompts), (eval_prompts, eval_teacher), reporter
            )
            warm_up(setup)
            result = loop.run(resume)
    finally:
        teacher.close()
    result.memory = {"baseline": baseline_rss, "after_load": loop.rss_after_load, "peak": loop.totals.peak_rss}
    return result


class OnPolicyLoop(RecipeLoop):
    def __init__(self, cfg: Config, setup: Setup, sampler: Sampler, teacher, prompts, eval_prompts, reporter: Reporter):
        self.cfg, self.setup, self.sampler, self.teacher, self.reporter = cfg, setup, sampler, teacher, reporter
        self.prompts, self.teacher_prompts = prompts
        self.eval_prompts, self.eval_teacher_prompts = eval_prompts
        d, t = cfg.distill, cfg.training
        self.optimizer = build_optimizer(setup.adapter.parameters(), t.optimizer, t.lr, t.weight_decay)
        self.total_steps = d.updates * d.distill_epochs
        self.schedule = Schedule(t.lr, t.lr_scheduler, t.warmup_steps, self.total_steps, t.max_grad_norm, d.updates)
        self.duty = for_device(t.max_gpu_duty_cycle, setup.device, reporter.message)
        self.options = LogprobOptions.from_training(t, setup.model.spec.n_vocab, d.sampling.temperature)
        loss_options = PolicyLossOptions(clip_range_low=d.clip_range_low, clip_range_high=d.clip_range_high)
        self.policy = PolicyOptimizer(
            setup, self.optimizer, loss_options, self.schedule, self.options, self.duty, t.micro_batch, cfg.lora.seed
        )
        self.sampling = Sampling(d.sampling.max_new_tokens, d.sampling.temperature, d.sampling.top_p)
        self.progress = {"update": 0, "global_step": 0, "prompt_cursor": 0, "best_eval": None, "stale_evals": 0}
        self.rss_after_load = rss_bytes()
        self.totals = RunTotals("train/loss")

    def run(self, resume) -> DistillResult:
        cfg, d = self.cfg, self.cfg.distill
        data_files = {"distill.prompts": d.prompts} | (
            {"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {}
        )
        self.signature = distill_signature(self.setup, data_files)
        checkpoint = resume_point(cfg, resume, self.reporter)
        self.progress = (
            resume_rollouts(checkpoint, self.signature, self.policy, self.sampler, self.reporter) or self.progress
        )
        self.reporter.message(
            f"distill on_policy ({d.loss}): updates={d.updates}, distill_epochs={d.distill_epochs}, "
            f"prompts={len(self.prompts)}, prompts_per_update={d.prompts_per_update}, samples_per_prompt={d.samples_per_prompt}"
        )
        records = []
        rollouts_path = cfg.output.path.parent / "rollouts.jsonl"
        with rollout_outputs(cfg, rollouts_path, append=checkpoint is not None) as (metrics, rollouts_file):
            self.reporter.start(
                d.updates, ["update", "step", "loss", "teacher_kl", "clipped", "kl", "lr", "tok/s"], "updates"
            )
            self.reporter.advance(self.progress["update"], "")
            try:
                while self.progress["update"] < d.updates:
                    update = self.progress["update"]
                    m, timing, members = self.totals.measure(self.update, update)
                    self.progress["update"] = update + 1
                    m = self.account(update, m, timing) | {"train/update": update + 1}
                    metrics.log(self.progress["global_step"], m)
                    records.append(m)
                    self._write_rollouts(rollouts_file, update, members)
                    self.reporter.row(
                        {
                            "update": f"{update + 1}/{d.updates}",
                            "step": self.progress["global_step"],
                            "loss": m.get("train/loss"),
                            "teacher_kl": m.get("distill/teacher_kl_mean"),
                            "clipped": m.get("distill/advantage_clipped_fraction"),
                            "kl": m.get("policy/kl"),
                            "lr": m.get("optimizer/learning_rate"),
                            "tok/s": m["train/tokens_per_second"],
                        }
                    )
                    self.reporter.advance(
                        update + 1, f"teacher_kl={m.get('distill/teacher_kl_mean', float('nan')):.3f}"
                    )
                    stop = False
                    if self.eval_prompts and self._evaluation_due(update):
                        stop = self._evaluate(update, metrics)
                    self.save_if_crossed(m["train/steps"])
                    if stop:
                        break
            finally:
                self.reporter.finish()
        out = self.setup.write_output()
        return DistillResult(
            out,
            "on_policy",
            self.progress["update"],
            d.updates,
            self.progress["global_step"],
            self.totals.last_loss,
            self.totals.tokens_per_second,
            records,
        )

    def update(self, update: int) -> tuple[dict, dict, list[Member]]:
        d = self.cfg.distill
        timing = dict.fromkeys(PHASES, 0.0)
        members = self._sample(update, timing)
        t0 = time.perf_counter()
        rollouts = [Rollout(m.group, m.teacher_prompt, m.tokens) for m in members]
        for m, scores in zip(members, self.teacher.score(rollouts, topk=d.topk if d.loss == "jsd" else 0)):
            m.teacher = scores
        timing["teacher"] = time.perf_counter() - t0
        lengths = [len(m.tokens) for m in members]
        metrics = {
            "completions/length_mean": float(np.mean(lengths)),
            "completions/length_min": float(min(lengths)),
            "completions/length_max": float(max(lengths)),
            "completions/truncation_fraction": float(np.mean([m.truncated for m in members])),
        }
        trained = [m for m in members if not (d.mask_truncated and m.truncated)]
        steps_before = self.policy.global_step
        if trained:
            teacher_logp, mask = padded([m.teacher.logprobs for m in trained])  # [B, T]
            sampler_logp, _ = padded([m.sampler_logprobs for m in trained])  # [B, T]
            advantages, diagnostics = teacher_advantages(teacher_logp, sampler_logp, mask, d.weight_clip)  # [B, T]
            metrics |= diagnostics
            metrics |= TRAINERS[d.loss](self, update, trained, advantages, timing)
            t0 = time.perf_counter()
            metrics["sampler/adapter_refresh_seconds"] = self.sampler.set_adapter(self.setup.adapter).total_s
            timing["adapter_refresh"] = time.perf_counter() - t0
        else:
            self.reporter.message(
                f"update {update + 1}: every completion was truncated (distill.mask_truncated); nothing to train"
            )
        self.progress["global_step"] = self.policy.global_step
        metrics |= {
            "batch/trained_fraction": len(trained) / len(members),
            "train/steps": self.policy.global_step - steps_before,
        }
        return metrics, timing, members

    def _sample(self, update: int, timing: dict) -> list[Member]:
        d = self.cfg.distill
        cursor = self.progress["prompt_cursor"]
        chosen = [
            prompt_index(cursor + k, len(self.prompts), order=order_name(d.prompt_order), seed=self.cfg.lora.seed)
            for k in range(d.prompts_per_update)
        ]
        requests = [
            GroupRequest(
                self.prompts[i].ids,
                [completion_seed(d.sampling.seed, cursor + k, j) for j in range(d.samples_per_prompt)],
                self.sampling,
            )
            for k, i in enumerate(chosen)
        ]
        self.progress["prompt_cursor"] = cursor + d.prompts_per_update
        t0 = time.perf_counter()
        with self.duty.burst():
            completions = self.sampler.generate(requests)
        timing["generation"] = time.perf_counter() - t0
        return [
            Member(
                g,
                self.prompts[i],
                self.teacher_prompts[i].ids,
                tuple(c.tokens),
                torch.tensor(c.logprobs),
                c.finish == "length",
            )
            for g, (i, group) in enumerate(zip(chosen, completions))
            for c in group
        ]

    # ---------------------------------------------------------------- the two losses

    def _train_reverse_kl(self, update: int, trained: list[Member], advantages: torch.Tensor, timing: dict) -> dict:
        """The sampled-token estimator of the reverse KL's gradient, through the shared policy update."""
        d = self.cfg.distill
        samples = [
            TrainSample(m.rollout, advantages[i, : len(m.tokens)], m.sampler_logprobs) for i, m in enumerate(trained)
        ]
        result = self.policy.update(
            update,
            samples,
            beta=d.kl_coefficient,
            epochs=d.distill_epochs,
            minibatches=1,
            budget_tokens=d.sampling.max_new_tokens,
            timing=timing,
        )
        for m, logp in zip(trained, result.policy_logprobs):
            m.policy_logprobs = logp
        return result.diagnostics | {"train/loss": result.diagnostics["policy/total_loss"]}

    def _train_jsd(self, update: int, trained: list[Member], advantages: torch.Tensor, timing: dict) -> dict:
        """GKD's generalized JSD over the teacher's top-k at each sampled position (+ k3 KL to
        the base on the sampled tokens), divided by samples x max_new_tokens; one step per epoch."""
        d, setup = self.cfg.distill, self.setup
        model = setup.model.transformer
        rollouts = [m.rollout for m in trained]
        ref = None
        if d.kl_coefficient > 0:
            t0 = time.perf_counter()
            with setup.adapter.disabled():
                ref = rollout_logprobs(model, rollouts, self.options, self.cfg.training.micro_batch, setup.device)
            timing["reference"] = time.perf_counter() - t0
        denominator = len(trained) * d.sampling.max_new_tokens
        t0 = time.perf_counter()
        totals: dict[str, float] = {}
        total = self.schedule.total_from(update, self.policy.global_step, d.distill_epochs)
        n_tokens = sum(len(m.tokens) for m in trained)
        for epoch in range(d.distill_epochs):
            lr = self.schedule.apply(self.optimizer, self.policy.global_step, total)
            step = dict.fromkeys(("distill/jsd", "train/loss") + (("policy/kl",) if ref is not None else ()), 0.0)
            with self.duty.burst():
                for micro in plan(rollouts, self.cfg.training.micro_batch):
                    batch, order = pack_rollouts([rollouts[i] for i in micro], setup.device)
                    chosen = [trained[micro[k]] for k in order]
                    teacher_ids = torch.cat([m.teacher.topk_ids for m in chosen]).to(setup.device)  # [N, K]
                    teacher_logp = torch.cat([m.teacher.topk_logprobs for m in chosen]).to(setup.device)  # [N, K]
                    ids = torch.cat([batch.targets[:, None], teacher_ids], 1)  # [N, 1 + K]: the sampled token first
                    logp, _ = gather_at(model, batch, ids, self.options)  # [N, 1 + K]
                    every = torch.ones(len(ids), dtype=torch.bool, device=setup.device)  # [N]
                    loss, diag = generalized_jsd(logp[:, 1:], teacher_logp, every, denominator, d.jsd_beta)
                    if epoch == 0:  # the student before this update's steps, for rollouts.jsonl
                        for m, lp in zip(chosen, logp[:, 0].detach().float().cpu().split([len(m.tokens) for m in chosen])):
                            m.policy_logprobs = lp
                    if ref is not None:
                        ref_logp = torch.cat([ref[micro[k]] for k in order]).to(setup.device)  # [N]
                        kl = k3_kl(ref_logp, logp[:, 0])  # [N]
                        loss = loss + d.kl_coefficient * kl.sum() / denominator
                        step["policy/kl"] += kl.sum().item() / n_tokens  # per token, as the policy update reports it
                    loss.backward()
                    step["distill/jsd"] += diag["distill/jsd"]
                    step["train/loss"] += loss.item()
                apply_step(
                    setup,
                    self.optimizer,
                    self.policy.params,
                    step["train/loss"],
                    self.policy.global_step,
                    self.schedule.max_grad_norm,
                )
            self.policy.global_step += 1
            for k, v in step.items():
                totals[k] = totals.get(k, 0.0) + v / d.distill_epochs
        timing["optimizer"] = time.perf_counter() - t0
        return totals | {
            "optimizer/learning_rate": lr,
            "batch/trained_tokens": float(sum(len(m.tokens) for m in trained)),
        }

    # ---------------------------------------------------------------- evaluation, checkpoints

    def _evaluation_due(self, update: int) -> bool:
        return (update + 1) % self.cfg.evaluation.every_iterations == 0 or update + 1 == self.cfg.distill.updates

    def _evaluate(self, update: int, metrics: MetricsSink) -> bool:
        """Mean log p_S - log p_T over the tokens of one completion per held-out prompt (fixed
        seeds); best checkpoint and patience. Returns True to stop early."""
        d, ev = self.cfg.distill, self.cfg.evaluation
        requests = [
            GroupRequest(p.ids, [completion_seed(d.sampling.seed + 1, i, 0)], self.sampling)
            for i, p in enumerate(self.eval_prompts)
        ]
        completions = [group[0] for group in self.sampler.generate(requests)]
        rollouts = [Rollout(i, self.eval_teacher_prompts[i].ids, tuple(c.tokens)) for i, c in enumerate(completions)]
        teacher = self.teacher.score(rollouts)
        gap = torch.cat([torch.tensor(c.logprobs) - s.logprobs for c, s in zip(completions, teacher)]).double()  # [n]
        value = gap.mean().item()
        metrics.log(
            self.progress["global_step"],
            {"eval/teacher_kl_mean": value, "eval/tokens": gap.numel(), "train/update": update + 1},
        )
        outcome = track_evaluation(
            self.progress, value, higher_is_better=False, min_delta=ev.min_delta, patience=ev.patience
        )
        line = f"eval update {update + 1}/{d.updates}: teacher_kl {value:.4f} nats/token over {gap.numel()} tokens"
        if outcome.improved and self.cfg.checkpoint and "best_eval" in self.cfg.checkpoint.mode:
            self.save("best")
        self.reporter.message(
            f"{line}  best {outcome.best:.4f}"
            + ("" if outcome.improved else f", stale {outcome.stale}/{ev.patience or '∞'}")
        )
        return outcome.stop

    def _write_rollouts(self, f, update: int, members: list[Member]) -> None:
        tokenizer = self.setup.model.tokenizer
        for m in members:
            gap = (m.sampler_logprobs - m.teacher.logprobs).mean().item()
            f.write(
                json.dumps(
                    {
                        "update": update + 1,
                        "group": m.group,
                        "source": m.prompt.source,
                        "prompt": m.prompt.text,
                        "completion": tokenizer.decode(list(m.tokens), special=False),
                        "tokens": len(m.tokens),
                        "truncated": m.truncated,
                        "teacher_kl_mean": gap,
                        "prompt_ids": list(m.prompt.ids),
                        "completion_ids": list(m.tokens),
                        "sampler_logprobs": m.sampler_logprobs.tolist(),
                        "policy_logprobs": None if m.policy_logprobs is None else m.policy_logprobs.tolist(),
                        "teacher_logprobs": m.teacher.logprobs.tolist(),
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
        f.flush()


TRAINERS = {"reverse_kl": OnPolicyLoop._train_reverse_kl, "jsd": OnPolicyLoop._train_jsd}
