"""LoRA targets, PEFT-style initialisation (step 0 == base model) and the disabled switch."""

import pytest
import torch

import retrograd
from retrograd.errors import ConfigError
from retrograd.lora import attach_lora, frozen_linears, resolve_targets

NAMES = [f"blk.{i}.{f}.weight" for i in range(12) for f in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down", "ffn_gate")]


def test_aliases_patterns_and_auto():
    assert resolve_targets(["q", "v"], NAMES) == [f"blk.{i}.attn_{t}.weight" for i in range(12) for t in ("q", "v")]
    assert resolve_targets(["auto"], NAMES) == resolve_targets(["q", "k", "v", "o", "ffn_up", "ffn_down", "ffn_gate"], NAMES)
    assert len(resolve_targets(["auto"], NAMES)) == len(NAMES)
    assert resolve_targets(["blk.1*.ffn_down.weight"], NAMES) == ["blk.1.ffn_down.weight", "blk.10.ffn_down.weight", "blk.11.ffn_down.weight"]


@pytest.mark.parametrize(
    "targets,message",
    [
        (["qq"], "unknown target 'qq' (did you mean 'q'?)"),
        (["auto", "q"], '"auto" must stand alone'),
        (["blk.99.attn_q.weight"], "matches no trainable weight"),
    ],
)
def test_bad_targets(targets, message):
    with pytest.raises(ConfigError, match="lora.targets") as e:
        resolve_targets(targets, NAMES)
    assert message in str(e.value)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("qwen2")


def test_step_zero_equals_base_and_disabled_is_base(tiny):
    ids = list(range(100, 140))
    model = retrograd.load_model(tiny)
    base = model.logits(ids)
    adapter = attach_lora(model.transformer, ["auto"], rank=4, alpha=8.0, seed=3)
    assert len(adapter.layers) == 14 and adapter.n_parameters() == sum(l.rank * (l.base.in_features + l.base.out_features) for l in adapter.layers.values())
    assert torch.equal(model.logits(ids), base)  # B = 0: exactly the base model
    with torch.no_grad():
        for layer in adapter.layers.values():
            layer.lora_b.normal_(0, 0.05)
    changed = model.logits(ids)
    assert (changed - base).abs().max() > 1e-3
    with adapter.disabled():
        assert torch.equal(model.logits(ids), base)
    assert torch.equal(model.logits(ids), changed)


def test_same_seed_same_init_and_gradients_reach_every_adapter(tiny):
    a1 = attach_lora(retrograd.load_model(tiny).transformer, ["q", "ffn_down"], rank=2, alpha=4.0, seed=7)
    model = retrograd.load_model(tiny)
    a2 = attach_lora(model.transformer, ["q", "ffn_down"], rank=2, alpha=4.0, seed=7)
    for name in a1.layers:
        assert torch.equal(a1.layers[name].lora_a, a2.layers[name].lora_a)
    hidden = model.transformer(torch.tensor(list(range(50, 70))))
    model.transformer.head(hidden).logsumexp(-1).sum().backward()
    assert all(layer.lora_b.grad is not None and layer.lora_b.grad.abs().sum() > 0 for layer in a2.layers.values())
    assert not any(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in model.transformer.buffers())
    assert len(frozen_linears(model.transformer)) == 14  # still found inside their LoRA wrappers
