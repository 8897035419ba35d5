"""The one rollout loop that grpo, agent_grpo and distill's on_policy mode run.

A recipe hands `run_rollouts` a RolloutRecipe (training/rollout_recipe.py): `produce` samples one update's rollouts
(immutable records, rewards included) and `plan` turns them into training samples with
advantages and one Decision per rollout; a few smaller functions give its rollouts.jsonl
line, its held-out evaluation and its table row. The loop owns the rest: resuming into the
live sampler, the update schedule, the optimizer update and the adapter push, metrics.jsonl,
rollouts.jsonl (each record joined with its decision and torch's log-probs), timeline.jsonl,
evaluation with the best checkpoint and patience, periodic checkpoints and the run's totals.
Batches come from training/rollout_sources.py: the trainer's own turn, a producer thread
(max_async_rollout), or rank 0 under torchrun.

Progress (checkpointed at update boundaries) is the loop's counters, the data cursor the
producer reached and the recipe's own `state`; every random choice derives from (seed,
update, position), so a resumed run repeats the remaining updates exactly.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from retrograd.errors import RetrogradError
from retrograd.runtime.memory import PeakMemory, rss_bytes
from retrograd.training.batches import LogprobOptions
from retrograd.training.checkpoint import Checkpoint, check_signature, resume_point, step_name
from retrograd.training.distributed import init_ranks
from retrograd.training.duty_cycle import for_device
from retrograd.training.metrics import MetricsSink, NullMetrics, run_record
from retrograd.training.optim import Schedule, build_optimizer
from retrograd.training.report import Reporter
from retrograd.training.rollout_recipe import Batch, Evaluation, RolloutRecipe, TrainPlan
from retrograd.training.rollout_sources import AsyncSource, Delivery, RankSource, SyncSource
from retrograd.training.rollout_step import PolicyOptimizer, TrainSample, UpdateResult, adapter_is_zero
from retrograd.training.scoring import Rollout, micro_batch_logprobs
from retrograd.training.state import keep_best, restore_state, save_state, step_checkpoint_due
from retrograd.training.timeline import PhaseClock, Timeline


class RolloutRunStopped(RetrogradError):
    """A recipe's failure policy ended the run (agent_grpo: too many dropped trajectories, an
    update without a baseline); the update's metrics and rollouts are written first."""


@dataclass
class UpdateRecord:
    update: int
    metrics: dict
    timing: dict  # phase -> seconds
    steps: int
    step_diagnostics: list[dict] = field(default_factory=list)  # merged policy diagnostics per optimizer step


@dataclass
class RolloutResult:
    output: Path
    epochs_label: str
    updates_done: int
    steps: int
    train_loss: float
    tokens_per_second: float
    records: list[UpdateRecord] = field(default_factory=list)
    init_timing: dict = field(default_factory=dict)  # model load, LoRA, sampler: (seconds, Δ RSS)
    memory: dict = field(default_factory=dict)  # rss baseline / after load / peak
    updates_planned: int = 0
    epochs_per_update: int = 0
    duty: object = None  # DutyStats of the run

    def summary(self) -> str:
        return (
            f"done update={self.updates_done}/{self.updates_planned} {self.epochs_label}={self.epochs_per_update} "
            f"step={self.steps} train_loss={self.train_loss:.4f} tok/s={self.tokens_per_second:.0f} out={self.output}"
        )


# ---------------------------------------------------------------- the trainer's side


@dataclass
class Trainer:
    """The optimizer side of a run: what every rollout recipe builds the same way."""

    setup: Any  # recipes.common.Setup
    sampler: Any  # the rollout sampler that gets the adapter after each update
    policy: PolicyOptimizer
    reporter: Reporter
    signature: dict
    init_timing: dict = field(default_factory=dict)
    baseline_rss: int = 0

    @property
    def duty(self):
        return self.policy.duty


def make_policy(cfg, setup, loss_options, *, updates: int, steps_per_update: int, temperature: float,
                reporter: Reporter) -> PolicyOptimizer:
    """The optimizer, learning-rate schedule, duty cycle and policy update of a rollout run
    (under torchrun, of this rank)."""
    t = cfg.training
    optimizer = build_optimizer(setup.adapter.parameters(), t.optimizer, t.lr, t.weight_decay)
    schedule = Schedule(t.lr, t.lr_scheduler, t.warmup_steps, updates * steps_per_update, t.max_grad_norm, updates)
    duty = for_device(t.max_gpu_duty_cycle, setup.device, reporter.message)
    options = LogprobOptions.from_training(t, setup.model.spec.n_vocab, temperature)
    policy = PolicyOptimizer(setup, optimizer, loss_options, schedule, options, duty, t.micro_batch, cfg.lora.seed, init_ranks(setup.device))
    if policy.merging is not None:
        reporter.message(policy.merging.describe(t.micro_batch))
    return policy


def on_rank_zero(device, opener: Callable):
    """What only the sampling side needs (the rollout sampler, a teacher): `opener()`, a
    context manager, on rank 0; None on the other torchrun ranks, which train on the
    batches rank 0 broadcasts."""
    return opener() if init_ranks(device).is_main else nullcontext(None)


def warm_up(setup) -> dict:
    """One forward+backward on a few tokens before the first update (compiles the
    dequantization kernels), so update timings measure steady work."""
    t0, r0 = time.perf_counter(), rss_bytes()
    ids = tuple(range(10, 42))
    model = setup.model.transformer
    logp, _ = micro_batch_logprobs(model, [Rollout(0, ids[:16], ids[16:])], LogprobOptions(), setup.device)
    logp.sum().backward()
    for p in setup.adapter.parameters():
        p.grad = None
    return {"warm-up (compile + probe step)": (time.perf_counter() - t0, rss_bytes() - r0)}


def reward_evaluation(update: int, planned: int, rewards: list[float], extra: dict | None = None) -> Evaluation:
    """A held-out evaluation by mean reward (grpo, agent_grpo): higher is better."""
    mean, low, high = float(sum(rewards) / len(rewards)), float(min(rewards)), float(max(rewards))
    line = f"eval update {update + 1}/{planned}: mean {mean:.4f}  range [{low:.3f}, {high:.3f}]  n={len(rewards)}"
    metrics = {"eval/mean_reward": mean, "eval/reward_min": low, "eval/reward_max": high} | (extra or {})
    return Evaluation(mean, metrics, line)


def cut_text(text: str, cap: int) -> str:
    """A text for rollouts.jsonl, cut to [observe].max_text_chars (0: whole)."""
    return text if not cap or len(text) <= cap else text[:cap] + " […]"


# ---------------------------------------------------------------- the loop


def run_rollouts(cfg, recipe: RolloutRecipe, trainer: Trainer, resume: Path | bool | None = None) -> RolloutResult:
    """Warm up, then train `recipe.updates` updates (fewer when patience or the recipe
    halts), resuming as `resume` says (checkpoint.resume_point)."""
    trainer.init_timing = trainer.init_timing | warm_up(trainer.setup)
    checkpoint = resume_point(cfg, resume, trainer.reporter.message)
    loop = _Loop(cfg, recipe, trainer)
    return loop.run(checkpoint)


class _Loop:
    def __init__(self, cfg, recipe: RolloutRecipe, trainer: Trainer):
        self.cfg, self.recipe, self.trainer = cfg, recipe, trainer
        self.setup, self.policy, self.reporter = trainer.setup, trainer.policy, trainer.reporter
        self.ranks = trainer.policy.ranks
        self.progress = {"update": 0, "global_step": 0, "prompt_cursor": 0, "best_eval": None, "stale_evals": 0} | recipe.state
        self.rss_after_load = rss_bytes()
        self.totals = RunTotals(recipe.loss_key)

    def run(self, checkpoint: Checkpoint | None) -> RolloutResult:
        recipe = self.recipe
        if checkpoint is not None:
            check_signature(checkpoint, self.trainer.signature)
            self.progress = self.progress | restore_state(checkpoint, self.setup, self.policy.optimizer)  # older checkpoints lack newer counters
            self.policy.global_step = self.progress["global_step"]
            self.reporter.message(f"resumed from {checkpoint.path} at update {self.progress['update']}")
        if not adapter_is_zero(self.setup.adapter) and self.trainer.sampler is not None:
            self.trainer.sampler.set_adapter(self.setup.adapter)  # resumed or warm-started: sample from it
        self.reporter.message(f"{recipe.name}: {recipe.plan_line}")
        records: list[UpdateRecord] = []
        append = checkpoint is not None
        ahead = self.cfg.training.max_async_rollout
        if append and ahead:
            self.reporter.message(
                f"max_async_rollout = {ahead}: sampling restarts at update {self.progress['update'] + 1} with the "
                "checkpointed adapter, so the rest of the run differs from one that was never stopped")
        main = self.ranks.is_main  # under torchrun rank 0 samples and writes; the others train
        with _outputs(self.cfg, append=append, write=main) as (metrics, rollouts_file), \
                Timeline(run_record(self.cfg, "timeline.jsonl") if main else None,
                         resumed_at=self.progress["update"] if append else None) as timeline:
            self.metrics, self.timeline = metrics, timeline
            source = None
            if main:
                source = (AsyncSource(recipe, self.trainer.sampler, timeline, start=self.progress["update"],
                                      cursor=self.progress["prompt_cursor"], ahead=ahead)
                          if ahead else SyncSource(recipe, self.trainer.sampler, timeline))
            self.source = RankSource(source, self.ranks) if self.ranks.spread else source
            self.reporter.start(recipe.updates, ["update", "step", *recipe.columns], "updates")
            self.reporter.advance(self.progress["update"], "")
            try:
                while self.progress["update"] < recipe.updates:
                    record, delivery, plan, result = self.totals.measure(self._update, self.progress["update"])
                    records.append(record)
                    if self._finish_update(record, delivery, plan, result, rollouts_file):
                        break
            finally:
                self.source.close()
                self.reporter.finish()
        out = self.setup.write_output() if main else self.cfg.output.path
        return RolloutResult(
            output=out, epochs_label=recipe.epochs_label, updates_done=self.progress["update"],
            steps=self.progress["global_step"], train_loss=self.totals.last_loss,
            tokens_per_second=self.totals.tokens_per_second, records=records, updates_planned=recipe.updates,
            epochs_per_update=recipe.epochs, init_timing=self.trainer.init_timing,
            memory={"baseline": self.trainer.baseline_rss, "after_load": self.rss_after_load, "peak": self.totals.peak_rss},
            duty=self.trainer.duty.stats,
        )

    def _update(self, update: int) -> tuple[UpdateRecord, Delivery, TrainPlan, UpdateResult | None]:
        recipe = self.recipe
        clock = PhaseClock(recipe.phases, timeline=self.timeline, update=update)
        delivery = self.source.next(update, self.progress["prompt_cursor"], clock)
        for phase, seconds in delivery.timing.items():  # the producer's, already on the timeline
            clock[phase] = clock.get(phase, 0.0) + seconds
        batch = delivery.batch
        state = {k: self.progress[k] for k in recipe.state}
        plan = recipe.plan(batch, state, clock)
        c = delivery.counters
        metrics = batch.metrics | delivery.metrics | plan.metrics | {
            "timing/waiting_for_adapter_seconds": c.get("waiting_for_adapter_seconds", 0.0),
            "rollouts/queued": c.get("queued_rollouts", 0), "rollouts/in_flight": c.get("in_flight_rollouts", 0),
            "rollouts/staleness": update - delivery.adapter_version}
        workers = self.trainer.sampler
        if hasattr(workers, "lost_workers"):  # rollout workers ([rollout]): run totals so far
            metrics |= {"workers/lost": workers.lost_workers, "workers/requeued_groups": workers.requeued_groups}
        steps_before = self.policy.global_step
        result = None
        if plan.samples and plan.fail is None:
            train = recipe.train or self._policy_update
            result = train(update, list(plan.samples), plan.beta, clock)
            metrics |= result.diagnostics
            if recipe.settle is not None:
                plan = replace(plan, state=recipe.settle(plan.state, metrics))
            metrics |= self.source.push(self.setup.adapter, update + 1, clock)
        elif plan.fail is None:
            self.source.unchanged(update + 1)  # the adapter after this update is the one before it
            if plan.note:
                self.reporter.message(f"update {update + 1}: {plan.note}")
        metrics["policy/beta"] = plan.beta
        steps = self.policy.global_step - steps_before
        metrics["train/steps"] = steps
        step_diagnostics = result.step_diagnostics if result is not None else []
        return UpdateRecord(update, metrics, dict(clock), steps, step_diagnostics), delivery, plan, result

    def _policy_update(self, update: int, samples: list[TrainSample], beta: float, clock: PhaseClock) -> UpdateResult:
        r = self.recipe
        return self.policy.update(update, samples, beta=beta, epochs=r.epochs, minibatches=r.minibatches,
                                  budget_tokens=r.budget_tokens, timing=clock, kl_reference=r.kl_reference)

    def _finish_update(self, record: UpdateRecord, delivery: Delivery, plan: TrainPlan, result, rollouts_file) -> bool:
        """Log, write, report, evaluate and checkpoint one update. Returns True to stop."""
        recipe, update, batch = self.recipe, record.update, delivery.batch
        self.progress["global_step"] = self.policy.global_step
        m = self.totals.account(record.metrics, record.timing)
        phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in record.timing.items())
        self.setup.detail(f"update {update + 1} phases: {phases} (update {self.totals.elapsed:.2f} s)")
        self.metrics.log(self.progress["global_step"], m | {"train/update": update + 1})
        self.timeline.counters(update, delivery.counters | {
            "discarded_groups": plan.discarded_groups,
            "truncated_rollouts": sum(_truncated(r) for r in batch.rollouts),
        })
        self._write_rollouts(rollouts_file, batch, plan, result)
        if plan.fail is not None:
            raise RolloutRunStopped(plan.fail)
        self.progress |= plan.state | {"update": update + 1, "prompt_cursor": batch.cursor}
        self.reporter.row({"update": f"{update + 1}/{recipe.updates}", "step": self.progress["global_step"]} | recipe.row(m))
        self.reporter.advance(update + 1, recipe.status(m) + (f" loss={self.totals.last_loss:.4f}" if self.totals.losses else ""))
        stop = False
        if plan.halt:
            self.reporter.message(f"stopping: {plan.halt}")
            stop = True
        if recipe.evaluate is not None and self._evaluation_due(update):
            stop = self._evaluate(update) or stop
        self._save_if_crossed(record.steps)
        return stop

    # ---------------------------------------------------------------- outputs

    def _write_rollouts(self, f, batch: Batch, plan: TrainPlan, result: UpdateResult | None) -> None:
        observe, update = self.cfg.observe, batch.update
        if observe and (update + 1) % observe.every:
            return
        cap = observe.max_text_chars if observe else 0
        policy: list[list[float] | None] = [None] * len(batch.rollouts)
        if result is not None:
            for i, logp in zip(plan.trained, result.policy_logprobs):
                policy[i] = logp.tolist()
        for rollout, decision, logp in zip(batch.rollouts, plan.decisions, policy):
            f.write(json.dumps(self.recipe.record(rollout, decision, logp, update, cap), ensure_ascii=False) + "\n")
        f.flush()

    # ---------------------------------------------------------------- evaluation, checkpoints

    def _evaluation_due(self, update: int) -> bool:
        every = self.cfg.evaluation.every_iterations
        return (update + 1) % every == 0 or update + 1 == self.recipe.updates

    def _evaluate(self, update: int) -> bool:
        """Log a held-out evaluation, keep the best checkpoint when asked, say so in one line.
        Returns True when patience has run out."""
        result = self.source.call(lambda: self.recipe.evaluate(update))
        self.metrics.log(self.progress["global_step"], result.metrics | {"train/update": update + 1})
        return keep_best(self.cfg, self.progress, result.value, result.line, self.reporter.message, self._save,
                         higher_is_better=result.higher_is_better)

    def _save(self, name: str) -> None:
        if not self.ranks.is_main:  # every rank holds the same adapter and optimizer: rank 0 writes
            return
        path = save_state(self.setup, self.policy.optimizer, self.progress, self.trainer.signature, name)
        self.reporter.checkpoint(path)

    def _save_if_crossed(self, steps: int) -> None:
        if step_checkpoint_due(self.cfg, self.progress["global_step"], steps):
            self._save(step_name(self.progress["global_step"]))


def _truncated(rollout) -> bool:
    return bool(getattr(rollout, "truncated", False))


@contextmanager
def _outputs(cfg, *, append: bool, write: bool = True) -> Iterator[tuple[MetricsSink, object]]:
    """NAME.metrics.jsonl beside the output (plus TensorBoard when asked) and NAME.rollouts.jsonl,
    both appended to when the run resumes; with write False (torchrun ranks other than 0)
    sinks that keep nothing."""
    if not write:
        with open(os.devnull, "w", encoding="utf-8") as nowhere:
            yield NullMetrics(), nowhere
        return
    rollouts_path = run_record(cfg, "rollouts.jsonl")
    rollouts_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        MetricsSink(run_record(cfg, "metrics.jsonl"), cfg.metrics.tensorboard_dir, append=append) as metrics,
        open(rollouts_path, "a" if append else "w", encoding="utf-8") as rollouts,
    ):
        yield metrics, rollouts


@dataclass
class RunTotals:
    """Trained tokens and wall time over a run's updates, the peak RSS and the losses."""

    loss_key: str
    tokens: float = 0.0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    peak_rss: int = field(default_factory=rss_bytes)
    elapsed: float = 0.0  # the last measured update

    def measure(self, update: Callable, *args):
        """Run one update, timing it and watching its peak RSS."""
        t0 = time.perf_counter()
        with PeakMemory() as peak:
            result = update(*args)
        self.peak_rss = max(self.peak_rss, peak.peak_rss)
        self.elapsed = time.perf_counter() - t0
        return result

    def account(self, metrics: dict, timing: dict) -> dict:
        """Count the measured update and add its timing/*, system/rss_bytes and
        train/tokens_per_second to `metrics` (in place; returned for convenience).
        Synchronous runs never wait for a batch (the phase is absent: recorded as 0), and
        no run samples with an adapter staler than max_async_rollout (the producer waits
        instead), so rollouts/canceled is always 0; both are written so a report can say so."""
        trained = metrics.get("batch/trained_tokens", 0)
        self.tokens += trained
        self.seconds += self.elapsed
        if self.loss_key in metrics:
            self.losses.append(metrics[self.loss_key])
        metrics |= {"timing/waiting_for_batch_seconds": 0.0} | {f"timing/{k}_seconds": v for k, v in timing.items()} | {
            "rollouts/canceled": 0,
            "timing/update_seconds": self.elapsed,
            "system/rss_bytes": rss_bytes(),
            "train/tokens_per_second": trained / self.elapsed if self.elapsed else 0.0,
        }
        return metrics

    @property
    def last_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0
