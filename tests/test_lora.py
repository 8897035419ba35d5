"""LoRA targets, PEFT-style initialisation (step 0 == base model) and the disabled switch."""

import pytest
import torch

import retrograd
from retrograd.errors import ConfigError
from retrograd.model.lora import attach_lora, frozen_linears, resolve_targets

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


def test_a_small_delta_survives_bf16_compute():
    """In bf16 compute the adapter's output is added in float32: a delta of 1e-4 relative to
    the frozen output, far below bf16's resolution, still reaches the result."""
    from gguf import GGMLQuantizationType as QT

    from retrograd.kernels.frozen import FrozenWeight
    from retrograd.model.layers import FrozenLinear
    from retrograd.model.lora import LoRALinear

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 32, generator=g)
    layer = LoRALinear(FrozenLinear(FrozenWeight("w", weight, QT.F32, (16, 32)), None), 4, 4.0, g)
    x = torch.randn(8, 32, generator=g)
    with torch.no_grad():
        layer.lora_b.copy_(torch.randn(16, 4, generator=g))
        base = layer.base(x.bfloat16()).float()  # [8, 16]
        expected = 1e-4 * (x.bfloat16().float() @ layer.lora_a.T @ layer.lora_b.T) / 4.0 * layer.scale  # [8, 16]
        layer.lora_b.mul_(1e-4 / 4.0)
        out = layer(x.bfloat16())
    assert out.dtype == torch.float32
    assert torch.allclose(out - base, expected, rtol=0.05, atol=1e-6)
    assert (out.bfloat16().float() - base).abs().max() < expected.abs().max()  # what bf16 alone would keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_adapters_gradients_are_those_of_its_formula(dtype):
    """LoRALinear's one autograd node gives the gradients autograd finds for
    base(x) + scale * (x A^T) B^T written out in float64: for x, A and B, in float32 and in
    bf16 compute (there to bf16's resolution of x and of the gradient reaching the base)."""
    from gguf import GGMLQuantizationType as QT

    from retrograd.kernels.frozen import FrozenWeight
    from retrograd.model.layers import FrozenLinear
    from retrograd.model.lora import LoRALinear

    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 32, generator=g).to(dtype)
    layer = LoRALinear(FrozenLinear(FrozenWeight("w", weight, QT.F32, (48, 32)), None), 4, 8.0, g)
    with torch.no_grad():
        layer.lora_b.copy_(torch.randn(48, 4, generator=g) * 0.1)
    x = torch.randn(2, 6, 32, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(2, 6, 48, generator=g)
    (layer(x) * upstream).sum().backward()

    x64 = x.detach().double().requires_grad_()
    a64, b64 = (p.detach().double().requires_grad_() for p in (layer.lora_a, layer.lora_b))
    out64 = x64 @ weight.double().T + layer.scale * (x64 @ a64.T) @ b64.T
    (out64 * upstream.double()).sum().backward()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for ours, exact in ((x.grad, x64.grad), (layer.lora_a.grad, a64.grad), (layer.lora_b.grad, b64.grad)):
        assert ours.shape == exact.shape
        assert (ours.double() - exact).abs().max() <= tol * exact.abs().max(), (ours.dtype, (ours.double() - exact).abs().max())


@pytest.mark.parametrize("held", ["f32", "bf16", "q8_0"])
def test_the_input_gradient_through_w_accumulates_into_the_one_through_a(held, monkeypatch):
    """_PlusBase adds the base output, and the input's gradient through W accumulates into the
    one through A (addmm_); without it (as for experts) the delta's node computes its own share
    and autograd sums the two. Same output bit for bit, same gradients of A and B bit for bit,
    the input's to a rounding of the compute dtype (rounded twice, not three times); the base
    model as it was. Dense and quantized weights."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    from retrograd.kernels.frozen import FrozenWeight
    from retrograd.model import lora
    from retrograd.model.layers import FrozenLinear
    from retrograd.model.lora import LoRALinear

    g = torch.Generator().manual_seed(2)
    matrix = torch.randn(40, 64, generator=g)
    dtype = torch.bfloat16 if held == "bf16" else torch.float32
    if held == "q8_0":
        weight = FrozenWeight("w", torch.from_numpy(quantize(matrix.numpy(), QT.Q8_0)), QT.Q8_0, (40, 64))
    else:
        weight = FrozenWeight("w", matrix.to(dtype), QT.F32, (40, 64))
    layer = LoRALinear(FrozenLinear(weight, None), 8, 16.0, g)
    with torch.no_grad():
        layer.lora_b.copy_(torch.randn(40, 8, generator=g) * 0.1)
    x = torch.randn(12, 64, generator=g).to(dtype)
    upstream = torch.randn(12, 40, generator=g)
    with torch.no_grad():
        base_before = layer.base(x)
    calls = []
    plus_base = lora._PlusBase.apply
    monkeypatch.setattr(lora._PlusBase, "apply", lambda *a: calls.append(1) or plus_base(*a))

    def run(joint: bool):
        with monkeypatch.context() as patch:
            if not joint:  # the experts' way: the delta's own input gradient, then autograd's sum
                patch.setattr(lora, "FrozenExperts", FrozenLinear)
            leaf = x.clone().requires_grad_()
            layer.lora_a.grad = layer.lora_b.grad = None
            out = layer(leaf)
            (out * upstream).sum().backward()
        return out.detach(), leaf.grad, layer.lora_a.grad, layer.lora_b.grad

    (out, dx, da, db), (out_s, dx_s, da_s, db_s) = run(True), run(False)
    assert calls == [1]
    assert out.dtype == out_s.dtype == torch.float32 and torch.equal(out, out_s)
    assert torch.equal(da, da_s) and torch.equal(db, db_s)
    step = 2**-6 if dtype == torch.bfloat16 else 1e-6  # bf16: two roundings of the largest (one ulp is 2^-7 of it)
    assert (dx.float() - dx_s.float()).abs().max() <= step * dx_s.float().abs().max()
    with torch.no_grad():
        assert torch.equal(layer.base(x), base_before)
