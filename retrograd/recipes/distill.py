"""Distillation from a teacher GGUF that shares the student's tokenizer (retrograd notes 4.4,
peers notes 3.2), in one of two modes picked by `distill.mode`:

on_policy, per update:
1. prompts_per_update prompts (in order or shuffled), samples_per_prompt completions each,
   sampled by llama.cpp from the student plus its live adapter;
2. the teacher scores the sampled tokens after its own rendering of the prompt (the chat
   templates may differ): log p_T of each token, and its top-k there for the JSD loss;
3. with mask_truncated, completions that used the whole budget are left out;
4. reverse_kl: per-token advantages A_t = clamp(log p_T - log p_S, +-weight_clip), with
   log p_S the sampler's own log-probs (the behaviour policy), trained by the shared
   policy-gradient update (rollout_step.py; clipped surrogate when distill_epochs > 1,
   k3 KL to the base when kl_coefficient > 0, budget normalization);
   jsd: GKD's generalized JSD between the teacher's top-k and the student's log-probs at
   those ids (chunked gather), plus the same k3 KL, budget-normalized, one step per epoch;
5. llama.cpp gets the new adapter.
Evaluation samples one completion per held-out prompt (fixed seeds) and reports the mean
log p_S - log p_T of its tokens (lower is better).

topk_offline: an SFT loop over the corpus (epoch plan and packing as in sft.py) whose loss
is the cross-entropy against the teacher's renormalised top-k, read from the `.topk`
sidecar that `retrograd distill-teacher` wrote (`write_teacher_topk` below). The teacher is
never loaded; a sidecar for other data or another tokenizer is refused.

Checkpoints sit at update (on_policy) or step (offline) boundaries; every random choice is a
function of (seed, update or epoch), so a resumed run repeats the rest exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retrograd.bundled import default_model_path
from retrograd.config import Config
from retrograd.data import ChatFormat, Prompt, load_prompts, load_sft, resolve_chat_template
from retrograd.device import resolve_device
from retrograd.errors import ConfigError
from retrograd.gguf.file import GGUFFile
from retrograd.gguf.spec import read_spec
from retrograd.memory import PeakMemory, rss_bytes
from retrograd.model.tokenizer import Tokenizer
from retrograd.objectives.distill import generalized_jsd, teacher_advantages, topk_cross_entropy
from retrograd.objectives.policy import PolicyLossOptions, k3_kl
from retrograd.recipes.common import (
    Setup,
    compute_dtype,
    open_chat,
    prepare,
    resume_point,
    rollout_sampler_options,
    signature,
)
from retrograd.recipes.grpo import completion_seed, prompt_index, warm_up
from retrograd.recipes.sft import epoch_plan, mean_loss
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.teacher import (
    Sidecar,
    SidecarHeader,
    TeacherOptions,
    TeacherScores,
    check_same_tokenizer,
    check_sidecar,
    corpus_fingerprint,
    gather_at,
    open_teacher,
    pack_rollouts,
    read_sidecar,
    read_vocabulary,
    row_offsets,
    tokenizer_fingerprint,
    write_sidecar,
)
from retrograd.training.batches import LogprobOptions, pack
from retrograd.training.checkpoint import check_signature, file_fingerprint, step_name
from retrograd.training.duty_cycle import for_device
from retrograd.training.metrics import MetricsSink
from retrograd.training.optim import build_optimizer, clip_gradients, learning_rate
from retrograd.training.report import Reporter
from retrograd.training.rollout_run import RunTotals, crossed_every, resume_rollouts, rollout_outputs
from retrograd.training.rollout_step import PolicyOptimizer, Schedule, TrainingDiverged, TrainSample
from retrograd.training.scoring import Rollout, plan, rollout_logprobs
from retrograd.training.state import RecipeLoop, restore_state, track_evaluation

PHASES = ("generation", "teacher", "reference", "optimizer", "adapter_refresh")
SIDECAR_CHUNK = 64  # corpus examples scored per teacher call while writing a sidecar
TEACHER_MICRO_BATCH = 1024  # tokens per torch teacher forward at least: no gradients, and a quantized
# model dequantizes its weights once per forward (measured 3x faster than 256)


@dataclass
class DistillResult:
    output: Path
    mode: str
    done: int  # updates (on_policy) or epochs (topk_offline)
    planned: int
    steps: int
    train_loss: float
    tokens_per_second: float
    records: list[dict] = field(default_factory=list)  # per update (on_policy) or per step (offline)
    memory: dict = field(default_factory=dict)  # rss baseline / after load / peak

    def summary(self) -> str:
        unit = "update" if self.mode == "on_policy" else "epoch"
        return (
            f"done {unit}={self.done}/{self.planned} step={self.steps} train_loss={self.train_loss:.4f} "
            f"tok/s={self.tokens_per_second:.0f} out={self.output}"
        )


def run(cfg: Config, reporter: Reporter, *, resume: Path | bool | None = None) -> DistillResult:
    return MODES[cfg.distill.mode](cfg, reporter, resume)


# ----------------------------------------------------------------------------- shared pieces


def student_path(cfg: Config) -> Path:
    return cfg.model.path or default_model_path()


def require_teacher(cfg: Config) -> Path:
    """The teacher GGUF, checked to exist and to share the student's tokenizer."""
    teacher = cfg.distill.teacher_path
    if not teacher.is_file():
        raise ConfigError(f"distill.teacher_path = {str(teacher)!r}: no such file (the teacher GGUF)")
    return teacher


def teacher_options(cfg: Config, device: torch.device, precision: str, group: int, n_vocab: int) -> TeacherOptions:
    t = cfg.training
    return TeacherOptions(
        n_ctx=t.ctx,
        group=group,
        threads=t.threads or 0,
        weights=cfg.model.weights,
        compute_dtype=precision,
        device=device,
        micro_batch=max(t.micro_batch, TEACHER_MICRO_BATCH),
        logprobs=LogprobOptions.from_training(t, n_vocab),
    )


def teacher_chat(teacher: Path, student: ChatFormat) -> ChatFormat:
    """The teacher's own chat format (its tokenizer is the student's, its template may not be);
    the student's when the teacher GGUF has no template."""
    template = resolve_chat_template(read_spec(GGUFFile(teacher)).chat_template)
    if template is None:
        return student
    return ChatFormat(Tokenizer(teacher), template, origin=str(teacher))


def distill_signature(setup: Setup, data_files: dict[str, Path]) -> dict:
    """The resume signature: the common one, the [distill] settings and the teacher's fingerprint."""
    d = setup.cfg.distill
    unsigned = ("teacher_path", "prompts", "data", "sidecar") + (("teacher_backend",) if d.mode == "topk_offline" else ())
    settings = {k: v for k, v in dataclasses.asdict(d).items() if k not in unsigned}
    extra = {
        "distill": settings,
        "distill.teacher": file_fingerprint(d.teacher_path) if d.teacher_path.is_file() else None,
    }
    return signature(setup, data_files) | json.loads(json.dumps(extra, default=str))


def set_learning_rate(optimizer: torch.optim.Optimizer, schedule: Schedule, step: int) -> float:
    lr = learning_rate(
        step,
        lr=schedule.lr,
        schedule=schedule.scheduler,
        warmup_steps=schedule.warmup_steps,
        total_steps=schedule.total_steps,
    )
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def apply_step(optimizer: torch.optim.Optimizer, params, loss: float, step: int, max_grad_norm: float) -> float:
    """Clip and step (the gradients are accumulated); a non-finite loss stops the run first."""
    if not math.isfinite(loss):
        raise TrainingDiverged(
            f"step {step + 1}: the loss is {loss} (not finite); stopped without updating the adapter — try a lower training.lr"
        )
    grad_norm = clip_gradients(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def evenly_spaced(items: tuple, limit: int | None) -> tuple:
    if not limit or limit >= len(items):
        return items
    return tuple(items[i] for i in np.linspace(0, len(items) - 1, limit).round().astype(int))


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors of different lengths -> ([B, T] left-aligned, zeros after; mask [B, T])."""
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width)  # [B, T]
    mask = torch.zeros(len(rows), width, dtype=torch.bool)  # [B, T]
    for i, r in enumerate(rows):
        values[i, : len(r)] = r
        mask[i, : len(r)] = True
    return values, mask


# ----------------------------------------------------------------------------- on-policy


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
        teacher_options(cfg, setup.device, setup.precision, d.samples_per_prompt, setup.model.spec.n_vocab),
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
        self.schedule = Schedule(t.lr, t.lr_scheduler, t.warmup_steps, self.total_steps, t.max_grad_norm)
        self.duty = for_device(t.max_gpu_duty_cycle, setup.device, reporter.message)
        self.options = LogprobOptions.from_training(t, setup.model.spec.n_vocab)
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
        checkpoint = resume_point(cfg, resume)
        self.progress = resume_rollouts(checkpoint, self.signature, self.policy, self.sampler, self.reporter) or self.progress
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
                    m = self.totals.account(m, timing) | {"train/update": update + 1}
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
                    if cfg.checkpoint and crossed_every(
                        cfg.checkpoint.every_steps, self.progress["global_step"], m["train/steps"]
                    ):
                        self.save(step_name(self.progress["global_step"]))
                    if stop:
                        break
            finally:
                self.reporter.finish()
        out = self.setup.export(cfg.output.path)
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
        order = "sequential" if d.prompt_order == "sequential" else "shuffled"
        chosen = [
            prompt_index(cursor + k, len(self.prompts), order=order, seed=self.cfg.lora.seed)
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
        diagnostics, _ = self.policy.update(
            update,
            samples,
            beta=d.kl_coefficient,
            epochs=d.distill_epochs,
            minibatches=1,
            budget_tokens=d.sampling.max_new_tokens,
            timing=timing,
        )
        return diagnostics | {"train/loss": diagnostics["policy/total_loss"]}

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
        for _ in range(d.distill_epochs):
            lr = set_learning_rate(self.optimizer, self.schedule, self.policy.global_step)
            step = dict.fromkeys(("distill/jsd", "policy/kl", "train/loss"), 0.0)
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
                    if ref is not None:
                        ref_logp = torch.cat([ref[micro[k]] for k in order]).to(setup.device)  # [N]
                        kl = k3_kl(ref_logp, logp[:, 0]).sum() / denominator  # []
                        loss = loss + d.kl_coefficient * kl
                        step["policy/kl"] += kl.item()
                    loss.backward()
                    step["distill/jsd"] += diag["distill/jsd"]
                    step["train/loss"] += loss.item()
                apply_step(
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
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
        f.flush()


TRAINERS = {"reverse_kl": OnPolicyLoop._train_reverse_kl, "jsd": OnPolicyLoop._train_jsd}


# ----------------------------------------------------------------------------- offline top-k: the sidecar


@dataclass(frozen=True)
class TopkOptions:
    """What `retrograd distill-teacher` may change; None keeps the config's choice."""

    data: Path | None = None  # None: distill.data
    out: Path | None = None  # None: distill.sidecar, else the data file with suffix .topk
    k: int | None = None  # None: distill.topk
    backend: str | None = None  # None: distill.teacher_backend


@dataclass(frozen=True)
class TopkReport:
    path: Path
    header: SidecarHeader
    examples: int
    seconds: float

    @property
    def bytes(self) -> int:
        return self.path.stat().st_size

    def summary(self) -> str:
        h = self.header
        rate = h.rows / self.seconds if self.seconds else 0.0
        return (
            f"wrote {self.path}: {h.rows} positions x k={h.k} from {self.examples} examples, "
            f"{self.bytes / 2**20:.2f} MiB, {rate:.0f} positions/s through {h.backend}"
        )


def write_teacher_topk(cfg: Config, reporter: Reporter, options: TopkOptions = TopkOptions()) -> TopkReport:
    """Score the corpus with the teacher and write its top-k at every supervised position."""
    d, t = cfg.distill, cfg.training
    data = options.data.resolve() if options.data else d.data
    if data is None:
        raise ConfigError(
            f'{cfg.path}: distill-teacher needs the corpus: --data FILE or distill.data (mode = "topk_offline")'
        )
    out = options.out.resolve() if options.out else d.sidecar or data.with_suffix(".topk")
    k = options.k or d.topk
    backend = options.backend or d.teacher_backend
    teacher_path = require_teacher(cfg)
    chat = open_chat(cfg)
    check_same_tokenizer(student_path(cfg), teacher_path, student_tokenizer=chat.tokenizer)
    vocabulary = read_vocabulary(teacher_path)
    if k > vocabulary.n_vocab:
        raise ConfigError(f"--k {k} is more than the teacher's {vocabulary.n_vocab}-token vocabulary")
    corpus = load_sft(data, chat, ctx=t.ctx)
    if corpus.dropped:
        reporter.message(
            f"dropped {len(corpus.dropped)} example(s) longer than ctx={t.ctx} (first: {corpus.dropped[0]})"
        )
    examples = corpus.examples
    header = SidecarHeader(
        k=k,
        rows=sum(e.n_trained for e in examples),
        vocab_size=vocabulary.n_vocab,
        tokenizer_fingerprint=vocabulary.fingerprint,
        corpus_fingerprint=corpus_fingerprint(examples),
        teacher=teacher_path.name,
        teacher_fingerprint=file_fingerprint(teacher_path),
        backend=backend,
    )
    device = resolve_device(cfg.model.device)
    teacher = open_teacher(
        teacher_path,
        backend,
        teacher_options(cfg, device, compute_dtype(t.compute_dtype, device), SIDECAR_CHUNK, vocabulary.n_vocab),
    )
    reporter.message(
        f"distill-teacher: {len(examples)} examples, {header.rows} positions, k={k}, teacher {teacher_path.name} through {backend}"
    )

    def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        reporter.start(len(examples), ["examples", "positions", "positions/s"], "examples")
        done, row_every = 0, max(1, len(examples) // (8 * SIDECAR_CHUNK)) * SIDECAR_CHUNK
        for s in range(0, len(examples), SIDECAR_CHUNK):
            part = examples[s : s + SIDECAR_CHUNK]
            rollouts = [Rollout(i, e.ids[:1], e.ids[1:], e.mask[1:]) for i, e in enumerate(part)]
            for scores in teacher.score(rollouts, topk=k):
                yield scores.topk_ids.numpy(), scores.topk_logprobs.numpy()
            done += sum(e.n_trained for e in part)
            reporter.advance(s + len(part), f"positions={done}")
            if (s + len(part)) % row_every == 0 or s + len(part) == len(examples):
                reporter.row(
                    {"examples": s + len(part), "positions": done, "positions/s": done / (time.perf_counter() - t0)}
                )
        reporter.finish()

    t0 = time.perf_counter()
    try:
        path = write_sidecar(out, header, chunks())
    finally:
        teacher.close()
    return TopkReport(path, header, len(examples), time.perf_counter() - t0)


# ----------------------------------------------------------------------------- offline top-k: training


def run_offline(cfg: Config, reporter: Reporter, resume) -> DistillResult:
    d, t = cfg.distill, cfg.training
    baseline_rss = rss_bytes()
    chat = open_chat(cfg)
    examples = load_sft(d.data, chat, ctx=t.ctx).examples
    sidecar = read_sidecar(d.sidecar)
    check_sidecar(
        sidecar,
        tokenizer_fingerprint=tokenizer_fingerprint(student_path(cfg)),
        corpus_fingerprint=corpus_fingerprint(examples),
        rows=sum(e.n_trained for e in examples),
        vocab_size=chat.tokenizer.n_vocab,
        data=d.data,
    )
    eval_examples = ()
    if cfg.evaluation is not None:
        eval_examples = load_sft(cfg.evaluation.data, chat, ctx=t.ctx).examples[: cfg.evaluation.max_examples]
    setup = prepare(cfg, reporter, chat)
    loop = OfflineLoop(cfg, setup, examples, sidecar, eval_examples, reporter)
    result = loop.run(resume)
    result.memory = {"baseline": baseline_rss, "after_load": loop.rss_after_load, "peak": loop.peak_rss}
    return result


class OfflineLoop(RecipeLoop):
    """SFT's loop (epoch plan, packing, checkpoints at steps) with the top-k cross-entropy."""

    def __init__(self, cfg: Config, setup: Setup, examples, sidecar: Sidecar, eval_examples, reporter: Reporter):
        d, t = cfg.distill, cfg.training
        self.cfg, self.setup, self.examples, self.sidecar, self.eval_examples = (
            cfg,
            setup,
            examples,
            sidecar,
            eval_examples,
        )
        self.reporter = reporter
        self.options = LogprobOptions.from_training(t, setup.model.spec.n_vocab)
        self.params = setup.adapter.parameters()
        self.optimizer = build_optimizer(self.params, t.optimizer, t.lr, t.weight_decay)
        self.offsets = row_offsets([e.n_trained for e in examples])
        self.plans = [
            epoch_plan(
                examples,
                e,
                seed=cfg.lora.seed,
                shuffle=True,
                micro_batch=t.micro_batch,
                accumulation=t.gradient_accumulation,
            )
            for e in range(d.offline_epochs)
        ]
        self.schedule = Schedule(t.lr, t.lr_scheduler, t.warmup_steps, sum(len(p) for p in self.plans), t.max_grad_norm)
        self.progress = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "best_eval": None, "stale_evals": 0}
        self.rss_after_load = self.peak_rss = rss_bytes()

    def run(self, resume) -> DistillResult:
        cfg, d = self.cfg, self.cfg.distill
        data_files = {"distill.data": d.data, "distill.sidecar": d.sidecar} | (
            {"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {}
        )
        self.signature = distill_signature(self.setup, data_files)
        checkpoint = resume_point(cfg, resume)
        if checkpoint is not None:
            check_signature(checkpoint, self.signature)
            self.progress = restore_state(checkpoint, self.setup, self.optimizer)
            self.reporter.message(f"resumed from {checkpoint.path} at step {self.progress['global_step']}")
        total = self.schedule.total_steps
        self.reporter.message(
            f"distill topk_offline: examples={len(self.examples)}, positions={self.sidecar.header.rows}, "
            f"k={self.sidecar.header.k}, epochs={d.offline_epochs}, steps={total} (the teacher is not loaded)"
        )
        records, tokens, seconds = [], 0, 0.0
        self.reporter.start(total, ["epoch", "step", "topk_ce", "eval_loss", "lr", "tok/s"], "steps")
        self.reporter.advance(self.progress["global_step"], "")
        out_dir = cfg.output.path.parent
        with MetricsSink(
            out_dir / "metrics.jsonl", cfg.metrics.tensorboard_dir, append=checkpoint is not None
        ) as metrics:
            try:
                for epoch in range(self.progress["epoch"], d.offline_epochs):
                    for k in range(self.progress["step_in_epoch"], len(self.plans[epoch])):
                        step = self.progress["global_step"]
                        t0 = time.perf_counter()
                        with PeakMemory() as peak:
                            m = self.step(self.plans[epoch][k])
                        self.peak_rss = max(self.peak_rss, peak.peak_rss)
                        elapsed = time.perf_counter() - t0
                        tokens, seconds = tokens + m["batch/tokens"], seconds + elapsed
                        self.progress.update(global_step=step + 1, epoch=epoch, step_in_epoch=k + 1)
                        m |= {
                            "train/tokens_per_second": m["batch/tokens"] / elapsed,
                            "train/epoch": epoch + 1,
                            "system/rss_bytes": rss_bytes(),
                        }
                        metrics.log(step + 1, m)
                        records.append(m)
                        self.reporter.advance(step + 1, f"topk_ce={m['train/loss']:.4f} lr={m['train/lr']:.2e}")
                        self.reporter.row(
                            {
                                "epoch": epoch + 1,
                                "step": step + 1,
                                "topk_ce": m["train/loss"],
                                "eval_loss": None,
                                "lr": m["train/lr"],
                                "tok/s": m["train/tokens_per_second"],
                            }
                        )
                        if (
                            cfg.checkpoint
                            and cfg.checkpoint.every_steps
                            and (step + 1) % cfg.checkpoint.every_steps == 0
                        ):
                            self.save(step_name(step + 1))
                    self.progress.update(epoch=epoch + 1, step_in_epoch=0)
                    due = (
                        (epoch + 1) % cfg.evaluation.every_iterations == 0 or epoch + 1 == d.offline_epochs
                        if cfg.evaluation
                        else False
                    )
                    if self.eval_examples and due and self._evaluate(epoch, metrics):
                        break
            finally:
                self.reporter.finish()
        out = self.setup.export(cfg.output.path)
        return DistillResult(
            out,
            "topk_offline",
            self.progress["epoch"],
            d.offline_epochs,
            self.progress["global_step"],
            records[-1]["train/loss"] if records else float("nan"),
            tokens / seconds if seconds else 0.0,
            records,
        )

    def step(self, micro_batches: list[list[int]]) -> dict:
        """One optimizer step: the cross-entropy against the teacher's renormalised top-k,
        averaged over the step's supervised positions."""
        setup, step = self.setup, self.progress["global_step"]
        lr = set_learning_rate(self.optimizer, self.schedule, step)
        n_trained = sum(self.examples[i].n_trained for mb in micro_batches for i in mb)
        m = {"train/loss": 0.0, "distill/teacher_topk_mass": 0.0, "distill/student_topk_mass": 0.0, "batch/tokens": 0}
        for mb in micro_batches:
            batch = pack([self.examples[i] for i in mb], setup.device)
            rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in mb])  # in packing order
            teacher_ids = torch.from_numpy(self.sidecar.ids[rows].astype(np.int64)).to(setup.device)  # [N, K]
            teacher_logp = torch.from_numpy(np.asarray(self.sidecar.logprobs[rows])).to(setup.device)  # [N, K]
            student_logp, _ = gather_at(setup.model.transformer, batch, teacher_ids, self.options)  # [N, K]
            every = torch.ones(len(rows), dtype=torch.bool, device=setup.device)  # [N]
            loss, diag = topk_cross_entropy(student_logp, teacher_logp, every, n_trained)
            loss.backward()
            m["train/loss"] += diag["distill/topk_ce"]
            for key in ("distill/teacher_topk_mass", "distill/student_topk_mass"):
                m[key] += diag[key] * len(rows) / n_trained
            m["batch/tokens"] += batch.n_tokens
        grad_norm = apply_step(self.optimizer, self.params, m["train/loss"], step, self.schedule.max_grad_norm)
        return m | {
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "distill/topk_entries": n_trained * self.sidecar.header.k,
        }

    def _evaluate(self, epoch: int, metrics: MetricsSink) -> bool:
        """The student's loss on the held-out data's own tokens; best checkpoint and patience.
        Returns True to stop early."""
        ev = self.cfg.evaluation
        loss, _ = mean_loss(self.setup, self.eval_examples, self.options)
        metrics.log(
            self.progress["global_step"],
            {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)), "train/epoch": epoch + 1},
        )
        outcome = track_evaluation(
            self.progress, loss, higher_is_better=False, min_delta=ev.min_delta, patience=ev.patience
        )
        if outcome.improved and self.cfg.checkpoint and "best_eval" in self.cfg.checkpoint.mode:
            self.save("best")
        self.reporter.row(
            {
                "epoch": epoch + 1,
                "step": self.progress["global_step"],
                "topk_ce": None,
                "eval_loss": loss,
                "lr": None,
                "tok/s": None,
            }
        )
        self.reporter.message(
            f"eval epoch {epoch + 1}: loss {loss:.4f}  best {outcome.best:.4f}"
            + ("" if outcome.improved else f", stale {outcome.stale}/{ev.patience or '∞'}")
        )
        return outcome.stop


MODES = {"on_policy": run_on_policy, "topk_offline": run_offline}
