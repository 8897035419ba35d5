"""Llama-shaped GGUF models of the sizes people fine-tune, with random weights and SmolLM2's
tokenizer, for benchmarks (and tests) where only 135M and 270M real models exist offline.

    python benchmarks/sized_models.py --size 0.5b --type q4_0 --out /tmp/models   # ~10 s
    python benchmarks/sized_models.py --size 1.5b --type q4_k_m --out /tmp/models

Shapes (Qwen2.5's widths; SmolLM2's 49,152-token vocabulary, tied embeddings):
  0.5b  24 layers, width 896, 14 heads, 2 KV heads, FFN 4864   (~0.40B parameters)
  1.5b  28 layers, width 1536, 12 heads, 2 KV heads, FFN 8960  (~1.39B parameters)
Types: f16; q8_0 and q4_0 (quantized by gguf-py); q4_k_m (an F16 file quantized by llama.cpp's
own llama_model_quantize, as users' Q4_K_M files are). Weights are N(0, 1/fan_in), norms near
1, so activations stay in range and a forward's cost is a real model's. The file loads in
stock llama.cpp and in retrograd, and transformers' GGUF loader reads llama files, so a peer
can train the very same weights. Written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT, LlamaFileType

from retrograd.gguf.file import GGUFFile
from retrograd.runtime.bundled import default_model_path


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int

    def parameters(self, n_vocab: int) -> int:
        head_dim = self.n_embd // self.n_head
        per_layer = 2 * self.n_embd * self.n_embd + 2 * self.n_embd * self.n_head_kv * head_dim + 3 * self.n_embd * self.n_ff
        return self.n_layer * per_layer + n_vocab * self.n_embd


SIZES = {
    "0.5b": Shape(24, 896, 14, 2, 4864),
    "1.5b": Shape(28, 1536, 12, 2, 8960),
}
MODEL_ENV = "RETROGRAD_BENCH_MODEL"  # a benchmark's --model, passed on to its child processes
TYPES = {"f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_k_m": None}
FILE_TYPES = {QT.F16: LlamaFileType.MOSTLY_F16, QT.Q8_0: LlamaFileType.MOSTLY_Q8_0, QT.Q4_0: LlamaFileType.MOSTLY_Q4_0}


def bench_model() -> Path:
    """The base a benchmark trains: its --model (see use_model), else the bundled SmolLM2-135M."""
    return Path(os.environ[MODEL_ENV]) if os.environ.get(MODEL_ENV) else default_model_path()


def use_model(path: Path | None, script: str) -> None:
    """Make `path` the benchmark's base, in this process and its children."""
    if path is None:
        return
    if not path.is_file():
        sys.exit(f"{script}: --model {path}: no such file")
    os.environ[MODEL_ENV] = str(path.resolve())


def write_model(path: Path, shape: Shape, qtype: str = "q4_0", seed: int = 0, name: str | None = None) -> Path:
    """A random llama model of `shape` stored as `qtype` (see TYPES) at `path`."""
    if qtype not in TYPES:
        raise ValueError(f"type must be one of {', '.join(TYPES)}, got {qtype!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".sized-") as tmp:
        if qtype == "q4_k_m":
            f16 = _write(Path(tmp) / "f16.gguf", shape, QT.F16, seed, name)
            staged = Path(tmp) / "model.gguf"
            _llama_quantize(f16, staged, LlamaFileType.MOSTLY_Q4_K_M)
        else:
            staged = _write(Path(tmp) / "model.gguf", shape, TYPES[qtype], seed, name)
        os.replace(staged, path)
    return path


def _write(path: Path, s: Shape, qtype: QT, seed: int, name: str | None) -> Path:
    vocab = GGUFFile(default_model_path())
    tokens = vocab.get("tokenizer.ggml.tokens")
    rng = np.random.default_rng(seed)
    head_dim = s.n_embd // s.n_head
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name or f"random-llama-{s.n_layer}x{s.n_embd}")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(vocab.get("tokenizer.ggml.token_type"))
    w.add_token_merges(vocab.get("tokenizer.ggml.merges"))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(vocab.get("tokenizer.chat_template"))
    w.add_context_length(8192)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(FILE_TYPES[qtype])

    def matrix(rows: int, cols: int) -> np.ndarray:
        values = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
        return gguf.quants.quantize(values, qtype) if qtype != QT.F16 else values.astype(np.float16)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.05 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def put(tensor: str, values: np.ndarray) -> None:
        w.add_tensor(tensor, values, raw_dtype=qtype if values.dtype == np.uint8 else None)

    put("token_embd.weight", matrix(len(tokens), s.n_embd))
    w.add_tensor("output_norm.weight", norm(s.n_embd))
    kv = s.n_head_kv * head_dim
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(s.n_embd))
        w.add_tensor(p + "ffn_norm.weight", norm(s.n_embd))
        for tensor, rows, cols in (("attn_q", s.n_embd, s.n_embd), ("attn_k", kv, s.n_embd), ("attn_v", kv, s.n_embd),
                                   ("attn_output", s.n_embd, s.n_embd), ("ffn_gate", s.n_ff, s.n_embd),
                                   ("ffn_up", s.n_ff, s.n_embd), ("ffn_down", s.n_embd, s.n_ff)):
            put(p + tensor + ".weight", matrix(rows, cols))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_quantize(src: Path, dst: Path, ftype: LlamaFileType) -> None:
    """llama.cpp's own quantizer (llama_model_quantize), on the CPU's cores."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="0.5b")
    parser.add_argument("--type", choices=TYPES, default="q4_0")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "retrograd-models")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = SIZES[args.size]
    path = args.out / f"random-llama-{args.size}.{args.type.upper()}.gguf"
    n_vocab = len(GGUFFile(default_model_path()).get("tokenizer.ggml.tokens"))
    print(f"writing {path} ({shape.parameters(n_vocab) / 1e9:.2f}B parameters, {args.type})", flush=True)
    write_model(path, shape, args.type, args.seed)
    print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
