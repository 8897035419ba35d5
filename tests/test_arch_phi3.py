"""phi3 (Phi-3, Phi-4-mini without long RoPE): q, k, v fused in attn_qkv and gate, up fused in
ffn_up. LoRA adapts the fused weights, as llama.cpp's LoRA loader does (an alias of a fused
family picks the fused weight); an adapter we train reproduces our logits in llama.cpp.
Base-model parity with llama.cpp runs in tests/test_parity.py (TINY_ARCHS["phi3"])."""

import pytest
from chats import write_chat
from gguf_factory import write_tiny_model
from llama_ref import llama_logits
from lora_files import random_adapter

import retrograd
from retrograd.config import load_config
from retrograd.errors import GGUFError
from retrograd.gguf.adapter import read_adapter
from retrograd.lora import attach_lora, frozen_linears, resolve_targets
from retrograd.recipes import sft
from retrograd.recipes.common import load_adapter_weights
from retrograd.training.report import SilentReporter


def test_spec_and_target_aliases(tiny_model):
    model = retrograd.load_model(tiny_model("phi3"))
    spec = model.spec
    # the file sets a 16-token window, which llama.cpp's phi3 switches off (parity holds over 280 tokens)
    assert spec.fused_qkv and spec.fused_gate_up and spec.sliding_window == 0 and spec.rope_style == "neox"
    names = list(frozen_linears(model.transformer))
    for alias, family in (("q", "attn_qkv"), ("k", "attn_qkv"), ("v", "attn_qkv"), ("ffn_gate", "ffn_up"), ("ffn_up", "ffn_up")):
        assert resolve_targets([alias], names) == [f"blk.{i}.{family}.weight" for i in range(spec.n_layer)]
    families = {name.split(".")[2] for name in resolve_targets(["auto"], names)}
    assert families == {"attn_qkv", "attn_output", "ffn_up", "ffn_down"}


def test_long_rope_factors_are_refused(tmp_path):
    path = write_tiny_model(tmp_path / "longrope.gguf", "phi3", extra_vectors=("rope_factors_long.weight",))
    with pytest.raises(GGUFError, match="phi3 with long-RoPE factors"):
        retrograd.load_model(path)


def test_adapter_on_fused_weights_reproduces_our_logits_in_llama_cpp(tmp_path, tiny_model, ordinary_text):
    base = tiny_model("phi3")
    exported = random_adapter(base, tmp_path / "adapter.gguf", scale=0.05)  # non-zero B on attn_qkv, attn_output, ffn_up, ffn_down
    model = retrograd.load_model(base)
    loaded = read_adapter(exported)
    adapter = attach_lora(model.transformer, list(loaded.tensors), loaded.rank, loaded.alpha, seed=0)
    load_adapter_weights(adapter, exported)
    assert len(adapter.layers) == 4 * model.spec.n_layer and "blk.0.attn_qkv.weight" in adapter.layers
    ids = model.tokenize(ordinary_text)[:256]
    ours, ref = model.logits(ids), llama_logits(base, ids, lora_path=exported)
    assert (ours - ref).abs().max() <= 1e-3
    with adapter.disabled():
        assert (model.logits(ids) - ref).abs().max() > 1e-1  # the adapter changed the model


def test_sft_on_fused_weights_learns(tmp_path, tiny_model):
    """20 optimizer steps (epochs) on one chat with the q, k, v, ffn_gate aliases: the loss falls
    by more than a quarter, and the adapter holds the fused weights. (An adapter trained by SFT
    reproducing our logits in llama.cpp: tests/test_sft.py, parametrized with phi3.)"""
    data = write_chat(tmp_path / "train.jsonl", 1)
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f"""
[run]
algorithm = "sft"
[model]
path = "{tiny_model("phi3")}"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
targets = ["q", "k", "v", "ffn_gate"]
[training]
ctx = 64
micro_batch = 64
lr = 1e-2
epochs = 20
compute_dtype = "f32"
threads = 2
[sft]
data = "{data.name}"
"""
    )
    result = sft.run(load_config(cfg), SilentReporter())
    assert result.steps == 20 and result.losses[-1] < 0.75 * result.losses[0], result.losses
    assert sorted(read_adapter(result.output).tensors) == [f"blk.{i}.{f}.weight" for i in range(2) for f in ("attn_qkv", "ffn_up")]
