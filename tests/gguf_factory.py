"""Write small GGUF models for tests with the gguf writer: random tiny models of each
supported architecture (borrowing SmolLM2's real vocabulary so llama.cpp can load them),
and dequantized or requantized copies of real models."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from retrograd.gguf.file import GGUFFile
from retrograd.runtime.bundled import default_model_path

# name -> (arch, hyperparameters); each exercises the features of its architecture
TINY_ARCHS = {
    "llama": dict(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, tied=False),
    "qwen2": dict(arch="qwen2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, tied=True, bias=True),
    # qwen3: head size 32 != n_embd / n_head = 16, q/k norms
    "qwen3": dict(arch="qwen3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, tied=True, qk_norm=True),
    # gemma3: six layers so the pattern has five sliding-window layers and one global one;
    # a window of 16 tokens binds inside a 256-token test
    "gemma3": dict(arch="gemma3", n_layer=6, n_embd=64, n_head=4, n_head_kv=1, head_dim=32, n_ff=128, tied=True, qk_norm=True, window=16),
    # dense variants; `floats` are written as {arch}.{key}, with values small or large enough to bind
    # smollm3: four layers, so the fourth skips RoPE (NoPE)
    "smollm3": dict(arch="smollm3", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, tied=True),
    # gemma2: window of 16 on even layers, both soft-caps binding on these random weights
    "gemma2": dict(arch="gemma2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, tied=True, window=16,
                   floats={"attn_logit_softcapping": 3.0, "final_logit_softcapping": 8.0}),
    "granite": dict(arch="granite", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, tied=False,
                    floats={"embedding_scale": 3.0, "residual_scale": 0.5, "attention.scale": 0.25, "logit_scale": 0.5}),
    # olmo2: no pre-norms, q/k norms over the whole projection (its head size is n_embd / n_head)
    "olmo2": dict(arch="olmo2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, tied=False,
                  qk_norm="full", pre_norm=False),
    # lfm2: gated short convolutions (kernel 3) in layers 0, 1 and 3, attention in layer 2; lfm2's
    # head size must be n_embd / n_head (llama.cpp sizes attn_output [n_embd, n_embd])
    "lfm2": dict(arch="lfm2", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, tied=True, qk_norm=True,
                 conv_layers=(0, 1, 3), conv_kernel=3),
    # phi3: fused attn_qkv and gate/up; a window of 16 that llama.cpp's phi3 switches off. Not named
    # "tiny-phi3": llama.cpp's vocabulary loader wants </s>, <unk>, <s> in a model whose name says phi3
    "phi3": dict(arch="phi3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, tied=False, fused=True,
                 window=16, name="tiny-fused"),
    # qwen3moe: qwen3 attention (head size 32 != 64 / 4) and in every layer a router over 4 experts
    # (2 used, each 32 wide); a router gain that keeps the picks far from ties
    "qwen3moe": dict(arch="qwen3moe", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, tied=False,
                     qk_norm=True, experts=(4, 2, 32)),
    # lfm2moe: lfm2's hybrid stack (conv layers 0 and 2, attention in 1 and 3) with a dense FFN in layer 0
    # (leading_dense_block_count 1) and a mixture in the rest: 4 experts, 2 used, sigmoid gating
    # (expert_gating_func 2) and a selection bias exp_probs_b of spread 0.5, enough to change picks
    "lfm2moe": dict(arch="lfm2moe", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, tied=False, qk_norm=True,
                    conv_layers=(0, 2), conv_kernel=3, experts=(4, 2, 32), dense_lead=1, gating=2, selection_bias=0.5),
    # RoPE variants; `meta` keys are written as {arch}.{key} (str, bool, int as uint32, float as float32, tuple as array).
    # mistral3: YaRN (factor 4 over an original context of 64) with a log multiplier, attention
    # temperature, which binds from position 64 on, and YaRN betas 16 and 2, which llama.cpp's mistral3
    # reads (the ramp spans pairs 0 to 3 of 16; llama.cpp's default betas 32 and 1: 0 to 5); head size 32 != 64 / 4
    "mistral3": dict(arch="mistral3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, tied=False,
                     meta={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64,
                           "rope.scaling.yarn_beta_fast": 16.0, "rope.scaling.yarn_beta_slow": 2.0,
                           "rope.scaling.yarn_log_multiplier": 0.5, "attention.temperature_scale": 0.5}),
    # gpt-oss: q/k/v/o biases, a learned sink per head, a window of 16 on even layers, YaRN (on both
    # kinds of layer), and in every layer a biased router over 4 biased experts (2 used, softmax over the
    # picked), post_attention_norm before the FFN; expert gain 4 so the clamped SwiGLU's limit of 7 binds
    "gpt-oss": dict(arch="gpt-oss", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, tied=False,
                    bias=True, layer_biases=("attn_output",), sinks=True, window=16, experts=(4, 2, 32), expert_bias=True,
                    expert_gain=4.0, ffn_norm="post_attention_norm",
                    meta={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64}),
    # llama with YaRN (llama.cpp's default betas and magnitude)
    "llama-yarn": dict(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, tied=False,
                       meta={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64}),
}
SANDWICH_NORMS = ("gemma2", "gemma3", "olmo2")  # post_attention_norm and post_ffw_norm in each block


@functools.lru_cache(maxsize=1)
def _vocab() -> dict:
    f = GGUFFile(default_model_path())
    keys = ("tokens", "token_type", "merges")
    return {k: f.get(f"tokenizer.ggml.{k}") for k in keys} | {"chat_template": f.get("tokenizer.chat_template")}


def _add_vocab(w: gguf.GGUFWriter) -> int:
    v = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(v["tokens"])
    w.add_token_types(v["token_type"])
    w.add_token_merges(v["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(v["chat_template"])
    return len(v["tokens"])


def write_tiny_model(path: Path, name: str, seed: int = 0, qtype: QT = QT.F32, extra_biases: tuple[str, ...] = (),
                     extra_vectors: tuple[str, ...] = (), vector_length: int = 0, meta: dict | None = None) -> Path:
    """A random model of TINY_ARCHS[name]; matrices stored as `qtype` (F32 by default);
    `extra_biases` names weights (e.g. "blk.0.attn_output") given a bias of their output's size,
    `extra_vectors` further tensors of `vector_length` (default head_dim / 2) values around 1 (e.g.
    phi3's "rope_factors_long.weight"); `meta` more metadata, as TINY_ARCHS' `meta`."""
    h = TINY_ARCHS[name]
    extra_meta = h.get("meta", {}) | (meta or {})
    arch, E, D, F = h["arch"], h["n_embd"], h["head_dim"], h["n_ff"]
    H, K, L = h["n_head"], h["n_head_kv"], h["n_layer"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(h.get("name", f"tiny-{name}"))
    n_vocab = _add_vocab(w)
    w.add_context_length(2048)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    if h.get("experts"):  # (expert_count, expert_used_count, expert_feed_forward_length); "experts_key": other values in the metadata
        n_expert, n_used, n_ff_exp = h.get("experts_key", h["experts"])
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(n_ff_exp)
    if h.get("dense_lead"):  # layers before this one keep a dense FFN
        w.add_leading_dense_block_count(h["dense_lead"])
    if h.get("gating"):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid
        w.add_expert_gating_func(gguf.ExpertGatingFuncType(h["gating"]))
    w.add_head_count(H)
    conv_layers = h.get("conv_layers", ())
    w.add_head_count_kv([0 if i in conv_layers else K for i in range(L)] if conv_layers else K)  # lfm2: 0 for a conv layer
    if conv_layers:
        w.add_shortconv_l_cache(h["conv_kernel"])
    w.add_key_length(D)
    w.add_value_length(D)
    if "rope.dimension_count" not in extra_meta:
        w.add_rope_dimension_count(D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if h.get("window"):
        w.add_sliding_window(h["window"])
    for key, value in h.get("floats", {}).items():
        w.add_float32(f"{arch}.{key}", value)
    for key, value in extra_meta.items():
        add = (w.add_string if isinstance(value, str) else w.add_bool if isinstance(value, bool)
               else w.add_uint32 if isinstance(value, int) else w.add_float32)
        add = w.add_array if isinstance(value, tuple) else add  # e.g. gpt-oss's sliding_window_pattern, one flag per layer
        add(f"{arch}.{key}", value)

    def mat(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def vec(n, around=1.0, spread=0.1):
        return (around + spread * rng.standard_normal(n)).astype(np.float32)

    def put(name_, arr):
        if arr.ndim >= 2 and qtype != QT.F32:
            w.add_tensor(name_, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name_, arr)

    put("token_embd.weight", rng.standard_normal((n_vocab, E)).astype(np.float32))
    w.add_tensor("token_embd_norm.weight" if arch in ("lfm2", "lfm2moe") else "output_norm.weight", vec(E))
    if not h["tied"]:
        put("output.weight", mat(n_vocab, E, gain=3.0))
    for i in range(L):
        p = f"blk.{i}."
        if h.get("pre_norm", True):
            w.add_tensor(p + "attn_norm.weight", vec(E))
        if i in conv_layers:  # lfm2: a gated short convolution in place of attention
            w.add_tensor(p + "shortconv.conv.weight", (0.5 * rng.standard_normal((E, h["conv_kernel"]))).astype(np.float32))
            put(p + "shortconv.in_proj.weight", mat(3 * E, E, 2.0))
            put(p + "shortconv.out_proj.weight", mat(E, E))
        elif h.get("fused"):  # phi3: q, k, v stacked in one matrix
            put(p + "attn_qkv.weight", np.concatenate([mat(H * D, E, 2.0), mat(K * D, E, 2.0), mat(K * D, E)]))
            put(p + "attn_output.weight", mat(E, H * D))
        else:
            put(p + "attn_q.weight", mat(H * D, E, 2.0))
            put(p + "attn_k.weight", mat(K * D, E, 2.0))
            put(p + "attn_v.weight", mat(K * D, E))
            put(p + "attn_output.weight", mat(E, H * D))
            if h.get("bias"):
                for t, n in (("q", H * D), ("k", K * D), ("v", K * D)):
                    w.add_tensor(p + f"attn_{t}.bias", vec(n, 0.0, 0.5))
            for t in h.get("layer_biases", ()):  # attn_output (gpt-oss)
                w.add_tensor(p + f"{t}.bias", vec(E, 0.0, 0.5))
            if h.get("sinks"):  # gpt-oss: one logit per head in each softmax's denominator
                w.add_tensor(p + "attn_sinks.weight", vec(H, 0.0, 1.0))
            if h.get("qk_norm"):
                full = h["qk_norm"] == "full"
                w.add_tensor(p + "attn_q_norm.weight", vec(H * D if full else D))
                w.add_tensor(p + "attn_k_norm.weight", vec(K * D if full else D))
        if h.get("pre_norm", True):
            w.add_tensor(p + h.get("ffn_norm", "ffn_norm") + ".weight", vec(E))  # gpt-oss: post_attention_norm
        moe = h.get("experts") and i >= h.get("dense_lead", 0)
        if moe:  # a router and stacks [n_expert, rows, cols] of expert matrices
            X, Fx, gain = h["experts"][0], h["experts"][2], h.get("expert_gain", 1.0)
            put(p + "ffn_gate_inp.weight", mat(X, E, gain=4.0))
            put(p + "ffn_gate_exps.weight", np.stack([mat(Fx, E, gain) for _ in range(X)]))
            put(p + "ffn_up_exps.weight", np.stack([mat(Fx, E, gain) for _ in range(X)]))
            put(p + "ffn_down_exps.weight", np.stack([mat(E, Fx) for _ in range(X)]))
            if h.get("selection_bias"):  # lfm2moe: added to the gated values the pick sorts
                w.add_tensor(p + "exp_probs_b.bias", vec(X, 0.0, h["selection_bias"]))
            if h.get("expert_bias"):  # gpt-oss: the router's bias and each expert's [n_expert, rows]
                w.add_tensor(p + "ffn_gate_inp.bias", vec(X, 0.0, 1.0))
                for t, n in (("gate", Fx), ("up", Fx), ("down", E)):
                    w.add_tensor(p + f"ffn_{t}_exps.bias", (0.5 * rng.standard_normal((X, n))).astype(np.float32))
        elif h.get("fused"):  # phi3: gate then up in one matrix
            put(p + "ffn_up.weight", np.concatenate([mat(F, E), mat(F, E)]))
        else:
            put(p + "ffn_gate.weight", mat(F, E))
            put(p + "ffn_up.weight", mat(F, E))
        if not moe:
            put(p + "ffn_down.weight", mat(E, F))
        if arch in SANDWICH_NORMS:
            w.add_tensor(p + "post_attention_norm.weight", vec(E))
            w.add_tensor(p + "post_ffw_norm.weight", vec(E))
    bias_sizes = {"attn_q": H * D, "attn_k": K * D, "attn_v": K * D, "ffn_gate": F, "ffn_up": F, "output": n_vocab}
    for weight in extra_biases:  # as long as the weight's output
        w.add_tensor(weight + ".bias", vec(bias_sizes.get(weight.rsplit(".", 1)[-1], E), 0.0, 0.5))
    for name_ in extra_vectors:
        w.add_tensor(name_, vec(vector_length or D // 2))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


PHI3_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def write_phi3_long_rope(folder: Path, ctx_orig: int) -> Path:
    """A Phi-3.5-style file: both factor sets, a magnitude, an original context of ctx_orig."""
    meta = {"rope.scaling.attn_factor": 1.19, "rope.scaling.original_context_length": ctx_orig}
    return write_tiny_model(folder / f"phi3-long-rope-{ctx_orig}.gguf", "phi3", extra_vectors=PHI3_FACTORS, meta=meta)


def write_f32_copy(src: Path, dst: Path) -> Path:
    """The same model with every tensor dequantized to F32 (metadata copied unchanged)."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w.add_tensor(t.name, np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
