"""How much memory one forward keeps for backward (preflight's "activations" line), and so
how many small micro-batches can merge into one pass in the same memory."""

from __future__ import annotations

import math
from dataclasses import dataclass

from retrograd.gguf.spec import ModelSpec


def activation_bytes(spec: ModelSpec, tokens: int, compute_bytes: int, lora_rank: int = 0, row_length: int | None = None) -> int:
    """Tensors autograd keeps for backward in one forward over `tokens` tokens, counted from
    what our Block saves (float32 residual stream and norms, matmul inputs and outputs in the
    compute dtype, the SDPA inputs/output and its log-sum-exp) — an estimate, not a bound.
    `row_length`: the longest attention row (default: all tokens in one); gemma2's soft-capped
    attention keeps score matrices of that length per token, lfm2's conv layers keep no attention."""
    E, F, D, H, K = spec.n_embd, spec.n_ff, spec.head_dim, spec.n_head, spec.n_head_kv
    f, c = 4, compute_bytes
    row = min(row_length or tokens, tokens)
    norms = 2 * (E * f + E * c)  # two pre-norms: the float32 input, and the output as the matmuls read it
    if spec.sandwich_norm:
        norms += 2 * E * f
    qk = (H + K) * D * f * (2 if spec.qk_norm else 1)  # float32 q/k around RoPE (and qk norms)
    attn = (H + 2 * K) * D * c + 2 * H * D * c + H * f  # SDPA q, k, v, output (+ its copy), lse
    if spec.attn_logit_softcap:  # softcapped_attention: q, k and v repeated to H heads, output, all float32,
        attn = 4 * H * D * f + H * D * c + 2 * H * row * f  # and the tanh's and softmax's [H, L, L] outputs
    if spec.attn_sinks:  # gpt-oss's sink slot (with_sink_slot): SDPA keeps its [L, L + 1] mask as float32
        attn += row * f
    # lfm2's gated short convolution in place of attention: in_proj's output and the gated product
    # in the compute dtype, the padded b * x and the convolution in float32
    conv = 4 * E * c + 2 * E * f
    ffn = 3 * F * c + E * f  # gate and up (GatedProduct keeps them in the compute dtype), product; down output
    # a mixture (spec.moe_layers; lfm2moe keeps dense FFNs in its leading layers): that for each of a token's
    # experts (its gathered input, its output in float32, in slot order, weighted), and the router's float32
    # logits and gated values
    moe_ffn = spec.n_expert_used * (4 * spec.n_ff_exp * c + E * c + 3 * E * f) + 2 * spec.n_expert * f
    lora = 7 * lora_rank * c
    n_conv, n_moe = sum(spec.conv_layers), sum(spec.moe_layers)
    per_layer = norms + lora
    ffns = (spec.n_layer - n_moe) * ffn + n_moe * moe_ffn
    return tokens * ((spec.n_layer - n_conv) * (per_layer + qk + attn) + n_conv * (per_layer + conv) + ffns)


# Merged passes hold at most this many tokens. Below it a pass costs mostly what every pass
# costs (reading every base weight, a few thousand small ops), whatever it holds. Above it the
# process's memory grows with the pass where the allocator keeps what passes free: glibc's heap
# keeps about a pass's worth of freed blocks (SmolLM2, 2 threads: a 512-token pass checkpointed
# at every layer peaks at 1.52 GiB RSS and 0.60 GiB live, measured with
# MALLOC_MMAP_THRESHOLD_=65536; a 128-token pass without checkpoints peaks at 0.96 and 0.68 GiB),
# so on glibc larger merged passes would undo what a smaller micro_batch is for. jemalloc hands
# them back (runtime/allocator.py): there an SFT step of eight 47-token micro-batches merged into
# one 376-token pass reads the RSS of the unmerged run (995 against 1005 MiB; 1482 on glibc).
PASS_TOKENS_GLIBC = 256
PASS_TOKENS_JEMALLOC = 512

# About 2 c0 / c1, rounded down: a pass over T tokens costs about c0 + c1 T, and checkpointed at
# every layer at most c0 + 1.5 c1 T (it computes its forward twice, and with a frozen base the
# backward costs about one forward; the recomputation skips each block's down projection, about
# a quarter of it). SmolLM2 on 2 threads of a Xeon (AMX): c0 = 164 ms, c1 = 1.46 ms per token in
# bf16 (2 c0 / c1 = 225); 198 ms and 2.9 ms in f32 (136). Micro-batches of more tokens never gain
# from merging, and merging_pays weighs the passes saved against the recomputation
# (conservatively, at a whole forward).
SMALL_MICRO_BATCH = 128


def merging_pays(configured: int, merged: int, tokens: int) -> bool:
    """Whether `merged` passes checkpointed at every layer over `tokens` tokens in all take less
    time than the `configured` passes without: each pass saved saves c0, the recomputation
    costs c1 * tokens / 2."""
    return (configured - merged) * SMALL_MICRO_BATCH > tokens


@dataclass(frozen=True)
class Merging:
    """How small micro-batches run as fewer, larger passes: per token that a pass as
    configured computes with gradients, a pass checkpointed at every layer may hold `train`
    tokens in the same activation memory, and a pass without gradients `score` tokens; neither
    more than `cap`."""

    train: float
    score: float
    cap: int

    def budgets(self, kept_tokens: int) -> tuple[int, int]:
        """Tokens per merged pass (with, without gradients) where passes as configured would
        compute at most `kept_tokens` with gradients."""
        return tuple(max(kept_tokens, min(int(kept_tokens * factor), self.cap)) for factor in (self.train, self.score))

    def describe(self, micro_batch: int) -> str:
        return (f"passes: micro-batches of {micro_batch} tokens run merged where that saves time, up to {self.cap} tokens "
                f"per pass (checkpointed at every layer when training) in the same activation memory")


def merging(spec: ModelSpec, micro_batch: int, compute_bytes: int, lora_rank: int, *, checkpoint_every: int,
            checkpoint_bytes: int, cap: int) -> Merging | None:
    """Merging into passes of at most `cap` tokens (PASS_TOKENS_*) for micro-batches of at most
    SMALL_MICRO_BATCH tokens, or None. The memory a pass with gradients takes at its peak, per
    token: as configured without checkpointing, every layer's activations and one layer's
    gradients in backward; checkpointed every k layers, one float per width per k layers and, in
    backward, k recomputed layers and one layer's gradients (at every layer: 9 times fewer bytes
    per token than none, for SmolLM2-135M); without gradients, about one layer's activations. A GRPO update at micro_batch 8 made ten passes
    per step, each paying for reading every weight."""
    if micro_batch > SMALL_MICRO_BATCH:
        return None
    per_layer = activation_bytes(spec, 1, compute_bytes, lora_rank) / spec.n_layer  # one token, one layer

    def peak(every: int) -> float:
        if not every:
            return (spec.n_layer + 1) * per_layer
        return math.ceil(spec.n_layer / every) * spec.n_embd * checkpoint_bytes + (every + 1) * per_layer

    train = peak(checkpoint_every) / peak(1)
    return Merging(train, peak(checkpoint_every) / per_layer, cap) if train >= 2 else None
