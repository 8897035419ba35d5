"""Preference training (DPO, IPO, SimPO, ORPO; KTO on unpaired answers) with no second
model in memory: the reference is this base with the adapter off, or the adapter as the
run started (`reference = "initial"`, which differs only with `lora.init_adapter`).

A pair is packed as GRPO packs a group: its prompt once, chosen and rejected both reading
it, so a pass scores both answers for the price of one prompt. Reference log-probs are
computed once, before step 1, and kept in every checkpoint, so later epochs and a resume
reuse them. A step is `gradient_accumulation` micro-batches of `training.micro_batch` tokens
(or `pairs_per_step` pairs); its loss is the mean of its pairs' losses
(objectives/preference.py), and the chunked log-prob kernel is the only place logits exist.
Under torchrun a step's micro-batches are dealt out to the ranks and their gradients summed
(training/distributed.py); every rank scores the references itself.
KTO's reference point z0 comes from the step's own answers scored after other records'
prompts (each prompt with the previous record's answer, as TRL pairs them), without
gradients. Everything the next step depends on is in each checkpoint (exact resume).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from retrograd.config import Config
from retrograd.data import evenly_spaced
from retrograd.data.preference import Labelled, Pair, load_preference
from retrograd.errors import ConfigError
from retrograd.model.base import load_model
from retrograd.objectives.preference import PairLogps, kto, kto_reference_point, pair_loss
from retrograd.recipes.common import open_chat, prepare, signature
from retrograd.runtime.bundled import default_model_path
from retrograd.runtime.memory import rss_bytes
from retrograd.teacher import check_same_tokenizer
from retrograd.training.batches import (
    Group,
    LogprobOptions,
    batch_logprobs,
    epoch_plan,
    merge_micro_batches,
    merged_passes,
    pack,
    plan_micro_batches,
)
from retrograd.training.checkpoint import check_signature, file_fingerprint, resume_point, step_name
from retrograd.training.distributed import Ranks, init_ranks
from retrograd.training.duty_cycle import for_device
from retrograd.training.metrics import MetricsSink, NullMetrics, run_record
from retrograd.training.optim import Schedule, build_optimizer, clip_gradients
from retrograd.training.report import Reporter
from retrograd.training.state import keep_best, restore_state, save_state

SUMMED = ("loss", "rewards/accuracies", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected",
          "count/chosen", "count/rejected", "drop/chosen", "drop/rejected")


@dataclass(frozen=True)
class PreferenceResult:
    output: Path
    steps: int
    epochs_done: int
    train_loss: float
    eval_metrics: dict | None
    losses: tuple[float, ...]

    def summary(self) -> str:
        ev = self.eval_metrics or {}
        eval_part = (f" eval_loss={ev['eval/loss']:.4f} eval_accuracy={ev['eval/rewards/accuracies']:.3f}" if ev else "")
        return f"done epoch={self.epochs_done} step={self.steps} train_loss={self.train_loss:.4f}{eval_part} out={self.output}"


def run(cfg: Config, reporter: Reporter, *, resume: Path | bool | None = None) -> PreferenceResult:
    t, pc = cfg.training, cfg.preference
    unpaired = pc.loss == "kto"
    chat = open_chat(cfg)
    data = load_preference(pc.data, chat, ctx=t.ctx, unpaired=unpaired, data_format=pc.data_format)
    reporter.message(f"data: {data.description}")
    items = data.items
    held_out = ()
    if cfg.evaluation is not None:
        held_out = evenly_spaced(load_preference(cfg.evaluation.data, chat, ctx=t.ctx, unpaired=unpaired,
                                                 data_format=pc.data_format).items, cfg.evaluation.max_examples)
    if cfg.reference is not None:  # before the base loads, so that a wrong file stops at once
        check_same_tokenizer(cfg.model.path or default_model_path(), cfg.reference.model, student_tokenizer=chat.tokenizer,
                             names=("reference.model", "the base"))
    setup = prepare(cfg, reporter, chat)
    ranks = init_ranks(setup.device)
    scorer = Scorer(setup, LogprobOptions.from_training(t, setup.model.spec.n_vocab))
    params = setup.adapter.parameters()
    optimizer = build_optimizer(params, t.optimizer, t.lr, t.weight_decay)
    lengths = [item.n_tokens for item in items]
    plans = [epoch_plan(lengths, e, seed=cfg.lora.seed, shuffle=pc.shuffle, micro_batch=t.micro_batch,
                        accumulation=t.gradient_accumulation, items_per_step=pc.pairs_per_step) for e in range(t.epochs)]
    total_steps = sum(len(p) for p in plans)
    smallest = min(sum(len(mb) for mb in step) for plan in plans for step in plan)
    if unpaired and smallest < 2:
        raise ConfigError(f"{cfg.path}: loss = 'kto' needs at least 2 records per step (its reference point pairs each prompt "
                          f"with another record's answer), but a step holds {smallest}: set preference.pairs_per_step >= 2, "
                          "or a larger training.micro_batch or gradient_accumulation")
    schedule = Schedule(t.lr, t.lr_scheduler, t.warmup_steps, total_steps, t.max_grad_norm)
    data_files = {"preference.data": pc.data} | ({"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {})
    sig = signature(setup, data_files) | ({"reference.model": file_fingerprint(cfg.reference.model)} if cfg.reference else {})
    progress = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "best_eval": None, "stale_evals": 0,
                "reference": None, "eval_reference": None, "eval_sources": None, "warned_drop": False}
    reference = Reference(setup, pc.reference, scorer.options, reporter)  # before a resume restores later weights

    checkpoint = resume_point(cfg, resume, reporter.message)
    if checkpoint is not None:
        check_signature(checkpoint, sig)
        progress = restore_state(checkpoint, setup, optimizer)
        reporter.message(f"resumed from {checkpoint.path} at step {progress['global_step']}")
    sources = [item.source for item in held_out]
    if progress["reference"] is None or progress["eval_sources"] != sources:  # simpo, orpo too: the drop warning reads it
        t0 = time.perf_counter()
        if progress["reference"] is None:
            progress["reference"] = reference.score(scorer, items)
        progress["eval_reference"] = reference.score(scorer, held_out) if held_out else None
        progress["eval_sources"] = sources
        reporter.message(f"reference log-probs of {len(items) + len(held_out)} record(s) ({reference.describe()}) in "
                         f"{time.perf_counter() - t0:.1f} s")
    if not unpaired:
        reference.release()
    loss_name = {"dpo": "DPO", "ipo": "IPO", "simpo": "SimPO", "orpo": "ORPO", "kto": "KTO"}[pc.loss]
    reporter.message(f"preference ({loss_name}, beta {pc.strength:g}): {len(items)} {'answers' if unpaired else 'pairs'}, "
                     f"epochs={t.epochs}, steps_per_epoch={len(plans[0])}, steps={total_steps}")
    out_dir = cfg.output.path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = (MetricsSink(run_record(cfg, "metrics.jsonl"), cfg.metrics.tensorboard_dir, append=checkpoint is not None)
               if ranks.is_main else NullMetrics())
    objective = Objective(cfg, scorer, reference, ranks)
    if objective.merging is not None:
        reporter.message(objective.merging.describe(cfg.training.micro_batch))
    duty = for_device(t.max_gpu_duty_cycle, setup.device, reporter.message)  # gaps for a shared GPU

    def save(name: str) -> Path | None:
        if not ranks.is_main:  # rank 0 writes for all: every rank holds the same adapter and optimizer
            return None
        path = save_state(setup, optimizer, progress, sig, name)
        reporter.checkpoint(path)
        return path

    columns = ["epoch", "step", "loss", "accuracy", "margin", "eval_loss", "eval_acc", "lr"]
    reporter.start(total_steps, columns, "steps")
    reporter.advance(progress["global_step"], "")
    row_every = max(1, total_steps // (8 * t.epochs))
    losses: list[float] = []
    eval_metrics = None
    stop = False
    try:
        for epoch in range(progress["epoch"], t.epochs):
            steps = plans[epoch]
            for k in range(progress["step_in_epoch"], len(steps)):
                step = progress["global_step"]
                lr = schedule.apply(optimizer, step)
                threads = setup.cpu.adjust()
                t0 = time.perf_counter()
                chosen = [i for mb in steps[k] for i in mb]
                with duty.burst():
                    means = objective.step(items, steps[k], progress["reference"], len(chosen))
                    ranks.sum_gradients(params)
                    if not math.isfinite(means["loss"]):
                        raise setup.diverged(f"step {step + 1}: the loss is {means['loss']} (not finite); stopped without "
                                             "updating the adapter — try a lower training.lr")
                    grad_norm = clip_gradients(params, t.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - t0
                losses.append(means["loss"])
                progress.update(global_step=step + 1, epoch=epoch, step_in_epoch=k + 1)
                watch_chosen_logps(progress, means.pop("drop/chosen"), means.pop("drop/rejected"), pc.logps_drop_warn, reporter)
                metrics.log(step + 1, {f"train/{key}" if key == "loss" else key: v for key, v in means.items()} | {
                    "train/lr": lr, "train/grad_norm": grad_norm, "train/epoch": epoch + 1, "train/pairs_per_step": len(chosen),
                    "system/rss_bytes": rss_bytes(), "timing/step_seconds": elapsed, "system/threads": threads})
                reporter.advance(step + 1, f"loss={means['loss']:.4f} acc={means['rewards/accuracies']:.2f} lr={lr:.2e}")
                if (step + 1) % row_every == 0 or step + 1 == total_steps:
                    reporter.row({"epoch": epoch + 1, "step": step + 1, "loss": means["loss"], "accuracy": means["rewards/accuracies"],
                                  "margin": means.get("rewards/margins"), "lr": lr})
                if cfg.checkpoint and cfg.checkpoint.every_steps and (step + 1) % cfg.checkpoint.every_steps == 0:
                    save(step_name(step + 1))
            progress.update(epoch=epoch + 1, step_in_epoch=0)
            if held_out and ((epoch + 1) % cfg.evaluation.every_iterations == 0 or epoch + 1 == t.epochs):
                eval_metrics = ranks.broadcast(objective.evaluate(held_out, progress["eval_reference"]) if ranks.is_main else None)
                metrics.log(progress["global_step"], eval_metrics | {"train/epoch": epoch + 1})
                line = (f"eval epoch {epoch + 1}: loss {eval_metrics['eval/loss']:.4f}  accuracy "
                        f"{eval_metrics['eval/rewards/accuracies']:.3f}  margin {eval_metrics.get('eval/rewards/margins', math.nan):.3f}")
                stop = keep_best(cfg, progress, eval_metrics["eval/loss"], line, reporter.message, save)
                reporter.row({"epoch": epoch + 1, "step": progress["global_step"], "eval_loss": eval_metrics["eval/loss"],
                              "eval_acc": eval_metrics["eval/rewards/accuracies"]})
            if stop:
                break
    finally:
        reporter.finish()
        metrics.close()
    out = setup.write_output() if ranks.is_main else cfg.output.path
    return PreferenceResult(out, progress["global_step"], progress["epoch"],
                            losses[-1] if losses else float("nan"), eval_metrics, tuple(losses))


class Scorer:
    """Summed log-probs of answers after their prompts, through the one packed-batch path, by
    the run's model (or another: a [reference] model)."""

    def __init__(self, setup, options: LogprobOptions, transformer=None):
        self.setup, self.options = setup, options
        self.transformer = transformer or setup.model.transformer

    def sums(self, groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (summed log-prob per member [M], trained tokens per member [M]), members in order."""
        batch = pack(groups, self.setup.device)
        logprobs = batch_logprobs(self.transformer, batch, self.options)
        n = batch.n_sequences
        sums = torch.zeros(n, dtype=logprobs.dtype, device=logprobs.device).index_add(0, batch.sequence_index, logprobs)
        counts = torch.bincount(batch.sequence_index, minlength=n).to(logprobs.dtype)
        return sums, counts

    def without_grad(self, groups: list[Group]) -> list[float]:
        out = []
        with torch.no_grad():
            for mb in plan_micro_batches([len(g.prefix) + sum(len(m.ids) for m in g.members) for g in groups],
                                         self.setup.cfg.training.micro_batch):
                out += self.sums([groups[i] for i in mb])[0].tolist()
        return out


def group(item: Pair | Labelled) -> Group:
    return Group(item.prompt, (item.chosen, item.rejected) if isinstance(item, Pair) else (item.answer,))


def mismatched(items: list[Labelled]) -> list[Group]:
    """Each prompt with the previous record's answer (the first with the last): KTO's KL pairs."""
    return [Group(item.prompt, (items[i - 1].answer,)) for i, item in enumerate(items)]


class Reference:
    """The reference policy: the base (adapter off), the adapter as the run started, or a
    [reference] model. That model is loaded only while it is needed: for the scores before
    step 1, and for KTO's reference point at every step."""

    def __init__(self, setup, which: str, options: LogprobOptions, reporter: Reporter):
        cfg = setup.cfg
        self.adapter, self.setup, self.options, self.reporter = setup.adapter, setup, options, reporter
        self.model_path = cfg.reference.model if cfg.reference is not None else None
        self.is_base = self.model_path is None and (which == "base" or cfg.lora.init_adapter is None)  # a fresh LoRA adds exactly zero
        self.initial = None if self.is_base or self.model_path else [p.detach().clone() for p in self.adapter.parameters()]
        self._scorer = None

    def describe(self) -> str:
        return f"[reference] model {self.model_path.name}" if self.model_path else f"adapter {'off' if self.is_base else 'as loaded'}"

    def scorer(self, own: Scorer) -> Scorer:
        """What scores the reference: the run's own model, or the [reference] model (loaded once)."""
        if self.model_path is None:
            return own
        if self._scorer is None:
            model = load_model(self.model_path, weights=self.setup.cfg.model.weights, compute_dtype=self.setup.precision,
                               device=self.setup.device, tokenizer=self.setup.chat.tokenizer)
            for p in model.transformer.parameters():
                p.requires_grad_(False)
            self.reporter.message(f"reference model {self.model_path.name} loaded ({model.weights_choice})")
            self._scorer = Scorer(self.setup, self.options, model.transformer)
        return self._scorer

    def release(self) -> None:
        """Free a [reference] model once nothing will score with it."""
        self._scorer = None

    @contextmanager
    def active(self):
        if self.model_path is not None:
            yield
            return
        if self.is_base:
            with self.adapter.disabled():
                yield
            return
        current = [p.detach().clone() for p in self.adapter.parameters()]
        with torch.no_grad():
            for p, saved in zip(self.adapter.parameters(), self.initial):
                p.copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self.adapter.parameters(), current):
                    p.copy_(saved)

    def score(self, scorer: Scorer, items) -> list[float]:
        """Summed reference log-probs: [chosen, rejected] per pair, or [answer] per KTO record, flat."""
        with self.active():
            return self.scorer(scorer).without_grad([group(item) for item in items])


class Objective:
    """A step's (or an evaluation's) loss and TRL-named metrics, summed over its pairs."""

    def __init__(self, cfg: Config, scorer: Scorer, reference: Reference, ranks: Ranks):
        self.pc, self.scorer, self.reference, self.ranks = cfg.preference, scorer, reference, ranks
        self.width = 1 if self.pc.loss == "kto" else 2  # reference values per record
        self.merging = scorer.setup.merging(ranks.spread)

    def step(self, items, micro_batches: list[list[int]], ref: list[float] | None, n_items: int) -> dict:
        z0 = self._reference_point([items[i] for mb in micro_batches for i in mb]) if self.pc.loss == "kto" else None
        sums = dict.fromkeys(SUMMED, 0.0)
        micro_batches, checkpointed = merge_micro_batches(micro_batches, {i: items[i].n_tokens for mb in micro_batches for i in mb}, self.merging)
        for j in self.ranks.share(micro_batches):  # every micro-batch on one rank; dealt out under torchrun
            mb = micro_batches[j]
            with merged_passes(self.scorer.setup.model.transformer, checkpointed[j]):
                loss, parts = self._losses([items[i] for i in mb], self._ref(ref, mb), z0)
            (loss.sum() / n_items).backward()
            for key, value in parts.items():
                sums[key] += value
        return _means(dict(zip(SUMMED, self.ranks.sum_floats([sums[key] for key in SUMMED]))), n_items)

    def evaluate(self, items, ref: list[float] | None) -> dict:
        z0 = self._reference_point(list(items)) if self.pc.loss == "kto" else None
        sums = dict.fromkeys(SUMMED, 0.0)
        with torch.no_grad():
            for mb in plan_micro_batches([item.n_tokens for item in items], self.scorer.setup.cfg.training.micro_batch):
                _, parts = self._losses([items[i] for i in mb], self._ref(ref, mb), z0)
                for key, value in parts.items():
                    sums[key] += value
        return {f"eval/{key}": value for key, value in _means(sums, len(items)).items() if not key.startswith("drop/")}

    def _ref(self, ref: list[float] | None, mb: list[int]) -> torch.Tensor | None:
        if ref is None:
            return None
        return torch.tensor([ref[i * self.width + j] for i in mb for j in range(self.width)], dtype=torch.float32)

    def _reference_point(self, items: list[Labelled]) -> torch.Tensor:
        groups = mismatched(items)
        policy = torch.tensor(self.scorer.without_grad(groups))
        with self.reference.active():
            ref = torch.tensor(self.reference.scorer(self.scorer).without_grad(groups))
        return kto_reference_point(policy, ref)

    def _losses(self, items, ref: torch.Tensor | None, z0) -> tuple[torch.Tensor, dict]:
        """Per-record losses [B] of one micro-batch, and its metrics summed (floats)."""
        pc = self.pc
        sums, counts = self.scorer.sums([group(item) for item in items])
        ref = None if ref is None else ref.to(sums.device, sums.dtype)
        if pc.loss == "kto":
            desirable = torch.tensor([item.desirable for item in items], device=sums.device)
            loss, rewards = kto(sums, ref, desirable, z0, pc.strength, pc.desirable_weight, pc.undesirable_weight)
            chosen, rejected = rewards[desirable], rewards[~desirable]
            logps = sums.detach()
            return loss, {"loss": float(loss.detach().sum()), "rewards/chosen": float(chosen.sum()),
                          "rewards/rejected": float(rejected.sum()), "rewards/accuracies": float((rewards > 0).eq(desirable).float().sum()),
                          "logps/chosen": float(logps[desirable].sum()), "logps/rejected": float(logps[~desirable].sum()),
                          "count/chosen": float(desirable.sum()), "count/rejected": float((~desirable).sum()),
                          "drop/chosen": 0.0, "drop/rejected": 0.0}
        pairs = PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2], ref[0::2], ref[1::2])
        loss, chosen, rejected = pair_loss(pairs, pc.loss, beta=pc.strength, label_smoothing=pc.label_smoothing,
                                           gamma_beta_ratio=pc.gamma_beta_ratio)
        return loss, {"loss": float(loss.detach().sum()), "rewards/chosen": float(chosen.sum()),
                      "rewards/rejected": float(rejected.sum()), "rewards/accuracies": float((chosen > rejected).float().sum()),
                      "logps/chosen": float(pairs.chosen.detach().sum()), "logps/rejected": float(pairs.rejected.detach().sum()),
                      "count/chosen": float(len(items)), "count/rejected": float(len(items)),
                      "drop/chosen": float((pairs.ref_chosen - pairs.chosen.detach()).sum()),
                      "drop/rejected": float((pairs.ref_rejected - pairs.rejected.detach()).sum())}


def _means(sums: dict, n: int) -> dict:
    """Per-record means with TRL's names: the chosen side over the chosen answers, the
    rejected over the rejected (KTO's counts differ), the margin their difference. KTO's
    accuracy is the share of answers whose implicit reward has its label's sign."""
    out = {"loss": sums["loss"] / n, "rewards/accuracies": sums["rewards/accuracies"] / n,
           "drop/chosen": sums["drop/chosen"] / n, "drop/rejected": sums["drop/rejected"] / n}
    for side in ("chosen", "rejected"):  # a KTO step may hold one kind only: TRL then logs nothing for the other
        if sums[f"count/{side}"]:
            out |= {f"{metric}/{side}": sums[f"{metric}/{side}"] / sums[f"count/{side}"] for metric in ("rewards", "logps")}
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def watch_chosen_logps(progress: dict, chosen_drop: float, rejected_drop: float, limit: float, reporter: Reporter) -> None:
    """DPO's known failure: both answers become less likely than at the start, the chosen one
    by more than `limit` nats (the step's mean against its own pairs' log-probs before step 1).
    Said once; KTO records report no drop."""
    if not progress["warned_drop"] and chosen_drop > limit and rejected_drop > 0:
        progress["warned_drop"] = True
        reporter.message(f"warning: the chosen answers' log-prob is {chosen_drop:.2f} nats below where it started (the rejected "
                         "fell too): the model pushes both down; a lower training.lr or beta, or preference.loss = 'ipo', may help")
