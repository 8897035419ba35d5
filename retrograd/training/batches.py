"""Packing sequences into micro-batches and computing their log-probabilities: the one
path from token ids to differentiable per-token log-probs, shared by SFT, GRPO scoring and
distillation.

A micro-batch is a flat stream of packed sequences: positions restart in each sequence and
attention never crosses a sequence boundary (see model.transformer.Layout), except that a
group's members all see their shared prefix, packed and computed once (GRPO scores a
group's prompt once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from retrograd.kernels.chunked_logprobs import LOGPROB_PATHS, TOKEN_CHUNK, VOCAB_TILE
from retrograd.model.transformer import Layout, Transformer


@dataclass(frozen=True)
class LogprobOptions:
    """How the output head is evaluated (training.chunked_cross_entropy, chunked_ce_*), and
    at which temperature: a rollout algorithm scores every token at the temperature it was
    sampled at, so the policy it trains is the one that produced the samples."""

    path: str = "chunked"  # or "dense": materialised [N, V] logits
    vocab_tile: int = VOCAB_TILE
    token_chunk: int = TOKEN_CHUNK
    temperature: float = 1.0

    @classmethod
    def from_training(cls, training, n_vocab: int, temperature: float = 1.0) -> LogprobOptions:
        tiles = training.chunked_ce_tiles
        return cls(
            path="chunked" if training.chunked_cross_entropy else "dense",
            vocab_tile=VOCAB_TILE if tiles is None else -(-n_vocab // tiles),
            token_chunk=training.chunked_ce_seq_chunk or 1 << 30,
            temperature=temperature,
        )


@dataclass(frozen=True)
class TokenSequence:
    """ids and a loss mask: mask[i] is True when predicting ids[i] from what precedes it counts."""

    ids: tuple[int, ...]
    mask: tuple[bool, ...]

    @property
    def n_trained(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class Group:
    """A prefix packed once and members that each continue it: GRPO's prompt and its
    completions. A member's mask[0] may be True (its first token follows the prefix)."""

    prefix: tuple[int, ...]
    members: tuple[TokenSequence, ...]


@dataclass(frozen=True)
class PackedBatch:
    tokens: torch.Tensor  # [T] every token once (a shared prefix too)
    layout: Layout  # how the tokens are cut into attention rows
    hidden_index: torch.Tensor  # [N] hidden-state rows that predict a trained token
    targets: torch.Tensor  # [N] the trained token ids
    sequence_index: torch.Tensor  # [N] which packed sequence (group member) each belongs to
    n_sequences: int

    @property
    def n_tokens(self) -> int:
        return self.tokens.shape[0]


def pack(items: Sequence, device: torch.device | str = "cpu") -> PackedBatch:
    """Sequences (anything with .ids and .mask) and Groups -> one packed micro-batch."""
    ids: list[int] = []
    positions: list[int] = []
    rows: list[list[int]] = []
    out_slot: list[tuple[int, int]] = []
    hidden_index, targets, owner = [], [], []
    n_sequences = 0
    for item in items:
        group = item if isinstance(item, Group) else Group((), (item,))
        prefix = list(range(len(ids), len(ids) + len(group.prefix)))
        ids += group.prefix
        positions += range(len(prefix))
        out_slot += [(len(rows), col) for col in range(len(prefix))]  # read from the first member's row
        for member in group.members or (TokenSequence((), ()),):
            start = len(ids)
            own = list(range(start, start + len(member.ids)))
            ids += member.ids
            positions += range(len(prefix), len(prefix) + len(own))
            out_slot += [(len(rows), len(prefix) + col) for col in range(len(own))]
            rows.append(prefix + own)
            for i, trained in enumerate(member.mask):
                if trained:
                    if i == 0 and not prefix:
                        raise ValueError("the first token of a sequence without a prefix cannot be trained")
                    hidden_index.append(start + i - 1 if i else prefix[-1])
                    targets.append(member.ids[i])
                    owner.append(n_sequences)
            n_sequences += bool(member.ids)

    def t(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    layout = Layout.single(len(ids), device) if len(rows) == 1 else Layout.from_rows(rows, positions, out_slot, device)
    return PackedBatch(t(ids), layout, t(hidden_index), t(targets), t(owner), n_sequences)


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
    hidden = model(batch.tokens, batch.layout)  # [T, E]
    selected = hidden.index_select(0, batch.hidden_index)  # [N, E]: logits only where loss is
    logprobs, _ = LOGPROB_PATHS[options.path](
        selected,
        model.output,
        batch.targets.unsqueeze(1),  # [N, 1]
        compute_dtype=model.compute_dtype,
        softcap=model.spec.final_logit_softcap,
        temperature=options.temperature,
        vocab_tile=options.vocab_tile,
        token_chunk=options.token_chunk,
    )
    return logprobs[:, 0]
