"""mistral3 (Ministral 3, Devstral Small 2): llama with YaRN RoPE scaling and attention
temperature. What the spec reads (and what llama.cpp's mistral3 leaves unread), that both
features bind inside the parity length, an exported adapter reproducing our logits in
llama.cpp, and SFT learning with both features active. Base-model parity with llama.cpp runs
in tests/test_parity.py (TINY_ARCHS["mistral3"]: YaRN factor 4 over an original context of 64,
temperature from position 64 on)."""

import dataclasses
import math

import pytest
from arch_checks import assert_adapter_reproduced, parity_ids, sft_memorising_one_chat
from gguf_factory import TINY_ARCHS, write_tiny_model
from lora_files import random_adapter

import retrograd
from retrograd.errors import GGUFError, UnsupportedArchError
from retrograd.model.transformer import RotaryTable


def test_spec_reads_what_llama_cpp_reads(tiny_model):
    spec = retrograd.load_model(tiny_model("mistral3")).spec
    assert spec.rope_style == "norm" and spec.rope_freq_scale == 0.25 and spec.rope_ext_factor == 1.0
    assert spec.rope_ctx_orig == 64
    # yarn_log_multiplier 0.5: llama.cpp's magnitude mscale(4, 1) / mscale(4, 0.5), over the 1 + 0.1 ln 4 ggml multiplies in
    mscale = lambda s, m: 0.1 * m * math.log(s) + 1.0  # noqa: E731
    assert spec.rope_attn_factor == pytest.approx(mscale(4, 1) / mscale(4, 0.5) / (1 + 0.1 * math.log(4)))
    # the file's YaRN betas (16, 2), which llama.cpp's mistral3 reads (llama's would keep 32, 1)
    assert (spec.rope_yarn_beta_fast, spec.rope_yarn_beta_slow) == (16.0, 2.0)
    assert (spec.attn_temp_scale, spec.attn_temp_length) == (0.5, 64)


def test_yarn_and_temperature_bind_within_the_parity_length(tiny_model, ordinary_text):
    """Parity (tests/test_parity.py) would prove nothing about either feature if it did not
    change the logits over those 280 tokens: each one, switched off, moves them."""
    model = retrograd.load_model(tiny_model("mistral3"))
    t, spec = model.transformer, model.spec
    ids = parity_ids(model, ordinary_text)
    full = model.logits(ids)
    t.spec = dataclasses.replace(spec, attn_temp_scale=0.0)
    no_temperature = model.logits(ids)
    assert (full[:64] - no_temperature[:64]).abs().max() < 1e-6  # positions below 64 are unscaled
    assert (full[64:] - no_temperature[64:]).abs().max() > 1.0
    t.rope_global = RotaryTable(spec.n_rot, spec.rope_base, spec.rope_freq_scale)  # linear scaling, no YaRN ramp or magnitude
    assert (model.logits(ids) - no_temperature).abs().max() > 1.0


def test_exported_adapter_reproduces_our_logits_in_llama_cpp(tmp_path, tiny_model, ordinary_text):
    base = tiny_model("mistral3")
    exported = random_adapter(base, tmp_path / "adapter.gguf", scale=0.05)  # non-zero B on every standard target
    adapter = assert_adapter_reproduced(base, exported, ordinary_text)
    assert len(adapter.layers) == 7 * TINY_ARCHS["mistral3"]["n_layer"]


def test_sft_memorises_with_yarn_and_temperature_active(tmp_path):
    """An original context of 16: the chat's tokens past 16 get YaRN's scaled angles and the
    temperature, so training goes through both."""
    path = write_tiny_model(tmp_path / "mistral3-16.gguf", "mistral3", meta={"rope.scaling.original_context_length": 16})
    assert retrograd.load_model(path).spec.attn_temp_length == 16
    sft_memorising_one_chat(tmp_path, path)


def test_rotating_part_of_a_head_is_refused_in_one_line(tmp_path):
    """llama.cpp's mistral3 graph asserts rope.dimension_count == head size: such a file would
    abort the sampler's process, so it stops at load."""
    path = write_tiny_model(tmp_path / "partial.gguf", "mistral3", meta={"rope.dimension_count": 16})
    with pytest.raises(GGUFError, match="mistral3 needs rope.dimension_count = key_length = value_length, got 16, 32, 32"):
        retrograd.load_model(path)


def test_experts_are_refused_in_one_line(tmp_path):
    path = write_tiny_model(tmp_path / "moe.gguf", "mistral3", extra_vectors=("blk.0.ffn_gate_inp.weight",))  # a router's name is enough
    with pytest.raises(UnsupportedArchError, match=r"mistral3 with experts \(blk.0.ffn_gate_inp.weight\) is not supported"):
        retrograd.load_model(path)
