"""What a rollout recipe hands the loop (training/rollout_loop.py) and what it gets back for
each batch: below both the loop and its batch sources, which share these types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from retrograd.training.rollout_step import TrainSample, UpdateResult
from retrograd.training.timeline import PhaseClock


@dataclass(frozen=True)
class Batch:
    """One update's rollouts as the producer left them."""

    update: int
    rollouts: tuple  # the recipe's frozen records
    cursor: int = 0  # the data position after these rollouts (checkpointed with the update that trains them)
    metrics: dict = field(default_factory=dict)  # measured while producing: completions/*, agent/*, env/*


@dataclass(frozen=True)
class Decision:
    """What the trainer made of one rollout; joined with the record for rollouts.jsonl."""

    advantage: float
    trained: bool
    skip_reason: str | None = None


@dataclass(frozen=True)
class TrainPlan:
    """What `plan` makes of a batch."""

    samples: tuple[TrainSample, ...]
    trained: tuple[int, ...]  # the rollout index of each sample
    decisions: tuple[Decision, ...]  # one per rollout of the batch
    metrics: dict  # reward/*, batch/* and the like
    beta: float = 0.0  # the KL coefficient of this update
    state: dict = field(default_factory=dict)  # the recipe's checkpointed counters after this update
    discarded_groups: int = 0  # groups without a learning signal (timeline.jsonl counts them)
    note: str | None = None  # said when there is nothing to train
    halt: str | None = None  # stop cleanly after this update, saying why
    fail: str | None = None  # stop with an error once this update's records are written


@dataclass(frozen=True)
class Evaluation:
    """A held-out evaluation's value and what to log and say about it."""

    value: float
    metrics: dict
    line: str  # "eval update 3/10: mean reward …" (the loop adds best / stale)
    higher_is_better: bool = True


@dataclass(frozen=True)
class RolloutRecipe:
    """A rollout algorithm as the loop runs it."""

    name: str  # the plan line's first word: "grpo", "agent_grpo", "distill on_policy (jsd)"
    plan_line: str  # the rest of that line: updates, epochs, prompts, groups
    updates: int
    epochs_label: str  # the summary's name for epochs per update
    epochs: int
    minibatches: int
    budget_tokens: int  # the loss denominator's per-sample token budget
    phases: tuple[str, ...]  # the timing keys, in report order
    columns: tuple[str, ...]  # the table's columns after update and step
    loss_key: str
    produce: Callable[[int, int, PhaseClock], Batch]  # (update, cursor, clock) -> the update's rollouts
    plan: Callable[[Batch, dict, PhaseClock], TrainPlan]  # (batch, state, clock) -> samples and decisions
    record: Callable[[Any, Decision, list | None, int, int], dict]  # (rollout, decision, policy log-probs, update, cap)
    row: Callable[[dict], dict]  # metrics -> the table's values for `columns`
    status: Callable[[dict], str]  # metrics -> the progress bar's text
    evaluate: Callable[[int], Evaluation] | None = None
    state: dict = field(default_factory=dict)  # the recipe's counters at the start of a run
    settle: Callable[[dict, dict], dict] | None = None  # (state, metrics) -> state, after the optimizer
    train: Callable[..., UpdateResult] | None = None  # replaces PolicyOptimizer.update (distill's jsd)
    kl_reference: str = "base"  # what the KL term pulls toward: "base" (adapter off) or "behavior" (ppo)
