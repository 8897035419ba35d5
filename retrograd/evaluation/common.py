"""What every bench shares (bench.py, bench_rollouts.py): the options the command line
may change, the rows and verdict a result gives the CLI, and the adapter it measures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from retrograd.config import Config
from retrograd.errors import DataError

UNCHANGED_NATS = 1e-3  # |Δ mean log-prob per token| at or below this counts as unchanged


@dataclass(frozen=True)
class BenchOptions:
    """What the command line may change; None keeps the config's choice."""

    data: Path | None = None  # None: [evaluation].data, else [sft].data
    adapter: Path | None = None  # None: [output].path, or the base alone when that file is absent
    limit: int | None = None  # the first N examples only
    samples: int | None = None  # completions per prompt (grpo, agent_grpo); None: DEFAULT_SAMPLES
    success_at: float | None = None  # grpo: a completion succeeds when its reward reaches this; None: SUCCESS_AT


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Distribution:
    mean: float
    low: float
    p10: float
    p50: float
    p90: float
    high: float
    stddev: float  # population standard deviation

    @classmethod
    def of(cls, values) -> Distribution:
        v = np.asarray(values, dtype=np.float64)
        p10, p50, p90 = np.percentile(v, [10, 50, 90])
        return cls(float(v.mean()), float(v.min()), float(p10), float(p50), float(p90), float(v.max()), float(v.std()))


def percent_change(before: float, after: float) -> float | None:
    return None if before == 0 else 100.0 * (after - before) / abs(before)


@dataclass(frozen=True)
class Row:
    """One table line; `better` is +1 when higher is better, -1 when lower is, 0 for neither."""

    group: str
    metric: str
    base: float
    adapter: float | None
    digits: int
    better: int = 0

    @property
    def delta(self) -> float | None:
        return None if self.adapter is None else self.adapter - self.base

    @property
    def delta_percent(self) -> float | None:
        return None if self.adapter is None else percent_change(self.base, self.adapter)


@dataclass(frozen=True)
class ItemRow:
    """One line of the per-item table (--verbose): an example or prompt, base and adapter."""

    name: str
    base: float
    adapter: float | None

    @property
    def delta(self) -> float | None:
        return None if self.adapter is None else self.adapter - self.base


@dataclass(frozen=True)
class Verdict:
    label: str  # improved, degraded or unchanged (mean change within ±tolerance)
    metric: str  # what the verdict reads, e.g. "mean logprob"
    mean_delta: float
    loss_percent: float | None  # relative change of the overall figure named by percent_of
    improved: int
    degraded: int
    unchanged: int
    changes: Distribution  # of the per-example deltas: best = high, worst = low
    tolerance: float
    unit: str = "nats/token"  # of the deltas ("" for a reward)
    percent_of: str = "loss"
    items: str = "examples"  # what was compared one by one

    @property
    def total(self) -> int:
        return self.improved + self.degraded + self.unchanged


def make_verdict(
    deltas: np.ndarray, metric: str, loss_percent: float | None, tolerance: float = UNCHANGED_NATS, **naming: str
) -> Verdict:
    """Per-example deltas (positive = better) -> counts and the overall call; `naming` sets
    Verdict's unit, percent_of and items."""
    mean = float(deltas.mean())
    label = "improved" if mean > tolerance else "degraded" if mean < -tolerance else "unchanged"
    return Verdict(
        label=label,
        metric=metric,
        mean_delta=mean,
        loss_percent=loss_percent,
        improved=int((deltas > tolerance).sum()),
        degraded=int((deltas < -tolerance).sum()),
        unchanged=int((np.abs(deltas) <= tolerance).sum()),
        changes=Distribution.of(deltas),
        tolerance=tolerance,
        **naming,
    )


class BenchResult(Protocol):
    """What every algorithm's bench returns: table rows, a verdict when an adapter ran, and
    the per-item table (item_label names its first column)."""

    item_label: str

    def rows(self) -> list[Row]: ...

    def verdict(self) -> Verdict | None: ...

    def items(self) -> list[ItemRow]: ...


def resolve_adapter(cfg: Config, options: BenchOptions) -> Path | None:
    """The explicit --adapter must exist; the default [output].path may not (base only)."""
    if options.adapter is None:
        return cfg.output.adapter_path if cfg.output.adapter_path.is_file() else None
    path = Path(options.adapter).resolve()
    if not path.is_file():
        raise DataError(f"--adapter {path}: no such file")
    return path
