"""Packing sequences into micro-batches and computing their log-probabilities: the one
path from token ids to differentiable per-token log-probs, shared by SFT, GRPO scoring and
distillation.

A micro-batch is one row of packed sequences: positions restart in each sequence and
attention never crosses a sequence boundary (`segments`), except that a sequence may see
a shared prefix packed once before it (GRPO scores a group's prompt once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from retrograd.kernels.chunked_logprobs import LOGPROB_PATHS, TOKEN_CHUNK, VOCAB_TILE
from retrograd.model.transformer import Transformer


@dataclass(frozen=True)
class LogprobOptions:
    """How the output head is evaluated (training.chunked_cross_entropy, chunked_ce_*)."""

    path: str = "chunked"  # or "dense": materialised [N, V] logits
    vocab_tile: int = VOCAB_TILE
    token_chunk: int = TOKEN_CHUNK

    @classmethod
    def from_training(cls, training, n_vocab: int) -> LogprobOptions:
        tiles = training.chunked_ce_tiles
        return cls(
            path="chunked" if training.chunked_cross_entropy else "dense",
            vocab_tile=VOCAB_TILE if tiles is None else -(-n_vocab // tiles),
            token_chunk=training.chunked_ce_seq_chunk or 1 << 30,
        )


@dataclass(frozen=True)
class TokenSequence:
    """ids and a loss mask: mask[i] is True when predicting ids[i] from ids[:i] counts."""

    ids: tuple[int, ...]
    mask: tuple[bool, ...]

    def __post_init__(self):
        assert len(self.ids) == len(self.mask) and not (self.mask and self.mask[0]), "mask[0] can never be trained"

    @property
    def n_trained(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class PackedBatch:
    tokens: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    segments: torch.Tensor | None  # [1, T]; None when the row holds one sequence
    hidden_index: torch.Tensor  # [N] rows of the hidden states that predict a trained token
    targets: torch.Tensor  # [N] the trained token ids
    sequence_index: torch.Tensor  # [N] which packed sequence each trained token belongs to
    n_sequences: int

    @property
    def n_tokens(self) -> int:
        return self.tokens.shape[1]


def pack(sequences: Sequence[TokenSequence], device: torch.device | str = "cpu") -> PackedBatch:
    ids, positions, segments, hidden_index, targets, owner = [], [], [], [], [], []
    offset = 0
    for s, seq in enumerate(sequences):
        n = len(seq.ids)
        ids.extend(seq.ids)
        positions.extend(range(n))
        segments.extend([s] * n)
        for i, trained in enumerate(seq.mask):
            if trained:
                hidden_index.append(offset + i - 1)
                targets.append(seq.ids[i])
                owner.append(s)
        offset += n

    def t(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return PackedBatch(
        tokens=t([ids]),
        positions=t([positions]),
        segments=t([segments]) if len(sequences) > 1 else None,
        hidden_index=t(hidden_index),
        targets=t(targets),
        sequence_index=t(owner),
        n_sequences=len(sequences),
    )


def plan_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy, order-preserving packing of sequence indices into micro-batches of at most
    `budget` tokens; a sequence longer than the budget gets a micro-batch of its own."""
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches


def batch_logprobs(model: Transformer, batch: PackedBatch, options: LogprobOptions = LogprobOptions()) -> torch.Tensor:
    """Log-probabilities [N] of the batch's trained tokens, differentiable w.r.t. the LoRA."""
    hidden = model(batch.tokens, batch.positions, batch.segments)[0]  # [T, E]
    selected = hidden.index_select(0, batch.hidden_index)  # [N, E]: logits only where loss is
    logprobs, _ = LOGPROB_PATHS[options.path](
        selected,
        model.output,
        batch.targets.unsqueeze(1),  # [N, 1]
        compute_dtype=model.compute_dtype,
        softcap=model.spec.final_logit_softcap,
        vocab_tile=options.vocab_tile,
        token_chunk=options.token_chunk,
    )
    return logprobs[:, 0]
