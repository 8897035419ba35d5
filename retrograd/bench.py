"""`retrograd bench`: measure a trained adapter against its base on the same examples,
training nothing and writing nothing.

The base model is loaded once; the adapter is attached with the targets, rank and alpha
its own file declares, and each pass runs the same examples with the LoRA off (base) and
on (adapter). Each algorithm has its own bench, picked by `[run].algorithm` from BENCHES;
a bench returns a frozen result whose `rows()` and `verdict()` the CLI only formats.

SFT: each example's mean log-prob per supervised token, and the loss (mean NLL per
supervised token over all examples, so long examples weigh more than in the per-example
mean). An example counts as unchanged when its mean log-prob moves by at most
UNCHANGED_NATS, and so does the overall verdict.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from retrograd.config import Config
from retrograd.data import ChatFormat, Example, load_sft
from retrograd.errors import ConfigError, DataError, GGUFError
from retrograd.gguf.adapter import AdapterFile, check_shapes, read_adapter
from retrograd.lora import Adapter, attach_lora, frozen_linears
from retrograd.model.base import BaseModel
from retrograd.recipes.common import Setup, load_adapter_weights, load_base, open_chat
from retrograd.recipes.sft import mean_loss
from retrograd.training.batches import LogprobOptions
from retrograd.training.report import Reporter

UNCHANGED_NATS = 1e-3  # |Δ mean log-prob per token| at or below this counts as unchanged


@dataclass(frozen=True)
class BenchOptions:
    """What the command line may change; None keeps the config's choice."""

    data: Path | None = None  # None: [evaluation].data, else [sft].data
    adapter: Path | None = None  # None: [output].path, or the base alone when that file is absent
    limit: int | None = None  # the first N examples only


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
class Verdict:
    label: str  # improved, degraded or unchanged (mean change within ±tolerance)
    metric: str  # what the verdict reads, e.g. "mean logprob"
    mean_delta: float
    loss_percent: float | None  # relative change of the loss
    improved: int
    degraded: int
    unchanged: int
    changes: Distribution  # of the per-example deltas: best = high, worst = low
    tolerance: float

    @property
    def total(self) -> int:
        return self.improved + self.degraded + self.unchanged


def make_verdict(
    deltas: np.ndarray, metric: str, loss_percent: float | None, tolerance: float = UNCHANGED_NATS
) -> Verdict:
    """Per-example deltas (positive = better) -> counts and the overall call."""
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
    )


class BenchResult(Protocol):
    """What every algorithm's bench returns: table rows, and a verdict when an adapter ran."""

    def rows(self) -> list[Row]: ...

    def verdict(self) -> Verdict | None: ...


@dataclass(frozen=True)
class SFTPass:
    """One pass over the examples, LoRA off (base) or on (adapter)."""

    logprobs: tuple[float, ...]  # each example's mean log-prob per supervised token
    loss: float  # mean NLL per supervised token, over all examples
    supervised_tokens: int
    tokens: int  # every token the model read (context and supervised)
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SFTBench:
    data: Path
    adapter_path: Path | None  # None: the base alone was measured
    dropped: int  # records longer than training.ctx, left out
    base: SFTPass
    adapter: SFTPass | None

    @property
    def examples(self) -> int:
        return len(self.base.logprobs)

    def rows(self) -> list[Row]:
        def row(group: str, metric: str, of: Callable[[SFTPass], float], digits: int, better: int = 0) -> Row:
            return Row(group, metric, of(self.base), None if self.adapter is None else of(self.adapter), digits, better)

        def stat(name: str) -> Callable[[SFTPass], float]:
            return lambda p: getattr(Distribution.of(p.logprobs), name)

        per_example = "mean logprob / example"
        return [
            row("quality", "loss", lambda p: p.loss, 4, -1),
            row("quality", "perplexity", lambda p: p.perplexity, 2, -1),
            *(row(per_example, name, stat(name), 4, 1) for name in ("mean", "low", "p10", "p50", "p90", "high")),
            row(per_example, "stddev", stat("stddev"), 4),
            row("data", "examples", lambda p: len(p.logprobs), 0),
            row("data", "supervised tokens", lambda p: p.supervised_tokens, 0),
            row("performance", "tokens/s", lambda p: p.tokens_per_second, 1),
        ]

    def verdict(self) -> Verdict | None:
        if self.adapter is None:
            return None
        deltas = np.asarray(self.adapter.logprobs) - np.asarray(self.base.logprobs)  # [examples]
        return make_verdict(deltas, "mean logprob", percent_change(self.base.loss, self.adapter.loss))


# ----------------------------------------------------------------------------- running


def run(cfg: Config, reporter: Reporter, options: BenchOptions = BenchOptions()) -> BenchResult:
    """Bench `cfg` as its [run].algorithm says."""
    bench = BENCHES.get(cfg.run.algorithm)
    if bench is None:
        raise ConfigError(
            f"{cfg.path}: run.algorithm = {cfg.run.algorithm!r}: bench supports sft configs for now; "
            "grpo, agent_grpo and distill benches come later"
        )
    if options.limit is not None and options.limit < 1:
        raise ConfigError(f"--limit {options.limit}: expected a positive number of examples")
    return bench(cfg, reporter, options)


def bench_sft(cfg: Config, reporter: Reporter, options: BenchOptions) -> SFTBench:
    data_path = _data_path(cfg, options)
    adapter_path = _adapter_path(cfg, options)
    adapter_file = read_adapter(adapter_path) if adapter_path is not None else None
    t = cfg.training
    chat = open_chat(cfg)
    # read the data and the adapter before the model loads, so that bad input stops at once
    data = load_sft(data_path, chat, ctx=t.ctx, data_format=cfg.sft.data_format)
    setup = _load(cfg, reporter, chat, adapter_path, adapter_file)
    if data.dropped:
        reporter.message(f"dropped {len(data.dropped)} example(s) longer than ctx={t.ctx} (first: {data.dropped[0]})")
    examples = data.examples[: options.limit]
    reporter.message(f"bench: {len(examples)} example(s) from {data_path}")
    logprob_options = LogprobOptions.from_training(t, setup.model.spec.n_vocab)
    mean_loss(setup, examples[:1], logprob_options)  # warm-up (kernel compilation, caches), left out of tokens/s
    with setup.adapter.disabled():
        base = _sft_pass(setup, examples, logprob_options)
    adapter = _sft_pass(setup, examples, logprob_options) if adapter_path is not None else None
    return SFTBench(data_path, adapter_path, len(data.dropped), base, adapter)


def _sft_pass(setup: Setup, examples: tuple[Example, ...], options: LogprobOptions) -> SFTPass:
    t0 = time.perf_counter()
    loss, per_example = mean_loss(setup, examples, options)
    seconds = time.perf_counter() - t0
    return SFTPass(
        logprobs=tuple(-x for x in per_example),
        loss=loss,
        supervised_tokens=sum(e.n_trained for e in examples),
        tokens=sum(len(e.ids) for e in examples),
        seconds=seconds,
    )


# algorithm -> its bench; a new algorithm is a new function here
BENCHES: dict[str, Callable[[Config, Reporter, BenchOptions], BenchResult]] = {"sft": bench_sft}


# ----------------------------------------------------------------------------- inputs


def _data_path(cfg: Config, options: BenchOptions) -> Path:
    if options.data is not None:
        path, origin = Path(options.data).resolve(), "--data"
    elif cfg.evaluation is not None:
        path, origin = cfg.evaluation.data, "evaluation.data"
    else:
        path, origin = cfg.sft.data, "sft.data"
    if not path.is_file():
        raise DataError(f"{origin} {path}: no such file")
    return path


def _adapter_path(cfg: Config, options: BenchOptions) -> Path | None:
    """The explicit --adapter must exist; the default [output].path may not (base only)."""
    if options.adapter is None:
        return cfg.output.path if cfg.output.path.is_file() else None
    path = Path(options.adapter).resolve()
    if not path.is_file():
        raise DataError(f"--adapter {path}: no such file")
    return path


def _load(
    cfg: Config, reporter: Reporter, chat: ChatFormat, adapter_path: Path | None, adapter_file: AdapterFile | None
) -> Setup:
    """The base model once, with the adapter's LoRA attached (an empty one for the base alone)."""
    base = load_base(cfg, reporter, chat)
    model, device, precision = base.model, base.device, base.precision
    if adapter_file is None:
        reporter.message(f"no adapter at {cfg.output.path}: measuring the base model alone")
        adapter = Adapter({}, 0, 0.0)
    else:
        adapter = _attach_adapter(model, adapter_file, adapter_path)
        reporter.message(
            f"adapter {adapter_path}: {len(adapter.layers)} weights, rank {adapter.rank}, alpha {adapter.alpha:g}"
        )
    return Setup(cfg, device, model, adapter, chat, precision)


def _attach_adapter(model: BaseModel, loaded: AdapterFile, path: Path) -> Adapter:
    """A LoRA shaped as the file says (targets, rank, alpha), holding its weights."""
    if loaded.arch != model.spec.arch:
        raise GGUFError(
            f"adapter {path}: made for architecture {loaded.arch!r}, but the base model {model.path.name} is {model.spec.arch!r}"
        )
    if not loaded.tensors:
        raise GGUFError(f"adapter {path}: holds no LoRA tensors")
    if loaded.alpha <= 0:
        raise GGUFError(f"adapter {path}: adapter.lora.alpha = {loaded.alpha:g}; expected a positive alpha")
    base_shapes = {
        name: (lin.out_features, lin.in_features) for name, (_, _, lin) in frozen_linears(model.transformer).items()
    }
    try:
        check_shapes(loaded.tensors, base_shapes)
    except GGUFError as e:
        raise GGUFError(f"adapter {path} does not fit the base model {model.path.name}: {e}") from None
    adapter = attach_lora(model.transformer, list(loaded.tensors), loaded.rank, loaded.alpha, seed=0)
    load_adapter_weights(adapter, path)
    return adapter
