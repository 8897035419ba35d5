"""The whole decoder, top to bottom: norm, RoPE, attention, MLP, block, model.

It computes what llama.cpp computes for the same GGUF (src/models/{llama,qwen2,qwen3,
gemma3}.cpp); architecture differences are ModelSpec fields. The residual stream, norms
and RoPE run in float32; matmuls and attention run in `compute_dtype` (float32 or
bfloat16). Base weights are FrozenWeights: no gradient ever reaches them.

Shapes: B batch rows, T tokens per row, H query heads, K kv heads, D head size, E n_embd.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from retrograd.gguf.spec import ModelSpec
from retrograd.kernels.frozen import FrozenWeight, frozen_linear


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class FrozenLinear(nn.Module):
    """y = x W^T (+ b) with a frozen GGUF weight. LoRA wraps this module (retrograd.lora)."""

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


class RotaryTable:
    """cos/sin of the rotation angles, computed the way ggml's rope_cache_init does:
    theta starts at the position and is multiplied by base^(-2/n_rot) once per pair, in
    float32, so our angles carry llama.cpp's rounding."""

    def __init__(self, n_rot: int, base: float, freq_scale: float):
        self.n_rot, self.base, self.freq_scale = n_rot, base, freq_scale
        self.cos = self.sin = torch.empty(0, n_rot // 2)

    def _build(self, n_pos: int) -> None:
        step = torch.tensor(self.base, dtype=torch.float64).pow(-2.0 / self.n_rot).float()
        theta = torch.arange(n_pos, dtype=torch.float32)
        cols = []
        for _ in range(self.n_rot // 2):
            cols.append(theta * self.freq_scale)
            theta = theta * step
        angles = torch.stack(cols, dim=-1)  # [P, n_rot/2]
        self.cos, self.sin = angles.cos(), angles.sin()

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_pos = int(positions.max()) + 1
        if n_pos > self.cos.shape[0]:
            self._build(max(n_pos, 2 * self.cos.shape[0], 256))
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return self.cos[positions], self.sin[positions]  # [B, T, n_rot/2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [B, T, H, D] float32; rotates the first n_rot dims of each head."""
    n_rot = cos.shape[-1] * 2
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, n_rot/2]
    if style == "norm":  # interleaved pairs (x[2i], x[2i+1])
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    else:  # neox: halves (x[i], x[i + n_rot/2])
        x0, x1 = rot[..., : n_rot // 2], rot[..., n_rot // 2 :]
        rot = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


def attention_mask(positions: torch.Tensor, segments: torch.Tensor | None, window: int) -> torch.Tensor:
    """[B, 1, T, T] bool, True = may attend: causal by row order, within one segment (packed
    examples never see each other), and inside the sliding window when there is one."""
    T = positions.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril().unsqueeze(0)  # [1, T, T]
    if segments is not None:
        allowed = allowed & (segments.unsqueeze(2) == segments.unsqueeze(1))
    if window:
        allowed = allowed & (positions.unsqueeze(2) - positions.unsqueeze(1) < window)
    return allowed.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, i: int, w: dict[str, FrozenWeight], vec: dict[str, torch.Tensor]):
        super().__init__()
        p = f"blk.{i}."
        self.attn_q = FrozenLinear(w[p + "attn_q.weight"], vec.get(p + "attn_q.bias"))
        self.attn_k = FrozenLinear(w[p + "attn_k.weight"], vec.get(p + "attn_k.bias"))
        self.attn_v = FrozenLinear(w[p + "attn_v.weight"], vec.get(p + "attn_v.bias"))
        self.attn_output = FrozenLinear(w[p + "attn_output.weight"], vec.get(p + "attn_output.bias"))
        self.q_norm = RMSNorm(vec[p + "attn_q_norm.weight"], spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(vec[p + "attn_k_norm.weight"], spec.norm_eps) if spec.qk_norm else None
        self.n_head, self.n_head_kv, self.head_dim = spec.n_head, spec.n_head_kv, spec.head_dim
        self.scale = spec.attn_scale
        self.rope_style = spec.rope_style

    def forward(self, x, rope, mask, compute_dtype):
        B, T, _ = x.shape
        h = x.to(compute_dtype)
        q = self.attn_q(h).float().view(B, T, self.n_head, self.head_dim)  # [B, T, H, D]
        k = self.attn_k(h).float().view(B, T, self.n_head_kv, self.head_dim)  # [B, T, K, D]
        v = self.attn_v(h).view(B, T, self.n_head_kv, -1)  # [B, T, K, Dv]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q = apply_rope(q, cos, sin, self.rope_style)
        k = apply_rope(k, cos, sin, self.rope_style)
        q, k, v = (t.transpose(1, 2).to(compute_dtype) for t in (q, k, v))  # [B, heads, T, D]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=self.n_head != self.n_head_kv
        )  # [B, H, T, Dv]
        return self.attn_output(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, i: int, w: dict[str, FrozenWeight]):
        super().__init__()
        p = f"blk.{i}."
        self.ffn_gate = FrozenLinear(w[p + "ffn_gate.weight"], None)
        self.ffn_up = FrozenLinear(w[p + "ffn_up.weight"], None)
        self.ffn_down = FrozenLinear(w[p + "ffn_down.weight"], None)
        self.act = F.silu if spec.ffn_act == "silu" else lambda t: F.gelu(t, approximate="tanh")

    def forward(self, x, compute_dtype):
        h = x.to(compute_dtype)
        return self.ffn_down(self.act(self.ffn_gate(h)) * self.ffn_up(h))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, i: int, w: dict[str, FrozenWeight], vec: dict[str, torch.Tensor]):
        super().__init__()
        p = f"blk.{i}."
        self.attn_norm = RMSNorm(vec[p + "attn_norm.weight"], spec.norm_eps)
        self.attn = Attention(spec, i, w, vec)
        self.ffn_norm = RMSNorm(vec[p + "ffn_norm.weight"], spec.norm_eps)
        self.ffn = FeedForward(spec, i, w)
        # gemma3's sandwich norms: one more RMSNorm on each branch's output
        self.post_attention_norm = RMSNorm(vec[p + "post_attention_norm.weight"], spec.norm_eps) if spec.sandwich_norm else None
        self.post_ffw_norm = RMSNorm(vec[p + "post_ffw_norm.weight"], spec.norm_eps) if spec.sandwich_norm else None
        self.sliding = spec.swa_layers[i]

    def forward(self, x, rope, mask, compute_dtype):
        a = self.attn(self.attn_norm(x), rope, mask, compute_dtype).float()
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        x = x + a
        f = self.ffn(self.ffn_norm(x), compute_dtype).float()
        if self.post_ffw_norm is not None:
            f = self.post_ffw_norm(f)
        return x + f


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, FrozenWeight], vectors: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        self.token_embd = weights["token_embd.weight"]
        self.output = weights.get("output.weight", self.token_embd)
        self.blocks = nn.ModuleList(Block(spec, i, weights, vectors) for i in range(spec.n_layer))
        self.output_norm = RMSNorm(vectors["output_norm.weight"], spec.norm_eps)
        self.rope_global = RotaryTable(spec.n_rot, spec.rope_base, spec.rope_freq_scale)
        self.rope_local = RotaryTable(spec.n_rot, spec.rope_base_swa, 1.0)
        self.compute_dtype = torch.float32
        # gradient checkpointing: keep only every `checkpoint_every`-th block input, stored in
        # checkpoint_dtype, and recompute the blocks in between during backward (0 = off)
        self.checkpoint_every = 0
        self.checkpoint_dtype = torch.float32

    def to_device(self, device: torch.device) -> Transformer:
        """Move frozen weights (plain attributes, not buffers) and buffers to `device`."""
        tied = self.output is self.token_embd
        self.token_embd = self.token_embd.to(device)
        self.output = self.token_embd if tied else self.output.to(device)
        for m in self.modules():
            if isinstance(m, FrozenLinear):
                m.weight = m.weight.to(device)
        return self.to(device)

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

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] -> final normed hidden states [B, T, E] (float32).

        positions default to 0..T-1; `segments` [B, T] marks packed examples that must
        not attend to each other (positions should then restart in each segment)."""
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        cdt = self.compute_dtype
        x = self.token_embd.rows(tokens, torch.float32) * self.spec.embed_scale  # [B, T, E]
        plain = segments is None
        mask_global = None if plain else attention_mask(positions, segments, 0)
        mask_local = attention_mask(positions, segments, self.spec.sliding_window) if any(self.spec.swa_layers) else None
        rope_global = self.rope_global(positions)
        rope_local = self.rope_local(positions) if mask_local is not None else None

        def run(blocks, x):
            x = x.float()
            for block in blocks:
                if block.sliding:
                    x = block(x, rope_local, mask_local, cdt)
                else:
                    x = block(x, rope_global, mask_global, cdt)
            return x

        every = self.checkpoint_every if torch.is_grad_enabled() else 0
        if not every:
            return self.output_norm(run(self.blocks, x))
        for start in range(0, len(self.blocks), every):
            segment = self.blocks[start : start + every]
            x = checkpoint(run, segment, x.to(self.checkpoint_dtype), use_reentrant=False)
        return self.output_norm(x)

    def head(self, hidden: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Logits of vocabulary rows start..stop for hidden [..., E] (one tile of the head)."""
        stop = self.spec.n_vocab if stop is None else stop
        w = self.output.row_range(start, stop, self.compute_dtype)
        logits = F.linear(hidden.to(self.compute_dtype), w).float()
        cap = self.spec.final_logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits
