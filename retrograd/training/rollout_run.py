"""What the rollout recipes (grpo, agent_grpo, distill's on_policy mode) share around an
update: resuming into a live sampler, the run's output files, the per-update timing /
memory / throughput metrics, and (grpo, agent_grpo) the per-update record and the result."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from retrograd.memory import PeakMemory, rss_bytes
from retrograd.training.checkpoint import Checkpoint, check_signature
from retrograd.training.metrics import MetricsSink
from retrograd.training.report import Reporter
from retrograd.training.rollout_step import PolicyOptimizer, adapter_is_zero
from retrograd.training.state import restore_state

T = TypeVar("T")


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
    epochs_label: str  # the summary's name for epochs_per_update: grpo_epochs_per_update, agent_epochs_per_update
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


def resume_rollouts(checkpoint: Checkpoint | None, signature: dict, policy: PolicyOptimizer, sampler,
                    reporter: Reporter) -> dict | None:
    """Restore `checkpoint` if there is one (refused when its signature differs) and hand
    llama.cpp the adapter whenever it is not the untouched initial one. Returns the saved
    progress, or None for a fresh run."""
    progress = None
    if checkpoint is not None:
        check_signature(checkpoint, signature)
        progress = restore_state(checkpoint, policy.setup, policy.optimizer)
        policy.global_step = progress["global_step"]
        reporter.message(f"resumed from {checkpoint.path} at update {progress['update']}")
    if not adapter_is_zero(policy.setup.adapter):
        sampler.set_adapter(policy.setup.adapter)  # resumed or warm-started: sample from it
    return progress


@contextmanager
def rollout_outputs(cfg, rollouts_path: Path, *, append: bool) -> Iterator[tuple[MetricsSink, object]]:
    """metrics.jsonl beside the output (plus TensorBoard when asked) and rollouts.jsonl, both
    appended to when the run resumes."""
    out_dir = cfg.output.path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    rollouts_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        MetricsSink(out_dir / "metrics.jsonl", cfg.metrics.tensorboard_dir, append=append) as metrics,
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

    def measure(self, update: Callable[..., T], *args) -> T:
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
        Sampling and training take turns here, so no rollout is ever canceled and no update
        waits for a batch: those two counters are recorded as the zeros they are, beside
        the phases, so a run report can say so rather than leave them out."""
        trained = metrics.get("batch/trained_tokens", 0)
        self.tokens += trained
        self.seconds += self.elapsed
        if self.loss_key in metrics:
            self.losses.append(metrics[self.loss_key])
        metrics |= {f"timing/{k}_seconds": v for k, v in timing.items()} | {
            "timing/waiting_for_batch_seconds": 0.0,
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
