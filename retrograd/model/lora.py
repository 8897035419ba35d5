"""LoRA on the frozen linears: target selection, the LoRALinear wrapper, and the Adapter
that lists every adapted weight under its GGUF tensor name.

Initialisation follows PEFT (A ~ kaiming-uniform, B = 0), so step 0 equals the base model
exactly. `Adapter.disabled()` switches every LoRA off at once: with the base frozen, that
is the reference model GRPO and distillation need, with no second copy in memory.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from retrograd.errors import ConfigError
from retrograd.model.layers import FrozenLinear, rank_rows_product
from retrograd.model.moe import FrozenExperts
from retrograd.model.transformer import Transformer

# config alias -> GGUF tensor family (blk.N.<family>.weight)
TARGET_ALIASES = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "ffn_up": "ffn_up",
    "ffn_down": "ffn_down",
    "ffn_gate": "ffn_gate",
}
DEFAULT_TARGETS = tuple(TARGET_ALIASES)
# a family a model stores fused into another (phi3): its alias adapts the fused weight, which
# is the tensor llama.cpp's LoRA loader applies an adapter to (blk.N.attn_qkv.weight.lora_a/b)
FUSED_FAMILIES = {"attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv", "ffn_gate": "ffn_up"}
# projections no alias covers, targetable by name: lfm2's conv projections (llama.cpp's lfm2
# graph multiplies both through build_lora_mm, so an adapter on them applies there too)
NAMED_TARGETS = ("blk.*.shortconv.in_proj.weight", "blk.*.shortconv.out_proj.weight")
# and a mixture's router: llama.cpp's build_moe_ffn multiplies ffn_gate_inp through build_lora_mm too
# (checked: an adapter on it gives our logits in llama.cpp, tests/test_arch_lfm2moe.py)
NAMED_TARGETS += ("blk.*.ffn_gate_inp.weight",)
# a mixture of experts' stacks (blk.N.ffn_*_exps.weight) that an FFN alias adapts as well, with
# a LoRA pair per expert: llama.cpp applies them (build_lora_mm_id). The router (ffn_gate_inp) is no alias's:
# it goes by name (NAMED_TARGETS).
EXPERT_FAMILIES = {"ffn_up": "ffn_up_exps", "ffn_down": "ffn_down_exps", "ffn_gate": "ffn_gate_exps"}


def frozen_linears(model: Transformer) -> dict[str, tuple[nn.Module, str, FrozenLinear]]:
    """GGUF weight name -> (parent module, attribute, FrozenLinear) for every base linear."""
    found = {}
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, FrozenLinear):
                found[child.weight.name] = (parent, attr, child)
    return found


def resolve_targets(targets: list[str] | tuple[str, ...], weight_names: list[str]) -> list[str]:
    """Config targets -> sorted GGUF weight names. Aliases (q, k, v, o, ffn_up, ffn_down,
    ffn_gate) pick a family in every block, or the fused weight that holds it (FUSED_FAMILIES),
    the FFN ones also a mixture's expert stacks (EXPERT_FAMILIES);
    an entry with `*` or ending in `.weight` is a literal glob over GGUF names; ["auto"] means
    every attention and FFN projection."""
    targets = list(targets)
    if targets == ["auto"]:
        targets = list(DEFAULT_TARGETS)
    elif "auto" in targets:
        raise ConfigError('lora.targets: "auto" must stand alone')
    chosen: set[str] = set()
    for t in targets:
        if t in TARGET_ALIASES:
            pattern = f"blk.*.{TARGET_ALIASES[t]}.weight"
        elif "*" in t or t.endswith(".weight"):
            pattern = t
        else:
            hint = difflib.get_close_matches(t, list(TARGET_ALIASES) + ["auto"], n=1)
            did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(
                f"lora.targets: unknown target {t!r}{did_you_mean}; use {', '.join(TARGET_ALIASES)}, "
                "auto, or a GGUF name pattern such as 'blk.*.attn_q.weight'"
            )
        matched = fnmatch.filter(weight_names, pattern)
        if t in TARGET_ALIASES and TARGET_ALIASES[t] in EXPERT_FAMILIES:
            matched += fnmatch.filter(weight_names, f"blk.*.{EXPERT_FAMILIES[TARGET_ALIASES[t]]}.weight")
        if not matched and t in TARGET_ALIASES and TARGET_ALIASES[t] in FUSED_FAMILIES:
            matched = fnmatch.filter(weight_names, f"blk.*.{FUSED_FAMILIES[TARGET_ALIASES[t]]}.weight")
        if not matched:
            raise ConfigError(f"lora.targets: {t!r} matches no trainable weight of this model (pattern {pattern})")
        chosen.update(matched)
    return sorted(chosen, key=_natural)


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


class LoRALinear(nn.Module):
    """base(x) + (alpha / r) * B(A(x)); A [r, n_in], B [n_out, r] held in float32. On a stack
    of experts (FrozenExperts) a pair per expert, A [n_expert, r, n_in], B [n_expert, n_out, r],
    and forward(x, e) applies expert e's."""

    def __init__(self, base: FrozenLinear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        stack = (base.n_expert,) if isinstance(base, FrozenExperts) else ()
        a = torch.empty(*stack, rank, base.in_features)
        bound = 1.0 / math.sqrt(base.in_features)  # kaiming_uniform_(a=sqrt(5)), as PEFT and nn.Linear
        a.uniform_(-bound, bound, generator=generator)
        self.lora_a = nn.Parameter(a)
        self.lora_b = nn.Parameter(torch.zeros(*stack, base.out_features, rank))
        self.enabled = True

    @property
    def weight_name(self) -> str:
        return self.base.weight.name

    def forward(self, x: torch.Tensor, *expert: int) -> torch.Tensor:
        if not self.enabled:
            return self.base(x, *expert)
        if expert or isinstance(self.base, FrozenExperts) or self.base.bias is not None:
            a, b = (self.lora_a[expert[0]], self.lora_b[expert[0]]) if expert else (self.lora_a, self.lora_b)
            delta = _LoRADelta.apply(x, a, b, self.scale, None)  # [..., out] float32; first: see _LoRADelta
            return delta.add_(self.base(x, *expert))
        factors = _Factors()
        delta = _LoRADelta.apply(x, self.lora_a, self.lora_b, self.scale, factors)
        return _PlusBase.apply(delta, x, self.base.weight, factors)

    def split(self, x: torch.Tensor):
        """base(x) and the delta's factors, x A^T (in x's dtype) and scale * B (float32), for a
        caller that adds the delta itself (GatedProduct); no factors while disabled."""
        y = self.base(x)
        if not self.enabled:
            return y, None, None
        return y, F.linear(x, self.lora_a.to(x.dtype)), self.lora_b * self.scale


class _Factors:
    """What a projection's _LoRADelta and _PlusBase share: A in x's dtype and scale * B from the
    forward, and dL/dh = dL/dout (scale B) from _PlusBase's backward, which runs first (its
    input is the delta), for _LoRADelta's."""

    a_x: torch.Tensor
    b_scaled: torch.Tensor
    grad_h: torch.Tensor


class _LoRADelta(torch.autograd.Function):
    """scale * (x A^T) B^T in float32 whatever x's dtype: in bf16/f16 compute a young adapter's
    delta is far below bf16's 1/128 relative resolution of the base output and would round away
    wherever the output reaches the float32 residual. x A^T runs in x's dtype (the wide
    matmul), the rank-r product with B in float32. One node instead of autograd's four (two
    matmuls, the scale, the casts): at a 0.5B model's FFN width in bf16 the casts and
    elementwise passes cost 5-10% of a pass.

    LoRALinear adds the base output into this delta after computing it, so a projection's last
    saved tensors are this node's: the base matmul saves nothing (kernels/frozen.py, _PlusBase).
    A checkpointed pass's recomputation stops as soon as it has every saved tensor back
    (model/recompute.py), so it skips the base matmul of each segment's last projection: with
    a checkpoint per block, every down projection.

    With `factors` (_PlusBase adds the base) the input's gradient through A is _PlusBase's, and
    this node returns none for x."""

    @staticmethod
    def forward(ctx, x, a, b, scale: float, factors: _Factors | None):
        a_x = a.to(x.dtype)
        h = F.linear(x, a_x).float()  # [..., r]
        b_scaled = b * scale  # [out, r], float32
        delta = h @ b_scaled.t()  # [..., out]
        ctx.save_for_backward(x, a_x, h, b_scaled)
        ctx.scale, ctx.factors = scale, factors
        if factors is not None:
            factors.a_x, factors.b_scaled = a_x, b_scaled
        return delta

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, a_x, h, b_scaled = ctx.saved_tensors
        grad = grad.flatten(0, -2)
        grad_b = rank_rows_product(h.flatten(0, -2), grad).mul_(ctx.scale).t()  # [out, r]
        if ctx.factors is not None:
            grad_h, grad_x = ctx.factors.grad_h, None
            del ctx.factors.grad_h
        else:
            grad_h = rank_rows_product(b_scaled, grad.t()).t().to(x.dtype)  # [T, r]
            grad_x = (grad_h @ a_x).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_a = (grad_h.t() @ x.flatten(0, -2)).float()  # [r, in]
        return grad_x, grad_a, grad_b, None, None


class _PlusBase(torch.autograd.Function):
    """delta + x W^T for a frozen W, the delta _LoRADelta's (float32). Backward, the input's
    gradient through the LoRA's A, dL/dh A, is the matrix the base's dL/dout W accumulates
    into (addmm_: oneDNN adds it as the matmul writes), where autograd would add two [T, n_in]
    gradients: 0.1 ms per projection at a 0.5B llama's widths in bf16, 0.7 ms at the down
    projection's input. The input's gradient is rounded to x's dtype twice instead of three
    times; every other number is the one a separate base matmul gives (experts and biased
    projections keep that). Saves no tensor, so a checkpointed recomputation still stops
    before its matmul."""

    @staticmethod
    def forward(ctx, delta, x, weight, factors: _Factors):
        ctx.weight, ctx.factors = weight, factors
        ctx.mark_dirty(delta)
        return delta.add_(F.linear(x, weight.borrow_rows(0, weight.n_rows, x.dtype)))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        factors, weight = ctx.factors, ctx.weight
        shape, grad = grad.shape, grad.flatten(0, -2)
        a_x = factors.a_x
        factors.grad_h = rank_rows_product(factors.b_scaled, grad.t()).t().to(a_x.dtype)  # dL/dh [T, r], as _LoRADelta rounds it
        if not ctx.needs_input_grad[1]:
            return grad.view(shape), None, None, None
        grad_x = (factors.grad_h @ a_x).addmm_(grad.to(a_x.dtype), weight.borrow_rows(0, weight.n_rows, a_x.dtype))
        return grad.view(shape), grad_x.view(*shape[:-1], -1), None, None


@dataclass
class Adapter:
    """The adapted linears of one model, by GGUF weight name (the names the export uses)."""

    layers: dict[str, LoRALinear]
    rank: int
    alpha: float

    def parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers.values() for p in (layer.lora_a, layer.lora_b)]

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @contextlib.contextmanager
    def disabled(self):
        """Run the base model: every LoRA off inside the block."""
        for layer in self.layers.values():
            layer.enabled = False
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.enabled = True


def attach_lora(model: Transformer, targets, rank: int, alpha: float, seed: int) -> Adapter:
    """Wrap the targeted frozen linears of `model` in place and return the Adapter."""
    if rank < 1:
        raise ConfigError(f"lora.rank: {rank} is not a positive integer")
    linears = frozen_linears(model)
    names = resolve_targets(targets, list(linears))
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for name in names:  # sorted: the same seed gives the same initial weights every time
        parent, attr, base = linears[name]
        layer = LoRALinear(base, rank, alpha, generator).to(base.weight.data.device)
        setattr(parent, attr, layer)
        layers[name] = layer
    return Adapter(layers, rank, alpha)
