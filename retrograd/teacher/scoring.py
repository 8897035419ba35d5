"""The teacher's log-probabilities of given token sequences, and its top-k at each scored
position: through llama.cpp (the GGUF as it is, quantized; light and fast) or through our
torch model (exact, the same numbers the student's side computes).

Both take `Rollout`s (training/scoring.py): a prompt, the tokens after it and which of them
to score; rollouts with the same group share their prompt, which is computed once. Each
returns, per rollout, the log-prob of every scored token and optionally the k most likely ids
at that position with their log-probs, over the full vocabulary at the temperature of
`TeacherOptions.logprobs` (on-policy distillation compares teacher and student at the
temperature the student sampled at; a sidecar is written at 1).

The torch side reads the hidden states of the scored positions and gathers log-probs at any
ids through the chunked kernel, never as [N, V] logits; `gather_at` is that step, and the
student's top-k losses use it too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retrograd.errors import ConfigError, GGUFError
from retrograd.gguf.file import GGUFFile
from retrograd.kernels.chunked_logprobs import LOGPROB_PATHS, LogprobStats
from retrograd.model.base import BaseModel, load_model
from retrograd.model.transformer import Transformer
from retrograd.runtime.llamacpp import C, load_llama_model
from retrograd.training.batches import Group, LogprobOptions, PackedBatch, pack
from retrograd.training.scoring import Rollout, plan

LOGITS_BUDGET = 64 << 20  # bytes of float32 logits one llama_decode may return
MAX_SLOTS = 8  # llama.cpp sequences scored side by side after a shared prompt


@dataclass(frozen=True)
class TeacherScores:
    logprobs: torch.Tensor  # [n] the teacher's log-prob of each scored token
    topk_ids: torch.Tensor | None = None  # [n, k] most likely first
    topk_logprobs: torch.Tensor | None = None  # [n, k]


@dataclass(frozen=True)
class TeacherOptions:
    n_ctx: int  # longest prompt + continuation ([training] ctx)
    group: int = 1  # llama.cpp: continuations of one prompt scored side by side (at most MAX_SLOTS)
    threads: int = 0  # llama.cpp threads; 0 = every CPU this process may use
    weights: str = "quantized"  # torch: how the GGUF's matrices are held
    compute_dtype: str = "f32"  # torch
    device: torch.device | str = "cpu"  # torch
    micro_batch: int = 512  # torch: tokens per forward
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)  # how the head is evaluated (torch), the temperature (both)


# ----------------------------------------------------------------------------- shared torch step


def pack_rollouts(rollouts: Sequence[Rollout], device) -> tuple[PackedBatch, list[int]]:
    """Rollouts -> one packed micro-batch (each group's prompt once) and the rollout order
    of its scored rows, as training/scoring.micro_batch_logprobs packs them."""
    by_group: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        by_group.setdefault(r.group, []).append(i)
    items = [Group(rollouts[m[0]].prompt, tuple(rollouts[i].sequence() for i in m)) for m in by_group.values()]
    return pack(items, device), [i for m in by_group.values() for i in m]


def gather_at(
    model: Transformer, batch: PackedBatch, ids: torch.Tensor, options: LogprobOptions, *, topk: int = 0
) -> tuple[torch.Tensor, LogprobStats]:
    """log_softmax of the model's logits at the batch's scored positions, at `ids` [N, K]
    (differentiable w.r.t. the LoRA), plus the top-k of each row when asked."""
    hidden = model(batch.tokens, batch.layout)  # [T, E]
    selected = hidden.index_select(0, batch.hidden_index)  # [N, E]
    return LOGPROB_PATHS[options.path](
        selected,
        model.output,
        ids,
        compute_dtype=model.compute_dtype,
        softcap=model.spec.final_logit_softcap,
        temperature=options.temperature,
        vocab_tile=options.vocab_tile,
        token_chunk=options.token_chunk,
        topk=topk,
    )


def _split(values: torch.Tensor | None, lengths: list[int]) -> list[torch.Tensor | None]:
    return [None] * len(lengths) if values is None else list(values.split(lengths))


# ----------------------------------------------------------------------------- torch


class TorchTeacher:
    """The teacher as our torch model: exact, and on the training device."""

    def __init__(self, model: BaseModel, options: TeacherOptions):
        self.model, self.options = model, options
        self.n_vocab = model.spec.n_vocab

    @classmethod
    def open(cls, path: Path, options: TeacherOptions) -> TorchTeacher:
        model = load_model(path, weights=options.weights, compute_dtype=options.compute_dtype, device=options.device)
        model.transformer.use_context(options.n_ctx)  # phi3's RoPE factors as llama.cpp would pick them for this context
        return cls(model, options)

    def score(self, rollouts: Sequence[Rollout], topk: int = 0) -> list[TeacherScores]:
        out: list[TeacherScores] = [None] * len(rollouts)  # type: ignore[list-item]
        transformer = self.model.transformer
        with torch.no_grad():
            for idx in plan(rollouts, self.options.micro_batch):
                batch, order = pack_rollouts([rollouts[i] for i in idx], transformer.device)
                logp, stats = gather_at(transformer, batch, batch.targets[:, None], self.options.logprobs, topk=topk)
                lengths = [rollouts[idx[k]].sequence().n_trained for k in order]
                parts = zip(
                    _split(logp[:, 0].float().cpu(), lengths),
                    _split(_cpu(stats.topk_ids), lengths),
                    _split(_cpu(stats.topk_logprobs), lengths),
                )
                for k, (lp, ids, top) in zip(order, parts):
                    out[idx[k]] = TeacherScores(lp, ids, top)
        return out

    def close(self) -> None:
        self.model = None


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu() if t.dtype == torch.long else t.float().cpu()


# ----------------------------------------------------------------------------- llama.cpp


@dataclass(frozen=True)
class _Feed:
    """Tokens of one sequence from position `start`; targets[i] is the id whose log-prob the
    logits after tokens[i] give, or -1 for no logits there."""

    seq_id: int
    start: int
    tokens: Sequence[int]
    targets: Sequence[int]


class LlamaCppTeacher:
    """The teacher in llama.cpp, `slots` sequences per wave. In a wave, each group's prompt
    but its last token is decoded once, in its first member's sequence; the other members
    copy that sequence (the KV is unified, so copies share cells); then every member decodes
    the prompt's last token and its own tokens, with logits where a token is scored, packed
    into as few llama_decode calls as the logits budget allows."""

    def __init__(self, path: Path, options: TeacherOptions):
        self.path = Path(path)
        self.temperature = options.logprobs.temperature
        self.model = load_llama_model(self.path, lambda: GGUFFile(self.path).tensors)
        if not self.model:
            raise GGUFError(f"{self.path}: llama.cpp cannot load this teacher model")
        self.n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        self.n_batch = max(1, min(options.n_ctx * MAX_SLOTS, LOGITS_BUDGET // (4 * self.n_vocab)))
        self.slots = max(1, min(options.group, MAX_SLOTS))
        threads = options.threads or len(os.sched_getaffinity(0))
        n_ctx = options.n_ctx * self.slots
        self.ctx = C.llama_init_from_model(self.model, _context_params(n_ctx, self.slots, self.n_batch, threads))
        if not self.ctx:
            C.llama_model_free(self.model)
            raise GGUFError(f"{self.path}: llama.cpp cannot create a scoring context of {n_ctx} tokens")
        self.memory = C.llama_get_memory(self.ctx)
        self.batch = C.llama_batch_init(self.n_batch, 0, 1)

    @classmethod
    def open(cls, path: Path, options: TeacherOptions) -> LlamaCppTeacher:
        return cls(path, options)

    def score(self, rollouts: Sequence[Rollout], topk: int = 0) -> list[TeacherScores]:
        out: list[TeacherScores] = []
        for w in range(0, len(rollouts), self.slots):
            out += self._score_wave(rollouts[w : w + self.slots], topk)
        return out

    def _score_wave(self, wave: Sequence[Rollout], topk: int) -> list[TeacherScores]:
        assert all(r.prompt for r in wave), "a scored continuation needs at least one token of context"
        C.llama_memory_clear(self.memory, False)
        holder: dict[int, int] = {}  # group -> the sequence its prompt is decoded in
        for seq_id, r in enumerate(wave):
            holder.setdefault(r.group, seq_id)
        prompts = [_Feed(s, 0, wave[s].prompt[:-1], [-1] * (len(wave[s].prompt) - 1)) for s in holder.values()]
        self._decode([f for f in prompts if f.tokens], topk)
        feeds = []
        for seq_id, r in enumerate(wave):
            if holder[r.group] != seq_id:
                C.llama_memory_seq_cp(self.memory, holder[r.group], seq_id, -1, -1)
            mask = r.mask if r.mask is not None else (True,) * len(r.tokens)
            targets = [t if m else -1 for t, m in zip(r.tokens, mask)]
            feeds.append(_Feed(seq_id, len(r.prompt) - 1, (r.prompt[-1], *r.tokens[:-1]), targets))
        return self._decode(feeds, topk)

    def _decode(self, feeds: list[_Feed], topk: int) -> list[TeacherScores]:
        """Every feed's tokens, n_batch per llama_decode -> per feed, the scores of its targets."""
        stream = [(f, i) for f in feeds for i in range(len(f.tokens))]
        found: dict[int, list[tuple[torch.Tensor, ...]]] = {id(f): [] for f in feeds}
        for s in range(0, len(stream), self.n_batch):
            chunk = stream[s : s + self.n_batch]
            wanted = []
            for n, (f, i) in enumerate(chunk):
                self.batch.token[n] = f.tokens[i]
                self.batch.pos[n] = f.start + i
                self.batch.n_seq_id[n] = 1
                self.batch.seq_id[n][0] = f.seq_id
                self.batch.logits[n] = f.targets[i] >= 0
                if f.targets[i] >= 0:
                    wanted.append((f, f.targets[i]))
            self.batch.n_tokens = len(chunk)
            rc = C.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise GGUFError(f"{self.path}: llama_decode failed with status {rc} while scoring {len(chunk)} tokens")
            if not wanted:
                continue
            logits = np.ctypeslib.as_array(C.llama_get_logits(self.ctx), shape=(len(wanted), self.n_vocab))
            logp = (torch.from_numpy(logits) / self.temperature).log_softmax(-1)  # [n, V]
            targets = torch.tensor([t for _, t in wanted])[:, None]  # [n, 1]
            picked = logp.gather(1, targets)[:, 0]  # [n]
            top_lp, top_ids = logp.topk(topk, dim=-1) if topk else (None, None)  # [n, k]
            for n, (f, _) in enumerate(wanted):
                found[id(f)].append((picked[n : n + 1], *(() if not topk else (top_ids[n : n + 1], top_lp[n : n + 1]))))
        return [_scores(found[id(f)], topk) for f in feeds]

    def close(self) -> None:
        if self.ctx:
            C.llama_batch_free(self.batch)
            C.llama_free(self.ctx)
            C.llama_model_free(self.model)
            self.ctx = self.model = None


def _scores(rows: list[tuple[torch.Tensor, ...]], topk: int) -> TeacherScores:
    if not rows:
        empty = torch.zeros(0)
        return TeacherScores(
            empty, torch.zeros(0, topk, dtype=torch.long) if topk else None, torch.zeros(0, topk) if topk else None
        )
    columns = [torch.cat(c) for c in zip(*rows)]
    return TeacherScores(*columns)


def _context_params(n_ctx: int, n_seq_max: int, n_batch: int, n_threads: int):
    p = C.llama_context_default_params()
    p.n_ctx = n_ctx
    p.n_seq_max = n_seq_max
    p.kv_unified = True  # a copied prompt shares its cells
    p.n_batch = n_batch
    p.n_ubatch = min(n_batch, 512)
    p.n_outputs_max = n_batch
    p.n_outputs_max_per_seq = 0  # every position of a sequence may return logits
    p.n_threads = p.n_threads_batch = n_threads
    p.type_k = p.type_v = C.GGML_TYPE_F16  # as the sampler's fast context: half the KV memory
    p.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_AUTO
    p.no_perf = True
    return p


# ----------------------------------------------------------------------------- choosing one

BACKENDS = {"llama.cpp": LlamaCppTeacher.open, "torch": TorchTeacher.open}


def open_teacher(path: Path, backend: str, options: TeacherOptions, key: str = "distill.teacher_path"):
    """The teacher behind `backend` ("llama.cpp" or "torch"); a missing file is one line naming `key`."""
    if not Path(path).is_file():
        raise ConfigError(f"{key} = {str(path)!r}: no such file (the teacher GGUF)")
    if backend not in BACKENDS:
        raise ConfigError(f"teacher backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    return BACKENDS[backend](Path(path), options)
