"""ModelSpec: everything the torch forward needs to know, read once from GGUF metadata.

Architecture differences are fields, not subclasses. The values follow what llama.cpp
does for each architecture (llama-model.cpp `load_hparams` and the graph builders in
src/models/), since llama.cpp is the reference our logits must match.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from retrograd.errors import GGUFError, UnsupportedArchError
from retrograd.gguf.file import GGUFFile

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "smollm3", "gemma2", "granite", "olmo2")

# llama.cpp rotates interleaved pairs (x[2i], x[2i+1]) for "norm" models, whose GGUF Q/K
# rows the converter already permuted, and halves (x[i], x[i+n/2]) for "neox" models.
ROPE_STYLE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox"}
ROPE_STYLE |= {"smollm3": "norm", "gemma2": "neox", "granite": "norm", "olmo2": "neox"}
# hybrid stacks: lfm2 mixes gated short-convolution layers with attention layers
SUPPORTED_ARCHS += ("lfm2",)
ROPE_STYLE |= {"lfm2": "neox"}
# fused projections: phi3 stores q, k, v as one attn_qkv and gate, up as one ffn_up
SUPPORTED_ARCHS += ("phi3",)
ROPE_STYLE |= {"phi3": "neox"}
# mixture of experts: qwen3moe is qwen3 attention with a routed FFN in every layer
SUPPORTED_ARCHS += ("qwen3moe",)
ROPE_STYLE |= {"qwen3moe": "neox"}
# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values (the expert_gating_func key)
EXPERT_GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
# arch -> the routing llama.cpp's graph fixes for it whatever the file says (gating or first_dense
# None: read the file's key). qwen3moe: softmax, always renormalised, never scaled (its load_hparams reads no scale)
MOE_ROUTING = {"qwen3moe": dict(gating="softmax", norm=True, scale=1.0, first_dense=0)}
# lfm2moe: lfm2's hybrid stack, dense FFNs in the first leading_dense_block_count layers, then a
# mixture gated as expert_gating_func says (sigmoid in LFM2-8B-A1B), always renormalised, never scaled
# (the installed llama.cpp reads neither expert_weights_norm nor expert_weights_scale: test_arch_lfm2moe), with a
# per-expert selection bias blk.N.exp_probs_b.bias added to the values the pick sorts, not to the weights
SUPPORTED_ARCHS += ("lfm2moe",)
ROPE_STYLE |= {"lfm2moe": "neox"}
MOE_ROUTING |= {"lfm2moe": dict(gating=None, norm=True, scale=1.0, first_dense=None, selection_bias=True)}
HYBRID_ARCHS = ("lfm2", "lfm2moe")  # conv and attention layers, told apart by head_count_kv
# RoPE variants: mistral3 is llama with YaRN scaling and attention temperature (Ministral 3, Devstral Small 2)
SUPPORTED_ARCHS += ("mistral3",)
ROPE_STYLE |= {"mistral3": "norm"}
ROPE_SCALINGS = ("none", "linear", "yarn")  # rope.scaling.type values our RotaryTable computes
# archs whose load_hparams reads rope.scaling.yarn_log_multiplier, yarn_beta_fast/slow and
# attention.temperature_scale (others keep llama.cpp's defaults). No supported arch reads yarn_ext_factor or
# yarn_attn_factor (checked with the installed llama.cpp at its default context parameters, as the sampler
# and llama.cpp's tools run it: llama_cpp.Llama instead passes betas 32/1 and attn factor 1 explicitly)
YARN_KEYS_READ = ("mistral3",)
# gpt-oss: q/k/v/o biases and a learned sink logit per head, a window on alternate layers, YaRN on every
# layer; a mixture in every layer, routed by a softmax over the picked (biased) router logits, neither
# renormalised nor scaled (llama.cpp's graph fixes all three), biased experts with OpenAI's clamped SwiGLU
SUPPORTED_ARCHS += ("gpt-oss",)
ROPE_STYLE |= {"gpt-oss": "neox"}
MOE_ROUTING |= {"gpt-oss": dict(gating="softmax_weight", norm=False, scale=1.0, first_dense=0, biases=True)}


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # per-head size of q and k (attention.key_length, may differ from n_embd/n_head)
    head_dim_v: int
    n_vocab: int
    context_length: int
    norm_eps: float
    # rotary embedding
    rope_style: str  # "norm" | "neox"
    n_rot: int
    rope_base: float
    rope_freq_scale: float  # 1/linear scaling factor, global layers only
    rope_base_swa: float  # base for sliding-window layers (gemma3)
    rope_freq_scale_swa: float  # their freq_scale: llama.cpp's default is the global one; gemma3's is 1
    # RoPE scaling, as llama.cpp's context sets it up (llama-context.cpp) and ggml's rope_yarn applies it
    rope_ext_factor: float  # YaRN: how much of the original angle each pair keeps by its ramp (0 = plain/linear RoPE)
    rope_attn_factor: float  # llama.cpp's yarn_attn_factor: multiplies cos and sin (and, under YaRN, 1 + 0.1 ln(1/freq_scale) too)
    rope_yarn_beta_fast: float  # YaRN's correction range (ggml_rope_yarn_corr_dims)
    rope_yarn_beta_slow: float
    rope_ctx_orig: int  # n_ctx_orig_yarn: rope.scaling.original_context_length, else context_length
    # per-pair frequency divisors (tensor names, "" = none): llama.cpp uses the long ones when its context
    # per sequence exceeds rope_ctx_orig (phi3's rope_factors_long/short); rope_freqs.weight is both
    rope_factors_short: str
    rope_factors_long: str
    attn_temp_scale: float  # 0 = off; else q *= 1 + scale * ln(1 + floor(pos / attn_temp_length)) after RoPE (mistral3)
    attn_temp_length: int
    # architecture features
    qkv_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (qwen3, gemma3)
    sandwich_norm: bool  # extra norms after attention and after the FFN (gemma3)
    ffn_act: str  # "silu" | "gelu" (tanh approximation)
    embed_scale: float  # token embeddings are multiplied by this (sqrt(n_embd) for gemma3)
    attn_scale: float  # multiplies q before q·k
    sliding_window: int  # 0 = none
    swa_layers: tuple[bool, ...]
    final_logit_softcap: float  # 0 = none
    tied_output: bool  # no output.weight: the head reuses token_embd
    # dense variants (smollm3, gemma2, granite, olmo2)
    rope_layers: tuple[bool, ...]  # layers whose q and k are rotated (smollm3 leaves every fourth unrotated: NoPE)
    attn_logit_softcap: float  # 0 = none; else each q·k score becomes cap * tanh(score / cap) (gemma2)
    residual_scale: float  # multiplies each branch's output before it joins the residual stream (granite)
    logit_scale: float  # the logits are divided by this (granite)
    pre_norm: bool  # attn_norm / ffn_norm in front of each branch (olmo2 has only the post-norms)
    qk_norm_full: bool  # the q/k norm spans the whole projection instead of each head (olmo2)
    # granite: which of attn_output, ffn_gate, ffn_up, ffn_down carry a bias in every layer (llama.cpp
    # creates each as optional and its granite graph adds it; q/k/v biases are qkv_bias)
    biased_projections: tuple[str, ...]
    # hybrid stacks (lfm2, lfm2moe)
    conv_layers: tuple[bool, ...]  # layers whose mixer is a gated short convolution instead of attention
    conv_kernel: int  # shortconv.l_cache: each convolution sees its token and the conv_kernel - 1 before it (0 = none)
    final_norm: str  # GGUF name of the norm before the head (lfm2 stores it as token_embd_norm.weight)
    # fused projections (phi3); llama.cpp splits both outputs in its graph
    fused_qkv: bool  # blk.N.attn_qkv.weight holds q, k and v stacked, in that order
    fused_gate_up: bool  # blk.N.ffn_up.weight holds gate then up ([2 * n_ff, n_embd]), no ffn_gate
    # mixture of experts (qwen3moe, lfm2moe, gpt-oss), routed as llama.cpp's build_moe_ffn (src/llama-graph.cpp) does:
    # router logits -> gating -> top n_expert_used -> their weights (renormalised, scaled) -> experts
    moe_layers: tuple[bool, ...]  # layers whose FFN is the mixture (all False: a dense model)
    n_expert: int  # expert_count (0 = dense)
    n_expert_used: int  # expert_used_count: experts each token runs through
    n_ff_exp: int  # expert_feed_forward_length: each expert's hidden width
    expert_gating: str  # "softmax" over all router logits | "sigmoid" | "softmax_weight" (softmax over the selected logits)
    expert_weights_norm: bool  # the selected experts' weights divided by their sum
    expert_weights_scale: float  # then multiplied by this (1 = none)
    expert_selection_bias: bool  # blk.N.exp_probs_b.bias [n_expert] is added to the gated values the pick sorts (lfm2moe)
    # gpt-oss
    expert_biases: bool  # the router (ffn_gate_inp.bias [n_expert]) and each expert (ffn_*_exps.bias [n_expert, n_out]) add biases
    attn_sinks: bool  # blk.N.attn_sinks.weight [n_head]: a learned logit per head that joins each softmax's denominator
    ffn_norm: str  # the norm in front of the FFN, blk.N.<ffn_norm>.weight (gpt-oss stores it as post_attention_norm)
    chat_template: str | None

    @property
    def n_kv_groups(self) -> int:
        return self.n_head // self.n_head_kv


# llama.cpp keeps hyperparameters in 32-bit integers; a file claiming more is damaged
MAX_HPARAM = 2**31 - 1


def _int(f: GGUFFile, key: str, default: int | None = None, *, minimum: int = 1) -> int:
    """A required (default None) or optional integer hyperparameter, in [minimum, MAX_HPARAM]."""
    value = f.get_int(key, default)
    if value is None:
        raise GGUFError(f"{f.path}: missing metadata key {key}")
    return _in_range(f, key, value, minimum)


def _in_range(f: GGUFFile, key: str, value: int, minimum: int) -> int:
    if not minimum <= value <= MAX_HPARAM:
        raise GGUFError(f"{f.path}: metadata {key} is {value}, expected {minimum} to {MAX_HPARAM}")
    return value


def _float(f: GGUFFile, key: str, default: float | None = None, *, positive: bool = True) -> float:
    """A required (default None) or optional finite float hyperparameter, above zero or at least zero."""
    value = f.get_float(key, default)
    if value is None:
        raise GGUFError(f"{f.path}: missing metadata key {key}")
    if not math.isfinite(value) or value < 0.0 or (positive and value == 0.0):
        bound = "above 0" if positive else "of at least 0"
        raise GGUFError(f"{f.path}: metadata {key} is {value}, expected a finite number {bound}")
    return value


def _layer_int(f: GGUFFile, key: str, n_layer: int, default: int | None = None) -> int:
    """head_count(_kv) may be stored per layer; we need one value."""
    length = f.array_length(key)
    if length is None:
        return _int(f, key, default)
    if length != n_layer:
        raise GGUFError(f"{f.path}: {key} has {length} entries for {n_layer} layers")
    values = sorted(set(f.get_ints(key)))
    if len(values) != 1:
        raise GGUFError(f"{f.path}: {key} differs between layers ({values[:8]}); not supported")
    return _in_range(f, key, values[0], 1)


def _kv_heads_and_conv_layers(f: GGUFFile, key: str, n_layer: int, n_head: int, *, hybrid: bool) -> tuple[int, tuple[bool, ...]]:
    """head_count_kv, and which layers convolve instead of attending: a hybrid stack (lfm2)
    lists 0 key-value heads for those, which is how llama.cpp's load_hparams tells them apart."""
    if not hybrid or f.array_length(key) is None:
        return _layer_int(f, key, n_layer, n_head), (False,) * n_layer
    per_layer = f.get_ints(key)
    if len(per_layer) != n_layer:
        raise GGUFError(f"{f.path}: {key} has {len(per_layer)} entries for {n_layer} layers")
    attention = sorted({v for v in per_layer if v})
    if len(attention) > 1:
        raise GGUFError(f"{f.path}: {key} differs between attention layers ({attention[:8]}); not supported")
    return (_in_range(f, key, attention[0], 1) if attention else n_head), tuple(v == 0 for v in per_layer)


def _vocabulary_size(f: GGUFFile) -> int | None:
    """The length of tokenizer.ggml.tokens. llama.cpp aborts the whole process (a GGML_ASSERT,
    not an error it returns) on a vocabulary that lists a token twice: such a file stops here,
    before the tokenizer hands it to llama.cpp (0.2 s for Gemma-3's 262144 tokens)."""
    tokens = f.get_strs("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    if len(set(tokens)) != len(tokens):
        token, count = Counter(tokens).most_common(1)[0]
        raise GGUFError(f"{f.path}: tokenizer.ggml.tokens lists the token {token[:64]!r} {count} times")
    return len(tokens)


def _moe_routing(f: GGUFFile, arch: str, n_layer: int) -> dict:
    """The ModelSpec fields of a mixture of experts (all off for a dense arch). MOE_ROUTING fixes
    each arch's renormalisation and scale (llama.cpp's graphs pass them as constants, whatever
    the file says); the gating and the leading dense layers come from the file where it says None."""
    if arch not in MOE_ROUTING:
        return dict(moe_layers=(False,) * n_layer, n_expert=0, n_expert_used=0, n_ff_exp=0,
                    expert_gating="softmax", expert_weights_norm=False, expert_weights_scale=1.0, expert_selection_bias=False,
                    expert_biases=False)
    k = lambda key: f"{arch}.{key}"  # noqa: E731
    fixed = MOE_ROUTING[arch]
    n_expert = _int(f, k("expert_count"))
    n_expert_used = _int(f, k("expert_used_count"))
    if n_expert_used > n_expert:
        raise GGUFError(f"{f.path}: metadata {k('expert_used_count')} is {n_expert_used}, more than {k('expert_count')} {n_expert}")
    gating = fixed["gating"]
    if gating is None:
        code = _int(f, k("expert_gating_func"))
        if code not in EXPERT_GATING_FUNCS:
            raise GGUFError(f"{f.path}: metadata {k('expert_gating_func')} is {code}, not one of {sorted(EXPERT_GATING_FUNCS)}")
        gating = EXPERT_GATING_FUNCS[code]
    first_dense = fixed["first_dense"] if fixed["first_dense"] is not None else _int(f, k("leading_dense_block_count"), 0, minimum=0)
    return dict(
        moe_layers=tuple(i >= first_dense for i in range(n_layer)),
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=_int(f, k("expert_feed_forward_length"), 0, minimum=0) or _layer_int(f, k("feed_forward_length"), n_layer) // n_expert_used,
        expert_gating=gating,
        expert_weights_norm=fixed["norm"],
        expert_weights_scale=fixed["scale"],
        expert_selection_bias=fixed.get("selection_bias", False),
        expert_biases=fixed.get("biases", False),
    )


def _swa_pattern(f: GGUFFile, key: str, n_layer: int, default_period: int) -> tuple[bool, ...]:
    """Which layers slide, as llama.cpp reads `key`: one flag per layer, or a period p (layer i
    slides when i % p < p - 1; 0: every layer). llama.cpp asserts (aborting the process) that one does."""
    if f.array_length(key) is not None:
        flags = f.get_flags(key)
        if len(flags) != n_layer:
            raise GGUFError(f"{f.path}: {key} has {len(flags)} entries for {n_layer} layers")
        layers = tuple(flags)
    else:
        period = _int(f, key, default_period, minimum=0)
        layers = tuple(period == 0 or i % period < period - 1 for i in range(n_layer))
    if not any(layers):
        raise GGUFError(f"{f.path}: metadata {key} leaves no sliding-window layer, which llama.cpp cannot run")
    return layers


def _get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_scaling(f: GGUFFile, arch: str, scaling: str, factor: float) -> dict:
    """The RoPE scaling and attention temperature fields, as llama.cpp's load_hparams reads
    them and its context turns them into ggml_rope_ext's ext_factor and attn_factor. None of
    them depends on the context size except which frequency factors phi3 uses (Transformer.use_context)."""
    k = lambda key: f"{arch}.{key}"  # noqa: E731
    reads_yarn = arch in YARN_KEYS_READ
    ctx_orig = _int(f, k("rope.scaling.original_context_length"), 0, minimum=0) or _int(f, k("context_length"), 2048)
    ext_factor = 1.0 if scaling == "yarn" else 0.0
    attn_factor = 1.0
    if ext_factor:  # llama.cpp's mscale, divided by the one ggml's rope_yarn multiplies in again
        log_mul = _float(f, k("rope.scaling.yarn_log_multiplier"), 0.0, positive=False) if reads_yarn else 0.0
        attn_factor = _get_mscale(factor, 1.0) / _get_mscale(factor, log_mul) if log_mul else _get_mscale(factor, 1.0)
        attn_factor /= 1.0 + 0.1 * math.log(factor)
    attn_factor *= _float(f, k("rope.scaling.attn_factor"), 1.0)
    if "rope_freqs.weight" in f.tensors:  # llama3-style factors: always used
        short = long = "rope_freqs.weight"
    else:  # phi3's pair, chosen by context; a missing one means no factors in that case
        short, long = (name if name in f.tensors else "" for name in ("rope_factors_short.weight", "rope_factors_long.weight"))
    temp_scale = _float(f, k("attention.temperature_scale"), 0.0, positive=False) if reads_yarn else 0.0
    return dict(
        rope_ext_factor=ext_factor,
        rope_attn_factor=attn_factor,
        rope_yarn_beta_fast=_float(f, k("rope.scaling.yarn_beta_fast"), 32.0) if reads_yarn else 32.0,
        rope_yarn_beta_slow=_float(f, k("rope.scaling.yarn_beta_slow"), 1.0) if reads_yarn else 1.0,
        rope_ctx_orig=ctx_orig,
        rope_factors_short=short,
        rope_factors_long=long,
        attn_temp_scale=temp_scale,
        attn_temp_length=ctx_orig,  # llama.cpp's mistral3 floors positions by n_ctx_orig_yarn
    )


def read_spec(f: GGUFFile) -> ModelSpec:
    """Every value typed and bounded: a hostile file gets one GGUFError line, never a crash
    or an allocation sized by the file's say-so."""
    arch = f.get_str("general.architecture")
    if arch is None:
        raise GGUFError(f"{f.path}: missing metadata key general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchError(
            f"{f.path}: architecture {arch[:64]!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    k = lambda key: f"{arch}.{key}"  # noqa: E731
    n_layer = _int(f, k("block_count"))
    if n_layer > len(f.tensors):  # every layer has tensors of its own
        raise GGUFError(f"{f.path}: metadata {k('block_count')} is {n_layer}, but the file has only {len(f.tensors)} tensors")
    n_embd = _int(f, k("embedding_length"))
    n_head = _layer_int(f, k("attention.head_count"), n_layer)
    n_head_kv, conv_layers = _kv_heads_and_conv_layers(f, k("attention.head_count_kv"), n_layer, n_head, hybrid=arch in HYBRID_ARCHS)
    n_ff = _layer_int(f, k("feed_forward_length"), n_layer)
    head_dim = _int(f, k("attention.key_length"), max(n_embd // n_head, 1))
    head_dim_v = _int(f, k("attention.value_length"), head_dim)
    if n_head % n_head_kv:
        raise GGUFError(f"{f.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")

    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{f.path}: missing tensor token_embd.weight")
    n_vocab = _int(f, k("vocab_size"), _vocabulary_size(f) or emb.shape[0])

    scaling = f.get_str(k("rope.scaling.type"), "none")
    if scaling not in ROPE_SCALINGS:
        raise GGUFError(f"{f.path}: rope scaling {scaling[:64]!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")
    factor = (_float(f, k("rope.scaling.factor"), 1.0, positive=False) or 1.0) if scaling != "none" else 1.0  # 0: unset

    sliding_window = 0
    swa_layers = (False,) * n_layer
    attn_scale = 1.0 / math.sqrt(head_dim)
    if arch == "gemma3":
        sliding_window = _int(f, k("attention.sliding_window"), 0, minimum=0)
        if sliding_window > 0:
            # llama.cpp set_swa_pattern(6): every sixth layer is global, the rest slide
            swa_layers = tuple(i % 6 < 5 for i in range(n_layer))
        if n_layer == 62:  # gemma3-27B scales by n_embd/n_head, as llama.cpp does
            attn_scale = 1.0 / math.sqrt(n_embd / n_head)

    # dense variants: each value as llama.cpp's load_hparams and graph builder set it
    rope_base = _float(f, k("rope.freq_base"), 10000.0)
    rope_base_swa = 10000.0
    rope_layers = (True,) * n_layer
    embed_scale = math.sqrt(n_embd) if arch in ("gemma2", "gemma3") else 1.0
    attn_logit_softcap, residual_scale, logit_scale = 0.0, 1.0, 1.0
    biased_projections: tuple[str, ...] = ()
    if arch == "smollm3":  # llama.cpp's n_no_rope_layer_step = 4: layers 3, 7, 11, ... skip RoPE
        rope_layers = tuple((i + 1) % 4 != 0 for i in range(n_layer))
    elif arch == "gemma2":  # a window (4096 unless set) on every even layer, at the global RoPE base
        sliding_window = _int(f, k("attention.sliding_window"), 4096, minimum=0)
        swa_layers = tuple(i % 2 == 0 and sliding_window > 0 for i in range(n_layer))
        rope_base_swa = rope_base
        attn_logit_softcap = _float(f, k("attn_logit_softcapping"), 50.0)
        if n_layer == 46:  # gemma2-27B scales by n_embd/n_head, as llama.cpp does
            attn_scale = 1.0 / math.sqrt(n_embd / n_head)
    elif arch == "granite":  # each multiplier is off when absent or 0; logit_scale is required
        embed_scale = _float(f, k("embedding_scale"), 0.0, positive=False) or 1.0
        residual_scale = _float(f, k("residual_scale"), 0.0, positive=False) or 1.0
        attn_scale = _float(f, k("attention.scale"), 0.0, positive=False) or attn_scale
        logit_scale = _float(f, k("logit_scale"))
        biased_projections = tuple(t for t in ("attn_output", "ffn_gate", "ffn_up", "ffn_down") if f"blk.0.{t}.bias" in f.tensors)
        if f.get(k("rope.scaling.finetuned"), True) is False:  # granite's switch for RoPE
            rope_layers = (False,) * n_layer
    elif arch == "olmo2" and _int(f, k("attention.sliding_window"), 0, minimum=0):
        raise GGUFError(f"{f.path}: olmo2 with sliding-window layers (OLMo 3) is not supported")
    elif arch == "gpt-oss":  # the window is required; its own RoPE base when the file sets one; an attn_output bias
        sliding_window = _int(f, k("attention.sliding_window"))
        swa_layers = _swa_pattern(f, k("attention.sliding_window_pattern"), n_layer, default_period=2)
        rope_base_swa = _float(f, k("rope.freq_base_swa"), rope_base)
        biased_projections = ("attn_output",)

    if scaling == "yarn" and 1.0 in (rope_base, rope_base_swa):  # YaRN's correction range divides by log(base)
        raise GGUFError(f"{f.path}: YaRN RoPE scaling with a RoPE base of 1 is undefined (its correction range divides by ln(base))")

    # hybrid stacks: lfm2's gated short-convolution layers
    conv_kernel = _int(f, k("shortconv.l_cache"), minimum=2) if arch in HYBRID_ARCHS else 0
    if arch in HYBRID_ARCHS and _int(f, k("attention.sliding_window"), 0, minimum=0):
        raise GGUFError(f"{f.path}: {arch} with sliding-window attention layers is not supported")
    first_attention = conv_layers.index(False) if not all(conv_layers) else 0  # where q/k biases and norms show

    if arch == "mistral3" and "blk.0.ffn_gate_inp.weight" in f.tensors:
        raise UnsupportedArchError(f"{f.path}: mistral3 with experts (blk.0.ffn_gate_inp.weight) is not supported")
    # fused projections: phi3. llama.cpp's phi3 hparams switch a sliding window off (it warns
    # that Phi SWA is disabled), so a window in the file is not applied

    n_rot = _int(f, k("rope.dimension_count"), head_dim)
    if n_rot > head_dim:
        raise GGUFError(f"{f.path}: metadata {k('rope.dimension_count')} is {n_rot}, more than the head size {head_dim}")
    if arch in ("mistral3", "gpt-oss") and not n_rot == head_dim == head_dim_v:  # llama.cpp's graph asserts it (and aborts the process)
        raise GGUFError(f"{f.path}: {arch} needs rope.dimension_count = key_length = value_length, got {n_rot}, {head_dim}, {head_dim_v}")
    return ModelSpec(
        arch=arch,
        name=f.get_str("general.name", f.path.stem),
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_vocab=n_vocab,
        context_length=_int(f, k("context_length"), 2048),
        norm_eps=_float(f, k("attention.layer_norm_rms_epsilon")),
        rope_style=ROPE_STYLE[arch],
        n_rot=n_rot,
        rope_base=rope_base,
        rope_freq_scale=1.0 / factor,
        **_rope_scaling(f, arch, scaling, factor),
        rope_base_swa=rope_base_swa,
        rope_freq_scale_swa=1.0 if arch == "gemma3" else 1.0 / factor,
        qkv_bias=f"blk.{first_attention}.attn_q.bias" in f.tensors,
        qk_norm=f"blk.{first_attention}.attn_q_norm.weight" in f.tensors,
        sandwich_norm=arch in ("gemma2", "gemma3", "olmo2"),
        ffn_act="gelu" if arch in ("gemma2", "gemma3") else "swiglu_oai" if arch == "gpt-oss" else "silu",
        embed_scale=embed_scale,
        attn_scale=attn_scale,
        sliding_window=sliding_window,
        swa_layers=swa_layers,
        # llama.cpp applies the final soft-cap in gemma2's graph (30 unless set) and only in its
        # non-sliding-window gemma3 graph
        final_logit_softcap=_float(f, k("final_logit_softcapping"), 30.0) if arch == "gemma2"
        else _float(f, k("final_logit_softcapping"), 0.0, positive=False) if sliding_window == 0 else 0.0,
        tied_output="output.weight" not in f.tensors,
        rope_layers=rope_layers,
        attn_logit_softcap=attn_logit_softcap,
        residual_scale=residual_scale,
        logit_scale=logit_scale,
        pre_norm=arch != "olmo2",
        qk_norm_full=arch == "olmo2",
        biased_projections=biased_projections,
        conv_layers=conv_layers,
        conv_kernel=conv_kernel,
        final_norm="token_embd_norm.weight" if arch in HYBRID_ARCHS else "output_norm.weight",
        fused_qkv=f"blk.{first_attention}.attn_qkv.weight" in f.tensors,
        fused_gate_up=arch == "phi3",
        **_moe_routing(f, arch, n_layer),
        attn_sinks=arch == "gpt-oss",
        ffn_norm="post_attention_norm" if arch == "gpt-oss" else "ffn_norm",
        chat_template=f.get_str("tokenizer.chat_template"),
    )

