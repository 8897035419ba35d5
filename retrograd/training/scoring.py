"""Teacher-forced log-probabilities of sampled completions, a group's prompt packed once.

GRPO and on-policy distillation score the same things three ways (the current policy with
gradients, the behaviour policy and the reference without): all go through here, so the
packing, and therefore the numbers, are the same each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from retrograd.model.transformer import Transformer
from retrograd.training.batches import Group, LogprobOptions, TokenSequence, batch_logprobs, pack


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


def micro_batch_logprobs(
    model: Transformer, rollouts: Sequence[Rollout], options: LogprobOptions, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch -> (logp [B, T], mask [B, T]): each row holds the log-probs of its
    scored tokens, left-aligned and padded to the longest; rows in the order of `rollouts`;
    differentiable when grad is enabled."""
    by_group: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        by_group.setdefault(r.group, []).append(i)
    items, order = [], []
    for members in by_group.values():
        prompt = rollouts[members[0]].prompt
        items.append(Group(prompt, tuple(rollouts[i].sequence() for i in members)))
        order += members
    batch = pack(items, device)
    flat = batch_logprobs(model, batch, options)  # [N] in packing order
    lengths = [rollouts[i].sequence().n_trained for i in order]
    width = max(lengths)
    logp = flat.new_zeros(len(rollouts), width)  # [B, T]
    mask = torch.zeros(len(rollouts), width, dtype=torch.bool, device=flat.device)  # [B, T]
    rows = torch.tensor(order, device=flat.device)
    cols = torch.cat([torch.arange(n, device=flat.device) for n in lengths])
    row_of = torch.repeat_interleave(rows, torch.tensor(lengths, device=flat.device))
    logp = logp.index_put((row_of, cols), flat)
    mask[row_of, cols] = True
    return logp, mask


def rollout_logprobs(model: Transformer, rollouts: Sequence[Rollout], options: LogprobOptions, budget: int, device) -> list[torch.Tensor]:
    """Per-rollout log-prob vectors without gradients (behaviour or reference scoring)."""
    out: list[torch.Tensor] = [None] * len(rollouts)  # type: ignore[list-item]
    with torch.no_grad():
        for idx in plan(rollouts, budget):
            logp, mask = micro_batch_logprobs(model, [rollouts[i] for i in idx], options, device)
            for row, i in enumerate(idx):
                out[i] = logp[row][mask[row]].float()
    return out
