"""The dense variants of issue 13 (smollm3, gemma2, granite, olmo2): what each reads from its
metadata, an exported adapter reproducing our logits in llama.cpp, and SFT learning on each;
granite's optional biases. Their base-model parity with llama.cpp runs in tests/test_parity.py
(every TINY_ARCHS entry)."""

import subprocess
import sys

import pytest
from arch_checks import assert_adapter_reproduced, assert_matches_llama_cpp, sft_memorising_one_chat
from gguf_factory import TINY_ARCHS, write_tiny_model
from lora_files import random_adapter

import retrograd

DENSE_VARIANTS = ["smollm3", "gemma2", "granite", "olmo2"]


def test_specs_read_what_llama_cpp_reads(tiny_model):
    smollm3 = retrograd.load_model(tiny_model("smollm3")).spec
    assert smollm3.rope_layers == (True, True, True, False)  # every fourth layer is NoPE
    gemma2 = retrograd.load_model(tiny_model("gemma2")).spec
    assert gemma2.swa_layers == (True, False) and gemma2.sliding_window == 16
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (3.0, 8.0)
    assert gemma2.rope_base_swa == gemma2.rope_base and gemma2.ffn_act == "gelu" and gemma2.sandwich_norm
    granite = retrograd.load_model(tiny_model("granite")).spec
    assert (granite.embed_scale, granite.residual_scale, granite.attn_scale, granite.logit_scale) == (3.0, 0.5, 0.25, 0.5)
    olmo2 = retrograd.load_model(tiny_model("olmo2")).spec
    assert not olmo2.pre_norm and olmo2.qk_norm_full and olmo2.sandwich_norm


# gemma2's GELU: llama.cpp's CPU GELU reads a float16 table (input and output rounded to
# float16), ours is exact, so every gemma model carries a ~3e-3 logit gap already without
# an adapter (tiny gemma3: 6.8e-3). Its bound is the base gap plus 1e-3; the others get 1e-3.
BASE_GAP = {"gemma2": 4e-3}


@pytest.mark.parametrize("arch", DENSE_VARIANTS)
def test_exported_adapter_reproduces_our_logits_in_llama_cpp(tmp_path, tiny_model, arch, ordinary_text):
    base = tiny_model(arch)
    exported = random_adapter(base, tmp_path / "adapter.gguf", scale=0.05)  # non-zero B on every standard target
    adapter = assert_adapter_reproduced(base, exported, ordinary_text, base_gap=BASE_GAP.get(arch, 0.0))
    assert len(adapter.layers) == 7 * TINY_ARCHS[arch]["n_layer"]


@pytest.mark.parametrize("arch", DENSE_VARIANTS)
def test_sft_memorises(tmp_path, tiny_model, arch):
    """The loss falls by more than a quarter in 20 steps (gemma2's soft-capped logits learn slowest: 13.2 to 8.4)."""
    sft_memorising_one_chat(tmp_path, tiny_model(arch))


# granite: llama.cpp creates every bias below as optional and its graph adds each one
GRANITE_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def biased_granite(tmp_path_factory):
    n_layer = TINY_ARCHS["granite"]["n_layer"]
    biases = tuple(f"blk.{i}.{t}" for i in range(n_layer) for t in GRANITE_BIASES)
    return write_tiny_model(tmp_path_factory.mktemp("granite") / "granite-biases.gguf", "granite", extra_biases=biases)


def test_granite_biases_match_llama_cpp(biased_granite, ordinary_text):
    spec = retrograd.load_model(biased_granite).spec
    assert spec.qkv_bias and spec.biased_projections == ("attn_output", "ffn_gate", "ffn_up", "ffn_down")
    assert_matches_llama_cpp(biased_granite, ordinary_text)


def test_adapter_on_a_biased_granite_reproduces_our_logits_in_llama_cpp(tmp_path, biased_granite, ordinary_text):
    exported = random_adapter(biased_granite, tmp_path / "adapter.gguf", scale=0.05)
    adapter = assert_adapter_reproduced(biased_granite, exported, ordinary_text)
    assert len(adapter.layers) == 7 * TINY_ARCHS["granite"]["n_layer"]


def test_a_bias_our_forward_does_not_apply_is_refused_in_one_line(tmp_path):
    """A bias llama.cpp's graph has no place for (gemma2 adds none to attn_output): ignoring
    it would give other logits than the file's author meant, without a word."""
    path = write_tiny_model(tmp_path / "biased.gguf", "gemma2", extra_biases=("blk.0.attn_output",))
    run = subprocess.run([sys.executable, "-m", "retrograd", "preflight", "--model", str(path)],
                         capture_output=True, text=True, check=False, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "blk.0.attn_output.bias is a bias our gemma2 forward does not apply" in run.stderr
