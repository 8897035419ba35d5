"""benchmarks/sized_models.py writes llama models that stock llama.cpp and retrograd both load
and compute alike (the benchmarks' 0.5B and 1.5B files, here at a small shape of the same kind)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gguf import LlamaFileType
from llama_ref import agreement, llama_logits

import retrograd
from retrograd.gguf.file import GGUFFile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sized_models import SIZES, Shape, write_model  # noqa: E402

SMALL = Shape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512)


@pytest.mark.parametrize("qtype, expected, file_type", [
    ("q4_0", "Q4_0", LlamaFileType.MOSTLY_Q4_0), ("q8_0", "Q8_0", LlamaFileType.MOSTLY_Q8_0), ("q4_k_m", "Q4_K", LlamaFileType.MOSTLY_Q4_K_M),
])
def test_a_sized_model_loads_in_llama_cpp_and_agrees_with_our_forward(tmp_path, qtype, expected, file_type):
    path = write_model(tmp_path / f"small.{qtype}.gguf", SMALL, qtype)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging file left behind
    f = GGUFFile(path)
    types = {name: t.qtype.name for name, t in f.tensors.items()}
    assert types["blk.1.attn_q.weight"] == expected and f.get("general.file_type") == file_type
    model = retrograd.load_model(path)
    assert model.spec.n_layer == 2 and model.spec.n_embd == 256 and model.spec.n_vocab == 49152
    ids = model.tokenize("The quick brown fox jumps over the lazy dog. " * 4)[:40]
    kl, _ = agreement(llama_logits(path, ids), model.logits(ids))
    assert kl < 2e-2, f"{qtype}: mean KL {kl:.2e} against llama.cpp"  # llama.cpp quantizes activations on quantized weights


def test_the_benchmark_sizes_are_what_they_say():
    n_vocab = 49152
    assert 0.35e9 < SIZES["0.5b"].parameters(n_vocab) < 0.55e9
    assert 1.3e9 < SIZES["1.5b"].parameters(n_vocab) < 1.6e9
