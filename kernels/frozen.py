"""Frozen base weights that stay in their GGUF blocks, and the matmul that uses them.

A FrozenWeight holds either the raw GGUF bytes (dequantized per use) or a dense tensor
(the `bf16` / `f32` weight modes, `auto` when it fits, or GGUF tensors that are already
F32). Beside its blocks it may carry a dense copy in the compute dtype (`kept`) for the
model's life: `auto`'s token embedding, whose float32 rows still come from the blocks while
its matmuls use the copy. The copy holds exactly what dequantizing per use gives, so results
are the same bits either way.

`frozen_linear` is an autograd function that saves nothing for backward but the weight
handle: without a kept copy the backward pass dequantizes again instead of keeping a dense
copy alive. Such per-use matrices are `borrow_rows`: dequantized on the CPU into a buffer
the thread reuses for that shape, since a fresh matrix per use (two per weight and pass)
fragmented the heap: a 0.5B Q4_0 SFT run peaked at 3.0-3.1 GiB instead of 2.5-2.6 (f32).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

import psutil
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from retrograd.kernels import native_dequant
from retrograd.kernels.dequant import CODECS, dequantize

# Dense copies (`weights = "auto"`) may take at most this share of the memory that
# is free when they are made: host RAM as psutil's `available`, or the GPU's free memory.
DENSE_BUDGET_FRACTION = 0.5
HOST_MEMORY_ENV = "RETROGRAD_HOST_MEMORY"


class FrozenWeight:
    """A base weight `[n_out, n_in]` (torch order) that never receives a gradient, or a stack
    of them `[n_expert, n_out, n_in]` (a mixture's experts, one GGUF tensor), held as one
    matrix of n_expert * n_out rows: expert e is rows e * n_out to (e + 1) * n_out."""

    def __init__(self, name: str, data: torch.Tensor, qtype: QT, shape: tuple[int, ...]):
        self.name = name
        self.data = data  # uint8 [n_rows, row_bytes] for block types; float [n_rows, n_in] when dense
        self.qtype = qtype
        self.shape = shape
        self.kept: torch.Tensor | None = None  # a dense copy of `data` in one float dtype, while kept

    @property
    def n_rows(self) -> int:
        """Rows of the matrix the weight is held as (n_out, or n_expert * n_out for a stack)."""
        return math.prod(self.shape[:-1])

    @property
    def is_dense(self) -> bool:
        return self.data.is_floating_point()

    @property
    def nbytes(self) -> int:
        held = self.data.numel() * self.data.element_size()
        return held + (0 if self.kept is None else self.kept.numel() * self.kept.element_size())

    def ready(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The dense matrix in `dtype` when one is held (no work to get it), else None."""
        if self.kept is not None and self.kept.dtype == dtype:
            return self.kept
        if self.is_dense and self.data.dtype == dtype:
            return self.data
        return None

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole matrix in `dtype`."""
        held = self.ready(dtype)
        if held is not None:
            return held
        if self.is_dense:
            return self.data.to(dtype)
        return dequantize(self.data, self.qtype, (self.n_rows, self.shape[-1]), dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` (any shape) -> `[*index.shape, n_in]`: an embedding lookup."""
        held = self.ready(dtype)
        if held is not None:
            return held[index]
        if self.is_dense:
            return self.data[index].to(dtype)
        flat = index.reshape(-1)
        out = dequantize(self.data[flat], self.qtype, (flat.numel(), self.shape[-1]), dtype)
        return out.reshape(*index.shape, self.shape[-1])

    def row_range(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start..stop -> `[stop-start, n_in]`: one vocabulary tile of an output head, one expert of a stack."""
        held = self.ready(dtype)
        if held is not None:
            return held[start:stop]
        if self.is_dense:
            return self.data[start:stop].to(dtype)
        return dequantize(self.data[start:stop], self.qtype, (stop - start, self.shape[-1]), dtype)

    def borrow_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """`row_range` for a matrix used once and dropped (one matmul): a quantized weight on
        the CPU is dequantized into this thread's buffer for that shape and dtype, which the
        thread's next borrow of the same shape overwrites. Other devices have a caching
        allocator and get a fresh matrix."""
        if self.ready(dtype) is not None or self.is_dense or self.data.device.type != "cpu":
            return self.row_range(start, stop, dtype)
        shape = (stop - start, self.shape[-1])
        if dtype in native_dequant.OUTPUTS:  # written in that dtype by the C loops, or copied into it once
            return dequantize(self.data[start:stop], self.qtype, shape, dtype, out=_buffer(shape, dtype))
        values = dequantize(self.data[start:stop], self.qtype, shape, out=_buffer(shape, torch.float32))
        return _buffer(shape, dtype).copy_(values)

    def dense_nbytes(self, dtype: torch.dtype) -> int:
        """What a dense copy in `dtype` costs."""
        return self.n_rows * self.shape[-1] * dtype.itemsize

    def to(self, device: torch.device) -> FrozenWeight:
        if self.data.device == device:
            return self
        moved = FrozenWeight(self.name, self.data.to(device), self.qtype, self.shape)
        moved.kept = None if self.kept is None else self.kept.to(device)
        return moved

    def to_dense(self, dtype: torch.dtype) -> FrozenWeight:
        """A copy dequantized once (the `bf16` / `f32` weight modes)."""
        return FrozenWeight(self.name, self.dense(dtype).contiguous(), self.qtype, self.shape)

    def __repr__(self) -> str:
        return f"FrozenWeight({self.name}, {self.qtype.name}, {list(self.shape)})"


class _Buffers(threading.local):
    def __init__(self):
        self.by_shape: dict[tuple, torch.Tensor] = {}  # (shape, dtype) -> this thread's matrix


_buffers = _Buffers()


def _buffer(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """This thread's reusable CPU matrix of `shape` and `dtype` (contents undefined)."""
    key = (shape, dtype)
    if key not in _buffers.by_shape:
        _buffers.by_shape[key] = torch.empty(shape, dtype=dtype)
    return _buffers.by_shape[key]


def torch_dequantizable(qtype: QT) -> bool:
    return qtype in CODECS


@dataclass(frozen=True)
class Budget:
    """What dense copies may take on a device now: DENSE_BUDGET_FRACTION of its free memory."""

    nbytes: int
    free: int
    where: str  # "RAM" or "GPU memory"

    def __str__(self) -> str:
        return f"{self.nbytes / 2**20:.0f} MiB, {DENSE_BUDGET_FRACTION:.0%} of {self.free / 2**30:.1f} GiB free {self.where}"


def dense_budget(device: torch.device) -> Budget:
    """Free memory: psutil's `available` host RAM (what can be allocated without swapping),
    at most $RETROGRAD_HOST_MEMORY bytes when set (`preflight --memory` sets it for its
    probes, so they choose as a run on that smaller machine would), or the GPU's free memory."""
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], "GPU memory"
    else:
        free, where = min(psutil.virtual_memory().available, int(os.environ.get(HOST_MEMORY_ENV, 2**62))), "RAM"
    return Budget(int(DENSE_BUDGET_FRACTION * free), free, where)


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: FrozenWeight, start: int, stop: int) -> torch.Tensor:
        ctx.weight, ctx.rows = weight, (start, stop)
        return F.linear(x, weight.borrow_rows(start, stop, x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out @ ctx.weight.borrow_rows(*ctx.rows, grad_out.dtype), None, None, None


def frozen_linear(x: torch.Tensor, weight: FrozenWeight, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """x @ W.T for a frozen W, or for its rows start..stop (one expert of a stack: only
    those rows are dequantized). Without gradients a weight held dense in x's dtype goes
    straight to F.linear; with them every weight goes through _FrozenLinear, which saves no
    tensor for backward (F.linear would save W, a dense copy's cast included): so a checkpointed
    pass's recomputation can stop before it (see retrograd.model.lora._LoRADelta)."""
    start, stop = rows or (0, weight.n_rows)
    if not (torch.is_grad_enabled() and x.requires_grad):
        held = weight.ready(x.dtype)
        if held is not None:
            return F.linear(x, held[start:stop])
    return _FrozenLinear.apply(x, weight, start, stop)
