"""ModelSpec: everything the torch forward needs to know, read once from GGUF metadata.

Architecture differences are fields, not subclasses. The values follow what llama.cpp
does for each architecture (llama-model.cpp `load_hparams` and the graph builders in
src/models/), since llama.cpp is the reference our logits must match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from retrograd.errors import GGUFError, UnsupportedArchError
from retrograd.gguf.file import GGUFFile

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# llama.cpp rotates interleaved pairs (x[2i], x[2i+1]) for "norm" models, whose GGUF Q/K
# rows the converter already permuted, and halves (x[i], x[i+n/2]) for "neox" models.
ROPE_STYLE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox"}


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
    chat_template: str | None

    @property
    def n_kv_groups(self) -> int:
        return self.n_head // self.n_head_kv


def _layer_int(f: GGUFFile, key: str, n_layer: int) -> int:
    """head_count(_kv) may be stored per layer; we need one value."""
    value = f.require(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"{f.path}: {key} differs between layers ({sorted(set(value))}); not supported")
        value = value[0]
    return int(value)


def read_spec(f: GGUFFile) -> ModelSpec:
    arch = f.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{f.path}: missing metadata key general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchError(
            f"{f.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    k = lambda key: f"{arch}.{key}"  # noqa: E731
    n_layer = int(f.require(k("block_count")))
    n_embd = int(f.require(k("embedding_length")))
    n_head = _layer_int(f, k("attention.head_count"), n_layer)
    n_head_kv = _layer_int(f, k("attention.head_count_kv"), n_layer) if f.get(k("attention.head_count_kv")) is not None else n_head
    n_ff = _layer_int(f, k("feed_forward_length"), n_layer)
    head_dim = int(f.get(k("attention.key_length"), n_embd // n_head))
    head_dim_v = int(f.get(k("attention.value_length"), head_dim))
    if n_head % n_head_kv:
        raise GGUFError(f"{f.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")

    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{f.path}: missing tensor token_embd.weight")
    n_vocab = int(f.get(k("vocab_size"), f.array_length("tokenizer.ggml.tokens") or emb.shape[0]))

    scaling = f.get(k("rope.scaling.type"), "none")
    if scaling not in ("none", "linear"):
        raise GGUFError(f"{f.path}: rope scaling {scaling!r} is not supported (supported: none, linear)")
    factor = float(f.get(k("rope.scaling.factor"), 1.0) or 1.0) if scaling == "linear" else 1.0

    sliding_window = 0
    swa_layers = (False,) * n_layer
    attn_scale = 1.0 / math.sqrt(head_dim)
    if arch == "gemma3":
        sliding_window = int(f.get(k("attention.sliding_window"), 0))
        if sliding_window > 0:
            # llama.cpp set_swa_pattern(6): every sixth layer is global, the rest slide
            swa_layers = tuple(i % 6 < 5 for i in range(n_layer))
        if n_layer == 62:  # gemma3-27B scales by n_embd/n_head, as llama.cpp does
            attn_scale = 1.0 / math.sqrt(n_embd / n_head)

    return ModelSpec(
        arch=arch,
        name=str(f.get("general.name", f.path.stem)),
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_vocab=n_vocab,
        context_length=int(f.get(k("context_length"), 2048)),
        norm_eps=float(f.require(k("attention.layer_norm_rms_epsilon"))),
        rope_style=ROPE_STYLE[arch],
        n_rot=int(f.get(k("rope.dimension_count"), head_dim)),
        rope_base=float(f.get(k("rope.freq_base"), 10000.0)),
        rope_freq_scale=1.0 / factor,
        rope_base_swa=10000.0,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        sandwich_norm=arch == "gemma3",
        ffn_act="gelu" if arch == "gemma3" else "silu",
        embed_scale=math.sqrt(n_embd) if arch == "gemma3" else 1.0,
        attn_scale=attn_scale,
        sliding_window=sliding_window,
        swa_layers=swa_layers,
        # llama.cpp applies the final soft-cap only in its non-sliding-window gemma3 graph
        final_logit_softcap=float(f.get(k("final_logit_softcapping"), 0.0) or 0.0) if sliding_window == 0 else 0.0,
        tied_output="output.weight" not in f.tensors,
        chat_template=f.get("tokenizer.chat_template"),
    )

