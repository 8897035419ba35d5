"""RoPE variants beyond plain and linear, each against llama.cpp on tiny F32 GGUFs: YaRN on a
llama (its parity runs in tests/test_parity.py, TINY_ARCHS["llama-yarn"]), llama3-style
rope_freqs factors, and phi3's long-RoPE factors with their magnitude (rope.scaling.attn_factor),
long or short as llama.cpp picks them for its context. Bad input is refused in one line."""

import subprocess
import sys

import pytest
from arch_checks import assert_adapter_reproduced, parity_ids
from gguf_factory import PHI3_FACTORS, TINY_ARCHS, write_phi3_long_rope, write_tiny_model
from llama_ref import agreement, llama_logits, top1_disagreements
from lora_files import random_adapter

import retrograd
from retrograd.errors import GGUFError
from retrograd.model.transformer import RotaryTable


def _assert_parity(path, model, text):
    ids = parity_ids(model, text)
    ref, ours = llama_logits(path, ids), model.logits(ids)
    kl, _ = agreement(ref, ours)
    assert kl <= 1e-5 and top1_disagreements(ref, ours) == [], (kl, top1_disagreements(ref, ours))
    return ids, ours


def test_yarn_on_llama_reads_the_scaling_and_binds(tiny_model, ordinary_text):
    model = retrograd.load_model(tiny_model("llama-yarn"))
    spec = model.spec
    # factor 4: llama.cpp's magnitude 1 + 0.1 ln 4, which ggml's rope_yarn multiplies in itself
    assert (spec.rope_ext_factor, spec.rope_freq_scale, spec.rope_ctx_orig, spec.rope_attn_factor) == (1.0, 0.25, 64, pytest.approx(1.0))
    ids = parity_ids(model, ordinary_text)
    yarn = model.logits(ids)
    model.transformer.rope_global = RotaryTable(spec.n_rot, spec.rope_base, spec.rope_freq_scale)  # linear scaling alone
    assert (model.logits(ids) - yarn).abs().max() > 1.0  # so the parity of tests/test_parity.py covers YaRN


def test_adapter_on_a_yarn_llama_reproduces_our_logits_in_llama_cpp(tmp_path, tiny_model, ordinary_text):
    base = tiny_model("llama-yarn")
    adapter = assert_adapter_reproduced(base, random_adapter(base, tmp_path / "adapter.gguf", scale=0.05), ordinary_text)
    assert len(adapter.layers) == 7 * TINY_ARCHS["llama-yarn"]["n_layer"]


def test_llama3_rope_freqs_match_llama_cpp(tmp_path, ordinary_text):
    """Llama 3.1/3.2 files carry rope_freqs.weight: a divisor per pair, always applied."""
    path = write_tiny_model(tmp_path / "llama-rope-freqs.gguf", "llama", extra_vectors=("rope_freqs.weight",))
    model = retrograd.load_model(path)
    assert model.spec.rope_factors_short == model.spec.rope_factors_long == "rope_freqs.weight"
    ids, ours = _assert_parity(path, model, ordinary_text)
    model.transformer.rope_global = RotaryTable(model.spec.n_rot, model.spec.rope_base, 1.0)
    assert (model.logits(ids) - ours).abs().max() > 1.0  # the factors bind


# llama_ref's context for 280 tokens is 280, which llama.cpp pads to 512: the long factors past
# an original context of 256 or 300 (300 only because of that padding), the short ones at 1024
@pytest.mark.parametrize(("ctx_orig", "long"), [(256, True), (300, True), (1024, False)])
def test_phi3_long_rope_factors_match_llama_cpp_in_its_context(tmp_path, ordinary_text, ctx_orig, long):
    path = write_phi3_long_rope(tmp_path, ctx_orig)
    model = retrograd.load_model(path)
    t = model.transformer
    assert model.spec.rope_attn_factor == pytest.approx(1.19) and model.spec.rope_ctx_orig == ctx_orig
    t.use_context(280)
    assert t.rope_global.factors is t.rope_factors[long]
    ids, ours = _assert_parity(path, model, ordinary_text)
    t.use_context(1 if long else 2048)  # a context that makes llama.cpp pick the other set
    assert t.rope_global.factors is t.rope_factors[not long]
    assert (model.logits(ids) - ours).abs().max() > 1.0  # which would not do


def test_adapter_on_a_long_rope_phi3_reproduces_our_logits_in_llama_cpp(tmp_path, ordinary_text):
    base = write_phi3_long_rope(tmp_path, 1024)
    adapter = assert_adapter_reproduced(base, random_adapter(base, tmp_path / "adapter.gguf", scale=0.05), ordinary_text)
    assert len(adapter.layers) == 4 * TINY_ARCHS["phi3"]["n_layer"]


def test_factors_of_the_wrong_length_are_refused(tmp_path):
    path = write_tiny_model(tmp_path / "short-factors.gguf", "phi3", extra_vectors=PHI3_FACTORS, vector_length=5)
    with pytest.raises(GGUFError, match=r"tensor rope_factors_(short|long).weight has shape \[5\], expected \[8\]"):
        retrograd.load_model(path)


def test_an_unknown_rope_scaling_is_refused_in_one_line(tmp_path):
    path = write_tiny_model(tmp_path / "longrope.gguf", "llama", meta={"rope.scaling.type": "longrope"})
    run = subprocess.run([sys.executable, "-m", "retrograd", "preflight", "--model", str(path)],
                         capture_output=True, text=True, check=False, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "rope scaling 'longrope' is not supported (supported: none, linear, yarn)" in run.stderr
