"""lfm2moe (Liquid LFM2-8B-A1B style): lfm2's hybrid stack of gated short convolutions and
attention layers, a dense FFN in the first leading_dense_block_count layers and a mixture of
experts after them, gated as expert_gating_func says (sigmoid here), with a selection bias
(blk.N.exp_probs_b.bias) that moves the pick but not the weights; checked against llama.cpp.
Base-model parity (KL, top-1 over 280 tokens) runs in tests/test_parity.py (TINY_ARCHS["lfm2moe"])."""

import dataclasses
import subprocess
import sys

import pytest
import torch
from arch_checks import assert_adapter_reproduced, assert_matches_llama_cpp, sft_memorising_one_chat
from gguf_factory import TINY_ARCHS, write_tiny_model
from llama_ref import llama_logits
from lora_files import randomise_b

import retrograd
from retrograd.errors import GGUFError
from retrograd.gguf.adapter import adapter_tensors, read_adapter, write_adapter
from retrograd.model.activation_memory import activation_bytes
from retrograd.model.lora import attach_lora
from retrograd.model.moe import MoEFeedForward, route

CONV_PROJECTIONS = ["blk.*.shortconv.in_proj.weight", "blk.*.shortconv.out_proj.weight"]
ALL_TARGETS = ["q", "k", "v", "o", "ffn_up", "ffn_gate", "ffn_down", *CONV_PROJECTIONS]
ROUTER = "blk.*.ffn_gate_inp.weight"  # by name only; llama.cpp's build_moe_ffn applies a LoRA on it (build_lora_mm)


def test_spec_reads_the_hybrid_stack_and_the_routing(tiny_model):
    spec = retrograd.load_model(tiny_model("lfm2moe")).spec
    assert spec.conv_layers == (True, False, True, False) and spec.final_norm == "token_embd_norm.weight"
    assert spec.moe_layers == (False, True, True, True)  # leading_dense_block_count 1
    assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp, spec.n_ff) == (4, 2, 32, 128)
    assert (spec.expert_gating, spec.expert_weights_norm, spec.expert_weights_scale) == ("sigmoid", True, 1.0)
    assert spec.expert_selection_bias


@pytest.mark.parametrize(
    ("variant", "meta"),
    [
        ("lfm2moe", {"expert_weights_norm": False, "expert_weights_scale": 2.5}),  # keys llama.cpp's lfm2moe does not read
        ("lfm2moe-softmax", {}),  # expert_gating_func 1
    ],
    ids=["weight-keys-ignored", "softmax-gating"],
)
def test_routing_keys_are_read_as_llama_cpp_reads_them(tmp_path, monkeypatch, ordinary_text, variant, meta):
    """llama.cpp's lfm2moe graph always renormalises the picked weights and never scales them,
    whatever expert_weights_norm and expert_weights_scale say, and takes the gating from
    expert_gating_func: with either file our logits are llama.cpp's."""
    monkeypatch.setitem(TINY_ARCHS, "lfm2moe-softmax", TINY_ARCHS["lfm2moe"] | {"gating": 1})
    path = write_tiny_model(tmp_path / f"{variant}.gguf", variant, meta=meta)
    spec = retrograd.load_model(path).spec
    assert (spec.expert_weights_norm, spec.expert_weights_scale) == (True, 1.0)
    assert spec.expert_gating == ("softmax" if variant.endswith("softmax") else "sigmoid")
    assert_matches_llama_cpp(path, ordinary_text)


def test_selection_bias_moves_the_pick_but_not_the_weights(tiny_model, ordinary_text):
    spec = retrograd.load_model(tiny_model("lfm2moe")).spec
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    picked, weights = route(logits, spec, torch.tensor([2.0, 0.0, 0.0, 0.0]))
    assert picked.tolist() == [[0, 3]]  # sigmoid(0) + 2 sorts first
    unbiased = torch.sigmoid(torch.tensor([0.0, 3.0]))
    assert torch.allclose(weights[0], unbiased / unbiased.sum())
    # in the tiny model the bias changes picks: without it our logits leave llama.cpp's
    model = retrograd.load_model(tiny_model("lfm2moe"))
    ids = model.tokenize(ordinary_text)[:256]
    ref = llama_logits(tiny_model("lfm2moe"), ids)
    assert (model.logits(ids) - ref).abs().max() <= 1e-3
    for ffn in (b.ffn for b in model.transformer.blocks if isinstance(b.ffn, MoEFeedForward)):
        ffn.selection_bias.zero_()
    assert (model.logits(ids) - ref).abs().max() > 0.5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"selection_bias": 0}, r"missing tensor blk.1.exp_probs_b.bias \(expected for lfm2moe\)"),  # llama.cpp requires it too
        ({"window": 16}, "lfm2moe with sliding-window attention layers is not supported"),  # not modelled yet, as for lfm2
    ],
    ids=["no-selection-bias", "sliding-window"],
)
def test_files_we_cannot_reproduce_are_refused_in_one_line(tmp_path, monkeypatch, change, message):
    monkeypatch.setitem(TINY_ARCHS, "bad-lfm2moe", TINY_ARCHS["lfm2moe"] | change)
    with pytest.raises(GGUFError, match=message) as refused:
        retrograd.load_model(write_tiny_model(tmp_path / "bad.gguf", "bad-lfm2moe"))
    assert "\n" not in str(refused.value)


def test_aliases_pick_dense_ffns_experts_attention_and_conv_projections_by_name(tiny_model):
    model = retrograd.load_model(tiny_model("lfm2moe")).transformer
    names = set(attach_lora(model, ALL_TARGETS, 2, 4.0, seed=0).layers)
    assert names == (
        {f"blk.{i}.attn_{t}.weight" for i in (1, 3) for t in ("q", "k", "v", "output")}
        | {f"blk.{i}.shortconv.{p}.weight" for i in (0, 2) for p in ("in_proj", "out_proj")}
        | {f"blk.0.ffn_{t}.weight" for t in ("up", "gate", "down")}
        | {f"blk.{i}.ffn_{t}_exps.weight" for i in (1, 2, 3) for t in ("up", "gate", "down")}
    )


def test_adapter_on_attention_conv_dense_ffn_experts_and_router_reproduces_our_logits_in_llama_cpp(tmp_path, tiny_model, ordinary_text):
    base = tiny_model("lfm2moe")
    model = retrograd.load_model(base)
    adapter = attach_lora(model.transformer, [*ALL_TARGETS, ROUTER], 4, 8.0, seed=0)
    randomise_b(adapter)
    shapes = {w.name: w.shape for w in model.transformer.frozen_weights()}
    path = write_adapter(tmp_path / "lfm2moe-lora.gguf", adapter_tensors(adapter), arch="lfm2moe", alpha=8.0, base_shapes=shapes)
    assert read_adapter(path).tensors["blk.2.ffn_down_exps.weight"].b.shape == (4, 64, 4)
    assert set(assert_adapter_reproduced(base, path, ordinary_text).layers) == set(adapter.layers)
    # llama.cpp applies the router's pairs too: without them our logits leave its
    routers = [layer for name, layer in adapter.layers.items() if ".ffn_gate_inp." in name]
    assert len(routers) == 3
    for layer in routers:
        layer.enabled = False
    ids = model.tokenize(ordinary_text)[:256]
    assert (model.logits(ids) - llama_logits(base, ids, lora_path=path)).abs().max() > 1e-2


def test_inspect_shows_the_dense_and_expert_widths_and_the_named_targets(tiny_model):
    r = subprocess.run([sys.executable, "-m", "retrograd", "inspect", "--model", str(tiny_model("lfm2moe"))], check=False,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for expected in ("feed-forward 128 on 1 dense layer, 32 per expert on 3 (silu)", "gated short convolution (kernel 3) on 2 of 4 layers",
                     "2 of 4 per token (sigmoid, renormalised, picked with a selection bias), each 32 wide, on 3 of 4 layers",
                     "ffn_up (4)", "blk.*.shortconv.in_proj.weight (2)", "blk.*.ffn_gate_inp.weight (3)"):
        assert expected in r.stdout, r.stdout


def test_sft_on_experts_router_and_conv_projections_memorises_a_chat(tmp_path, tiny_model):
    targets = ["q", "ffn_up", "ffn_down", *CONV_PROJECTIONS, ROUTER]
    trained = read_adapter(sft_memorising_one_chat(tmp_path, tiny_model("lfm2moe"), targets=targets).output).tensors
    assert {"blk.0.ffn_up.weight", "blk.3.ffn_down_exps.weight", "blk.2.shortconv.in_proj.weight"} <= set(trained)
    assert (trained["blk.1.ffn_gate_inp.weight"].b != 0).any()  # the router's pair learned through the weights


def test_memory_estimate_counts_the_leading_dense_layer_as_dense(tiny_model):
    """The tiny model has one dense layer and three mixtures: its estimate lies strictly between
    those of its all-dense and all-mixture versions (it used to count every layer as a mixture)."""
    spec = retrograd.load_model(tiny_model("lfm2moe")).spec
    estimate = activation_bytes(spec, 256, 4, 4)
    all_moe = activation_bytes(dataclasses.replace(spec, moe_layers=(True,) * 4), 256, 4, 4)
    all_dense = activation_bytes(dataclasses.replace(spec, moe_layers=(False,) * 4), 256, 4, 4)
    assert all_dense != all_moe and min(all_dense, all_moe) < estimate < max(all_dense, all_moe)
