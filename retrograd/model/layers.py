"""The pieces the dense and the mixture-of-experts feed-forward share (transformer.py,
moe.py): a frozen GGUF linear layer and the gated product of an FFN."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

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
    of them), rounded once to `dtype` for the down projection. Saves only gate and up, in
    `dtype`: autograd would keep act(gate) as well, and float32 copies. In bf16 compute that
    halves the largest activations a pass keeps (gate and up are 2-5x the model's width).
    The backward runs in `dtype` too: the gradient arrives in it from the down projection
    and leaves for the gate and up projections' bf16 backward matmuls, so float32 there
    only refined what a LoRA's A and B gradients see, by bf16's 2^-9, at the price of
    casting five [tokens, n_ff] tensors per layer (4-7% of a 0.5B model's pass)."""

    @staticmethod
    def forward(ctx, gate, up, act: str, dtype):
        ctx.act = act
        ctx.save_for_backward(gate.to(dtype), up.to(dtype))
        gate, up = gate.float(), up.float()
        multiplier = GATED_UP[act][0](up) if act in GATED_UP else up
        return (GATE_ACTIVATIONS[act][0](gate) * multiplier).to(dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        act, act_backward = GATE_ACTIVATIONS[ctx.act]
        if ctx.act not in GATED_UP:
            return act_backward(grad * up, gate), grad * act(gate), None, None
        up_of, up_backward = GATED_UP[ctx.act]
        return act_backward(grad * up_of(up), gate), up_backward(grad * act(gate), up), None, None
