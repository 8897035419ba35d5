"""Load a GGUF base model for torch: `retrograd.load_model(path)`.

The returned BaseModel is the small, stable Python API (README "Python API"):
`m.tokenize(text) -> list[int]` and `m.logits(ids) -> Tensor[len(ids), n_vocab]`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import gguf.quants
import numpy as np
import torch

from retrograd.errors import GGUFError, UnsupportedArchError
from retrograd.gguf.file import GGUFFile, TensorInfo
from retrograd.gguf.spec import ModelSpec, read_spec
from retrograd.kernels import gated, native_dequant, rowwise
from retrograd.kernels.dequant import CODECS
from retrograd.kernels.frozen import FrozenWeight, dense_budget
from retrograd.model.tokenizer import Tokenizer
from retrograd.model.transformer import Transformer
from retrograd.runtime.bundled import default_model_path

WEIGHT_MODES = ("auto", "quantized", "bf16", "f32")
COMPUTE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
HEAD_TILE = 16384  # vocabulary rows per tile when computing full logits


@dataclass
class BaseModel:
    path: Path
    spec: ModelSpec
    tokenizer: Tokenizer
    transformer: Transformer
    weights_mode: str
    file_size: int
    notes: list[str] = field(default_factory=list)  # things the user should hear about (CLI prints them)
    weights_choice: str = ""  # how the matrices are held, and for "auto" why (printed at start-up)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 [len(ids), n_vocab]: next-token logits after each prefix."""
        tokens = torch.tensor(list(ids), dtype=torch.long, device=self.transformer.device)
        hidden = self.transformer(tokens)  # [T, E]
        v = self.spec.n_vocab
        tiles = [self.transformer.head(hidden, s, min(s + HEAD_TILE, v)) for s in range(0, v, HEAD_TILE)]
        return torch.cat(tiles, -1).cpu()

    @property
    def weight_bytes(self) -> int:
        """Memory held by the frozen base: matrices as kept (blocks or dense) plus vectors."""
        t = self.transformer
        return sum(w.nbytes for w in t.frozen_weights()) + sum(b.numel() * b.element_size() for b in t.buffers())

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.transformer.compute_dtype

    @compute_dtype.setter
    def compute_dtype(self, dtype: torch.dtype) -> None:
        self.transformer.compute_dtype = dtype


def load_model(
    path: str | Path | None = None,
    *,
    weights: str = "quantized",
    compute_dtype: str = "f32",
    device: torch.device | str = "cpu",
    tokenizer: Tokenizer | None = None,
) -> BaseModel:
    """GGUF file (default: the bundled SmolLM2-135M-Instruct Q4_1) -> BaseModel.

    weights: "quantized" keeps the GGUF blocks and dequantizes per matmul; "bf16" / "f32"
    dequantize every matrix once at load; "auto" holds the matrices dense in the compute
    dtype when they fit the memory budget (see `hold_dense`), else quantized. "auto" and
    "quantized" compute the same bits. compute_dtype: "f32" or "bf16" for matmuls.
    device: a torch device (see retrograd.runtime.device.resolve_device for auto/cpu/gpu).
    tokenizer: one already opened for this file, reused."""
    if weights not in WEIGHT_MODES:
        raise GGUFError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise GGUFError(f"compute dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}")
    path = Path(path) if path is not None else default_model_path()
    f = GGUFFile(path)
    spec = read_spec(f)
    notes: list[str] = []
    matrices, vectors = _load_tensors(f, spec, "quantized" if weights == "auto" else weights, notes)
    tokenizer = tokenizer or Tokenizer(path)
    device = torch.device(device)
    if device.type == "cpu":
        native_dequant.build()
        gated.available()
        rowwise.available()
    transformer = Transformer(spec, matrices, vectors).to_device(device)
    transformer.compute_dtype = COMPUTE_DTYPES[compute_dtype]
    transformer.requires_grad_(False)
    choice = hold_dense(transformer, device) if weights == "auto" else WEIGHT_CHOICES[weights]
    return BaseModel(path, spec, tokenizer, transformer, weights, f.size, notes, choice)


WEIGHT_CHOICES = {
    "quantized": "quantized (GGUF blocks, dequantized per use)",
    "bf16": "bf16 (dequantized once at load)",
    "f32": "f32 (dequantized once at load)",
}


def hold_dense(transformer: Transformer, device: torch.device) -> str:
    """`weights = "auto"`: dequantize every matrix once into the compute dtype when the dense
    copies fit the memory budget (kernels.frozen.dense_budget), else keep the blocks. Either
    way the matmuls see the same values (dequantized blocks, cast to the compute dtype); the
    token embedding keeps its blocks too, so its float32 rows stay exact. Returns the choice
    and why, for the start-up lines."""
    dtype = transformer.compute_dtype
    embedding = transformer.token_embd
    todo = [w for w in transformer.frozen_weights() if w.ready(dtype) is None]
    cost = sum(w.dense_nbytes(dtype) for w in todo)
    budget = dense_budget(device)
    dtype_name = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    if cost > budget.nbytes:
        return f"auto: quantized (GGUF blocks, dequantized per use): dense {dtype_name} copies ({cost / 2**20:.0f} MiB) exceed the budget ({budget})"
    for w in todo:
        if w is embedding:  # exact float32 rows come from the blocks; its own copy frees the file mapping
            w.data, w.kept = w.data.clone(), w.dense(dtype).contiguous()
        elif w.name.endswith("ffn_gate_inp.weight"):  # a MoE router multiplies in float32 (moe.py): not rounded to bf16
            w.data, w.kept = w.dense(torch.float32).contiguous(), None
        else:
            w.data, w.kept = w.dense(dtype).contiguous(), None
    return f"auto: dense {dtype_name} ({cost / 2**20:.0f} MiB; budget {budget})"


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward reads, with its torch shape; other tensors are ignored, except biases (refused)."""
    E, D, Dv = spec.n_embd, spec.head_dim, spec.head_dim_v
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.n_vocab, E), spec.final_norm: (E,)}
    if not spec.tied_output:
        shapes["output.weight"] = (spec.n_vocab, E)
    shapes |= {name: (spec.n_rot // 2,) for name in (spec.rope_factors_short, spec.rope_factors_long) if name}  # RoPE frequency factors
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_q.weight": (spec.n_head * D, E),
            p + "attn_k.weight": (spec.n_head_kv * D, E),
            p + "attn_v.weight": (spec.n_head_kv * Dv, E),
            p + "attn_output.weight": (E, spec.n_head * Dv),
            p + "ffn_gate.weight": (spec.n_ff, E),
            p + "ffn_up.weight": (spec.n_ff, E),
            p + "ffn_down.weight": (E, spec.n_ff),
        }
        if spec.qkv_bias:
            shapes |= {p + "attn_q.bias": (spec.n_head * D,), p + "attn_k.bias": (spec.n_head_kv * D,), p + "attn_v.bias": (spec.n_head_kv * Dv,)}
        shapes |= {p + f"{t}.bias": (spec.n_ff if t in ("ffn_gate", "ffn_up") else E,) for t in spec.biased_projections}  # granite
        if spec.pre_norm:
            shapes |= {p + "attn_norm.weight": (E,), p + f"{spec.ffn_norm}.weight": (E,)}
        if spec.qk_norm:  # per head, or over the whole projection (olmo2)
            q, k = (spec.n_head * D, spec.n_head_kv * D) if spec.qk_norm_full else (D, D)
            shapes |= {p + "attn_q_norm.weight": (q,), p + "attn_k_norm.weight": (k,)}
        if spec.sandwich_norm:
            shapes |= {p + "post_attention_norm.weight": (E,), p + "post_ffw_norm.weight": (E,)}
        if spec.conv_layers[i]:  # lfm2: a gated short convolution in place of attention (after the same attn_norm)
            shapes = {n: s for n, s in shapes.items() if not n.startswith(tuple(p + t for t in ("attn_q", "attn_k", "attn_v", "attn_output")))}
            shapes |= {p + "shortconv.conv.weight": (E, spec.conv_kernel), p + "shortconv.in_proj.weight": (3 * E, E), p + "shortconv.out_proj.weight": (E, E)}
        if spec.fused_qkv:  # phi3: one attn_qkv in place of attn_q, attn_k, attn_v
            shapes = {n: s for n, s in shapes.items() if not n.startswith(tuple(p + t for t in ("attn_q.", "attn_k.", "attn_v.")))}
            shapes[p + "attn_qkv.weight"] = ((spec.n_head + spec.n_head_kv) * D + spec.n_head_kv * Dv, E)
        if spec.fused_gate_up:  # phi3: ffn_up holds gate then up
            del shapes[p + "ffn_gate.weight"]
            shapes[p + "ffn_up.weight"] = (2 * spec.n_ff, E)
        if spec.moe_layers[i]:  # a mixture: the router and three expert stacks in place of the dense FFN
            X, Fx = spec.n_expert, spec.n_ff_exp
            shapes = {n: s for n, s in shapes.items() if n not in (p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight")}
            shapes |= {p + "ffn_gate_inp.weight": (X, E), p + "ffn_gate_exps.weight": (X, Fx, E),
                       p + "ffn_up_exps.weight": (X, Fx, E), p + "ffn_down_exps.weight": (X, E, Fx)}
            if spec.expert_selection_bias:  # lfm2moe: added to what the router's pick sorts
                shapes[p + "exp_probs_b.bias"] = (X,)
            if spec.expert_biases:  # gpt-oss: the router's and each expert's
                shapes |= {p + "ffn_gate_inp.bias": (X,), p + "ffn_gate_exps.bias": (X, Fx),
                           p + "ffn_up_exps.bias": (X, Fx), p + "ffn_down_exps.bias": (X, E)}
        if spec.attn_sinks:  # gpt-oss: one logit per head
            shapes[p + "attn_sinks.weight"] = (spec.n_head,)
    return shapes


def _load_tensors(f: GGUFFile, spec: ModelSpec, mode: str, notes: list[str]):
    matrices: dict[str, FrozenWeight] = {}
    vectors: dict[str, torch.Tensor] = {}
    once_dequantized: set[str] = set()
    expected = expected_shapes(spec)
    unread_bias = next((name for name in f.tensors if name.endswith(".bias") and name not in expected), None)
    if unread_bias is not None:  # e.g. an attn_output bias on gemma2: ignoring it would give other logits silently
        raise UnsupportedArchError(
            f"{f.path}: tensor {unread_bias} is a bias our {spec.arch} forward does not apply; this variant is not supported"
        )
    for name, shape in expected.items():
        t = f.tensors.get(name)
        if t is None:
            raise GGUFError(f"{f.path}: missing tensor {name} (expected for {spec.arch})")
        if t.shape != shape:
            raise GGUFError(f"{f.path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} for this {spec.arch} model")
        if len(shape) == 1 or name.endswith((".shortconv.conv.weight", "_exps.bias")):  # used elementwise, in float32
            vectors[name] = torch.from_numpy(_numpy_f32(f, t).copy())
            continue
        w = _frozen(f, t, once_dequantized)
        if mode != "quantized":
            w = w.to_dense(torch.bfloat16 if mode == "bf16" else torch.float32)
        matrices[name] = w
    if once_dequantized:
        notes.append(
            f"tensor types {', '.join(sorted(once_dequantized))} have no torch kernel: dequantized once at load (more memory)"
        )
    return matrices, vectors


def _frozen(f: GGUFFile, t: TensorInfo, once_dequantized: set[str]) -> FrozenWeight:
    with warnings.catch_warnings():  # the memory map is read-only; we never write to it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(t.data)
    if t.qtype == gguf.GGMLQuantizationType.BF16:
        data = data.view(torch.bfloat16)
    elif t.qtype not in CODECS:
        once_dequantized.add(t.qtype.name)
        data = torch.from_numpy(_numpy_f32(f, t))
    return FrozenWeight(t.name, data.reshape(-1, data.shape[-1]), t.qtype, t.shape)  # an expert stack: one matrix of its rows


def _numpy_f32(f: GGUFFile, t: TensorInfo) -> np.ndarray:
    try:
        out = gguf.quants.dequantize(t.data, t.qtype)
    except NotImplementedError:
        raise GGUFError(f"{f.path}: tensor {t.name} has type {t.qtype.name}, which cannot be dequantized") from None
    return np.asarray(out, dtype=np.float32).reshape(t.shape)
