"""Optimizer, learning-rate schedule and gradient clipping for the LoRA parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from retrograd.kernels.optim import SGD, AdamW, Optimizer

SCHEDULES = {
    # progress in [0, 1] after warm-up -> multiplier of the base learning rate
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def build_optimizer(params, name: str, lr: float, weight_decay: float) -> Optimizer:
    if name == "adamw":
        return AdamW(params, lr=lr, weight_decay=weight_decay)
    return SGD(params, lr=lr, weight_decay=weight_decay)


def state_shape(field: str, param: torch.Tensor) -> torch.Size:
    """The shape AdamW and SGD keep a parameter's state `field` in: the step count is a
    scalar, moments and momentum are shaped like the parameter."""
    return torch.Size([]) if field == "step" else param.shape


def learning_rate(step: int, *, lr: float, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """LR of optimizer step `step` (0-based): linear warm-up over warmup_steps, then the
    schedule, which for linear and cosine reaches 0 after the last of total_steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    return lr * SCHEDULES[schedule](min((step - warmup_steps) / span, 1.0))


@dataclass(frozen=True)
class Schedule:
    """A run's learning-rate plan. SFT and offline distillation know their step count up
    front. A rollout run plans `updates` updates of total_steps / updates steps each, but an
    update may take fewer (dead groups, fewer samples than minibatches): `total_from`
    re-plans at the start of every update from the steps actually taken, so the last step
    of the run always lands on the schedule's end."""

    lr: float
    scheduler: str
    warmup_steps: int
    total_steps: int  # as planned
    max_grad_norm: float
    updates: int = 1

    def rate(self, step: int, total_steps: int | None = None) -> float:
        return learning_rate(step, lr=self.lr, schedule=self.scheduler, warmup_steps=self.warmup_steps,
                             total_steps=self.total_steps if total_steps is None else total_steps)

    def apply(self, optimizer: Optimizer, step: int, total_steps: int | None = None) -> float:
        """Set the learning rate of optimizer step `step` (0-based); returns it."""
        lr = self.rate(step, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def total_from(self, update: int, steps_done: int, steps_now: int) -> int:
        """Steps of the whole run, as known when update `update` (0-based) starts after
        `steps_done` steps and will take `steps_now`; later updates are assumed full."""
        return steps_done + steps_now + (self.updates - update - 1) * (self.total_steps // self.updates)


def clip_gradients(params, max_norm: float) -> float:
    """Global L2 clip over every trainable gradient (0 = no clipping); returns the norm before."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
