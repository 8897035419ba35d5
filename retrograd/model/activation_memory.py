"""How much memory one forward keeps for backward: preflight's "activations" line."""

from __future__ import annotations

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
    norms = 2 * (2 * E * f + E * c)  # two pre-norms: input, normalised output, cast copy
    if spec.sandwich_norm:
        norms += 2 * 2 * E * f
    qk = (H + K) * D * f * (2 if spec.qk_norm else 1)  # float32 q/k around RoPE (and qk norms)
    attn = (H + 2 * K) * D * c + 2 * H * D * c + H * f  # SDPA q, k, v, output (+ its copy), lse
    if spec.attn_logit_softcap:  # softcapped_attention: q, k and v repeated to H heads, output, all float32,
        attn = 4 * H * D * f + H * D * c + 2 * H * row * f  # and the tanh's and softmax's [H, L, L] outputs
    if spec.attn_sinks:  # gpt-oss's sink slot (with_sink_slot): SDPA keeps its [L, L + 1] mask as float32
        attn += row * f
    # lfm2's gated short convolution in place of attention: in_proj's output and the gated product
    # in the compute dtype, the padded b * x and the convolution in float32
    conv = 4 * E * c + 2 * E * f
    ffn = 4 * F * c + E * f  # gate, act(gate), up, product; down output
    # a mixture (spec.moe_layers; lfm2moe keeps dense FFNs in its leading layers): that for each of a token's
    # experts (its gathered input, its output in float32, in slot order, weighted), and the router's float32
    # logits and gated values
    moe_ffn = spec.n_expert_used * (4 * spec.n_ff_exp * c + E * c + 3 * E * f) + 2 * spec.n_expert * f
    lora = 7 * lora_rank * c
    n_conv, n_moe = sum(spec.conv_layers), sum(spec.moe_layers)
    per_layer = norms + lora
    ffns = (spec.n_layer - n_moe) * ffn + n_moe * moe_ffn
    return tokens * ((spec.n_layer - n_conv) * (per_layer + qk + attn) + n_conv * (per_layer + conv) + ffns)
