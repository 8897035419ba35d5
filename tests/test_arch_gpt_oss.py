"""gpt-oss: attention with q/k/v/o biases and a learned sink logit per head, a 16-token window
on the even layers, YaRN on every layer; in every layer a biased router (softmax over the 2 picked
of 4) and biased experts with OpenAI's clamped SwiGLU. What the spec reads, that every feature
binds inside the parity length (so the parity test could fail on each), the window pattern as
llama.cpp reads it, an exported adapter on attention and experts reproducing our logits in
llama.cpp, and SFT learning. Base-model parity (KL, top-1 over 280 tokens) runs in
tests/test_parity.py (TINY_ARCHS["gpt-oss"])."""

import pytest
import torch
import torch.nn.functional as F
from arch_checks import assert_adapter_reproduced, assert_matches_llama_cpp, parity_ids, sft_memorising_one_chat
from gguf_factory import write_tiny_model
from llama_ref import agreement
from lora_files import random_adapter
from test_memory_estimate import saved_for_backward

import retrograd
from retrograd.errors import GGUFError
from retrograd.model import layers, transformer as tf
from retrograd.model.activation_memory import activation_bytes
from retrograd.model.capabilities import inspect_model
from retrograd.model.lora import attach_lora
from retrograd.model.moe import MoEFeedForward
from retrograd.model.transformer import Attention, Layout, RotaryTable, with_sink_slot


def test_spec_reads_what_llama_cpp_reads(tiny_model):
    spec = retrograd.load_model(tiny_model("gpt-oss")).spec
    assert spec.rope_style == "neox" and spec.head_dim == 32 != spec.n_embd // spec.n_head
    assert spec.swa_layers == (True, False) and spec.sliding_window == 16
    # YaRN on the sliding layers too, at the global base (no rope.freq_base_swa in the file)
    assert spec.rope_freq_scale_swa == spec.rope_freq_scale == 0.25 and spec.rope_base_swa == spec.rope_base
    assert (spec.expert_gating, spec.expert_weights_norm, spec.expert_weights_scale) == ("softmax_weight", False, 1.0)
    assert spec.expert_biases and spec.attn_sinks and spec.qkv_bias and spec.biased_projections == ("attn_output",)
    assert spec.ffn_act == "swiglu_oai" and spec.ffn_norm == "post_attention_norm" and spec.final_logit_softcap == 0.0


def test_every_feature_binds_within_the_parity_length(tiny_model, ordinary_text, monkeypatch):
    """Sinks, biases, the SwiGLU clamp, the window and YaRN on the sliding layers: each one,
    switched off, moves the logits over the parity test's 280 tokens by a mean KL 10x (and
    more) the parity bound of 1e-5, so parity fails without it."""
    model = retrograd.load_model(tiny_model("gpt-oss"))
    t, ids = model.transformer, parity_ids(model, ordinary_text)
    full = model.logits(ids)

    def moved() -> float:
        return agreement(full, model.logits(ids))[0]

    attentions = [m for m in t.modules() if isinstance(m, Attention)]
    mixtures = [m for m in t.modules() if isinstance(m, MoEFeedForward)]
    sinks = [a.sinks for a in attentions]
    for a in attentions:
        a.sinks = None
    assert moved() > 1e-4, "sinks"
    for a, s in zip(attentions, sinks, strict=True):
        a.sinks = s
    biased = [a.attn_q for a in attentions] + [a.attn_output for a in attentions] + [m.ffn_gate_inp for m in mixtures]
    biased += [m.ffn_up_exps for m in mixtures] + [m.ffn_down_exps for m in mixtures]
    for module in biased:
        bias = module.bias
        module.bias = None
        assert moved() > 1e-4, module.weight.name
        module.bias = bias
    with monkeypatch.context() as patch:
        patch.setattr(layers, "SWIGLU_OAI_LIMIT", float("inf"))
        assert moved() > 1e-4, "clamp"
    assert moved() == 0.0  # everything restored
    t.blocks[0].sliding = False  # layer 0 attends to everything before it
    assert moved() > 1e-4, "window"
    t.blocks[0].sliding = True
    t.rope_local = RotaryTable(model.spec.n_rot, model.spec.rope_base_swa, 1.0)
    assert moved() > 1e-4, "YaRN on the sliding layers"


def test_sink_slot_computes_the_softmax_with_sinks():
    """The extra key slot gives what the definition gives: softmax over [scores, sink] per head,
    the sink's share dropped (causal, and with a window mask), gradients included."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 24, 8, generator=gen, requires_grad=True) for n in (4, 2, 2))
    sinks, scale = torch.randn(4, generator=gen) * 2, 0.3
    for mask in (None, Layout.single(24).window_mask(5)):
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        scores = (q @ kk.transpose(-1, -2) * scale).masked_fill(~(torch.ones(24, 24).tril().bool() if mask is None else mask), float("-inf"))
        with_sink = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(2, 4, 24, 1)], -1).softmax(-1)
        expected = with_sink[..., :-1] @ vv
        ours = F.scaled_dot_product_attention(*with_sink_slot(q, k, v, mask, sinks, scale), scale=scale, enable_gqa=True)[..., :8]
        assert torch.allclose(ours, expected, atol=1e-5)
        assert (with_sink[..., -1] > 0.01).any()  # the sinks take a share
        grads = torch.autograd.grad(ours.pow(2).sum(), (q, k, v))
        for mine, theirs in zip(grads, torch.autograd.grad(expected.pow(2).sum(), (q, k, v)), strict=True):
            assert torch.allclose(mine, theirs, atol=1e-4)


def test_clamped_swiglu_backward_matches_autograd():
    """The hand-written backward of the clamped SwiGLU (no gradient past either clamp) against
    autograd through llama.cpp's formula, min(g, 7) / (1 + exp(-1.702 min(g, 7))) * (clamp(u, -7, 7) + 1)."""
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(64, 32, generator=gen) * 6 for _ in range(3))
    assert (gate > 7).any() and (up.abs() > 7).any()
    ours = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    ref = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    out = layers.GatedProduct.apply(*ours, None, None, None, None, "swiglu_oai", torch.float32)
    g = ref[0].clamp(max=7.0)
    expected = g / (1 + torch.exp(-1.702 * g)) * (ref[1].clamp(-7.0, 7.0) + 1)
    assert torch.allclose(out, expected, atol=1e-5)
    out.backward(grad)
    expected.backward(grad)
    for mine, theirs in zip(ours, ref, strict=True):
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-5)


def test_window_pattern_and_swa_base_as_llama_cpp_reads_them(tmp_path, ordinary_text):
    """attention.sliding_window_pattern as one flag per layer (here the odd layer slides), and
    rope.freq_base_swa for the sliding layers: both read by the installed llama.cpp (checked:
    each changes its logits), so both are read here, and the logits still match."""
    path = write_tiny_model(tmp_path / "odd.gguf", "gpt-oss", meta={"attention.sliding_window_pattern": (False, True),
                                                                  "rope.freq_base_swa": 500.0})
    spec = retrograd.load_model(path).spec
    assert spec.swa_layers == (False, True) and spec.rope_base_swa == 500.0
    assert_matches_llama_cpp(path, ordinary_text)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"attention.sliding_window_pattern": 3}, None),  # a period of 3: layers 0 and 1 slide
        ({"attention.sliding_window_pattern": 1}, "sliding_window_pattern leaves no sliding-window layer"),  # llama.cpp aborts
        ({"rope.dimension_count": 16}, "gpt-oss needs rope.dimension_count = key_length = value_length, got 16, 32, 32"),
        ({"attention.sliding_window_pattern": ("yes", "no")}, "sliding_window_pattern is .*expected an array of booleans or integers"),
        ({"rope.freq_base_swa": 1.0}, "YaRN RoPE scaling with a RoPE base of 1 is undefined"),  # ln(1) = 0 in its correction range
    ],
)
def test_window_period_and_refusals(tmp_path, ordinary_text, meta, message):
    path = write_tiny_model(tmp_path / "variant.gguf", "gpt-oss", meta=meta)
    if message is None:
        assert retrograd.load_model(path).spec.swa_layers == (True, True)
        assert_matches_llama_cpp(path, ordinary_text)
        return
    with pytest.raises(GGUFError, match=message) as refused:
        retrograd.load_model(path)
    assert "\n" not in str(refused.value)


def test_exported_adapter_on_attention_and_experts_reproduces_our_logits_in_llama_cpp(tmp_path, tiny_model, ordinary_text):
    """Non-zero B on q, k, v, o and every expert of the biased stacks: llama.cpp adds each
    expert's bias after its LoRA delta (build_moe_ffn), we before; the same sum."""
    base = tiny_model("gpt-oss")
    exported = random_adapter(base, tmp_path / "adapter.gguf", scale=0.05)
    adapter = assert_adapter_reproduced(base, exported, ordinary_text)
    assert len(adapter.layers) == 7 * 2 and adapter.layers["blk.1.ffn_up_exps.weight"].lora_b.shape == (4, 32, 4)
    assert "blk.0.attn_sinks.weight" not in adapter.layers  # a frozen base parameter, no target


def test_sft_memorises_one_chat(tmp_path, tiny_model):
    sft_memorising_one_chat(tmp_path, tiny_model("gpt-oss"), targets=["q", "o", "ffn_up", "ffn_down"])


def test_memory_estimate_counts_the_sink_slot_mask(tiny_model):
    """Sink attention runs in SDPA's fused kernel (no score matrix), which keeps the sink slot's
    [L, L + 1] mask as float32 per layer: the part of the saved activations that grows with the
    square of the row length, measured and estimated, agrees within 25%."""
    model = retrograd.load_model(tiny_model("gpt-oss"))
    attach_lora(model.transformer, ["auto"], 4, 8.0, seed=0)

    def measured(n: int) -> int:
        return saved_for_backward(model.transformer, torch.arange(100, 100 + n), Layout.single(n))

    quadratic = measured(1024) - 2 * measured(512)
    estimated = activation_bytes(model.spec, 1024, 4, 4) - 2 * activation_bytes(model.spec, 512, 4, 4)
    assert 0.75 <= estimated / quadratic <= 1.25, (estimated, quadratic)


def test_inspect_names_the_sinks_and_the_window(tiny_model):
    lines = inspect_model(tiny_model("gpt-oss"), torch.device("cpu")).lines()
    (attention,) = [line for line in lines if line.startswith("attention")]
    assert "sliding window 16 on 1 of 2 layers" in attention and "sink logit per head" in attention
