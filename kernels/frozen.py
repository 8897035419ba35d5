"""Frozen base weights that stay in their GGUF blocks, and the matmul that uses them.

A FrozenWeight holds either the raw GGUF bytes (dequantized per use) or a dense tensor
(the `bf16` / `f32` weight modes, or GGUF tensors that are already F32). `frozen_linear`
is an autograd function that saves nothing for backward but the weight handle: the
backward pass dequantizes again instead of keeping a dense copy alive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from retrograd.kernels.dequant import CODECS, dequantize


class FrozenWeight:
    """A 2-D base weight `[n_out, n_in]` (torch order) that never receives a gradient."""

    def __init__(self, name: str, data: torch.Tensor, qtype: QT, shape: tuple[int, int]):
        self.name = name
        self.data = data  # uint8 [n_out, row_bytes] for block types; float [n_out, n_in] when dense
        self.qtype = qtype
        self.shape = shape

    @property
    def is_dense(self) -> bool:
        return self.data.is_floating_point()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self.is_dense:
            return self.data.to(dtype)
        return dequantize(self.data, self.qtype, self.shape, dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` (any shape) -> `[*index.shape, n_in]`: an embedding lookup."""
        if self.is_dense:
            return self.data[index].to(dtype)
        flat = index.reshape(-1)
        out = dequantize(self.data[flat], self.qtype, (flat.numel(), self.shape[1]), dtype)
        return out.reshape(*index.shape, self.shape[1])

    def row_range(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start..stop -> `[stop-start, n_in]`: one vocabulary tile of an output head."""
        if self.is_dense:
            return self.data[start:stop].to(dtype)
        return dequantize(self.data[start:stop], self.qtype, (stop - start, self.shape[1]), dtype)

    def to(self, device: torch.device) -> FrozenWeight:
        return self if self.data.device == device else FrozenWeight(self.name, self.data.to(device), self.qtype, self.shape)

    def to_dense(self, dtype: torch.dtype) -> FrozenWeight:
        """A copy dequantized once (the `bf16` / `f32` weight modes)."""
        return FrozenWeight(self.name, self.dense(dtype).contiguous(), self.qtype, self.shape)

    def __repr__(self) -> str:
        return f"FrozenWeight({self.name}, {self.qtype.name}, {list(self.shape)})"


def torch_dequantizable(qtype: QT) -> bool:
    return qtype in CODECS


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: FrozenWeight) -> torch.Tensor:
        ctx.weight = weight
        return F.linear(x, weight.dense(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        w = ctx.weight.dense(grad_out.dtype)
        return grad_out @ w, None


def frozen_linear(x: torch.Tensor, weight: FrozenWeight) -> torch.Tensor:
    """x @ W.T for a frozen W; dense weights go straight to F.linear."""
    if weight.is_dense:
        return F.linear(x, weight.data if weight.data.dtype == x.dtype else weight.data.to(x.dtype))
    return _FrozenLinear.apply(x, weight)
