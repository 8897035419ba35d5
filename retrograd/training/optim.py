"""Optimizer, learning-rate schedule and gradient clipping for the LoRA parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULES = {
    # progress in [0, 1] after warm-up -> multiplier of the base learning rate
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


class Optimizer:
    """The part of torch.optim.Optimizer our loops use (`param_groups`, `step`, `zero_grad`,
    `state_dict`, `load_state_dict`), with torch's state-dict layout, so checkpoints written
    by torch's optimizers load here. Not torch.optim itself: the first call into any of its
    optimizers imports torch._dynamo, which costs 2 s of every run's start on a CPU."""

    def __init__(self, params, **hyper):
        self.param_groups = [{"params": list(params), **hyper}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        number = {p: i for i, p in enumerate(self._params())}
        groups, first = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(first, first + n))})
            first += n
        return {"state": {number[p]: dict(s) for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        """Saved moments cast to their parameter's device and dtype (the step count keeps its
        own), saved hyperparameters over the live ones; keys torch adds that we do not use
        (amsgrad, foreach, ...) are ignored."""
        groups = saved["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(live["params"]) for g, live in zip(groups, self.param_groups)):
            raise ValueError("the saved parameter groups do not match this optimizer's")
        params = dict(zip((i for g in groups for i in g["params"]), self._params()))
        self.state = {}
        for number, fields in saved["state"].items():
            p = params[int(number)]
            self.state[p] = {k: v.to(p.device, None if k == "step" else p.dtype, copy=True) for k, v in fields.items()}
        for group, live in zip(groups, self.param_groups):
            live.update({k: group[k] for k in live if k != "params"})


class AdamW(Optimizer):
    """torch.optim.AdamW's arithmetic as its single-tensor path runs it (the path it takes
    on a CPU): the same operations in the same order, so the same numbers bit for bit."""

    def __init__(self, params, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p not in self.state:
                    self.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
                state = self.state[p]
                state["step"] += 1
                if decay != 0:
                    p.mul_(1 - lr * decay)
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step = state["step"].item()
                denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


class SGD(Optimizer):
    """torch.optim.SGD without momentum: no state, the same arithmetic as torch's."""

    def __init__(self, params, lr: float, weight_decay: float):
        super().__init__(params, lr=lr, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] != 0 else p.grad
                    p.add_(grad, alpha=-group["lr"])


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
