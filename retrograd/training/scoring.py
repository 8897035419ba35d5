"""Teacher-forced log-probabilities of sampled completions, a group's prompt packed once.

GRPO and on-policy distillation score the same things three ways (the current policy with
gradients, the behaviour policy and the reference without): all go through here, so the
packing, and therefore the numbers, are the same each time.

A group whose prompt and completions do not fit one micro-batch (a small
training.micro_batch) is split: its prompt is computed once (SharedPrefix) and its
completions fill micro-batches by their own tokens, reading the prompt's keys and values.
Recomputing the prompt in every micro-batch instead made a small micro_batch cost several
times a large one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from retrograd.data import TokenSequence
from retrograd.model.activation_memory import Merging, merging_pays
from retrograd.model.transformer import Transformer
from retrograd.training.batches import Group, LogprobOptions, SharedPrefix, batch_hidden, batch_logprobs, pack


@dataclass(frozen=True)
class Rollout:
    """What scoring needs of one sample: its prompt (shared by its group), the tokens after
    it, and which of those the policy produced (None: all of them). Only those are scored."""

    group: int  # rollouts with the same group share the prompt
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    mask: tuple[bool, ...] | None = None

    def sequence(self) -> TokenSequence:
        return TokenSequence(self.tokens, self.mask if self.mask is not None else (True,) * len(self.tokens))


def plan(rollouts: Sequence[Rollout], budget: int) -> list[list[int]]:
    """Rollout indices per micro-batch: a group's members stay together while they fit
    `budget` tokens (prompt counted once per micro-batch), in the given order."""
    batches: list[list[int]] = []
    current: list[int] = []
    used, groups = 0, set()
    for i, r in enumerate(rollouts):
        cost = len(r.tokens) + (0 if r.group in groups else len(r.prompt))
        if current and used + cost > budget:
            batches.append(current)
            current, used, groups = [], 0, set()
            cost = len(r.tokens) + len(r.prompt)
        current.append(i)
        groups.add(r.group)
        used += cost
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class MicroBatch:
    rollouts: list[int]  # indices, a group's members adjacent
    split: bool = False  # members of one group too large for a micro-batch: its prompt is a SharedPrefix


def plan_shared(rollouts: Sequence[Rollout], budget: int) -> list[MicroBatch]:
    """Micro-batches of at most `budget` tokens (at least one rollout each), in the given
    order. Whole groups (prompt counted once) are packed together while they fit; a group
    that fits no micro-batch is split, its prompt computed once and its members packed by
    their own tokens."""
    batches: list[MicroBatch] = []
    current: list[int] = []
    used = 0
    for _, run in itertools.groupby(range(len(rollouts)), key=lambda i: rollouts[i].group):
        members = list(run)
        cost = len(rollouts[members[0]].prompt) + sum(len(rollouts[i].tokens) for i in members)
        if current and used + cost > budget:
            batches.append(MicroBatch(current))
            current, used = [], 0
        if cost <= budget:
            current += members
            used += cost
            continue
        chunk, chunk_used = [], 0
        for i in members:
            n = len(rollouts[i].tokens)
            if chunk and chunk_used + n > budget:
                batches.append(MicroBatch(chunk, split=True))
                chunk, chunk_used = [], 0
            chunk.append(i)
            chunk_used += n
        batches.append(MicroBatch(chunk, split=True))
    if current:
        batches.append(MicroBatch(current))
    return batches


@dataclass(frozen=True)
class Passes:
    """Tokens per pass in an update: `train` with gradients (checkpointed every
    `checkpoint_every` layers, 0: not at all), `score` without."""

    train: int
    score: int
    checkpoint_every: int


def plan_passes(rollouts: Sequence[Rollout], micro_batch: int, merging: Merging | None, checkpoint_every: int) -> Passes:
    """How an update's `rollouts` are split into passes: micro-batches of `micro_batch` tokens,
    or, where those are small (`merging`), merged passes that keep no more than the largest of
    them would; passes with gradients merge only where that pays for recomputing their layers
    (merging_pays)."""
    if merging is None:
        return Passes(micro_batch, micro_batch, checkpoint_every)
    configured = plan_shared(rollouts, micro_batch)
    train, score = merging.budgets(max(batch_tokens(rollouts, batch) for batch in configured))
    tokens = sum(len(r.tokens) for r in rollouts) + sum(len(r.prompt) for r in {r.group: r for r in rollouts}.values())
    if merging_pays(len(configured), len(plan_shared(rollouts, train)), tokens):
        return Passes(train, score, 1)
    return Passes(micro_batch, score, checkpoint_every)


def batch_tokens(rollouts: Sequence[Rollout], batch: MicroBatch) -> int:
    """Tokens whose activations a pass over `batch` keeps: each group's prompt once and the
    members' tokens; a split group's prompt is computed once but kept while each of its
    micro-batches runs, so it counts with each."""
    members = [rollouts[i] for i in batch.rollouts]
    return sum(len(r.tokens) for r in members) + sum(len(r.prompt) for r in {r.group: r for r in members}.values())


def scored_micro_batches(
    model: Transformer, rollouts: Sequence[Rollout], batches: Sequence[MicroBatch], options: LogprobOptions, device,
    score: Callable | None = None,
) -> Iterator[tuple[MicroBatch, torch.Tensor, torch.Tensor]]:
    """(batch, logp [B, T], mask [B, T]) for each of `batches` in turn (micro_batch_logprobs,
    or what `score` computes from the same packing: micro_batch_features). A split group's
    prompt is computed when its first micro-batch comes. Under autograd the caller
    backpropagates each micro-batch's loss before asking for the next one; after the group's
    last micro-batch its prompt's own backward runs."""
    score = score or micro_batch_logprobs
    shared: SharedPrefix | None = None
    for k, batch in enumerate(batches):
        chosen = [rollouts[i] for i in batch.rollouts]
        if batch.split and shared is None:
            shared = SharedPrefix(model, chosen[0].prompt, device)
        yield batch, *score(model, chosen, options, device, shared if batch.split else None)
        last_of_group = k + 1 == len(batches) or not batches[k + 1].split or rollouts[batches[k + 1].rollouts[0]].group != chosen[0].group
        if shared is not None and last_of_group:
            shared.backward()
            shared = None


def micro_batch_logprobs(
    model: Transformer, rollouts: Sequence[Rollout], options: LogprobOptions, device, shared: SharedPrefix | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch -> (logp [B, T], mask [B, T]): each row holds the log-probs of its
    scored tokens, left-aligned and padded to the longest; rows in the order of `rollouts`;
    differentiable when grad is enabled. `shared`: the rollouts are members of one group
    whose prompt was computed already."""
    batch, order = _packed(rollouts, device, shared)
    return _per_rollout(batch_logprobs(model, batch, options), rollouts, order)


def micro_batch_features(
    model: Transformer, rollouts: Sequence[Rollout], options: LogprobOptions, device, shared: SharedPrefix | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch -> (features [B, T, E], mask [B, T]): the final hidden state before
    each scored token (PPO's critic reads them), laid out as micro_batch_logprobs lays out
    log-probs."""
    batch, order = _packed(rollouts, device, shared)
    return _per_rollout(batch_hidden(model, batch), rollouts, order)


def _packed(rollouts: Sequence[Rollout], device, shared: SharedPrefix | None):
    """The micro-batch packed with each group's prompt once, and the rollout of each packed
    sequence in packing order."""
    by_group: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        by_group.setdefault(r.group, []).append(i)
    items, order = [], []
    for members in by_group.values():
        prompt = rollouts[members[0]].prompt
        items.append(Group(prompt, tuple(rollouts[i].sequence() for i in members), shared))
        order += members
    return pack(items, device), order


def _per_rollout(flat: torch.Tensor, rollouts: Sequence[Rollout], order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token values [N, ...] in packing order -> ([B, T, ...] with rows in the order of
    `rollouts`, left-aligned and zero-padded; mask [B, T])."""
    lengths = [rollouts[i].sequence().n_trained for i in order]
    width = max(lengths)
    out = flat.new_zeros(len(rollouts), width, *flat.shape[1:])  # [B, T, ...]
    mask = torch.zeros(len(rollouts), width, dtype=torch.bool, device=flat.device)  # [B, T]
    rows = torch.tensor(order, device=flat.device)
    cols = torch.cat([torch.arange(n, device=flat.device) for n in lengths])
    row_of = torch.repeat_interleave(rows, torch.tensor(lengths, device=flat.device))
    out = out.index_put((row_of, cols), flat)
    mask[row_of, cols] = True
    return out, mask


def rollout_logprobs(model: Transformer, rollouts: Sequence[Rollout], options: LogprobOptions, budget: int, device,
                     score: Callable | None = None) -> list[torch.Tensor]:
    """Per-rollout log-prob vectors [n] without gradients (behaviour or reference scoring),
    or what `score` computes per scored token (rollout_features)."""
    out: list[torch.Tensor] = [None] * len(rollouts)  # type: ignore[list-item]
    batches = plan_shared(rollouts, budget)
    with torch.no_grad():
        for batch, values, mask in scored_micro_batches(model, rollouts, batches, options, device, score):
            for row, i in enumerate(batch.rollouts):
                out[i] = values[row][mask[row]].float()
    return out


def rollout_features(model: Transformer, rollouts: Sequence[Rollout], budget: int, device) -> list[torch.Tensor]:
    """Per-rollout [n, E]: the final hidden state before each scored token, packed and split
    over micro-batches as scoring packs them (PPO's critic reads them)."""
    return rollout_logprobs(model, rollouts, LogprobOptions(), budget, device, score=micro_batch_features)
