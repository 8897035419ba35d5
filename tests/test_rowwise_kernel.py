"""kernels/rowwise.py: the C passes for RMSNorm and RoPE, against the torch formulas they
replace (run on the same inputs with the C pass turned off) and against float64."""

import pytest
import torch

from retrograd.kernels import rowwise
from retrograd.model.transformer import RMSNorm, apply_rope

pytestmark = pytest.mark.skipif(not rowwise.applies(torch.zeros(1)), reason="no C compiler")


def forward_backward(fn, x: torch.Tensor, grad: torch.Tensor, fused: bool, monkeypatch):
    """fn(x) and dL/dx for the upstream gradient `grad`, with the C pass on or off."""
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(rowwise, "applies", lambda *tensors: False)
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward(grad)
    return out.detach(), leaf.grad


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("shape", [(300, 272), (37, 48), (5, 3, 64)], ids=["threads", "one-thread", "heads"])
def test_rms_norm_agrees_with_torch_and_float64(shape, monkeypatch):
    """Forward within an ulp or two of torch's formula (only the sum of squares' order differs),
    the gradient as close to float64's as autograd's; over the last dim of any shape (q/k norms
    run per head)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    weight = torch.rand(shape[-1], generator=g) + 0.5
    grad = torch.randn(shape, generator=g)
    norm = RMSNorm(weight, 1e-5)
    ours, theirs = (forward_backward(norm, x, grad, fused, monkeypatch) for fused in (True, False))
    xd = x.double().requires_grad_()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    ref.backward(grad.double())
    assert relative(ours[0], theirs[0]) < 4 * 2**-24
    assert relative(ours[0], ref) < 4 * 2**-24
    assert relative(ours[1], xd.grad) < 1e-6
    assert relative(ours[1], xd.grad) <= 2 * relative(theirs[1], xd.grad) + 4 * 2**-24


def test_rms_norm_writes_bf16_as_its_float32_output_cast(monkeypatch):
    """A pre-norm in front of bf16 projections writes bf16 itself: the bits of its float32
    output cast, and from a bf16 gradient the input gradient the float32 pass gives for that
    gradient (to an ulp); the torch path rounds the same way."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 272, generator=g) * 3
    norm = RMSNorm(torch.rand(272, generator=g) + 0.5, 1e-5)
    grad = torch.randn(300, 272, generator=g).bfloat16()
    as_bf16, as_float = (forward_backward(lambda t, dtype=dtype: norm(t, dtype), x, grad.to(dtype), True, monkeypatch)
                         for dtype in (torch.bfloat16, torch.float32))
    assert as_bf16[0].dtype == torch.bfloat16 and torch.equal(as_bf16[0], as_float[0].bfloat16())
    assert relative(as_bf16[1], as_float[1]) < 4 * 2**-24  # the dot product's vector order may differ
    torch_path = forward_backward(lambda t: norm(t, torch.bfloat16), x, grad, False, monkeypatch)
    assert torch_path[0].dtype == torch.bfloat16
    assert (torch_path[0].float() - as_bf16[0].float()).abs().max() <= 2**-7 * as_bf16[0].float().abs().max()
    assert relative(as_bf16[1], torch_path[1]) < 1e-5


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("n_rot", [64, 32], ids=["full", "partial"])
def test_rope_forward_is_torchs_bits_and_backward_turns_back(style, n_rot, monkeypatch):
    """The rotation is torch's products and sums rounded the same way: equal bits, full or
    partial rotary, either pairing; the gradient is the rotation by minus the angle, which
    is exactly what autograd's sum of the four products' gradients comes to."""
    g = torch.Generator().manual_seed(1)
    T, H, D = 300, 5, 64
    angles = torch.rand(T, n_rot // 2, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    x, grad = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    fn = lambda t: apply_rope(t, cos, sin, style)  # noqa: E731
    (out, dx), (out_t, dx_t) = (forward_backward(fn, x, grad, fused, monkeypatch) for fused in (True, False))
    assert torch.equal(out, out_t)
    assert torch.equal(out[..., n_rot:], x[..., n_rot:])
    assert relative(dx, dx_t) < 2 * 2**-24
    xd = x.double().requires_grad_()
    apply_rope(xd, cos.double(), sin.double(), style).backward(grad.double())  # float64: the torch formula
    assert relative(dx, xd.grad) < 4 * 2**-24


def test_non_contiguous_input(monkeypatch):
    """A fused q/k/v projection's split hands RoPE a strided view: copied, same bits."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(40, 3 * 4 * 16, generator=g)
    q = qkv[:, : 4 * 16].reshape(40, 4, 16)
    angles = torch.rand(40, 8, generator=g)
    cos, sin = angles.cos(), angles.sin()
    assert not q.is_contiguous()
    fused = apply_rope(q, cos, sin, "neox")
    with monkeypatch.context() as patch:
        patch.setattr(rowwise, "applies", lambda *tensors: False)
        assert torch.equal(fused, apply_rope(q, cos, sin, "neox"))


def test_thread_count_does_not_change_bits():
    """Rows are independent: one thread or two give the same values and gradients."""
    g = torch.Generator().manual_seed(3)
    x, grad = torch.randn(400, 256, generator=g), torch.randn(400, 256, generator=g)
    norm = RMSNorm(torch.rand(256, generator=g), 1e-6)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            leaf = x.clone().requires_grad_()
            out = norm(leaf)
            out.backward(grad)
            results.append((out.detach(), leaf.grad))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_only_float32_on_the_cpu_takes_the_c_pass():
    """bf16 rows (and any device but the CPU) keep the torch formulas."""
    assert rowwise.applies(torch.zeros(2, 16), torch.zeros(16))
    assert not rowwise.applies(torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(16))
    assert not rowwise.applies(torch.zeros(2, 16, device="meta"), torch.zeros(16))
