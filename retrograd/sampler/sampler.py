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

The last sampled token of a turn is never in the cache: it is fed with the next turn.

Reproducibility. Each completion or conversation draws from its own numpy Generator, one
draw per token (sampling.py). What is left is to make llama.cpp's logits for a sequence a
function of that sequence alone, and on the CPU they are not by themselves: the same token
row comes out differently depending on how it is batched (measured with llama-cpp-python
0.3.36, SmolLM2 Q4_1 plus a trained adapter, up to 0.8 in a logit, enough to change
sampled tokens):
- a ubatch of ONE token row multiplies the adapter's f32 matrices (and, without flash
  attention, K·Q and V·softmax) with ggml's vec_dot, one of two or more rows with
  llamafile's tinyBLAS (`llamafile_sgemm` refuses n < 2): other roundings, which the next
  quantized matmul (activations rounded to 8 bits per block of 32) sometimes amplifies;
- with flash attention (f16 KV) a ubatch holding fewer than 64 query rows of a sequence
  accumulates V in f16 (`one_chunk`), one of 64 or more in f32 (`tiled`), and a lone query
  over >= 512 keys splits the keys per thread (so the thread count matters);
- llama.cpp cuts a batch over split-KV sequences into one ubatch per run of consecutive,
  ascending sequence ids with equal token counts, so a sequence whose neighbours are not in
  the batch (they finished, or the batch lists them in another order) is a one-row ubatch;
- on CPUs where llama.cpp repacks weights (no AMX here; Q4_0/Q4_K/IQ4_NL/Q8_0 elsewhere),
  rows beyond the last multiple of 4 of a ubatch take a gemv instead of the gemm.
So the scheduler feeds llama.cpp only two shapes, each a pure function of one sequence:
- a prefill piece: the tokens of ONE sequence between absolute positions that are
  multiples of PREFILL_CHUNK (a piece of a single token joins its neighbour), alone in its
  llama_decode;
- a step: one token for EVERY stream, in stream order, in one llama_decode (one ubatch of
  a fixed number of rows: n_seq_max, at least 2, above 3 rounded up to a multiple of 4);
  streams with nothing to decode get a pad token at their next position, removed right
  after, and every row asks for logits, so the output head always sees the same rows.
A cached prefix is taken from another sequence (or from this one's previous content) only
in whole aligned pieces that were computed as such by a prefill from position 0, i.e.
exactly as this context's own prefill would compute them; a group member that shares its
prompt copies the whole prefilled stream. A conversation continues on its own cache from
turn to turn (what its next turn computes depends on its own history only).

Recurrent models (lfm2, lfm2moe: gated short convolutions beside attention). llama.cpp keeps
one state per sequence that has read every position; it copies that state whole
(seq_cp) but cannot cut it back (seq_rm of a suffix fails, and Engine.keep then empties the
sequence). So nothing is ever rewound: a context is taken from another sequence only when
that sequence holds exactly its complete prefill (a group member copies the prompt's stream
before the first step moves it on; a member started later prefills the prompt again), else
it is prefilled from position 0 in the same pieces; a stream that takes a pad is emptied
(so whatever an idle sequence held is gone after a step); a conversation's every turn is
prefilled from position 0 (its state between turns lasts only until the next pad, so
continuing on it would make a turn depend on what the others did).

What is reproducible, bit for bit on the CPU (same llama.cpp build, model, adapter and
sampler options; tests/test_rollout_reproducibility.py): a completion's tokens and
log-probs are a function of its seed and context alone, whatever the other requests, their
order, the llama.cpp thread count and what the cache held before; a conversation's turns
are a function of its seed and its own history. Recurrent models keep both (tiny lfm2 and
lfm2moe, f16 and f32 KV, one and two threads; tests/test_sampler_recurrent.py), at the cost of
prefilling more: a group larger than n_seq_max prefills its prompt again for members started
later, no prefix is shared between different contexts, and a conversation turn prefills its
whole history (agent_grpo's prefill_reuse_fraction counts only group members' copies).
n_seq_max fixes the rows of every step: changing it changed nothing for SmolLM2 Q4_1 (1 to
16), but does for Gemma-3 Q4_K_M (8 rows or more compute differently), so it is part of
what a run must keep (it is in the resume signature as training.generation_concurrency).
Across builds, machines or GPU backends nothing is promised (other kernels). Costs: a
prompt is prefilled in pieces of at most PREFILL_CHUNK + 2 tokens, one llama_decode each; a
step computes pad rows for idle streams, and a pad row costs what a live one does (SmolLM2
Q4_1, one thread, AMD EPYC: a step of 16 rows 105 ms, 8 rows 59 ms, 1 row 11 ms), so after
the last waiting request has started, every step costs a full one until the last sequence
ends (llama.cpp's own batched decode drops finished sequences, but with split KV it also
cuts such a batch into one ubatch per run of consecutive sequence ids); one sequence alone
steps with 2 rows, about 30% slower than with 1.

Log-probabilities are those of sampling.py.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrograd.errors import ConfigError, DataError
from retrograd.runtime.bundled import default_model_path
from retrograd.sampler.engine import KV_MODES, MAX_SEQUENCES, Engine, Feed, Placement
from retrograd.sampler.live_adapter import LiveAdapter, RefreshTiming
from retrograd.sampler.sampling import Sampling, sample_token

PREFILL_CHUNK = 64  # prefill pieces end at multiples of this position (see the module doc)
PAD_TOKEN = 0  # what a stream with nothing to decode is fed in a step (its row is discarded)


@dataclass(frozen=True)
class SamplerOptions:
    n_ctx: int = 512  # positions per sequence: context + new tokens ([training] ctx)
    n_seq_max: int = 8  # sequences decoding together ([training] generation_concurrency)
    n_batch: int = 512  # llama.cpp batch capacity ([training] generation_batch), raised to what a piece or step needs
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

    @property
    def n_streams(self) -> int:
        """llama.cpp sequences, one row each in every step: n_seq_max, but at least 2 (one
        row takes other kernels) and above 3 a multiple of 4 (so a repacked matmul, gemm per
        4 rows and gemv for the rest, treats every stream alike; see the module doc)."""
        n = max(self.n_seq_max, 2)
        return n if n <= 3 else -(-n // 4) * 4


@dataclass(frozen=True)
class GroupRequest:
    """One prompt, one completion per seed (GRPO: seeds derived from the run seed)."""

    prompt: Sequence[int]
    seeds: Sequence[int]
    sampling: Sampling


@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # sampled, the end-of-generation token included when finish == "eos"
    logprobs: list[float]  # per token: its log-prob under the distribution it was drawn from (sampling.py)
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
    # What of `cached` a prefill from position 0 computed in aligned pieces (the only KV
    # another context may take): `canon` is a prefix of cached made of whole pieces, as any
    # context starting with these tokens computes them, and `prefilled` the context whose
    # complete prefill lies at the start of cached (group members copy it whole), else None.
    # Both are checked against cached when read, so code that empties cached (agent.py's
    # forget_kv_cache) cannot leave them stale.
    canon: tuple[int, ...] = ()
    prefilled: tuple[int, ...] | None = None

    @property
    def shareable(self) -> int:
        n = len(self.canon)
        return n if tuple(self.cached[:n]) == self.canon else 0

    def holds_prefill_of(self, context: tuple[int, ...]) -> bool:
        return self.prefilled == context and tuple(self.cached[: len(context)]) == context

    def forget(self) -> None:
        self.cached, self.canon, self.prefilled = [], (), None


@dataclass(eq=False)
class _Job:
    context: tuple[int, ...]
    sampling: Sampling
    rng: np.random.Generator
    slot: _Slot | None = None  # fixed for a conversation, else picked at admission
    conversation: Conversation | None = None
    feed: list[int] = field(default_factory=list)  # tokens to decode next, from position len(slot.cached)
    pieces: list[tuple[int, int]] = field(default_factory=list)  # prefill pieces left, absolute positions
    canonical: bool = False  # its prefill computes the context exactly as a prefill from position 0 would
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
        self._turns = 0  # completed turns: from the second on, the sequence holds its own history

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
        self.n_streams = options.n_streams
        self.engine = Engine(
            path,
            n_ctx=options.n_ctx,
            n_seq_max=self.n_streams,
            n_batch=max(options.n_batch, self.n_streams, PREFILL_CHUNK + 2),
            kv_dtype=options.kv_dtype,
            n_threads=threads,
        )
        try:
            self.adapter = LiveAdapter(self.engine)
        except BaseException:
            self.engine.close()
            raise
        self.slots = [_Slot(i) for i in range(options.n_seq_max)]  # streams beyond these only ever hold pads
        self.stats = SamplerStats()
        self._unsettled: set[int] = set()

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.engine.eog_ids

    @property
    def placement(self) -> Placement:
        """The device llama.cpp samples on and how many layers it offloaded there."""
        return self.engine.placement

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.adapter.close()
        self.engine.close()

    # ---- the live adapter

    def set_adapter(self, adapter, *, alpha: float | None = None) -> RefreshTiming:
        """Sample with `adapter` from now on: a retrograd.model.lora.Adapter, {weight name:
        LoRAWeights} with alpha, or None for the base model. Every cached KV is dropped
        (it was computed with the old weights); conversations re-prefill on their next turn."""
        timing = self.adapter.refresh(adapter, alpha)
        self.engine.clear()
        for slot in self.slots:
            slot.forget()
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
        cache does not hold are prefilled, all of them for a recurrent model (see the module
        doc; Completion.prefilled / .reused say how many)."""
        jobs = []
        for i, (conversation, tokens) in enumerate(turns):
            if conversation._sampler is not self or not conversation.open:
                raise DataError(f"sampler: turn {i} is for a conversation that is closed or not this sampler's")
            context = self._checked_context(tokens, sampling, f"turn {i}")
            jobs.append(_Job(context, sampling, conversation.rng, conversation._slot, conversation))
        if len({id(job.slot) for job in jobs}) != len(jobs):
            raise DataError("sampler: the same conversation appears twice in one generate_turn call")
        self._run(jobs)
        for job in jobs:
            job.conversation._turns += 1
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
        if job.conversation is not None and job.conversation._turns and not self.engine.recurrent:
            # a conversation goes on from its own history, whatever other sequences hold
            # (a recurrent one is prefilled from 0: see the module doc)
            donor, reuse = slot, min(_common_prefix(slot.cached, job.context), n - 1)
        else:
            donor, reuse = self._best_source(slot, job.context, whole=True)
            if reuse == n and job.context in rows:
                job.row = rows[job.context]  # a group member admitted after its prompt was prefilled
            elif any(j.context == job.context and j.canonical and j.feed and not j.tokens for j in live):
                job.waiting = True  # another job is prefilling this very context: share it
                return True
            else:  # the last piece is decoded (again) for its logits
                donor, reuse = self._best_source(slot, job.context, whole=False)
        if donor is not slot:
            self._copy(donor, slot)
        self._keep(slot, reuse)
        job.feed = list(job.context[reuse:])
        job.pieces = _pieces(reuse, n) if len(job.feed) > 1 else []
        job.canonical = reuse <= slot.shareable and reuse % PREFILL_CHUNK == 0 and reuse <= _last_piece_start(n)
        job.prefilled, job.reused = len(job.feed), reuse
        self.stats.prefilled += job.prefilled
        self.stats.reused += reuse
        return True

    def _shareable(self, source: _Slot, context: tuple[int, ...], whole: bool) -> int:
        """How much of `context` may be taken from `source`'s cache: all of it when `whole`
        and source holds the complete prefill of this very context, else whole aligned
        pieces of a prefill from position 0, short of the context's last piece. A recurrent
        state cannot be cut back: only a source holding exactly that prefill serves."""
        n = len(context)
        common = _common_prefix(source.cached, context)
        if whole and source.holds_prefill_of(context) and not (self.engine.recurrent and len(source.cached) > n):
            return n
        if self.engine.recurrent:
            return 0
        limit = min(common, source.shareable, _last_piece_start(n))
        return limit // PREFILL_CHUNK * PREFILL_CHUNK

    def _best_source(self, slot: _Slot, context: tuple[int, ...], *, whole: bool) -> tuple[_Slot, int]:
        """The sequence to take the most of `context` from (slot itself on a tie)."""
        best, best_n = slot, self._shareable(slot, context, whole)
        for other in self.slots:
            n = self._shareable(other, context, whole)
            if n > best_n and other.seq_id not in self._unsettled:
                best, best_n = other, n
        return best, best_n

    def _copy(self, donor: _Slot, slot: _Slot) -> None:
        self.engine.copy(donor.seq_id, slot.seq_id)
        slot.cached, slot.canon, slot.prefilled = list(donor.cached), donor.canon, donor.prefilled
        self._unsettled.add(slot.seq_id)  # its data lands at the next decode: no donor until then

    def _free_slot(self, context: tuple[int, ...]) -> _Slot | None:
        free = [s for s in self.slots if not s.busy and s.owner is None]
        return max(free, key=lambda s: self._shareable(s, context, True), default=None)

    def _keep(self, slot: _Slot, n: int) -> None:
        if len(slot.cached) > n:
            if not self.engine.keep(slot.seq_id, n):
                slot.forget()
                return
            slot.cached = slot.cached[:n]
        slot.canon = slot.canon[: n // PREFILL_CHUNK * PREFILL_CHUNK]
        if slot.prefilled is not None and len(slot.prefilled) > n:
            slot.prefilled = None

    def _decode(self, live: list[_Job], rows) -> None:
        """One llama_decode: the next prefill piece of one job if any job has one, else a step."""
        job = next((j for j in live if j.pieces), None)
        if job is not None:
            self._prefill_piece(job, rows)
        elif any(j.feed for j in live):
            self._step([j for j in live if j.feed], rows)

    def _prefill_piece(self, job: _Job, rows) -> None:
        start, end = job.pieces.pop(0)
        slot = job.slot
        assert start == len(slot.cached), (start, len(slot.cached))
        tokens = job.feed[: end - start]
        (row,) = self._llama_decode([Feed(slot.seq_id, start, tokens, want_logits=not job.pieces)])
        slot.cached.extend(tokens)
        del job.feed[: len(tokens)]
        if not job.pieces:
            self._prefill_done(job, row, rows)

    def _step(self, jobs: list[_Job], rows) -> None:
        """One token for every stream in stream order: the jobs' (each has one to decode)
        and a pad for every other stream, removed again after the decode."""
        by_stream = {job.slot.seq_id: job for job in jobs}
        feeds = []
        for seq_id in range(self.n_streams):
            job = by_stream.get(seq_id)
            if job is not None:
                feeds.append(Feed(seq_id, len(job.slot.cached), list(job.feed), want_logits=True))
            else:
                length = len(self.slots[seq_id].cached) if seq_id < len(self.slots) else 0
                feeds.append(Feed(seq_id, length, [PAD_TOKEN], want_logits=True, pad=True))
        out = self._llama_decode(feeds)
        for f, row in zip(feeds, out):
            if f.pad:
                if not self.engine.keep(f.seq_id, f.start) and f.seq_id < len(self.slots):
                    self.slots[f.seq_id].forget()
                continue
            job = by_stream[f.seq_id]
            job.slot.cached.extend(f.tokens)
            job.feed = []
            if job.tokens:
                job.row = row
            else:  # a context whose last token needed no piece of its own
                self._prefill_done(job, row, rows)

    def _prefill_done(self, job: _Job, row: np.ndarray, rows) -> None:
        job.row = row
        if not job.tokens:
            rows[job.context] = row
        if job.canonical:
            job.slot.canon = job.context[: _full_pieces_end(len(job.context))]
            job.slot.prefilled = job.context

    def _llama_decode(self, feeds: list[Feed]) -> list[np.ndarray | None]:
        t0 = time.perf_counter()
        out = self.engine.decode(feeds)
        self._unsettled.clear()
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.decode_calls += 1
        return out

    def _attach_waiting(self, live: list[_Job], rows) -> None:
        """A waiting job whose context was just prefilled copies that sequence and its logits."""
        for job in live:
            if not job.waiting or job.context not in rows:
                continue
            n = len(job.context)
            donor, reuse = self._best_source(job.slot, job.context, whole=True)
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


def _pieces(start: int, end: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """Positions [start, end) cut at the multiples of `chunk` in between; a piece of one
    token joins its neighbour, so every piece has two rows or more (when end - start >= 2)."""
    cuts = [start, *range((start // chunk + 1) * chunk, end, chunk), end]
    pieces = list(zip(cuts, cuts[1:]))
    if len(pieces) > 1 and pieces[0][1] - pieces[0][0] == 1:
        pieces[:2] = [(pieces[0][0], pieces[1][1])]
    if len(pieces) > 1 and pieces[-1][1] - pieces[-1][0] == 1:
        pieces[-2:] = [(pieces[-2][0], pieces[-1][1])]
    return pieces


def _last_piece_start(n: int) -> int:
    """Where the last piece of a prefill of n tokens from position 0 starts."""
    return _pieces(0, n)[-1][0]


def _full_pieces_end(n: int) -> int:
    """How far a prefill of n tokens from position 0 runs in whole, unmerged pieces: the KV
    any longer context with the same first tokens computes identically."""
    start, end = _pieces(0, n)[-1]
    return end if end - start == PREFILL_CHUNK else start


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
