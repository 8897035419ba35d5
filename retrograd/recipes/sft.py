"""Supervised fine-tuning: next-token cross-entropy on the supervised tokens, the loop
written out in full.

Order of work per epoch: a permutation that is a pure function of (lora.seed, epoch), greedy
packing of examples into micro-batches of `training.micro_batch` tokens, and
`gradient_accumulation` micro-batches per optimizer step (small ones run merged into fewer
checkpointed passes in the same activation memory: batches.merge_micro_batches). The loss of
a step is the mean negative log-likelihood over all of its supervised tokens. Everything the
next step depends on (LoRA weights, optimizer moments, RNG, data position) is in each
checkpoint, so a resumed run repeats the remaining steps bit for bit. Under torchrun a step's micro-batches are dealt
out to the ranks and their gradients summed (training/distributed.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from retrograd.config import Config
from retrograd.data import evenly_spaced, load_sft
from retrograd.recipes.common import open_chat, prepare, signature
from retrograd.runtime.memory import rss_bytes
from retrograd.training.batches import (
    LogprobOptions,
    batch_logprobs,
    epoch_plan,
    mean_loss,
    merge_micro_batches,
    merged_passes,
    pack,
)
from retrograd.training.checkpoint import check_signature, resume_point, step_name
from retrograd.training.distributed import init_ranks
from retrograd.training.metrics import MetricsSink, NullMetrics, run_record
from retrograd.training.optim import Schedule, build_optimizer, clip_gradients
from retrograd.training.report import Reporter
from retrograd.training.state import keep_best, restore_state, save_state


@dataclass(frozen=True)
class SFTResult:
    output: Path
    steps: int
    epochs_done: int
    train_loss: float
    eval_loss: float | None
    tokens_per_second: float
    losses: tuple[float, ...]  # per optimizer step, this run's part

    def summary(self) -> str:
        eval_part = f" eval_loss={self.eval_loss:.4f}" if self.eval_loss is not None else ""
        return (
            f"done epoch={self.epochs_done} step={self.steps} train_loss={self.train_loss:.4f}{eval_part} "
            f"tok/s={self.tokens_per_second:.0f} out={self.output}"
        )


def run(cfg: Config, reporter: Reporter, *, resume: Path | bool | None = None) -> SFTResult:
    t = cfg.training
    chat = open_chat(cfg)
    data = load_sft(cfg.sft.data, chat, ctx=t.ctx, data_format=cfg.sft.data_format)
    reporter.message(f"data: {data.description}")
    if data.dropped:
        reporter.message(f"dropped {len(data.dropped)} example(s) longer than ctx={t.ctx} (first: {data.dropped[0]})")
    examples = data.examples
    eval_examples = None
    if cfg.evaluation is not None:
        eval_examples = load_sft(cfg.evaluation.data, chat, ctx=t.ctx, data_format=cfg.sft.data_format).examples
        eval_examples = evenly_spaced(eval_examples, cfg.evaluation.max_examples)
    setup = prepare(cfg, reporter, chat)
    ranks = init_ranks(setup.device)
    options = LogprobOptions.from_training(t, setup.model.spec.n_vocab)
    transformer = setup.model.transformer
    params = setup.adapter.parameters()
    optimizer = build_optimizer(params, t.optimizer, t.lr, t.weight_decay)

    lengths = [len(x.ids) for x in examples]
    merging = setup.merging(ranks.spread) if t.gradient_accumulation > 1 else None  # a step of one micro-batch runs it
    if merging is not None:
        reporter.message(merging.describe(t.micro_batch))
    plans = [epoch_plan(lengths, e, seed=cfg.lora.seed, shuffle=cfg.sft.shuffle, micro_batch=t.micro_batch, accumulation=t.gradient_accumulation) for e in range(t.epochs)]
    total_steps = sum(len(p) for p in plans)
    schedule = Schedule(t.lr, t.lr_scheduler, t.warmup_steps, total_steps, t.max_grad_norm)
    data_files = {"sft.data": cfg.sft.data} | ({"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {})
    sig = signature(setup, data_files)
    progress = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "best_eval": None, "stale_evals": 0}

    checkpoint = resume_point(cfg, resume, reporter.message)
    if checkpoint is not None:
        check_signature(checkpoint, sig)
        progress = restore_state(checkpoint, setup, optimizer)
        reporter.message(f"resumed from {checkpoint.path} at step {progress['global_step']}")

    reporter.message(f"sft: examples={len(examples)}, epochs={t.epochs}, steps_per_epoch={len(plans[0])}, steps={total_steps}")
    out_dir = cfg.output.path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = (MetricsSink(run_record(cfg, "metrics.jsonl"), cfg.metrics.tensorboard_dir, append=checkpoint is not None)
               if ranks.is_main else NullMetrics())

    def save(name: str) -> Path | None:
        if not ranks.is_main:  # rank 0 writes for all: every rank holds the same adapter and optimizer
            return None
        path = save_state(setup, optimizer, progress, sig, name)
        reporter.checkpoint(path)
        return path

    reporter.start(total_steps, ["epoch", "step", "train_loss", "eval_loss", "lr", "tok/s"], "steps")
    reporter.advance(progress["global_step"], "")
    row_every = max(1, total_steps // (8 * t.epochs))
    losses: list[float] = []
    tokens_done, time_spent = 0, 0.0
    eval_loss = None
    stop = False
    try:
        for epoch in range(progress["epoch"], t.epochs):
            steps = plans[epoch]
            for k in range(progress["step_in_epoch"], len(steps)):
                step = progress["global_step"]
                lr = schedule.apply(optimizer, step)
                threads = setup.cpu.adjust()
                t0 = time.perf_counter()
                passes, checkpointed = merge_micro_batches(steps[k], lengths, merging)
                micro_batches = [[examples[i] for i in mb] for mb in passes]
                n_trained = sum(e.n_trained for mb in micro_batches for e in mb)
                step_loss, step_tokens = 0.0, 0
                for j in ranks.share(micro_batches):  # every micro-batch on one rank; dealt out under torchrun
                    mb = micro_batches[j]
                    t1 = time.perf_counter()
                    batch = pack(mb, setup.device)
                    with merged_passes(transformer, checkpointed[j]):
                        loss = -batch_logprobs(transformer, batch, options).sum() / n_trained
                    loss.backward()
                    step_loss += float(loss.detach())
                    step_tokens += batch.n_tokens
                    setup.detail(
                        f"step {step + 1} {'pass' if merging else 'micro-batch'} {j + 1}/{len(micro_batches)}: {len(mb)} sequences, {batch.n_tokens} tokens "
                        f"({len(batch.targets)} trained), loss share {float(loss.detach()):.5f}, {time.perf_counter() - t1:.2f} s"
                    )
                t1 = time.perf_counter()
                step_loss, step_tokens = ranks.sum_floats([step_loss, step_tokens])
                ranks.sum_gradients(params)
                all_reduce = {"timing/all_reduce_seconds": time.perf_counter() - t1} if ranks.spread else {}
                if not math.isfinite(step_loss):
                    raise setup.diverged(
                        f"step {step + 1}: the loss is {step_loss} (not finite); stopped without updating the adapter — try a lower training.lr"
                    )
                grad_norm = clip_gradients(params, t.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - t0
                tokens_done += step_tokens
                time_spent += elapsed
                losses.append(step_loss)
                progress.update(global_step=step + 1, epoch=epoch, step_in_epoch=k + 1)
                tps = step_tokens / elapsed
                metrics.log(step + 1, {
                    "train/loss": step_loss, "train/lr": lr, "train/tokens_per_second": tps,
                    "train/grad_norm": grad_norm, "train/epoch": epoch + 1, "system/rss_bytes": rss_bytes(),
                    "timing/step_seconds": elapsed, "system/threads": threads,
                } | all_reduce)
                reporter.advance(step + 1, f"loss={step_loss:.4f} lr={lr:.2e} tok/s={tps:.0f}")
                if (step + 1) % row_every == 0 or step + 1 == total_steps:
                    reporter.row({"epoch": epoch + 1, "step": step + 1, "train_loss": step_loss, "eval_loss": None, "lr": lr, "tok/s": tps})
                if cfg.checkpoint and cfg.checkpoint.every_steps and (step + 1) % cfg.checkpoint.every_steps == 0:
                    save(step_name(step + 1))
            progress.update(epoch=epoch + 1, step_in_epoch=0)
            last_epoch = epoch + 1 == t.epochs
            if eval_examples and ((epoch + 1) % cfg.evaluation.every_iterations == 0 or last_epoch):
                eval_loss = ranks.broadcast(mean_loss(setup, eval_examples, options)[0] if ranks.is_main else None)
                metrics.log(progress["global_step"], {"eval/loss": eval_loss, "eval/perplexity": math.exp(min(eval_loss, 50.0)), "train/epoch": epoch + 1})
                line = f"eval epoch {epoch + 1}: loss {eval_loss:.4f}  perplexity {math.exp(min(eval_loss, 50.0)):.2f}"
                stop = keep_best(cfg, progress, eval_loss, line, reporter.message, save)
                reporter.row({"epoch": epoch + 1, "step": progress["global_step"], "train_loss": losses[-1] if losses else None, "eval_loss": eval_loss, "lr": None, "tok/s": None})
            if stop:
                break
    finally:
        reporter.finish()
        metrics.close()
    out = setup.write_output() if ranks.is_main else cfg.output.path
    return SFTResult(
        output=out,
        steps=progress["global_step"],
        epochs_done=progress["epoch"],
        train_loss=losses[-1] if losses else float("nan"),
        eval_loss=eval_loss,
        tokens_per_second=tokens_done / time_spent if time_spent else 0.0,
        losses=tuple(losses),
    )
