"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): q, k, v fused in attn_qkv and gate, up fused in
ffn_up. LoRA adapts the fused weights, as llama.cpp's LoRA loader does (an alias of a fused
family picks the fused weight); an adapter we train reproduces our logits in llama.cpp.
Base-model parity with llama.cpp runs in tests/test_parity.py (TINY_ARCHS["phi3"]); the long-RoPE
factors of Phi-3.5 and Phi-4-mini in tests/test_arch_rope_scaling.py."""

from arch_checks import assert_adapter_reproduced, sft_memorising_one_chat
from gguf_factory import TINY_ARCHS
from lora_files import random_adapter

import retrograd
from retrograd.gguf.adapter import read_adapter
from retrograd.model.lora import frozen_linears, resolve_targets


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


def test_adapter_on_fused_weights_reproduces_our_logits_in_llama_cpp(tmp_path, tiny_model, ordinary_text):
    base = tiny_model("phi3")
    exported = random_adapter(base, tmp_path / "adapter.gguf", scale=0.05)  # non-zero B on attn_qkv, attn_output, ffn_up, ffn_down
    adapter = assert_adapter_reproduced(base, exported, ordinary_text)
    assert len(adapter.layers) == 4 * TINY_ARCHS["phi3"]["n_layer"] and "blk.0.attn_qkv.weight" in adapter.layers


def test_sft_on_fused_weights_learns(tmp_path, tiny_model):
    """SFT with the q, k, v, ffn_gate aliases learns (arch_checks.sft_memorising_one_chat), and
    the adapter holds the fused weights. (An adapter trained by SFT reproducing our logits in
    llama.cpp: tests/test_sft.py, parametrized with phi3.)"""
    result = sft_memorising_one_chat(tmp_path, tiny_model("phi3"), targets=["q", "k", "v", "ffn_gate"])
    assert sorted(read_adapter(result.output).tensors) == [f"blk.{i}.{f}.weight" for i in range(2) for f in ("attn_qkv", "ffn_up")]
