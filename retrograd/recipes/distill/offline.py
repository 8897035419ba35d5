"""Offline top-k distillation: `retrograd distill-teacher` writes the teacher's top-k into a
sidecar (`write_teacher_topk`), and an SFT-style loop trains on it without loading the
teacher (see the package docstring)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrograd.config import Config
from retrograd.data import evenly_spaced, load_sft
from retrograd.errors import ConfigError
from retrograd.objectives.distill import topk_cross_entropy
from retrograd.recipes.common import (
    Setup,
    compute_dtype,
    open_chat,
    prepare,
)
from retrograd.recipes.distill.common import (
    DistillResult,
    apply_step,
    distill_signature,
    require_teacher,
    student_path,
    teacher_options,
)
from retrograd.runtime.device import resolve_device
from retrograd.runtime.memory import PeakMemory, rss_bytes
from retrograd.teacher import (
    Sidecar,
    SidecarHeader,
    check_same_tokenizer,
    check_sidecar,
    corpus_fingerprint,
    gather_at,
    open_teacher,
    read_sidecar,
    read_vocabulary,
    row_offsets,
    tokenizer_fingerprint,
    write_sidecar,
)
from retrograd.training.batches import LogprobOptions, epoch_plan, mean_loss, merge_micro_batches, merged_passes, pack
from retrograd.training.checkpoint import check_signature, file_fingerprint, resume_point
from retrograd.training.metrics import MetricsSink, run_record
from retrograd.training.optim import Schedule, build_optimizer
from retrograd.training.report import Reporter
from retrograd.training.scoring import Rollout
from retrograd.training.state import RecipeLoop, keep_best, restore_state

SIDECAR_CHUNK = 64  # corpus examples scored per teacher call while writing a sidecar


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
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("distill mode 'topk_offline' does not run under torchrun yet: run it as one process")
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
        eval_examples = evenly_spaced(load_sft(cfg.evaluation.data, chat, ctx=t.ctx).examples, cfg.evaluation.max_examples)
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
                [len(x.ids) for x in examples],
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
        self.merging = setup.merging() if t.gradient_accumulation > 1 else None  # one process (refused under torchrun)
        if self.merging is not None:
            reporter.message(self.merging.describe(t.micro_batch))

    def run(self, resume) -> DistillResult:
        cfg, d = self.cfg, self.cfg.distill
        data_files = {"distill.data": d.data, "distill.sidecar": d.sidecar} | (
            {"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {}
        )
        self.signature = distill_signature(self.setup, data_files)
        checkpoint = resume_point(cfg, resume, self.reporter.message)
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
        with MetricsSink(
            run_record(cfg, "metrics.jsonl"), cfg.metrics.tensorboard_dir, append=checkpoint is not None
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
                        self.save_if_crossed(1)
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
        out = self.setup.write_output()
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
        lr = self.schedule.apply(self.optimizer, step)
        n_trained = sum(self.examples[i].n_trained for mb in micro_batches for i in mb)
        m = {"train/loss": 0.0, "distill/teacher_topk_mass": 0.0, "distill/student_topk_mass": 0.0, "batch/tokens": 0}
        passes, checkpointed = merge_micro_batches(micro_batches, {i: len(self.examples[i].ids) for mb in micro_batches for i in mb}, self.merging)
        for mb, merged in zip(passes, checkpointed):
            batch = pack([self.examples[i] for i in mb], setup.device)
            rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in mb])  # in packing order
            teacher_ids = torch.from_numpy(self.sidecar.ids[rows].astype(np.int64)).to(setup.device)  # [N, K]
            teacher_logp = torch.from_numpy(np.asarray(self.sidecar.logprobs[rows])).to(setup.device)  # [N, K]
            with merged_passes(setup.model.transformer, merged):
                student_logp, _ = gather_at(setup.model.transformer, batch, teacher_ids, self.options)  # [N, K]
            every = torch.ones(len(rows), dtype=torch.bool, device=setup.device)  # [N]
            loss, diag = topk_cross_entropy(student_logp, teacher_logp, every, n_trained)
            loss.backward()
            m["train/loss"] += diag["distill/topk_ce"]
            for key in ("distill/teacher_topk_mass", "distill/student_topk_mass"):
                m[key] += diag[key] * len(rows) / n_trained
            m["batch/tokens"] += batch.n_tokens
        grad_norm = apply_step(setup, self.optimizer, self.params, m["train/loss"], step, self.schedule.max_grad_norm)
        return m | {
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "distill/topk_entries": n_trained * self.sidecar.header.k,
        }

    def _evaluate(self, epoch: int, metrics: MetricsSink) -> bool:
        """The student's loss on the held-out data's own tokens; best checkpoint and patience.
        Returns True to stop early."""
        loss, _ = mean_loss(self.setup, self.eval_examples, self.options)
        metrics.log(
            self.progress["global_step"],
            {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)), "train/epoch": epoch + 1},
        )
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
        return keep_best(self.cfg, self.progress, loss, f"eval epoch {epoch + 1}: loss {loss:.4f}", self.reporter.message, self.save)
