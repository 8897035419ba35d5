"""Gradient checkpointing of a segment of blocks: its forward keeps none of the tensors autograd
saves (only the segment's input stays alive), and the backward recomputes them on first use.

torch.utils.checkpoint does the same (its non-reentrant form) but imports torch._dynamo when
first called, 2-3 s of a 2-core CPU's start-up in every checkpointed run and preflight probe.
The model has no dropout and no autocast, so no RNG or autocast state needs replaying; what is
kept from torch's design: saved-tensor hooks (the segment's output stays in the caller's
graph), recomputation that stops as soon as every saved tensor is back (so a segment's last
frozen matmul, whose output nothing saves, is not recomputed), each recomputed tensor
released as autograd takes it, and a refusal when the recomputation saves something else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _AllRecomputed(Exception):
    """Raised from the recomputation's pack hook to stop the segment's forward early."""


def checkpoint_segment(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """fn(*args), with fn's saved tensors recomputed during backward instead of kept."""
    frame = _Frame(fn, args)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args)


class _Frame:
    def __init__(self, fn: Callable[..., torch.Tensor], args: tuple):
        self.fn, self.args = fn, args
        self.saved: list[tuple[torch.Size, torch.dtype]] = []  # what the forward saved, in order
        self.recomputed: dict[int, torch.Tensor] = {}

    def pack(self, x: torch.Tensor) -> int:
        self.saved.append((x.shape, x.dtype))
        return len(self.saved) - 1

    def unpack(self, index: int) -> torch.Tensor:
        if index not in self.recomputed:
            self.recompute()
        return self.recomputed.pop(index)  # autograd holds it from here; the frame lets go

    def recompute(self) -> None:
        count = 0

        def keep(x: torch.Tensor) -> None:
            nonlocal count
            if count >= len(self.saved) or (x.shape, x.dtype) != self.saved[count]:
                expected = _described(*self.saved[count]) if count < len(self.saved) else "nothing more"
                raise RuntimeError(f"gradient checkpointing: the recomputed segment saved tensor {count} as "
                                   f"{_described(x.shape, x.dtype)}, its forward as {expected}")
            self.recomputed[count] = x.detach()
            count += 1
            if count == len(self.saved):
                raise _AllRecomputed

        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, _never_unpacked):
                self.fn(*self.args)
        except _AllRecomputed:
            return
        raise RuntimeError(f"gradient checkpointing: the recomputed segment saved {count} tensors, its forward {len(self.saved)}")


def _described(shape: torch.Size, dtype: torch.dtype) -> str:
    return f"{tuple(shape)} {dtype}"


def _never_unpacked(_):
    raise AssertionError("the recomputation's own graph is never run backward")
