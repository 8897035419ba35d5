"""Packing sequences into micro-batches and computing their log-probabilities: the one
path from token ids to differentiable per-token log-probs, shared by SFT, GRPO scoring and
distillation.

A micro-batch is a flat stream of packed sequences: positions restart in each sequence and
attention never crosses a sequence boundary (see model.transformer.Layout), except that a
group's members all see their shared prefix, packed and computed once (GRPO scores a
group's prompt once). A group too large for one micro-batch has its prefix computed once in
a pass of its own (SharedPrefix) and its members split over micro-batches that read it.

SFT and offline distillation share the example level too: the epoch plan (a seeded order
packed into micro-batches and optimizer steps) and the held-out mean loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from retrograd.data import TokenSequence
from retrograd.kernels.chunked_logprobs import LOGPROB_PATHS, TOKEN_CHUNK, VOCAB_TILE
from retrograd.model.activation_memory import Merging, merging_pays
from retrograd.model.transformer import Layout, Past, Transformer


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


class SharedPrefix:
    """A group's prefix computed once for every micro-batch its members are split over: per
    layer its keys and values, and the final hidden state of its last token (which predicts
    each member's first token). Under autograd the micro-batches read detached leaves that
    collect their gradients; `backward()` then sends the sum through the prefix's own pass
    once, which gives the gradient a micro-batch holding the whole group would."""

    def __init__(self, model: Transformer, ids: Sequence[int], device):
        captured = Past()
        hidden = model(torch.tensor(list(ids), dtype=torch.long, device=device), capture=captured)  # [P, E]
        n = len(captured.keys)
        outputs = [*captured.keys, *captured.values, hidden[-1]]
        reads = [t.detach().requires_grad_() if t.requires_grad else t for t in outputs]
        self.past = Past(reads[:n], reads[n : 2 * n])
        self.last_hidden = reads[-1]  # [E]
        self._graph = [(out, leaf) for out, leaf in zip(outputs, reads) if out.requires_grad]

    def backward(self) -> None:
        """The gradients the micro-batches left on the leaves, through the prefix's pass."""
        pairs = [(out, leaf.grad) for out, leaf in self._graph if leaf.grad is not None]
        self._graph = []
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


@dataclass(frozen=True)
class Group:
    """A prefix packed once and members that each continue it: GRPO's prompt and its
    completions. A member's mask[0] may be True (its first token follows the prefix). With
    `shared` the prefix was computed by an earlier pass and is not packed again."""

    prefix: tuple[int, ...]
    members: tuple[TokenSequence, ...]
    shared: SharedPrefix | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PackedBatch:
    tokens: torch.Tensor  # [T] every token once (a shared prefix too, unless computed earlier)
    layout: Layout  # how the tokens are cut into attention rows
    hidden_index: torch.Tensor  # [N] rows of [*earlier_hidden, *hidden of the T tokens] that predict a trained token
    targets: torch.Tensor  # [N] the trained token ids
    sequence_index: torch.Tensor  # [N] which packed sequence (group member) each belongs to
    n_sequences: int
    past: Past | None = None  # keys and values of the prefixes computed earlier (the layout's n_past slots)
    earlier_hidden: torch.Tensor | None = None  # [C, E] the last hidden state of each of those prefixes

    @property
    def n_tokens(self) -> int:
        return self.tokens.shape[0]


def pack(items: Sequence, device: torch.device | str = "cpu") -> PackedBatch:
    """Sequences (anything with .ids and .mask) and Groups -> one packed micro-batch."""
    groups = [item if isinstance(item, Group) else Group((), (item,)) for item in items]
    shared = [g for g in groups if g.shared is not None]
    n_past = sum(len(g.prefix) for g in shared)
    positions: list[int] = [pos for g in shared for pos in range(len(g.prefix))]  # the past slots, then the tokens
    ids: list[int] = []
    rows: list[list[int]] = []
    out_slot: list[tuple[int, int]] = []
    hidden_index, targets, owner = [], [], []
    n_sequences = 0
    past_cursor = n_shared = 0
    for group in groups:
        if group.shared is not None:  # its prefix is in the past slots, its last hidden state an earlier row
            prefix = list(range(past_cursor, past_cursor + len(group.prefix)))
            past_cursor += len(prefix)
            last, n_shared = n_shared, n_shared + 1
        else:
            prefix = list(range(n_past + len(ids), n_past + len(ids) + len(group.prefix)))
            ids += group.prefix
            positions += range(len(prefix))
            out_slot += [(len(rows), col) for col in range(len(prefix))]  # read from the first member's row
            last = len(shared) + prefix[-1] - n_past if prefix else None
        for member in group.members or (TokenSequence((), ()),):
            start = len(ids)
            own = list(range(n_past + start, n_past + start + len(member.ids)))
            ids += member.ids
            positions += range(len(prefix), len(prefix) + len(own))
            out_slot += [(len(rows), len(prefix) + col) for col in range(len(own))]
            rows.append(prefix + own)
            for i, trained in enumerate(member.mask):
                if trained:
                    if i == 0 and last is None:
                        raise ValueError("the first token of a sequence without a prefix cannot be trained")
                    hidden_index.append(len(shared) + start + i - 1 if i else last)
                    targets.append(member.ids[i])
                    owner.append(n_sequences)
            n_sequences += bool(member.ids)

    def t(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    if len(rows) == 1 and not shared:
        layout = Layout.single(len(ids), device)
    else:
        layout = Layout.from_rows(rows, positions, out_slot, device, n_past)
    past = earlier = None
    if shared:
        n_layers = len(shared[0].shared.past.keys)
        past = Past(
            [_cat([g.shared.past.keys[i] for g in shared]) for i in range(n_layers)],
            [_cat([g.shared.past.values[i] for g in shared]) for i in range(n_layers)],
        )
        earlier = torch.stack([g.shared.last_hidden for g in shared])
    return PackedBatch(t(ids), layout, t(hidden_index), t(targets), t(owner), n_sequences, past, earlier)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


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


def merge_micro_batches(micro_batches: list[list[int]], lengths: Sequence[int] | Mapping[int, int],
                        merging: Merging | None) -> tuple[list[list[int]], list[bool]]:
    """A step's micro-batches (item indices; `lengths[i]` tokens each) as the passes that run
    them, and for each whether it runs checkpointed at every layer (merged_passes). With
    `merging`, and where that pays (merging_pays), the items are repacked in order into fewer
    passes of up to merging.cap tokens that keep no more than the largest micro-batch would;
    a pass that holds one micro-batch's items or fewer runs as configured."""
    unmerged = micro_batches, [False] * len(micro_batches)
    if merging is None or len(micro_batches) < 2:
        return unmerged
    items = [i for mb in micro_batches for i in mb]
    budget, _ = merging.budgets(max(sum(lengths[i] for i in mb) for mb in micro_batches))
    passes = [[items[j] for j in mb] for mb in plan_micro_batches([lengths[i] for i in items], min(budget, merging.cap))]
    if not merging_pays(len(micro_batches), len(passes), sum(lengths[i] for i in items)):
        return unmerged
    home = {i: k for k, mb in enumerate(micro_batches) for i in mb}
    return passes, [len({home[i] for i in p}) > 1 for p in passes]


def merged_passes(model: Transformer, checkpointed: bool):
    """The scope of a merged pass: checkpointed at every layer."""
    return model.checkpointed(1) if checkpointed else nullcontext()


def batch_hidden(model: Transformer, batch: PackedBatch) -> torch.Tensor:
    """The final hidden states [N, E] that predict the batch's trained tokens (the state
    before each of them)."""
    hidden = model(batch.tokens, batch.layout, past=batch.past)  # [T, E]
    if batch.earlier_hidden is not None:
        hidden = torch.cat([batch.earlier_hidden, hidden])  # [C + T, E]
    return hidden.index_select(0, batch.hidden_index)  # [N, E]


def batch_logprobs(model: Transformer, batch: PackedBatch, options: LogprobOptions = LogprobOptions()) -> torch.Tensor:
    """Log-probabilities [N] of the batch's trained tokens, differentiable w.r.t. the LoRA."""
    logprobs, _ = LOGPROB_PATHS[options.path](
        batch_hidden(model, batch),  # [N, E]: logits only where loss is
        model.output,
        batch.targets.unsqueeze(1),  # [N, 1]
        compute_dtype=model.compute_dtype,
        softcap=model.spec.final_logit_softcap,
        temperature=options.temperature,
        vocab_tile=options.vocab_tile,
        token_chunk=options.token_chunk,
    )
    return logprobs[:, 0]


def epoch_plan(lengths: Sequence[int], epoch: int, *, seed: int, shuffle: bool, micro_batch: int, accumulation: int,
               items_per_step: int | None = None):
    """Items of these token lengths -> list of optimizer steps, each a list of micro-batches of
    item indices: `accumulation` micro-batches per step, or with `items_per_step` that many
    items per step, packed into as many micro-batches as they need."""
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    if items_per_step:
        steps = [order[i : i + items_per_step] for i in range(0, len(order), items_per_step)]
        return [[[int(step[j]) for j in mb] for mb in plan_micro_batches([lengths[k] for k in step], micro_batch)] for step in steps]
    micro = [[int(order[j]) for j in mb] for mb in plan_micro_batches([lengths[i] for i in order], micro_batch)]
    return [micro[i : i + accumulation] for i in range(0, len(micro), accumulation)]


def mean_loss(setup, examples, options: LogprobOptions) -> tuple[float, list[float]]:
    """Mean NLL per supervised token over `examples`, and each example's own mean."""
    transformer = setup.model.transformer
    per_example = []
    total = count = 0.0
    with torch.no_grad():
        for mb in plan_micro_batches([len(e.ids) for e in examples], setup.cfg.training.micro_batch):
            batch = pack([examples[i] for i in mb], setup.device)
            nll = -batch_logprobs(transformer, batch, options).double()
            sums = torch.zeros(len(mb), dtype=torch.float64).index_add_(0, batch.sequence_index.cpu(), nll.cpu())
            counts = torch.bincount(batch.sequence_index.cpu(), minlength=len(mb))
            per_example += (sums / counts.clamp(min=1)).tolist()
            total += float(sums.sum())
            count += int(counts.sum())
    return total / max(count, 1), per_example
