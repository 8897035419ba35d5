"""`retrograd bench`: measure a trained adapter against its base on the same examples,
training nothing and writing nothing.

The base model is loaded once; the adapter is attached with the targets, rank and alpha
its own file declares, and each pass runs the same examples with the LoRA off (base) and
on (adapter). Each algorithm has its own bench, picked by `[run].algorithm` from BENCHES;
a bench returns a frozen result (common.py: what every bench shares) whose `rows()` and `verdict()` the CLI only formats.

SFT: each example's mean log-prob per supervised token, and the loss (mean NLL per
supervised token over all examples, so long examples weigh more than in the per-example
mean). An example counts as unchanged when its mean log-prob moves by at most
UNCHANGED_NATS, and so does the overall verdict.

Distill: the student's distance to the teacher on held-out data, teacher-forced: the KL
from the teacher over its top-k ids plus one bucket for the rest of the vocabulary (a lower
bound of the full KL, tight when the top-k holds the mass), the share of positions where the
student's most likely token is the teacher's, and the student's perplexity. topk_offline
configs read SFT-style conversations; on_policy configs read prompts and measure on one
answer per prompt sampled from the teacher (fixed seeds), so base and adapter see the same
tokens. The teacher is scored first and closed before the student loads.

GRPO and agent_grpo: the reward of sampled answers on held-out prompts or scenarios, see
retrograd.evaluation.bench_rollouts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrograd.config import Config
from retrograd.data import ChatFormat, Example, completion_seed, load_prompts, load_sft
from retrograd.errors import ConfigError, DataError, GGUFError
from retrograd.evaluation.bench_rollouts import ROLLOUT_BENCHES
from retrograd.evaluation.common import (
    BenchOptions,
    BenchResult,
    Distribution,
    ItemRow,
    Row,
    Verdict,
    make_verdict,
    percent_change,
    resolve_adapter,
)
from retrograd.gguf.adapter import AdapterFile, check_fits, read_adapter
from retrograd.model.base import BaseModel
from retrograd.model.lora import Adapter, attach_lora, frozen_linears
from retrograd.recipes.common import Setup, compute_dtype, load_adapter_weights, load_base, open_chat
from retrograd.recipes.distill import require_teacher, student_path, teacher_chat, teacher_options
from retrograd.runtime.device import resolve_device
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.teacher import check_same_tokenizer, gather_at, open_teacher
from retrograd.training.batches import LogprobOptions, mean_loss, pack, plan_micro_batches
from retrograd.training.report import Reporter
from retrograd.training.scoring import Rollout


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
    sources: tuple[str, ...] = ()  # each example's `file:line`
    item_label = "example (mean logprob)"

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

    def items(self) -> list[ItemRow]:
        adapter = self.adapter.logprobs if self.adapter is not None else (None,) * len(self.sources)
        return [ItemRow(*row) for row in zip(self.sources, self.base.logprobs, adapter)]


# ----------------------------------------------------------------------------- running


def run(cfg: Config, reporter: Reporter, options: BenchOptions = BenchOptions()) -> BenchResult:
    """Bench `cfg` as its [run].algorithm says."""
    benches = BENCHES | ROLLOUT_BENCHES
    bench = benches.get(cfg.run.algorithm)
    if bench is None:
        raise ConfigError(f"{cfg.path}: run.algorithm = {cfg.run.algorithm!r}: bench supports {', '.join(benches)} configs")
    if options.limit is not None and options.limit < 1:
        raise ConfigError(f"--limit {options.limit}: expected a positive number of examples")
    if options.samples is not None and options.samples < 1:
        raise ConfigError(f"--samples {options.samples}: expected a positive number of completions per prompt")
    if cfg.run.algorithm not in ROLLOUT_BENCHES:
        for flag, value in (("--samples", options.samples), ("--success-at", options.success_at)):
            if value is not None:
                raise ConfigError(f"{flag}: applies to {', '.join(ROLLOUT_BENCHES)} configs, not {cfg.run.algorithm}")
    return bench(cfg, reporter, options)


def bench_sft(cfg: Config, reporter: Reporter, options: BenchOptions) -> SFTBench:
    data_path = _data_path(cfg, options)
    adapter_path = resolve_adapter(cfg, options)
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
    return SFTBench(data_path, adapter_path, len(data.dropped), base, adapter, tuple(e.source for e in examples))


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


# ----------------------------------------------------------------------------- distill

REST_FLOOR = 1e-12  # probability left outside the top-k, floored so its log stays finite


def topk_plus_rest_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per row over k + 1 outcomes: the teacher's top-k ids and "any
    other token" (mass 1 - sum of the k). Merging outcomes never raises a KL, so this is a
    lower bound of the full-vocabulary KL, equal to it when the top-k holds all the mass.
    teacher_logp, student_logp [N, K] are full-vocabulary log-probs at the same ids."""
    def with_rest(logp: torch.Tensor) -> torch.Tensor:
        rest = (1.0 - logp.exp().sum(-1, keepdim=True)).clamp(min=REST_FLOOR)  # [N, 1]
        return torch.cat([logp, rest.log()], -1)  # [N, K + 1]

    t, s = with_rest(teacher_logp.double()), with_rest(student_logp.double())  # [N, K + 1]
    return (t.exp() * (t - s)).sum(-1)  # [N]


@dataclass(frozen=True)
class DistillPass:
    """One pass over the examples, LoRA off (base) or on (adapter)."""

    kl: tuple[float, ...]  # each example's mean KL to the teacher per scored token
    agreement: tuple[float, ...]  # each example's share of positions whose top-1 is the teacher's
    kl_mean: float  # per scored token, over all examples
    agreement_mean: float
    reading: SFTPass  # the data's own tokens: log-probs, perplexity, throughput


@dataclass(frozen=True)
class DistillBench:
    data: Path
    adapter_path: Path | None
    teacher: Path
    scored_tokens: int
    teacher_perplexity: float
    teacher_topk_mass: float  # mean probability the teacher's top-k holds
    base: DistillPass
    adapter: DistillPass | None
    sources: tuple[str, ...] = ()  # each example's `file:line`
    item_label = "example (KL to teacher)"

    def rows(self) -> list[Row]:
        def row(group: str, metric: str, of: Callable[[DistillPass], float], digits: int, better: int = 0) -> Row:
            return Row(group, metric, of(self.base), None if self.adapter is None else of(self.adapter), digits, better)

        def same(group: str, metric: str, value: float, digits: int) -> Row:
            return Row(group, metric, value, None if self.adapter is None else value, digits)

        per_example = "KL to teacher / example"
        return [
            row("teacher", "KL to teacher (nats/token)", lambda p: p.kl_mean, 4, -1),
            row("teacher", "top-1 agreement", lambda p: p.agreement_mean, 4, 1),
            row("quality", "perplexity", lambda p: p.reading.perplexity, 2, -1),
            same("quality", "teacher perplexity", self.teacher_perplexity, 2),
            *(row(per_example, name, lambda p, n=name: getattr(Distribution.of(p.kl), n), 4, -1) for name in ("p10", "p50", "p90")),
            row("data", "examples", lambda p: len(p.kl), 0),
            same("data", "scored tokens", self.scored_tokens, 0),
            same("data", "teacher top-k mass", self.teacher_topk_mass, 4),
            row("performance", "tokens/s", lambda p: p.reading.tokens_per_second, 1),
        ]

    def verdict(self) -> Verdict | None:
        if self.adapter is None:
            return None
        deltas = np.asarray(self.base.kl) - np.asarray(self.adapter.kl)  # [examples], positive = closer to the teacher
        return make_verdict(deltas, "KL to teacher", percent_change(self.base.kl_mean, self.adapter.kl_mean))

    def items(self) -> list[ItemRow]:
        adapter = self.adapter.kl if self.adapter is not None else (None,) * len(self.sources)
        return [ItemRow(*row) for row in zip(self.sources, self.base.kl, adapter)]


def bench_distill(cfg: Config, reporter: Reporter, options: BenchOptions) -> DistillBench:
    d, t = cfg.distill, cfg.training
    data_path = _distill_data_path(cfg, options)
    adapter_path = resolve_adapter(cfg, options)
    adapter_file = read_adapter(adapter_path) if adapter_path is not None else None
    teacher_path = require_teacher(cfg)
    chat = open_chat(cfg)
    check_same_tokenizer(student_path(cfg), teacher_path, student_tokenizer=chat.tokenizer)
    device = resolve_device(cfg.model.device)
    examples, rollouts = HELD_OUT[d.mode](cfg, chat, teacher_chat(teacher_path, chat), data_path, options.limit, reporter)
    reporter.message(f"bench: {len(examples)} example(s) from {data_path}; teacher {teacher_path.name} through {d.teacher_backend}")
    n_vocab = chat.tokenizer.n_vocab
    teacher = open_teacher(teacher_path, d.teacher_backend, teacher_options(cfg, device, compute_dtype(t.compute_dtype, device), 8, n_vocab))
    try:
        scores = teacher.score(rollouts, topk=d.topk)
    finally:
        teacher.close()
    setup = _load(cfg, reporter, chat, adapter_path, adapter_file)
    logprob_options = LogprobOptions.from_training(t, setup.model.spec.n_vocab)
    _distill_pass(setup, examples[:1], scores[:1], logprob_options)  # warm-up, left out of tokens/s
    with setup.adapter.disabled():
        base = _distill_pass(setup, examples, scores, logprob_options)
    adapter = _distill_pass(setup, examples, scores, logprob_options) if adapter_path is not None else None
    teacher_nll = -torch.cat([s.logprobs for s in scores]).double()
    mass = torch.cat([s.topk_logprobs for s in scores]).double().exp().sum(-1)
    return DistillBench(data_path, adapter_path, teacher_path, teacher_nll.numel(), math.exp(min(teacher_nll.mean().item(), 700.0)),
                        mass.mean().item(), base, adapter, tuple(e.source for e in examples))


def _conversations(cfg: Config, chat: ChatFormat, t_chat: ChatFormat, path: Path, limit: int | None, reporter: Reporter):
    """topk_offline: SFT-style conversations, every assistant token scored."""
    data = load_sft(path, chat, ctx=cfg.training.ctx)
    if data.dropped:
        reporter.message(f"dropped {len(data.dropped)} example(s) longer than ctx={cfg.training.ctx} (first: {data.dropped[0]})")
    examples = data.examples[:limit]
    return examples, [Rollout(i, e.ids[:1], e.ids[1:], e.mask[1:]) for i, e in enumerate(examples)]


def _teacher_answers(cfg: Config, chat: ChatFormat, t_chat: ChatFormat, path: Path, limit: int | None, reporter: Reporter):
    """on_policy: held-out prompts, each answered once by the teacher (fixed seeds); the
    student reads its own rendering of the prompt, the teacher its own."""
    d, t = cfg.distill, cfg.training
    budget = t.ctx - d.sampling.max_new_tokens
    prompts = load_prompts(path, chat, max_tokens=budget)[:limit]
    teacher_prompts = load_prompts(path, t_chat, max_tokens=budget)[:limit]
    sampling = Sampling(d.sampling.max_new_tokens, d.sampling.temperature, d.sampling.top_p)
    options = SamplerOptions(n_ctx=t.ctx, n_seq_max=min(len(prompts), 16), n_threads=t.threads or 0)
    reporter.message(f"sampling one teacher answer per prompt ({len(prompts)} prompts)")
    with Sampler(cfg.distill.teacher_path, options) as sampler:
        requests = [GroupRequest(p.ids, [completion_seed(d.sampling.seed + 2, i, 0)], sampling) for i, p in enumerate(teacher_prompts)]
        answers = [tuple(group[0].tokens) for group in sampler.generate(requests)]
    examples = tuple(Example(p.ids + a, (False,) * len(p.ids) + (True,) * len(a), p.source) for p, a in zip(prompts, answers))
    return examples, [Rollout(i, p.ids, a) for i, (p, a) in enumerate(zip(teacher_prompts, answers))]


HELD_OUT = {"topk_offline": _conversations, "on_policy": _teacher_answers}


def _distill_pass(setup: Setup, examples, scores, options: LogprobOptions) -> DistillPass:
    t0 = time.perf_counter()
    kl, agreement, logprobs = [], [], []
    with torch.no_grad():
        for mb in plan_micro_batches([len(e.ids) for e in examples], setup.cfg.training.micro_batch):
            batch = pack([examples[i] for i in mb], setup.device)
            teacher_ids = torch.cat([scores[i].topk_ids for i in mb]).to(setup.device)  # [N, K]
            ids = torch.cat([batch.targets[:, None], teacher_ids], 1)  # [N, 1 + K]: the data's own token first
            logp, stats = gather_at(setup.model.transformer, batch, ids, options, topk=1)  # [N, 1 + K]
            teacher_logp = torch.cat([scores[i].topk_logprobs for i in mb])  # [N, K]
            per_token_kl = topk_plus_rest_kl(teacher_logp, logp[:, 1:].cpu())  # [N]
            agree = (stats.topk_ids[:, 0] == teacher_ids[:, 0]).double().cpu()  # [N]
            own = logp[:, 0].double().cpu()  # [N]
            owner = batch.sequence_index.cpu()  # [N]
            for j in range(len(mb)):
                mine = owner == j
                kl.append(per_token_kl[mine])
                agreement.append(agree[mine])
                logprobs.append(own[mine])
    seconds = time.perf_counter() - t0
    reading = SFTPass(
        logprobs=tuple(x.mean().item() for x in logprobs), loss=-torch.cat(logprobs).mean().item(),
        supervised_tokens=sum(e.n_trained for e in examples), tokens=sum(len(e.ids) for e in examples), seconds=seconds,
    )
    return DistillPass(
        kl=tuple(x.mean().item() for x in kl), agreement=tuple(x.mean().item() for x in agreement),
        kl_mean=torch.cat(kl).mean().item(), agreement_mean=torch.cat(agreement).mean().item(), reading=reading,
    )


# ----------------------------------------------------------------------------- preference


@dataclass(frozen=True)
class PreferencePass:
    """One pass over held-out records, LoRA off (base) or on (adapter): each record's summed
    log-prob of its answers."""

    chosen: tuple[float, ...]  # per pair; for KTO the desirable answers
    rejected: tuple[float, ...]  # per pair; for KTO the undesirable answers
    seconds: float

    @property
    def margins(self) -> np.ndarray:
        return np.asarray(self.chosen) - np.asarray(self.rejected)


@dataclass(frozen=True)
class PreferenceBench:
    data: Path
    adapter_path: Path | None
    paired: bool
    base: PreferencePass
    adapter: PreferencePass | None
    sources: tuple[str, ...] = ()
    item_label = "pair (log p(chosen) - log p(rejected))"

    def rows(self) -> list[Row]:
        def row(group: str, metric: str, of: Callable[[PreferencePass], float], digits: int, better: int = 0) -> Row:
            return Row(group, metric, of(self.base), None if self.adapter is None else of(self.adapter), digits, better)

        if not self.paired:
            return [row("answers", "mean log-prob, desirable", lambda p: float(np.mean(p.chosen or [0.0])), 3, 1),
                    row("answers", "mean log-prob, undesirable", lambda p: float(np.mean(p.rejected or [0.0])), 3, -1),
                    row("data", "answers", lambda p: len(p.chosen) + len(p.rejected), 0)]
        return [row("pairs", "accuracy (chosen more likely)", lambda p: float((p.margins > 0).mean()), 3, 1),
                row("pairs", "mean margin (nats)", lambda p: float(p.margins.mean()), 3, 1),
                row("answers", "mean log-prob, chosen", lambda p: float(np.mean(p.chosen)), 3, 1),
                row("answers", "mean log-prob, rejected", lambda p: float(np.mean(p.rejected)), 3),
                row("data", "pairs", lambda p: len(p.chosen), 0)]

    def verdict(self) -> Verdict | None:
        if self.adapter is None:
            return None
        if self.paired:
            deltas = self.adapter.margins - self.base.margins
        else:  # a desirable answer should gain, an undesirable one lose
            deltas = np.concatenate([np.asarray(self.adapter.chosen) - self.base.chosen,
                                     np.asarray(self.base.rejected) - self.adapter.rejected])
        return make_verdict(deltas, "log-prob margin" if self.paired else "signed log-prob change", None,
                            unit="nats", items="pairs" if self.paired else "answers")

    def items(self) -> list[ItemRow]:
        if not self.paired:
            return []
        adapter = self.adapter.margins if self.adapter is not None else (None,) * len(self.sources)
        return [ItemRow(*row) for row in zip(self.sources, self.base.margins, adapter)]


def bench_preference(cfg: Config, reporter: Reporter, options: BenchOptions) -> PreferenceBench:
    from retrograd.data.preference import load_preference
    from retrograd.recipes.preference import Scorer, group

    data_path = _data_path(cfg, options)
    adapter_path = resolve_adapter(cfg, options)
    adapter_file = read_adapter(adapter_path) if adapter_path is not None else None
    chat = open_chat(cfg)
    paired = cfg.preference.loss != "kto"
    records = load_preference(data_path, chat, ctx=cfg.training.ctx, unpaired=not paired,
                              data_format=cfg.preference.data_format).items[: options.limit]
    setup = _load(cfg, reporter, chat, adapter_path, adapter_file)
    reporter.message(f"bench: {len(records)} record(s) from {data_path}")
    scorer = Scorer(setup, LogprobOptions.from_training(cfg.training, setup.model.spec.n_vocab))
    groups = [group(r) for r in records]

    def one_pass() -> PreferencePass:
        t0 = time.perf_counter()
        sums = scorer.without_grad(groups)
        if paired:
            return PreferencePass(tuple(sums[0::2]), tuple(sums[1::2]), time.perf_counter() - t0)
        desirable = [r.desirable for r in records]
        return PreferencePass(tuple(x for x, d in zip(sums, desirable) if d), tuple(x for x, d in zip(sums, desirable) if not d),
                              time.perf_counter() - t0)

    with setup.adapter.disabled():
        base = one_pass()
    adapter = one_pass() if adapter_path is not None else None
    return PreferenceBench(data_path, adapter_path, paired, base, adapter, tuple(r.source for r in records))


# algorithm -> its bench; a new algorithm is a new function here
BENCHES: dict[str, Callable[[Config, Reporter, BenchOptions], BenchResult]] = {
    "sft": bench_sft, "distill": bench_distill, "preference": bench_preference}


# ----------------------------------------------------------------------------- inputs


def _data_path(cfg: Config, options: BenchOptions) -> Path:
    if options.data is not None:
        path, origin = Path(options.data).resolve(), "--data"
    elif cfg.evaluation is not None:
        path, origin = cfg.evaluation.data, "evaluation.data"
    elif cfg.preference is not None:
        path, origin = cfg.preference.data, "preference.data"
    else:
        path, origin = cfg.sft.data, "sft.data"
    if not path.is_file():
        raise DataError(f"{origin} {path}: no such file")
    return path


def _distill_data_path(cfg: Config, options: BenchOptions) -> Path:
    """--data, else [evaluation].data, else the training data (distill.data or distill.prompts)."""
    d = cfg.distill
    if options.data is not None:
        path, origin = Path(options.data).resolve(), "--data"
    elif cfg.evaluation is not None:
        path, origin = cfg.evaluation.data, "evaluation.data"
    elif d.mode == "topk_offline":
        path, origin = d.data, "distill.data"
    else:
        path, origin = d.prompts, "distill.prompts"
    if not path.is_file():
        raise DataError(f"{origin} {path}: no such file")
    return path


def _load(
    cfg: Config, reporter: Reporter, chat: ChatFormat, adapter_path: Path | None, adapter_file: AdapterFile | None
) -> Setup:
    """The base model once, with the adapter's LoRA attached (an empty one for the base alone)."""
    base = load_base(cfg, reporter, chat)
    model, device, precision = base.model, base.device, base.precision
    if adapter_file is None:
        reporter.message(f"no adapter at {cfg.output.adapter_path}: measuring the base model alone")
        adapter = Adapter({}, 0, 0.0)
    else:
        adapter = attach_adapter_file(model, adapter_file, adapter_path)
        reporter.message(
            f"adapter {adapter_path}: {len(adapter.layers)} weights, rank {adapter.rank}, alpha {adapter.alpha:g}"
        )
    return Setup(cfg, device, model, adapter, chat, precision)


def attach_adapter_file(model: BaseModel, loaded: AdapterFile, path: Path) -> Adapter:
    """A LoRA shaped as the file says (targets, rank, alpha), holding its weights."""
    base_shapes = {name: tuple(lin.weight.shape) for name, (_, _, lin) in frozen_linears(model.transformer).items()}  # expert stacks 3-D
    check_fits(loaded, path, model.path.name, model.spec.arch, base_shapes)
    if loaded.alpha <= 0:  # torch's LoRA scales by alpha / rank (llama.cpp reads 0 as 1)
        raise GGUFError(f"adapter {path}: adapter.lora.alpha = {loaded.alpha:g}; expected a positive alpha")
    adapter = attach_lora(model.transformer, list(loaded.tensors), loaded.rank, loaded.alpha, seed=0)
    load_adapter_weights(adapter, path)
    return adapter
