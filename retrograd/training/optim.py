"""Optimizer, learning-rate schedule and gradient clipping for the LoRA parameters."""

from __future__ import annotations

import math

import torch

SCHEDULES = {
    # progress in [0, 1] after warm-up -> multiplier of the base learning rate
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def build_optimizer(params, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)


def learning_rate(step: int, *, lr: float, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """LR of optimizer step `step` (0-based): linear warm-up over warmup_steps, then the
    schedule, which for linear and cosine reaches 0 after the last of total_steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    return lr * SCHEDULES[schedule](min((step - warmup_steps) / span, 1.0))


def clip_gradients(params, max_norm: float) -> float:
    """Global L2 clip over every trainable gradient (0 = no clipping); returns the norm before."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
