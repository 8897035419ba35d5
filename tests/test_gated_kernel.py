"""kernels/gated.py: the C pass for silu(gate) * up with LoRA deltas, against float64 and
against GatedProduct's torch path on the same inputs."""

import pytest
import torch

import retrograd
from retrograd.kernels import gated
from retrograd.model import layers
from retrograd.model.layers import GatedProduct
from retrograd.model.lora import attach_lora

pytestmark = pytest.mark.skipif(not gated.available(), reason="no C compiler")


def inputs(T: int, F: int, r: int, seed: int = 0, dtype=torch.bfloat16):
    """Projections in the compute dtype, the factors of two deltas (h in it, as x A^T is; b = scale
    B in float32) and a gradient in it; deltas about a tenth of the projections, as a trained
    adapter's."""
    g = torch.Generator().manual_seed(seed)
    y = [(torch.randn(T, F, generator=g) * s).to(dtype) for s in (2.0, 1.0)]
    h = [torch.randn(T, r, generator=g).to(dtype) for _ in range(2)]
    b = [torch.randn(F, r, generator=g) * 0.05 for _ in range(2)]
    grad = torch.randn(T, F, generator=g).to(dtype)
    return y, h, b, grad


def run(y, h, b, grad, fused: bool, monkeypatch):
    """GatedProduct forward and backward -> out and the gradients of gate, up, h and b (both deltas)."""
    monkeypatch.setattr(layers, "_fused", (lambda *a, original=layers._fused: original(*a)) if fused else (lambda *a: False))
    leaves = [t.clone().requires_grad_() for t in (*y, *h, *b)]
    yg, yu, hg, hu, bg, bu = leaves
    out = GatedProduct.apply(yg, yu, hg, bg, hu, bu, "silu", y[0].dtype)
    monkeypatch.undo()
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def reference(y, h, b, grad):
    """The same in float64 from the same bf16 inputs (gate and up not rounded for backward)."""
    leaves = [t.double().requires_grad_() for t in (*y, *h, *b)]
    yg, yu, hg, hu, bg, bu = leaves
    gate, up = yg + hg @ bg.t(), yu + hu @ bu.t()
    out = torch.nn.functional.silu(gate) * up
    out.backward(grad.double())
    return [out.detach()] + [t.grad for t in leaves]


def error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("T, F, r", [(300, 272, 8), (37, 48, 3), (64, 48, 15), (45, 272, gated.BLAS_RANK)],
                         ids=["threads", "one-thread-tails", "rank-tiles", "blas-rank"])
def test_as_accurate_as_the_torch_path(T, F, r, dtype, monkeypatch):
    """Output and every gradient within the compute dtype's rounding of float64, and no further
    from it than GatedProduct's torch path: 300 x 272 runs on both threads (F is two column
    blocks and a part), 37 x 48 on one, with a row group cut short; rank 3 takes the backward's
    tiles of 2 and 1 ranks, rank 15 a whole tile of 8 and the 4, 2 and 1 after it; at BLAS_RANK
    the deltas' products are the BLAS's."""
    y, h, b, grad = inputs(T, F, r, dtype=dtype)
    ref = reference(y, h, b, grad)
    ours, theirs = run(y, h, b, grad, True, monkeypatch), run(y, h, b, grad, False, monkeypatch)
    names = ["out", "gate", "up", "h_gate", "h_up", "b_gate", "b_up"]
    bound = 2**-7 if dtype == torch.bfloat16 else 1e-5
    # float32 sums in another order (this loop's, the BLAS's on this CPU) differ by a few roundings
    slack = bound / 100 if dtype == torch.bfloat16 else 8 * 2**-24
    for name, a, t, x in zip(names, ours, theirs, ref):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        assert error(a, x) < bound, (name, error(a, x))
        assert error(a, x) <= 1.25 * error(t, x) + slack, (name, error(a, x), error(t, x))


@pytest.mark.parametrize("r", [4, gated.BLAS_RANK])
def test_one_delta_or_none(r, monkeypatch):
    """A LoRA on gate only, or on neither: the missing factors get no gradient, the rest agree
    (the delta's products in the C pass, or the BLAS's)."""
    y, h, b, grad = inputs(64, 1040, r, seed=1)
    monkeypatch.setattr(layers, "_fused", layers._fused)
    for on_gate in (True, False):
        outs = []
        for fused in (True, False):
            monkeypatch.setattr(layers, "_fused", (lambda *a, original=layers._fused: original(*a)) if fused else (lambda *a: False))
            yg, yu = (t.clone().requires_grad_() for t in y)
            hg, bg = h[0].clone().requires_grad_(), b[0].clone().requires_grad_()
            factors = (hg, bg) if on_gate else (None, None)
            out = GatedProduct.apply(yg, yu, *factors, None, None, "silu", torch.bfloat16)
            out.backward(grad)
            outs.append((out, yg.grad, yu.grad, hg.grad, bg.grad))
            monkeypatch.undo()
        for a, t in zip(*outs):
            if a is None:
                assert t is None
            else:
                assert error(a, t.double()) < 2**-6


def test_halves_of_one_projection(monkeypatch):
    """phi3's gate and up are the halves of one float32 output: strided views, read as they are."""
    y, h, b, grad = inputs(40, 96, 4, seed=3, dtype=torch.float32)
    fused_projection = torch.cat(y, dim=1)
    halves = list(fused_projection.chunk(2, dim=1))
    assert not halves[0].is_contiguous()
    ours, theirs = (run(halves, h, b, grad, fused, monkeypatch) for fused in (True, False))
    for a, t in zip(ours, theirs):
        assert error(a, t.double()) < 1e-5


def test_thread_count_changes_nothing_but_sum_order():
    """The forward's rows are independent: the same bits on one thread as on two. The backward's
    factor gradients are per-thread sums added afterwards: equal to float32 rounding of the sums."""
    y, h, b, grad = inputs(256, 512, 8, seed=2)
    factors = [(h[i].float(), b[i].t()) for i in range(2)]
    threads = torch.get_num_threads()
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            gate, up, out = gated.silu_forward(*y, *factors, keep=True)
            results.append((gate, up, out, *gated.silu_backward(grad, gate, up, *factors)))
        finally:
            torch.set_num_threads(threads)
    (g1, u1, o1, dg1, du1, low_g1, _), (g2, u2, o2, dg2, du2, low_g2, _) = results
    for a, c in ((g1, g2), (u1, u2), (o1, o2), (dg1, dg2), (du1, du2)):
        assert torch.equal(a.view(torch.int16), c.view(torch.int16))
    for a, c in zip(low_g1, low_g2):
        assert error(a, c.double()) < 1e-5


def test_blas_products_in_row_chunks(monkeypatch):
    """Past BLAS_ROWS rows the BLAS's products go a chunk of rows at a time (the last one short),
    beside a delta of low rank whose products the C pass computes in the same chunks: every
    output and gradient still within float32 rounding of float64."""
    monkeypatch.setattr(gated, "BLAS_ROWS", 16)
    g = torch.Generator().manual_seed(4)
    T, F, ranks = 45, 272, (5, gated.BLAS_RANK)
    y = [torch.randn(T, F, generator=g) * s for s in (2.0, 1.0)]
    h = [torch.randn(T, r, generator=g) for r in ranks]
    b = [torch.randn(F, r, generator=g) * 0.05 for r in ranks]
    grad = torch.randn(T, F, generator=g)
    gate, up, out = gated.silu_forward(*y, *((hi, bi.t()) for hi, bi in zip(h, b)), keep=True)
    d_gate, d_up, (dh_g, dbt_g), (dh_u, dbt_u) = gated.silu_backward(grad, gate, up, *((hi, bi.t()) for hi, bi in zip(h, b)))
    ref = reference(y, h, b, grad)
    pre = [yi.double() + hi.double() @ bi.double().t() for yi, hi, bi in zip(y, h, b)]
    for name, a, x in [("out", out, ref[0]), ("gate", gate, pre[0]), ("up", up, pre[1]),
                       ("d_gate", d_gate, ref[1]), ("d_up", d_up, ref[2]), ("h_gate", dh_g, ref[3]),
                       ("h_up", dh_u, ref[4]), ("b_gate", dbt_g.t(), ref[5]), ("b_up", dbt_u.t(), ref[6])]:
        assert error(a, x) < 1e-5, (name, error(a, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_a_model_trains_the_same_with_and_without_the_kernel(tiny_model, monkeypatch, dtype):
    """A llama with a LoRA on every projection: the loss, and the gradients of the FFN's gate
    and up adapters, agree with the torch path to the compute dtype's precision."""
    model = retrograd.load_model(tiny_model("llama"), weights="bf16" if dtype == torch.bfloat16 else "f32")
    model.transformer.compute_dtype = dtype
    adapter = attach_lora(model.transformer, ["auto"], 4, 8.0, seed=0)
    for p in adapter.parameters():  # B starts at zero; a trained-looking B gives A a gradient too
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.02)
    tokens = torch.arange(100, 420)
    probe = torch.empty(1, model.spec.n_ff, dtype=dtype)
    assert layers._fused(probe, probe, "silu", dtype)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(layers, "_fused", lambda *a: False)
        for p in adapter.parameters():
            p.grad = None
        loss = model.transformer(tokens).float().logsumexp(-1).mean()
        loss.backward()
        grads = {n: (layer.lora_a.grad.clone(), layer.lora_b.grad.clone()) for n, layer in adapter.layers.items() if "ffn_gate" in n or "ffn_up" in n}
        results.append((loss.item(), grads))
    (loss_c, grads_c), (loss_t, grads_t) = results
    precise = dtype == torch.float32
    assert loss_c == pytest.approx(loss_t, rel=1e-6 if precise else 1e-3)
    assert grads_c.keys() == grads_t.keys() and len(grads_c) == 2 * model.spec.n_layer
    for name in grads_c:
        for a, t in zip(grads_c[name], grads_t[name]):
            cosine = torch.nn.functional.cosine_similarity(a.flatten(), t.flatten(), dim=0).item()
            assert cosine > (1 - 1e-6 if precise else 0.999), (name, cosine)
