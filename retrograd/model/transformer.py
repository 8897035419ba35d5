"""The whole decoder, top to bottom: norm, RoPE, attention, MLP, block, model.

It computes what llama.cpp computes for the same GGUF (src/models/{llama,qwen2,qwen3,
gemma3,smollm3,gemma2-iswa,granite,olmo2,lfm2,lfm2moe,phi3,mistral3,qwen3moe,openai-moe-iswa}.cpp); architecture differences are ModelSpec
fields. The residual stream, norms and RoPE run in float32; matmuls and attention run in
`compute_dtype` (float32 or bfloat16). Base weights are FrozenWeights: no gradient ever reaches them.

Mixed precision: a bf16 matmul's output is a bf16 number, and a young LoRA's delta on it
lies far below bf16's resolution (1/256 of the value), so base + delta rounded back to bf16
is the base output again: the adapter would get gradients while its forward effect stayed
invisible (bf16 SFT fell 23% behind float32 per step). So a projection's output (float32
once a LoRA adds to it) is never rounded back by itself: queries and keys go through RoPE in
float32, values that carry a LoRA make the attention run in float32, and the FFN's gate and
up meet in float32, their product rounded once for the down projection.

Shapes: T tokens in the flat stream of a micro-batch, R attention rows of L slots (see
Layout), H query heads, K kv heads, D head size, E n_embd, P tokens of a past prefix.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from retrograd.gguf.spec import ModelSpec
from retrograd.kernels import rowwise
from retrograd.kernels.frozen import FrozenWeight
from retrograd.model.layers import FrozenLinear, GatedProduct
from retrograd.model.moe import MoEFeedForward
from retrograd.model.recompute import checkpoint_segment


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The norm of x in float32, rounded to `dtype` (a pre-norm's output goes to bf16
        projections: the C pass writes it so, with no cast's pass forward and back)."""
        x = x.float()
        if rowwise.applies(x, self.weight) and dtype in rowwise.SUFFIXES:  # one C pass each way (kernels/rowwise.py)
            return rowwise.RMSNormFunction.apply(x, self.weight, self.eps, dtype)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(dtype)


class RotaryTable:
    """cos/sin of the rotation angles, computed the way ggml's rope_cache_init and rope_yarn
    do: theta starts at the position and is multiplied by base^(-2/n_rot) once per pair, in
    float32, so our angles carry llama.cpp's rounding. Each pair's angle is divided by its
    frequency factor (llama3's rope_freqs, phi3's long-RoPE factors) and multiplied by
    freq_scale; under YaRN (ext_factor > 0) the fast pairs, below ggml's correction range,
    keep their unscaled angle by a linear ramp. cos and sin carry the magnitude `mscale`."""

    def __init__(self, n_rot: int, base: float, freq_scale: float, *, factors: torch.Tensor | None = None,
                 ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0, ctx_orig: int = 0):
        self.n_rot, self.base, self.freq_scale, self.factors = n_rot, base, freq_scale, factors
        self.mix = _yarn_ramp(n_rot, base, beta_fast, beta_slow, ctx_orig) * ext_factor if ext_factor else None
        f32 = np.float32
        self.mscale = float(f32(attn_factor) * (f32(1) + f32(0.1) * np.log(f32(1) / f32(freq_scale)))) if ext_factor else attn_factor
        self.cos = self.sin = torch.empty(0, n_rot // 2)

    def _build(self, n_pos: int) -> None:
        step = torch.tensor(self.base, dtype=torch.float64).pow(-2.0 / self.n_rot).float()
        theta = torch.arange(n_pos, dtype=torch.float32)
        cols = []
        for i in range(self.n_rot // 2):
            extrapolated = theta if self.factors is None else theta / self.factors[i]
            angle = extrapolated * self.freq_scale
            if self.mix is not None:
                angle = angle * (1 - self.mix[i]) + extrapolated * self.mix[i]
            cols.append(angle)
            theta = theta * step
        angles = torch.stack(cols, dim=-1)  # [P, n_rot/2]
        self.cos, self.sin = angles.cos(), angles.sin()
        if self.mscale != 1.0:
            self.cos, self.sin = self.cos * self.mscale, self.sin * self.mscale

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_pos = int(positions.max()) + 1
        if n_pos > self.cos.shape[0]:
            self._build(max(n_pos, 2 * self.cos.shape[0], 256))
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return self.cos[positions], self.sin[positions]  # [T, n_rot/2]


def _yarn_ramp(n_rot: int, base: float, beta_fast: float, beta_slow: float, ctx_orig: int) -> torch.Tensor:
    """[n_rot/2] float32: the share of its unscaled angle each pair keeps under YaRN, 1 for
    pairs that turn more than beta_fast times over the original context, 0 for those under
    beta_slow, linear between (ggml_rope_yarn_corr_dims and rope_yarn_ramp, in float32)."""
    f32 = np.float32

    def corr_dim(beta: float) -> np.float32:
        return f32(n_rot) * np.log(f32(ctx_orig) / (f32(beta) * f32(2) * f32(math.pi))) / (f32(2) * np.log(f32(base)))

    low, high = max(0.0, math.floor(corr_dim(beta_fast))), min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
    pair = torch.arange(n_rot // 2, dtype=torch.float32)
    return 1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)


def attention_temperature(positions: torch.Tensor, scale: float, length: int) -> torch.Tensor:
    """[T] float32 factors for the queries at `positions` (llama.cpp's build_inp_attn_scale,
    mistral3/llama4 temperature tuning): 1 + scale * ln(1 + floor(pos / length))."""
    return (torch.log(torch.floor(positions.double() / length) + 1.0) * scale + 1.0).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [T, H, D] float32; rotates the first n_rot dims of each head."""
    if rowwise.applies(x, cos, sin):  # one C pass each way (kernels/rowwise.py)
        return rowwise.RopeFunction.apply(x, cos, sin, style != "norm")
    n_rot = cos.shape[-1] * 2
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, n_rot/2]
    if style == "norm":  # interleaved pairs (x[2i], x[2i+1])
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    else:  # neox: halves (x[i], x[i + n_rot/2])
        x0, x1 = rot[..., : n_rot // 2], rot[..., n_rot // 2 :]
        rot = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


@dataclass(frozen=True)
class Layout:
    """How the flat token stream [T] of a micro-batch is cut into causal attention rows.

    Each row lists stream indices in attention order, padded at the end with the stream's
    length (an all-zero slot that no real token can see under the causal mask). Packed
    examples are separate rows, so they never see each other. A member of a group that
    shares a prefix (GRPO's prompt) is the row prefix + member: its tokens see the prefix,
    whose projections are computed once, and nothing else. The stream starts with `n_past`
    slots whose keys and values were computed by an earlier pass (a Past: a prompt shared
    by several micro-batches), then the T tokens computed now. Every computed token's output
    is read back from one slot (`out_index`)."""

    rows: torch.Tensor  # [R, L] stream index per slot, n_past + T = padding
    out_index: torch.Tensor  # [T] slot (in the flattened [R * L] grid) each computed token's output comes from
    positions: torch.Tensor  # [n_past + T] RoPE position of each stream slot
    n_past: int = 0

    @staticmethod
    def single(n_tokens: int, device: torch.device | str = "cpu") -> Layout:
        idx = torch.arange(n_tokens, device=device)
        return Layout(idx.unsqueeze(0), idx, idx)

    @staticmethod
    def from_rows(rows: list[list[int]], positions: list[int], out_slot: list[tuple[int, int]], device="cpu", n_past: int = 0) -> Layout:
        """`positions` covers the whole stream (past slots first); `out_slot` the computed tokens."""
        n, width = len(positions), max(len(r) for r in rows)
        grid = torch.full((len(rows), width), n, dtype=torch.long)
        for i, r in enumerate(rows):
            grid[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        out = torch.tensor([row * width + col for row, col in out_slot], dtype=torch.long)
        return Layout(grid.to(device), out.to(device), torch.tensor(positions, dtype=torch.long, device=device), n_past)

    @property
    def trivial(self) -> bool:
        return self.n_past == 0 and self.rows.shape[0] == 1 and self.rows.shape[1] == self.positions.shape[0]

    @property
    def computed_positions(self) -> torch.Tensor:
        """[T] RoPE positions of the tokens computed in this pass."""
        return self.positions[self.n_past :]

    def window_mask(self, window: int) -> torch.Tensor | None:
        """[R, 1, L, L] bool for a sliding window (None when no row is long enough for it to bind)."""
        if not window or self.rows.shape[1] <= window:
            return None
        pos = torch.cat([self.positions, self.positions.new_zeros(1)])[self.rows]  # [R, L]
        L = self.rows.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=pos.device).tril()
        return (causal & (pos.unsqueeze(2) - pos.unsqueeze(1) < window)).unsqueeze(1)


SHORT_ROWS = 256  # attention rows up to this length run in float32 (measured faster)


@dataclass
class Past:
    """Keys (after RoPE, float32) and values (as the projection gave them) of tokens computed
    by an earlier pass, per layer: [P, K, D] and [P, K, Dv]. A forward with `capture` fills one in; a
    forward given one places it at the start of its stream (Layout.n_past)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Pass:
    """What every block of one forward reads."""

    layout: Layout
    compute_dtype: torch.dtype
    rope: tuple  # global (cos, sin)
    rope_local: tuple | None
    mask_local: torch.Tensor | None
    past: Past | None = None
    capture: Past | None = None
    attn_temp: torch.Tensor | None = None  # [T] query factors (spec.attn_temp_scale)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, i: int, w: dict[str, FrozenWeight], vec: dict[str, torch.Tensor]):
        super().__init__()
        p = f"blk.{i}."
        self.fused_qkv = spec.fused_qkv
        if spec.fused_qkv:  # phi3: one projection, split as llama.cpp's graph views it
            self.attn_qkv = FrozenLinear(w[p + "attn_qkv.weight"], None)
            self.qkv_split = (spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim, spec.n_head_kv * spec.head_dim_v)
        else:
            self.attn_q = FrozenLinear(w[p + "attn_q.weight"], vec.get(p + "attn_q.bias"))
            self.attn_k = FrozenLinear(w[p + "attn_k.weight"], vec.get(p + "attn_k.bias"))
            self.attn_v = FrozenLinear(w[p + "attn_v.weight"], vec.get(p + "attn_v.bias"))
        self.attn_output = FrozenLinear(w[p + "attn_output.weight"], vec.get(p + "attn_output.bias"))
        self.q_norm = RMSNorm(vec[p + "attn_q_norm.weight"], spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(vec[p + "attn_k_norm.weight"], spec.norm_eps) if spec.qk_norm else None
        self.n_head, self.n_head_kv, self.head_dim = spec.n_head, spec.n_head_kv, spec.head_dim
        self.scale = spec.attn_scale
        self.rope_style = spec.rope_style
        self.index = i
        self.rotates = spec.rope_layers[i]
        self.qk_norm_full = spec.qk_norm_full
        self.logit_softcap = spec.attn_logit_softcap
        self.register_buffer("sinks", vec[p + "attn_sinks.weight"] if spec.attn_sinks else None, persistent=False)  # gpt-oss

    def forward(self, x, rope, mask, p: _Pass):
        T, layout = x.shape[0], p.layout
        h = x.to(p.compute_dtype)
        q, k, v = self.attn_qkv(h).split(self.qkv_split, dim=-1) if self.fused_qkv else (self.attn_q(h), self.attn_k(h), self.attn_v(h))
        q = q.float().reshape(T, self.n_head, self.head_dim)  # [T, H, D]
        k = k.float().reshape(T, self.n_head_kv, self.head_dim)  # [T, K, D]
        v = v.reshape(T, self.n_head_kv, -1)  # [T, K, Dv], float32 from a LoRA
        if self.q_norm is not None and self.qk_norm_full:  # olmo2: over the whole projection
            q, k = self.q_norm(q.flatten(1)).view_as(q), self.k_norm(k.flatten(1)).view_as(k)
        elif self.q_norm is not None:  # over each head
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotates:  # not on smollm3's NoPE layers
            cos, sin = rope
            q = apply_rope(q, cos, sin, self.rope_style)
            k = apply_rope(k, cos, sin, self.rope_style)
        if p.attn_temp is not None:  # mistral3: each query scaled by its position's temperature
            q = q * p.attn_temp[:, None, None]
        if p.capture is not None:  # assigned, not appended: a checkpointed block runs twice
            p.capture.keys[self.index], p.capture.values[self.index] = k, v
        if p.past is not None:  # the past's slots come first; their queries are zeros whose outputs nobody reads
            q = torch.cat([q.new_zeros(layout.n_past, *q.shape[1:]), q])
            k, v = torch.cat([p.past.keys[self.index], k]), torch.cat([p.past.values[self.index].to(v.dtype), v])
        # float32 on short rows (torch's CPU flash-attention backward is 3x slower there in
        # bf16) and for a LoRA's float32 values: their delta is linear in the output, and bf16
        # would round it away (queries and keys went through RoPE: rounding them only adds noise)
        short = layout.rows.shape[1] <= SHORT_ROWS
        attention_dtype = torch.float32 if short or v.dtype == torch.float32 else p.compute_dtype
        q, k, v = q.to(attention_dtype), k.to(attention_dtype), v.to(attention_dtype)
        if layout.trivial:
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, T, D]
        else:  # gather into rows, with a zero slot for padding
            # index_select, not [layout.rows]: a shared prompt sits in several rows, and the
            # backward of indexing adds those copies up with parallel atomic adds in whatever
            # order the threads run (run-to-run different gradients); index_select's does
            # it in index order.
            q, k, v = (
                torch.cat([t, t.new_zeros(1, *t.shape[1:])]).index_select(0, layout.rows.flatten())
                .view(*layout.rows.shape, *t.shape[1:]).transpose(1, 2)
                for t in (q, k, v)
            )  # [R, heads, L, D]
        if self.logit_softcap:
            out = softcapped_attention(q, k, v, mask, self.scale, self.logit_softcap).to(p.compute_dtype)
        elif self.sinks is not None:  # gpt-oss
            out = F.scaled_dot_product_attention(
                *with_sink_slot(q, k, v, mask, self.sinks, self.scale), scale=self.scale, enable_gqa=self.n_head != self.n_head_kv
            )[..., : v.shape[-1]].to(p.compute_dtype)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=self.n_head != self.n_head_kv
            ).to(p.compute_dtype)  # [R, H, L, Dv]
        out = out.transpose(1, 2).reshape(-1, self.n_head * out.shape[-1])  # [R * L, H * Dv]
        # index_select: its backward writes each slot's gradient once (each token reads one
        # slot), where indexing's accumulates through index_put_, 4x slower forward and back
        return self.attn_output(out if layout.trivial else out.index_select(0, layout.out_index))  # [T, E]


def softcapped_attention(q, k, v, mask: torch.Tensor | None, scale: float, cap: float) -> torch.Tensor:
    """Attention whose scores pass through cap * tanh(score / cap) before the softmax
    (gemma2), a step scaled_dot_product_attention has no place for. q [R, H, L, D], k and v
    [R, K, L, D(v)], mask [R, 1, L, L] bool or None (causal) -> [R, H, L, Dv] float32 (the
    scores and their softmax in float32, as SDPA keeps them)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * (scale / cap)) * cap  # [R, H, L, L]
    if mask is None:
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def with_sink_slot(q, k, v, mask: torch.Tensor | None, sinks: torch.Tensor, scale: float):
    """gpt-oss's sinks, a learned logit per head that joins each softmax's denominator and
    attends to nothing (llama.cpp's ggml_soft_max_add_sinks), as inputs of a plain
    scaled_dot_product_attention, so its fused kernel runs and no score matrix is kept (a
    materialised softmax was 6x slower at 1024 tokens): one more key slot, first in every row and
    seen by every query, with a zero value. Its score comes from one more dimension, where each
    query holds its head's sink / scale and the keys hold 1 (the sink's) or 0 (every other key's
    scores stay as they were); v gets that dimension too, as zeros (the CPU kernel wants one head
    size), for the caller to drop. q [R, H, L, D], k and v [R, K, L, D], mask [R, 1, L, L] bool or
    None (causal) -> (q, k, v, mask) with D + 1 dimensions and L + 1 key slots."""
    R, H, L, _ = q.shape
    q = torch.cat([q, (sinks.float() / scale).to(q.dtype).view(1, H, 1, 1).expand(R, H, L, 1)], -1)
    k = F.pad(k, (0, 1, 1, 0))
    k[..., 0, -1] = 1.0
    v = F.pad(v, (0, 1, 1, 0))
    if mask is None:
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    return q, k, v, torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], -1)


def causal_conv(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """x [R, L, E], kernel [E, K] -> [R, L, E]: out[t] = sum_k kernel[:, k] * x[t - K + 1 + k],
    zeros before each row's start; ggml_ssm_conv over a fresh state, summed in its order."""
    K, L = kernel.shape[1], x.shape[1]
    padded = F.pad(x, (0, 0, K - 1, 0))
    return sum(padded[:, k : k + L] * kernel[:, k] for k in range(K))


class ShortConv(nn.Module):
    """LFM2's gated short convolution, the mixer of its non-attention layers (llama.cpp
    src/models/lfm2.cpp build_shortconv_block): in_proj gives gates b, c and input x;
    y = c * conv(b * x), conv a causal depthwise convolution over each attention row's tokens;
    then out_proj. The gates run in float32, as the FFN's do (a LoRA's delta on in_proj is
    below bf16's resolution). A Past holds b * x as this layer's keys (and no values)."""

    def __init__(self, spec: ModelSpec, i: int, w: dict[str, FrozenWeight], vec: dict[str, torch.Tensor]):
        super().__init__()
        p = f"blk.{i}.shortconv."
        self.in_proj = FrozenLinear(w[p + "in_proj.weight"], None)
        self.out_proj = FrozenLinear(w[p + "out_proj.weight"], None)
        self.register_buffer("kernel", vec[p + "conv.weight"], persistent=False)  # [E, conv_kernel]
        self.index = i

    def forward(self, x, rope, mask, p: _Pass):
        layout = p.layout
        b, c, h = self.in_proj(x.to(p.compute_dtype)).float().chunk(3, dim=-1)  # [T, E] each
        bx = b * h
        if p.capture is not None:  # assigned, not appended: a checkpointed block runs twice
            p.capture.keys[self.index], p.capture.values[self.index] = bx, bx.new_zeros(bx.shape[0], 0)
        if p.past is not None:  # the past's slots come first in the stream
            bx = torch.cat([p.past.keys[self.index], bx])
        if layout.trivial:
            conv = causal_conv(bx.unsqueeze(0), self.kernel)[0]
        else:  # into rows (a zero slot for padding, which only ends rows) and back
            rows = torch.cat([bx, bx.new_zeros(1, bx.shape[1])]).index_select(0, layout.rows.flatten())
            conv = causal_conv(rows.view(*layout.rows.shape, -1), self.kernel).flatten(0, 1).index_select(0, layout.out_index)
        return self.out_proj((c * conv).to(p.compute_dtype))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, i: int, w: dict[str, FrozenWeight], vec: dict[str, torch.Tensor]):
        super().__init__()
        p = f"blk.{i}."  # biases: granite's optional ones
        self.ffn_gate = None if spec.fused_gate_up else FrozenLinear(w[p + "ffn_gate.weight"], vec.get(p + "ffn_gate.bias"))
        self.ffn_up = FrozenLinear(w[p + "ffn_up.weight"], vec.get(p + "ffn_up.bias"))  # phi3: gate then up, halves of one output
        self.ffn_down = FrozenLinear(w[p + "ffn_down.weight"], vec.get(p + "ffn_down.bias"))
        self.act = spec.ffn_act

    def forward(self, x, compute_dtype):
        h = x.to(compute_dtype)
        if self.ffn_gate is None:  # one projection, its LoRA (if any) summed there
            gate, up = self.ffn_up(h).chunk(2, dim=-1)
            return self.ffn_down(GatedProduct.apply(gate, up, None, None, None, None, self.act, compute_dtype))
        gate, gate_h, gate_b = self.ffn_gate.split(h)
        up, up_h, up_b = self.ffn_up.split(h)
        return self.ffn_down(GatedProduct.apply(gate, up, gate_h, gate_b, up_h, up_b, self.act, compute_dtype))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, i: int, w: dict[str, FrozenWeight], vec: dict[str, torch.Tensor]):
        super().__init__()
        p = f"blk.{i}."
        # olmo2 has no pre-norms: its branches read the residual stream as it is
        self.attn_norm = RMSNorm(vec[p + "attn_norm.weight"], spec.norm_eps) if spec.pre_norm else None
        self.attn = ShortConv(spec, i, w, vec) if spec.conv_layers[i] else Attention(spec, i, w, vec)
        self.ffn_norm = RMSNorm(vec[p + f"{spec.ffn_norm}.weight"], spec.norm_eps) if spec.pre_norm else None
        if spec.moe_layers[i]:  # a mixture of experts in place of the dense FFN
            self.ffn = MoEFeedForward(spec, i, w, vec)
        else:
            self.ffn = FeedForward(spec, i, w, vec)
        self.ffn_reads_float = spec.moe_layers[i]  # the router's logits come from the float32 norm
        # gemma2/gemma3/olmo2's sandwich norms: one more RMSNorm on each branch's output
        self.post_attention_norm = RMSNorm(vec[p + "post_attention_norm.weight"], spec.norm_eps) if spec.sandwich_norm else None
        self.post_ffw_norm = RMSNorm(vec[p + "post_ffw_norm.weight"], spec.norm_eps) if spec.sandwich_norm else None
        self.sliding = spec.swa_layers[i]
        self.residual_scale = spec.residual_scale  # granite's branch multiplier; 1 elsewhere

    def forward(self, x, p: _Pass):
        """x [T, E] float32 -> the same; a branch's output in the compute dtype is added as it
        is (the sum is float32: the same values as casting it first, without the cast's passes)."""
        rope, mask = (p.rope_local, p.mask_local) if self.sliding else (p.rope, None)
        a = self.attn(_normed(self.attn_norm, x, p.compute_dtype), rope, mask, p)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        x = x + self._scaled(a)
        f = self.ffn(_normed(self.ffn_norm, x, torch.float32 if self.ffn_reads_float else p.compute_dtype), p.compute_dtype)
        if self.post_ffw_norm is not None:
            f = self.post_ffw_norm(f)
        return x + self._scaled(f)

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """The branch times granite's multiplier, in float32; as it is where that is 1 (a
        product by 1 is a pass over the tensor each way for nothing)."""
        return branch if self.residual_scale == 1 else branch.float() * self.residual_scale


def _normed(norm: RMSNorm | None, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A branch's input: its pre-norm's output in `dtype`, or the residual stream (olmo2)."""
    return x if norm is None else norm(x, dtype)


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, FrozenWeight], vectors: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        self.token_embd = weights["token_embd.weight"]
        self.output = weights.get("output.weight", self.token_embd)
        self.blocks = nn.ModuleList(Block(spec, i, weights, vectors) for i in range(spec.n_layer))
        # granite divides its logits by logit_scale; every logit path (head, chunked log-probs)
        # is linear in the final hidden state, so the final norm's weight takes the division
        self.output_norm = RMSNorm(vectors[spec.final_norm] / spec.logit_scale, spec.norm_eps)
        # RoPE frequency factors as (short, long): which one llama.cpp uses depends on its context (use_context)
        self.rope_factors = tuple(vectors.get(name) for name in (spec.rope_factors_short, spec.rope_factors_long))
        self.rope_global = self._global_rotary_table(self.rope_factors[0])
        # sliding-window layers: their own base and freq_scale, the global layers' YaRN (llama.cpp passes both the same)
        self.rope_local = RotaryTable(spec.n_rot, spec.rope_base_swa, spec.rope_freq_scale_swa, ext_factor=spec.rope_ext_factor,
                                      attn_factor=spec.rope_attn_factor, beta_fast=spec.rope_yarn_beta_fast,
                                      beta_slow=spec.rope_yarn_beta_slow, ctx_orig=spec.rope_ctx_orig)
        self.compute_dtype = torch.float32
        # gradient checkpointing: keep only every `checkpoint_every`-th block input, stored in
        # checkpoint_dtype, and recompute the blocks in between during backward (0 = off)
        self.checkpoint_every = 0
        self.checkpoint_dtype = torch.float32

    def _global_rotary_table(self, factors: torch.Tensor | None) -> RotaryTable:
        s = self.spec
        return RotaryTable(s.n_rot, s.rope_base, s.rope_freq_scale, factors=factors, ext_factor=s.rope_ext_factor,
                           attn_factor=s.rope_attn_factor, beta_fast=s.rope_yarn_beta_fast, beta_slow=s.rope_yarn_beta_slow,
                           ctx_orig=s.rope_ctx_orig)

    def use_context(self, n_ctx: int) -> None:
        """Rotate as llama.cpp does in a context of n_ctx tokens per sequence: it pads that to a
        multiple of 256 and uses the long frequency factors (phi3) when the padded size exceeds
        the original context (llama_model::get_rope_factors); until this is called, the short
        ones. Training calls it with [training] ctx, the context the rollout sampler gets too."""
        padded = -(-n_ctx // 256) * 256
        self.rope_global = self._global_rotary_table(self.rope_factors[padded > self.spec.rope_ctx_orig])

    def to_device(self, device: torch.device) -> Transformer:
        """Move frozen weights (plain attributes, not buffers) and buffers to `device`."""
        tied = self.output is self.token_embd
        self.token_embd = self.token_embd.to(device)
        self.output = self.token_embd if tied else self.output.to(device)
        for m in self.modules():
            if isinstance(m, FrozenLinear):
                m.weight = m.weight.to(device)
        return self.to(device)

    @contextmanager
    def checkpointed(self, every: int) -> Iterator[None]:
        """Passes with gradients in this scope keep every `every`-th block input (0: all of
        their activations), in checkpoint_dtype."""
        before, self.checkpoint_every = self.checkpoint_every, every
        try:
            yield
        finally:
            self.checkpoint_every = before

    def frozen_weights(self) -> list[FrozenWeight]:
        """Every base matrix once (a tied head is the embedding)."""
        found = {id(self.token_embd): self.token_embd, id(self.output): self.output}
        for m in self.modules():
            if isinstance(m, FrozenLinear):
                found[id(m.weight)] = m.weight
        return list(found.values())

    @property
    def device(self) -> torch.device:
        return self.token_embd.data.device

    def forward(self, tokens: torch.Tensor, layout: Layout | None = None, *, past: Past | None = None,
                capture: Past | None = None) -> torch.Tensor:
        """tokens [T] -> final normed hidden states [T, E] (float32). Without a layout the
        tokens are one sequence at positions 0..T-1. `past`: the keys and values of the
        layout's n_past leading slots; `capture`: a Past to fill with this pass's own."""
        layout = layout or Layout.single(tokens.shape[0], tokens.device)
        x = self.token_embd.rows(tokens, torch.float32) * self.spec.embed_scale  # [T, E]
        positions = layout.computed_positions
        sliding = any(self.spec.swa_layers)
        p = _Pass(
            layout, self.compute_dtype, self.rope_global(positions),
            self.rope_local(positions) if sliding else None,
            layout.window_mask(self.spec.sliding_window) if sliding else None,
            past, capture,
            attention_temperature(positions, self.spec.attn_temp_scale, self.spec.attn_temp_length) if self.spec.attn_temp_scale else None,
        )
        if capture is not None:
            capture.keys[:] = [None] * len(self.blocks)
            capture.values[:] = [None] * len(self.blocks)

        def run(blocks, x):
            x = x.float()
            for block in blocks:
                x = block(x, p)
            return x

        every = self.checkpoint_every if torch.is_grad_enabled() else 0
        if not every:
            return self.output_norm(run(self.blocks, x))
        for start in range(0, len(self.blocks), every):
            segment = self.blocks[start : start + every]
            # the recomputation stops at the segment's last saved tensor, before its last down
            # projection's base matmul (see retrograd.model.lora._LoRADelta); not under gemma's
            # sandwich norms, whose post-FFN norm saves that matmul's output
            x = checkpoint_segment(run, segment, x.to(self.checkpoint_dtype))
        return self.output_norm(x)

    def head(self, hidden: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Logits of vocabulary rows start..stop for hidden [..., E] (one tile of the head)."""
        stop = self.spec.n_vocab if stop is None else stop
        w = self.output.row_range(start, stop, self.compute_dtype)
        logits = F.linear(hidden.to(self.compute_dtype), w).float()
        cap = self.spec.final_logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits
