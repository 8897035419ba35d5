"""The rollout generator: llama.cpp samples completions of the base model plus the live LoRA.

Two ways in, one scheduler underneath:
- `generate(groups)` for GRPO and distillation: each group is one prompt and one seed per
  completion. Its prompt is prefilled once; the other members copy that sequence's cache
  and draw their first token from the same logits row. Up to `n_seq_max` sequences decode
  together, one token each per llama_decode, and a finished sequence hands its slot to the
  next waiting member or group (continuous batching).
- `open(seeds)` + `generate_turn(...)` for multi-turn agents: a Conversation keeps its
  sequence and KV between turns; each turn gives the whole token list so far, and only
  what the cache does not already hold is prefilled.

A job's context is matched against every sequence's cached tokens and the longest common
prefix is reused (KV of a prefix depends only on that prefix), the rest is prefilled. The
last sampled token of a turn is never in the cache: it is fed with the next turn.

Reproducibility: each completion or conversation draws from its own numpy Generator, one
draw per token, and llama.cpp's logits for a sequence do not depend on its batch neighbours
(split KV; see engine.py for the one measured exception), so the same seed and context give
the same tokens whatever the concurrency, the batch composition or the order of the
requests, bit for bit (tests/test_sampler.py, SmolLM2 in both KV modes).

Log-probabilities are those of sampling.py: full vocabulary, temperature 1.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrograd.bundled import default_model_path
from retrograd.errors import ConfigError, DataError
from retrograd.sampler.engine import KV_MODES, MAX_SEQUENCES, Engine, Feed
from retrograd.sampler.live_adapter import LiveAdapter, RefreshTiming
from retrograd.sampler.sampling import Sampling, sample_token


@dataclass(frozen=True)
class SamplerOptions:
    n_ctx: int = 512  # positions per sequence: context + new tokens ([training] ctx)
    n_seq_max: int = 8  # sequences decoding together ([training] generation_concurrency)
    n_batch: int = 512  # tokens per llama_decode ([training] generation_batch)
    kv_dtype: str = "f16"  # "f16" (fast) or "f32" (f32 attention; fast_sampling_context = false)
    n_threads: int = 0  # 0: every CPU this process may run on

    def __post_init__(self):
        if not 1 <= self.n_seq_max <= MAX_SEQUENCES:
            raise ConfigError(f"sampler: generation_concurrency {self.n_seq_max} must be in [1, {MAX_SEQUENCES}]")
        if self.n_ctx < 2:
            raise ConfigError(f"sampler: ctx {self.n_ctx} must be >= 2")
        if self.n_batch < self.n_seq_max:
            raise ConfigError(
                f"sampler: generation_batch {self.n_batch} must be >= generation_concurrency {self.n_seq_max}"
            )
        if self.kv_dtype not in KV_MODES:
            raise ConfigError(f"sampler: kv_dtype {self.kv_dtype!r} must be one of {', '.join(KV_MODES)}")
        if self.n_threads < 0:
            raise ConfigError(f"sampler: threads {self.n_threads} must be >= 0 (0 = all)")


@dataclass(frozen=True)
class GroupRequest:
    """One prompt, one completion per seed (GRPO: seeds derived from the run seed)."""

    prompt: Sequence[int]
    seeds: Sequence[int]
    sampling: Sampling


@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # sampled, the end-of-generation token included when finish == "eos"
    logprobs: list[float]  # per token: log-softmax over the full vocabulary at temperature 1
    finish: str  # "eos" | "length"
    prefilled: int  # context tokens decoded for this completion (0 when it shared another's)
    reused: int  # context tokens taken from the cache


@dataclass
class SamplerStats:
    """Running totals since the sampler opened."""

    prefilled: int = 0
    reused: int = 0
    sampled: int = 0
    decode_calls: int = 0
    decode_s: float = 0.0


@dataclass(eq=False)
class _Slot:
    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens in this sequence's KV, positions 0..n-1
    busy: bool = False  # a job is running in it
    owner: Conversation | None = None


@dataclass(eq=False)
class _Job:
    context: tuple[int, ...]
    sampling: Sampling
    rng: np.random.Generator
    slot: _Slot | None = None  # fixed for a conversation, else picked at admission
    feed: list[int] = field(default_factory=list)  # tokens to decode next, from position len(slot.cached)
    row: np.ndarray | None = None  # logits to draw the next token from
    waiting: bool = False  # for another job's prefill of the same context
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    prefilled: int = 0
    reused: int = 0

    def result(self) -> Completion:
        return Completion(self.tokens, self.logprobs, self.finish, self.prefilled, self.reused)


class Conversation:
    """A sequence that keeps its KV between turns; its RNG continues from turn to turn."""

    def __init__(self, sampler: Sampler, slot: _Slot, seed: int):
        self._sampler, self._slot = sampler, slot
        self.rng = np.random.default_rng(seed)

    @property
    def cached(self) -> tuple[int, ...]:
        """The tokens whose KV is resident (empty after an adapter change)."""
        return tuple(self._slot.cached)

    @property
    def open(self) -> bool:
        return self._slot.owner is self

    def close(self) -> None:
        """Give the sequence back (its KV stays until the slot is reused)."""
        if self.open:
            self._slot.owner = None


class Sampler:
    def __init__(self, model_path: str | Path | None = None, options: SamplerOptions = SamplerOptions()):
        self.options = options
        threads = options.n_threads or len(os.sched_getaffinity(0))
        path = Path(model_path) if model_path is not None else default_model_path()
        self.engine = Engine(
            path,
            n_ctx=options.n_ctx,
            n_seq_max=options.n_seq_max,
            n_batch=options.n_batch,
            kv_dtype=options.kv_dtype,
            n_threads=threads,
        )
        try:
            self.adapter = LiveAdapter(self.engine)
        except BaseException:
            self.engine.close()
            raise
        self.slots = [_Slot(i) for i in range(options.n_seq_max)]
        self.stats = SamplerStats()
        self._unsettled: set[int] = set()

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.engine.eog_ids

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.adapter.close()
        self.engine.close()

    # ---- the live adapter

    def set_adapter(self, adapter, *, alpha: float | None = None) -> RefreshTiming:
        """Sample with `adapter` from now on: a retrograd.lora.Adapter, {weight name:
        LoRAWeights} with alpha, or None for the base model. Every cached KV is dropped
        (it was computed with the old weights); conversations re-prefill on their next turn."""
        timing = self.adapter.refresh(adapter, alpha)
        self.engine.clear()
        for slot in self.slots:
            slot.cached = []
        return timing

    # ---- GRPO groups

    def generate(self, requests: Sequence[GroupRequest]) -> list[list[Completion]]:
        """Per request, its completions in seed order."""
        groups = []
        for i, r in enumerate(requests):
            context = self._checked_context(r.prompt, r.sampling, f"request {i}")
            if not r.seeds:
                raise DataError(f"sampler: request {i} has no seeds (one per completion expected)")
            rngs = [np.random.default_rng(_checked_seed(seed, f"request {i}")) for seed in r.seeds]
            groups.append([_Job(context, r.sampling, rng) for rng in rngs])
        if not any(not s.owner for s in self.slots):
            raise DataError(f"sampler: all {len(self.slots)} sequences are held by open conversations")
        self._run([job for group in groups for job in group])
        return [[job.result() for job in group] for group in groups]

    # ---- multi-turn conversations

    def open(self, seeds: Sequence[int]) -> list[Conversation]:
        """Reserve one sequence per seed until Conversation.close()."""
        free = [s for s in self.slots if s.owner is None]
        if len(seeds) > len(free):
            raise DataError(
                f"sampler: {len(seeds)} conversations asked, only {len(free)} of {len(self.slots)} sequences are free"
            )
        conversations = []
        for slot, seed in zip(free, seeds):
            slot.owner = Conversation(self, slot, _checked_seed(seed, "open"))
            conversations.append(slot.owner)
        return conversations

    def generate_turn(
        self, turns: Sequence[tuple[Conversation, Sequence[int]]], sampling: Sampling
    ) -> list[Completion]:
        """Each conversation's whole token list so far -> its next turn. Only the tokens its
        cache does not hold are prefilled (Completion.prefilled / .reused say how many)."""
        jobs = []
        for i, (conversation, tokens) in enumerate(turns):
            if conversation._sampler is not self or not conversation.open:
                raise DataError(f"sampler: turn {i} is for a conversation that is closed or not this sampler's")
            jobs.append(
                _Job(
                    self._checked_context(tokens, sampling, f"turn {i}"), sampling, conversation.rng, conversation._slot
                )
            )
        if len({id(job.slot) for job in jobs}) != len(jobs):
            raise DataError("sampler: the same conversation appears twice in one generate_turn call")
        self._run(jobs)
        return [job.result() for job in jobs]

    # ---- the scheduler

    def _run(self, jobs: list[_Job]) -> None:
        pending = deque(jobs)
        live: list[_Job] = []
        rows: dict[tuple[int, ...], np.ndarray] = {}  # context -> logits after it (valid during this run)
        while pending or live:
            while pending and self._admit(pending[0], live, rows):
                live.append(pending.popleft())
            self._decode(live, rows)
            self._attach_waiting(live, rows)
            for job in [j for j in live if j.row is not None]:
                self._draw(job)
                if job.finish:
                    live.remove(job)
                    job.slot.busy = False

    def _admit(self, job: _Job, live: list[_Job], rows) -> bool:
        """Give the job a slot and decide what it prefills; False when no slot is free."""
        slot = job.slot or self._free_slot(job.context)
        if slot is None:
            return False
        job.slot, slot.busy = slot, True
        n = len(job.context)
        donor, reuse = self._best_source(slot, job.context, n)
        if reuse == n and job.context in rows:
            job.row = rows[job.context]  # a group member admitted after its prompt was prefilled
        elif any(j.context == job.context and j.feed and not j.tokens for j in live):
            job.waiting = True  # another job is prefilling this very context: share it
            return True
        else:  # the last context token is decoded (again) for its logits
            donor, reuse = self._best_source(slot, job.context, n - 1)
        if donor is not slot:
            self._copy(donor, slot)
        self._keep(slot, reuse)
        job.feed = list(job.context[reuse:])
        job.prefilled, job.reused = len(job.feed), reuse
        self.stats.prefilled += job.prefilled
        self.stats.reused += reuse
        return True

    def _best_source(self, slot: _Slot, context: tuple[int, ...], limit: int) -> tuple[_Slot, int]:
        """The sequence holding the longest prefix of context, up to limit tokens (slot itself on a tie)."""
        best, best_n = slot, min(_common_prefix(slot.cached, context), limit)
        for other in self.slots:
            n = min(_common_prefix(other.cached, context), limit)
            if n > best_n and other.seq_id not in self._unsettled:
                best, best_n = other, n
        return best, best_n

    def _copy(self, donor: _Slot, slot: _Slot) -> None:
        self.engine.copy(donor.seq_id, slot.seq_id)
        slot.cached = list(donor.cached)
        self._unsettled.add(slot.seq_id)  # its data lands at the next decode: no donor until then

    def _free_slot(self, context: tuple[int, ...]) -> _Slot | None:
        free = [s for s in self.slots if not s.busy and s.owner is None]
        return max(free, key=lambda s: _common_prefix(s.cached, context), default=None)

    def _keep(self, slot: _Slot, n: int) -> None:
        if len(slot.cached) > n:
            slot.cached = slot.cached[:n] if self.engine.keep(slot.seq_id, n) else []

    def _decode(self, live: list[_Job], rows) -> None:
        """One llama_decode: every sampled token, then as much prefill as n_batch allows."""
        budget = self.options.n_batch
        feeds, fed = [], []
        for job in sorted((j for j in live if j.feed), key=lambda j: len(j.feed) > 1):
            take = job.feed[:budget]
            if not take:
                break
            feeds.append(Feed(job.slot.seq_id, len(job.slot.cached), take, want_logits=len(take) == len(job.feed)))
            fed.append(job)
            budget -= len(take)
        if not feeds:
            return
        t0 = time.perf_counter()
        out = self.engine.decode(feeds)
        self._unsettled.clear()
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.decode_calls += 1
        for job, f, row in zip(fed, feeds, out):
            job.slot.cached.extend(f.tokens)
            del job.feed[: len(f.tokens)]
            if row is not None:
                job.row = row
                if not job.tokens:
                    rows[job.context] = row

    def _attach_waiting(self, live: list[_Job], rows) -> None:
        """A waiting job whose context was just prefilled copies that sequence and its logits."""
        for job in live:
            if not job.waiting or job.context not in rows:
                continue
            n = len(job.context)
            donor, reuse = self._best_source(job.slot, job.context, n)
            if reuse < n:
                continue  # its prefill is still in flight
            if donor is not job.slot:
                self._copy(donor, job.slot)
            self._keep(job.slot, n)
            job.waiting, job.row, job.reused = False, rows[job.context], n
            self.stats.reused += n

    def _draw(self, job: _Job) -> None:
        token, logprob = sample_token(job.row, job.sampling, job.rng)
        job.row = None
        job.tokens.append(token)
        job.logprobs.append(logprob)
        self.stats.sampled += 1
        if token in self.engine.eog_ids:
            job.finish = "eos"
        elif len(job.tokens) >= job.sampling.max_new_tokens:
            job.finish = "length"
        else:
            job.feed = [token]

    def _checked_context(self, tokens: Sequence[int], sampling: Sampling, what: str) -> tuple[int, ...]:
        context = tuple(int(t) for t in tokens)
        if not context:
            raise DataError(f"sampler: {what} has an empty prompt")
        bad = next((t for t in context if not 0 <= t < self.engine.n_vocab), None)
        if bad is not None:
            raise DataError(f"sampler: {what} has token id {bad}, outside the vocabulary [0, {self.engine.n_vocab})")
        if len(context) + sampling.max_new_tokens > self.options.n_ctx:
            raise DataError(
                f"sampler: {what}: {len(context)} prompt tokens + max_new_tokens {sampling.max_new_tokens} "
                f"= {len(context) + sampling.max_new_tokens} exceed ctx {self.options.n_ctx}"
            )
        return context


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _checked_seed(seed: int, what: str) -> int:
    if not (isinstance(seed, (int, np.integer)) and seed >= 0):
        raise DataError(f"sampler: {what} has seed {seed!r}; seeds must be integers >= 0")
    return int(seed)
