"""The pieces the dense and the mixture-of-experts feed-forward share (transformer.py,
moe.py): a frozen GGUF linear layer and the gated product of an FFN."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from retrograd.kernels import gated
from retrograd.kernels.frozen import FrozenWeight, frozen_linear


class FrozenLinear(nn.Module):
    """y = x W^T (+ b) with a frozen GGUF weight. LoRA wraps this module (retrograd.model.lora)."""

    def __init__(self, weight: FrozenWeight, bias: torch.Tensor | None):
        super().__init__()
        self.weight = weight  # a plain attribute: not a parameter, never in state_dict
        self.register_buffer("bias", bias, persistent=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = frozen_linear(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def split(self, x: torch.Tensor):
        """As LoRALinear.split: the output, and no delta."""
        return self(x), None, None


# gpt-oss's clamped SwiGLU (llama.cpp's swiglu_oai; both constants fixed in its graph, not read from the file)
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def _swiglu_oai_gate(x: torch.Tensor) -> torch.Tensor:
    """min(x, limit) * sigmoid(alpha * min(x, limit))."""
    x = x.clamp(max=SWIGLU_OAI_LIMIT)
    return x * torch.sigmoid(SWIGLU_OAI_ALPHA * x)


def _swiglu_oai_gate_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    c = x.clamp(max=SWIGLU_OAI_LIMIT)
    s = torch.sigmoid(SWIGLU_OAI_ALPHA * c)
    return grad * (s + SWIGLU_OAI_ALPHA * c * s * (1 - s)) * (x <= SWIGLU_OAI_LIMIT)


# spec.ffn_act -> (act, (grad, x) -> grad * act'(x))
GATE_ACTIVATIONS = {
    "silu": (F.silu, torch.ops.aten.silu_backward),
    "gelu": (lambda x: F.gelu(x, approximate="tanh"), lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh")),
    "swiglu_oai": (_swiglu_oai_gate, _swiglu_oai_gate_backward),
}
# spec.ffn_act -> what multiplies act(gate) in place of up itself: (u(up), (grad, up) -> grad * u'(up))
GATED_UP = {
    "swiglu_oai": (lambda up: up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1,
                   lambda grad, up: grad * (up.abs() <= SWIGLU_OAI_LIMIT)),
}


class GatedProduct(torch.autograd.Function):
    """act(gate) * up in float32 (a LoRA's delta on gate or up is below bf16's resolution
    of them), rounded once to `dtype` for the down projection. gate and up are projections
    in `dtype`, each with an optional LoRA delta scale * (x A^T) B^T given as its factors
    h = x A^T [T, r] and b = scale * B [F, r] (LoRALinear.split), added here in float32: one
    node instead of a LoRA sum per projection feeding this one, whose float32 outputs and
    gradients cost four casts of [T, F] per layer.

    Saves only gate and up, in `dtype`: autograd would keep act(gate) as well, and float32
    copies. In bf16 compute that halves the largest activations a pass keeps (gate and up
    are 2-5x the model's width). The backward runs in `dtype` too: the gradient arrives in
    it from the down projection and leaves for the gate and up projections' bf16 backward
    matmuls. On the CPU, silu runs as one C pass each way (kernels/gated.py)."""

    @staticmethod
    def forward(ctx, gate, up, gate_h, gate_b, up_h, up_b, act: str, dtype):
        ctx.act = act
        shape = gate.shape
        gate, up = gate.flatten(0, -2), up.flatten(0, -2)
        factors = [(h.flatten(0, -2), b) if h is not None else None for h, b in ((gate_h, gate_b), (up_h, up_b))]
        ctx.fused = _fused(gate, up, act, dtype)
        if ctx.fused:
            keep = any(ctx.needs_input_grad)
            kept_gate, kept_up, out = gated.silu_forward(gate, up, *(_transposed(f) for f in factors), keep=keep)
        else:
            gate, up = (torch.addmm(y.float(), f[0].float(), f[1].t()) if f else y.float() for y, f in zip((gate, up), factors))
            kept_gate, kept_up = gate.to(dtype), up.to(dtype)
            multiplier = GATED_UP[act][0](up) if act in GATED_UP else up
            out = (GATE_ACTIVATIONS[act][0](gate) * multiplier).to(dtype)
        ctx.save_for_backward(kept_gate, kept_up, gate_h, gate_b, up_h, up_b)
        return out.view(*shape[:-1], -1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        gate, up, gate_h, gate_b, up_h, up_b = ctx.saved_tensors
        shape = grad.shape
        grad = grad.flatten(0, -2)
        factors = [(h.flatten(0, -2), b) if h is not None else None for h, b in ((gate_h, gate_b), (up_h, up_b))]
        if ctx.fused:
            d_gate, d_up, *low = gated.silu_backward(grad, gate, up, *(_transposed(f) for f in factors))
            low = [(g[0].to(f[0].dtype), g[1].t()) if f else (None, None) for f, g in zip(factors, low)]
        else:
            act, act_backward = GATE_ACTIVATIONS[ctx.act]
            if ctx.act in GATED_UP:
                up_of, up_backward = GATED_UP[ctx.act]
                d_gate, d_up = act_backward(grad * up_of(up), gate), up_backward(grad * act(gate), up)
            else:
                d_gate, d_up = act_backward(grad * up, gate), grad * act(gate)
            low = [_factor_grads(d, f) for d, f in ((d_gate, factors[0]), (d_up, factors[1]))]
        (d_gate_h, d_gate_b), (d_up_h, d_up_b) = (
            (dh.view(*shape[:-1], -1) if dh is not None else None, db) for dh, db in low)
        return (d_gate.view(shape), d_up.view(shape), d_gate_h, d_gate_b, d_up_h, d_up_b, None, None)


def _fused(gate: torch.Tensor, up: torch.Tensor, act: str, dtype: torch.dtype) -> bool:
    """Whether kernels/gated.py's C pass applies: silu, on the CPU, gate and up in the compute
    dtype (bf16 or float32)."""
    return (act == "silu" and dtype == gate.dtype == up.dtype and dtype in gated.SUFFIXES and gate.device.type == "cpu"
            and gate.shape[-1] % 16 == 0 and gated.available())


def _transposed(factors):
    return None if factors is None else (factors[0], factors[1].t())


def _factor_grads(d: torch.Tensor, factors):
    """dL/dh = d b and dL/db = d^T h from the gradient d of gate or up (as LoRA's own backward)."""
    if factors is None:
        return None, None
    h, b = factors
    d = d.float()
    return rank_rows_product(b, d.t()).t().to(h.dtype), rank_rows_product(h.float(), d).t()


def rank_rows_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left^T right -> [r, n] for left [K, r] with r the LoRA rank, right [K, n]: a LoRA's
    float32 gradients, dL/dB^T = h^T dL/dout and dL/dh^T = (scale B)^T dL/dout^T. Written with
    the rank as the result's rows: MKL's sgemm takes 2-3x longer for the same numbers when
    the rank is the columns (at 376 tokens x 896: dL/dB 107 -> 35 us, dL/dh 92 -> 65 us, Xeon)."""
    return left.t() @ right
