"""qwen3moe: qwen3 attention with a mixture of experts in every layer (router, softmax over all
experts, top 2 of 4 renormalised, SiLU-gated experts), checked against llama.cpp. LoRA adapts
the expert stacks with a pair per expert, which llama.cpp applies (build_lora_mm_id): an
exported adapter, a trained one and a merged model reproduce our logits there.
Base-model parity (KL, top-1 over 280 tokens) runs in tests/test_parity.py (TINY_ARCHS["qwen3moe"])."""

import dataclasses

import pytest
import torch
from arch_checks import assert_adapter_reproduced, sft_memorising_one_chat
from gguf import GGMLQuantizationType as QT
from gguf_factory import TINY_ARCHS, write_tiny_model
from llama_ref import llama_logits
from lora_files import random_adapter, randomise_b

import retrograd
from retrograd.config import load_config
from retrograd.errors import GGUFError
from retrograd.gguf.adapter import read_adapter
from retrograd.gguf.merge import merge
from retrograd.model.activation_memory import activation_bytes
from retrograd.model.lora import attach_lora, frozen_linears, resolve_targets
from retrograd.model.moe import route
from retrograd.recipes import sft
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.training.report import SilentReporter

EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def test_spec_routing_and_target_aliases(tiny_model):
    model = retrograd.load_model(tiny_model("qwen3moe"))
    spec = model.spec
    assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp) == (4, 2, 32) and all(spec.moe_layers)
    assert (spec.expert_gating, spec.expert_weights_norm, spec.expert_weights_scale) == ("softmax", True, 1.0)
    names = list(frozen_linears(model.transformer))
    for alias in ("ffn_up", "ffn_gate", "ffn_down"):
        assert resolve_targets([alias], names) == [f"blk.{i}.{alias}_exps.weight" for i in range(spec.n_layer)]
    families = {name.split(".")[2] for name in resolve_targets(["auto"], names)}
    assert families == {"attn_q", "attn_k", "attn_v", "attn_output", *EXPERTS}  # never the router ffn_gate_inp
    adapter = attach_lora(model.transformer, ["ffn_down"], rank=3, alpha=6.0, seed=0)
    layer = adapter.layers["blk.0.ffn_down_exps.weight"]
    assert layer.lora_a.shape == (4, 3, 32) and layer.lora_b.shape == (4, 64, 3)


def test_routing_picks_the_largest_and_renormalises(tiny_model):
    spec = retrograd.load_model(tiny_model("qwen3moe")).spec
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 3.0]])
    picked, weights = route(logits, spec)
    assert picked.tolist() == [[1, 2], [0, 1]]  # an exact tie goes to the lower index
    assert torch.allclose(weights[0], torch.tensor([2.0, 1.0]).softmax(-1)) and torch.allclose(weights[1], torch.tensor([0.5, 0.5]))


def test_adapter_on_attention_and_experts_reproduces_our_logits_in_llama_cpp(tmp_path, tiny_model, ordinary_text):
    base = tiny_model("qwen3moe")
    exported = random_adapter(base, tmp_path / "adapter.gguf", scale=0.05)  # non-zero B on attention and every expert
    assert read_adapter(exported).tensors["blk.1.ffn_up_exps.weight"].a.shape == (4, 4, 64)
    adapter = assert_adapter_reproduced(base, exported, ordinary_text)
    assert len(adapter.layers) == 7 * 2 and adapter.layers["blk.0.ffn_down_exps.weight"].lora_b.shape == (4, 64, 4)
    # merged into the base (F32, as stored): llama.cpp gives what it gives with the adapter
    merged = merge(base, exported, tmp_path / "merged.gguf", "same").out
    ids = retrograd.load_model(base).tokenize(ordinary_text)[:256]
    assert (llama_logits(merged, ids) - llama_logits(base, ids, lora_path=exported)).abs().max() <= 1e-3


def test_quantized_expert_stacks_compute_what_dense_ones_do(tmp_path, ordinary_text):
    """Per expert only its rows of a Q8_0 stack are dequantized; the same bits as dequantizing all at load."""
    path = write_tiny_model(tmp_path / "q8.gguf", "qwen3moe", qtype=QT.Q8_0)
    quantized, dense = retrograd.load_model(path), retrograd.load_model(path, weights="f32")
    ids = quantized.tokenize(ordinary_text)[:64]
    assert torch.equal(quantized.logits(ids), dense.logits(ids))


def test_sft_on_experts_learns_resumes_and_exports_what_llama_cpp_applies(tmp_path, tiny_model, ordinary_text):
    """SFT with q and the FFN aliases memorises a chat and its adapter holds the expert stacks;
    run again with float32 adapters and checkpoints, a run resumed at step 10 ends on the same
    weights, and llama.cpp with that adapter gives our logits."""
    base = tiny_model("qwen3moe")
    result = sft_memorising_one_chat(tmp_path, base, targets=["q", "ffn_up", "ffn_gate", "ffn_down"])
    assert sorted(read_adapter(result.output).tensors) == sorted(f"blk.{i}.{f}.weight" for i in range(2) for f in ("attn_q", *EXPERTS))
    cfg = tmp_path / "run.toml"
    # llama.cpp multiplies by an f16 adapter in f16 (about 3e-3 off on these logits): float32 here
    text = cfg.read_text().replace("alpha = 8.0", 'alpha = 8.0\ndtype = "f32"')
    # bit for bit needs one thread count throughout: not one that follows a busy machine's load
    text = text.replace("[training]", "[training]\nthreads_follow_load = false")
    cfg.write_text(text + '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 10\n')
    whole = sft.run(load_config(cfg), SilentReporter())
    trained = read_adapter(whole.output)
    second_half = sft.run(load_config(cfg), SilentReporter(), resume=tmp_path / "ckpt" / "step-000000000010.state")
    assert second_half.losses == whole.losses[10:]
    resumed = read_adapter(whole.output)
    for name, w in trained.tensors.items():
        assert (w.a == resumed.tensors[name].a).all() and (w.b == resumed.tensors[name].b).all(), name
    assert_adapter_reproduced(base, whole.output, ordinary_text)


def test_live_adapter_on_experts_reaches_the_sampler(tiny_model):
    """The sampler's llama.cpp, refreshed with our in-memory adapter (non-zero B on attention and
    every expert), gives the log-probs our torch forward with that adapter gives."""
    base = tiny_model("qwen3moe")
    model = retrograd.load_model(base)
    adapter = attach_lora(model.transformer, ["auto"], rank=4, alpha=8.0, seed=0)
    randomise_b(adapter)
    prompt = model.tokenize("The capital of France is")
    with Sampler(base, SamplerOptions(n_ctx=64, n_seq_max=2, kv_dtype="f32", n_threads=1)) as s:
        s.set_adapter(adapter)
        (group,) = s.generate([GroupRequest(prompt, [1], Sampling(8))])
    tokens = group[0].tokens
    logits = model.logits(prompt + tokens[:-1])[len(prompt) - 1 :]
    ours = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(group[0].logprobs, dtype=torch.float32), ours, atol=1e-3)
    with adapter.disabled():
        base_logits = model.logits(prompt + tokens[:-1])[len(prompt) - 1 :]
    assert (base_logits - logits).abs().max() > 1e-1


def test_memory_estimate_counts_the_experts(tiny_model):
    model = retrograd.load_model(tiny_model("qwen3moe"))
    stacks = [w for w in model.transformer.frozen_weights() if w.name.endswith("_exps.weight")]
    assert len(stacks) == 6 and sum(w.nbytes for w in stacks) == 2 * 3 * 4 * 32 * 64 * 4
    assert model.weight_bytes > sum(w.nbytes for w in stacks)
    spec = model.spec
    assert activation_bytes(spec, 64, 4) > activation_bytes(dataclasses.replace(spec, n_expert_used=1), 64, 4)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((4, 5, 32), "expert_used_count is 5, more than qwen3moe.expert_count 4"),
        ((4, 0, 32), "expert_used_count is 0, expected 1"),
        ((4, 2, 48), r"tensor blk.0.ffn_gate_exps.weight has shape \[4, 32, 64\], expected \[4, 48, 64\]"),
    ],
)
def test_bad_expert_metadata_is_refused_in_one_line(tmp_path, monkeypatch, metadata, message):
    monkeypatch.setitem(TINY_ARCHS, "bad-moe", TINY_ARCHS["qwen3moe"] | {"experts_key": metadata})
    path = write_tiny_model(tmp_path / "bad.gguf", "bad-moe")
    with pytest.raises(GGUFError, match=message) as refused:
        retrograd.load_model(path)
    assert "\n" not in str(refused.value)
