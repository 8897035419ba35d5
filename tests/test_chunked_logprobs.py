"""The streamed log-prob kernel against a float64 reference, torch's own losses and finite differences."""

from __future__ import annotations

import math

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from retrograd.kernels.chunked_logprobs import (
    VOCAB_TILE,
    dense_gather_logprobs,
    gather_logprobs,
    token_logprobs,
)
from retrograd.kernels.frozen import FrozenWeight

# ---------------------------------------------------------------- error bounds
# The kernel works in float32 and sums over the vocabulary in an order that depends on the
# tiling and on the BLAS (AMD and Intel CPUs, AVX2, AVX-512 and NEON all pick their own).
# So the float32 results are compared with a float64 evaluation of the same formulas, within
# the standard worst-case bound (Higham, "Accuracy and Stability of Numerical Algorithms",
# ch. 3): a sum of n float32 terms, in ANY order, is within gamma(n) * sum |terms| of the exact
# sum, gamma(n) = n u / (1 - n u), u = 2^-24. n is the longest chain of roundings a result
# goes through; the kernel bounds it whatever the BLAS does: a vocabulary reduction is a
# reduction over one tile (<= vocab_tile terms, in the GEMM's or torch's order) followed by one
# merge per tile (the running log-sum-exp merge rounds ~4 times: exp, log1p, add, subtract),
#     n_vocab_chain = vocab_tile + 4 * n_tiles,
# and the dense path, which reduces all V entries at once, has n = V + 4. Elementwise
# functions (exp, tanh, log) are taken as correct to 2 ulp (Sleef, MKL VML and glibc are
# within 1). Propagated through the kernel's formulas (z = cap tanh(h.w / cap), lse, p, dz):
#   |dz_v|    <= gamma(E + 4) sum_e |h_e W_ve|                    (matmul over E, then /cap, tanh, *cap)
#   |dlse|    <= max_v |dz_v| + gamma(n_chain + 4) + u |lse|      (positive terms: a relative error)
#   |dlogp|   <= |dz_id| + |dlse| + u |logp|
#   |dp_v|/p_v <= dp = max_v |dz_v| + |dlse| + 4u
#   |dH|      <= |dlse| + max|dz| + (dp + gamma(n_chain)) (sum p|z| + |lse|) + u (|lse| + |E_p z|)
#   |dgrad_e| <= dp |G| sum_v p_v c'_v |W_ve| + (2 max|dz| / cap + 3u) sum_v |g_v| |W_ve|
#                + gamma(n_chain + 3) sum_v |g_v| c'_v |W_ve|
# (the kernel takes the gradient in its forward: E_p[c' W] is summed over one tile in the GEMM,
# then merged tile by tile with a rescale, the same chain as the log-sum-exp, and its weights
# e^(z - lse) carry p's relative error dp),
# with g_v = [v in ids] upstream - G p_v the logits' gradient, G = sum_k upstream_k and
# c' = 1 - tanh^2 the softcap's slope. These are first-order worst-case bounds derived from the
# arithmetic, not measured numbers: they hold on any IEEE machine whatever order its BLAS
# sums in. The errors seen here use 0.1-7% of them (~1e-6 at Gemma's vocabulary), while
# leaving out one tile's share of the gradient exceeds them 13x (V = 262144) to 160x (V = 1000).

U = 2.0**-24  # float32 unit roundoff


def gamma(n: float) -> float:
    return n * U / (1 - n * U)


def vocab_chain(n_vocab: int, vocab_tile: int | None) -> int:
    """Longest chain of roundings in a reduction over the vocabulary; None: the dense path."""
    if vocab_tile is None:
        return n_vocab + 4
    return min(vocab_tile, n_vocab) + 4 * math.ceil(n_vocab / vocab_tile)


def exact_head(head: FrozenWeight) -> torch.Tensor:
    """The head's float32 values (F32, or Q8_0's d * q: exact in float32) in float64."""
    return head.dense(torch.float32).double()


def reference(hidden, head, ids, upstream, *, softcap=0.0, entropy=True, topk=0):
    """The oracle: the dense path evaluated in float64 on the exact inputs (rounding ~1e-16)."""
    w = exact_head(head)
    head64 = FrozenWeight("output.weight", w, QT.F64, tuple(w.shape))
    kw = {"softcap": softcap, "entropy": entropy, "topk": topk, "compute_dtype": torch.float64}
    return run(dense_gather_logprobs, hidden.double(), head64, ids, upstream.double(), **kw)


def error_bounds(hidden, head, ids, upstream, *, softcap: float, n_chain: int, topk_ids=None) -> dict:
    """Worst-case |float32 result - exact| of each output, per element (see the comment above)."""
    h, w, g_up = hidden.double(), exact_head(head), upstream.double()  # [N, E], [V, E], [N, K]
    n_embd = h.shape[1]
    x = h @ w.T  # [N, V]
    t = torch.tanh(x / softcap) if softcap > 0 else None
    z = softcap * t if softcap > 0 else x  # [N, V]
    dz = gamma(n_embd + 4) * (h.abs() @ w.abs().T)  # [N, V] logit error bound
    dz_max = dz.amax(1)  # [N]
    lse = torch.logsumexp(z, 1)  # [N]
    p = (z - lse[:, None]).exp()  # [N, V]
    dlse = dz_max + gamma(n_chain + 4) + U * lse.abs()  # [N]
    logp = z.gather(1, ids) - lse[:, None]  # [N, K]
    bounds = {"logprobs": dz.gather(1, ids) + dlse[:, None] + U * logp.abs()}
    dp = dz_max + dlse + 4 * U  # [N] relative error of p
    mean_z = (p * z).sum(1)  # [N]
    # chunked: H = lse - E_p[z]; dense: H = -sum p log p = sum p (lse - z); one bound covers both
    spread = (p * z.abs()).sum(1) + lse.abs()  # [N] >= sum p |log p|
    bounds["entropy"] = dlse + dz_max + (dp + gamma(n_chain)) * spread + U * (lse.abs() + mean_z.abs())
    total = g_up.sum(1, keepdim=True)  # [N, 1]
    g = (-total * p).scatter_add(1, ids, g_up)  # [N, V] d(sum upstream * logp)/dz
    slope = 1 - t.square() if softcap > 0 else torch.ones_like(z)  # [N, V]
    grad = dp[:, None] * ((total.abs() * p * slope) @ w.abs()) + gamma(n_chain + 3) * ((g.abs() * slope) @ w.abs())
    if softcap > 0:
        grad = grad + (2 * dz_max[:, None] / softcap + 3 * U) * (g.abs() @ w.abs())
    bounds["grad"] = grad  # [N, E]
    if topk_ids is not None:
        top_logp = z.gather(1, topk_ids) - lse[:, None]  # [N, k]
        bounds["topk_logprobs"] = dz.gather(1, topk_ids) + dlse[:, None] + U * top_logp.abs()
        # the top-k ids are only well defined when neighbours are further apart than the logits' error
        ordered = z.topk(topk_ids.shape[1] + 1, dim=1).values  # [N, k + 1]
        assert ((ordered[:, :-1] - ordered[:, 1:]).amin() > 2 * dz_max.max()).item(), "near-tie in the top-k"
    return bounds


def within(name: str, got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - exact).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{name}: error {err.max().item():.2e} exceeds its bound by {worst:.2f}x"


def assert_near_reference(result, exact, bounds) -> None:
    (lp, stats, grad), (lp_x, stats_x, grad_x) = result, exact
    within("logprobs", lp, lp_x, bounds["logprobs"])
    within("grad", grad, grad_x, bounds["grad"])
    if stats_x.entropy is not None:
        within("entropy", stats.entropy, stats_x.entropy, bounds["entropy"])
    if stats_x.topk_ids is not None:
        assert torch.equal(stats.topk_ids, stats_x.topk_ids)
        within("topk_logprobs", stats.topk_logprobs, stats_x.topk_logprobs, bounds["topk_logprobs"])


def dense_head(weights: torch.Tensor) -> FrozenWeight:
    return FrozenWeight("output.weight", weights, QT.F32, tuple(weights.shape))


def q8_0_head(weights: torch.Tensor) -> FrozenWeight:
    rows = gguf.quants.quantize(weights.numpy(), QT.Q8_0)  # uint8 [V, E / 32 * 34]
    return FrozenWeight("output.weight", torch.from_numpy(rows), QT.Q8_0, tuple(weights.shape))


HEADS = {"f32": dense_head, "q8_0": q8_0_head}


def problem(n_vocab: int, n_rows: int, n_embd: int, n_ids: int, seed: int = 0):
    """Random hidden/head scaled so logits have std ~2, and ids whose last column repeats the first."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_rows, n_embd, generator=gen)  # [N, E]
    weights = torch.randn(n_vocab, n_embd, generator=gen) * (2.0 / n_embd**0.5)  # [V, E]
    ids = torch.randint(0, n_vocab, (n_rows, n_ids), generator=gen)  # [N, K]
    if n_ids > 1:
        ids[:, -1] = ids[:, 0]
    upstream = torch.randn(n_rows, n_ids, generator=gen)  # [N, K] dL/dlogprobs
    return hidden, weights, ids, upstream


def run(fn, hidden: torch.Tensor, head: FrozenWeight, ids: torch.Tensor, upstream: torch.Tensor, **kw):
    """-> (logprobs, stats, grad of (upstream * logprobs).sum() w.r.t. hidden)."""
    leaf = hidden.clone().requires_grad_()
    logprobs, stats = fn(leaf, head, ids, **kw)
    (upstream * logprobs).sum().backward()
    return logprobs.detach(), stats, leaf.grad


@pytest.mark.parametrize("head_kind", ["f32", "q8_0"])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("n_ids", [1, 4])
def test_matches_float64_across_ragged_tiles(head_kind, softcap, n_ids):
    # 1000 = 10 tiles of 97 + 30, 37 = 3 chunks of 10 + 7: every edge case of the loops at once.
    hidden, weights, ids, upstream = problem(1000, 37, 64, n_ids)
    head = HEADS[head_kind](weights)
    kw = {"softcap": softcap, "entropy": True, "topk": 5}
    exact = reference(hidden, head, ids, upstream, **kw)
    for path_fn, tile in ((gather_logprobs, 97), (dense_gather_logprobs, None)):  # the dense fallback too
        result = run(path_fn, hidden, head, ids, upstream, vocab_tile=tile or 97, token_chunk=10, **kw)
        bounds = error_bounds(hidden, head, ids, upstream, softcap=softcap, n_chain=vocab_chain(1000, tile),
                              topk_ids=exact[1].topk_ids)
        assert_near_reference(result, exact, bounds)
    chunked = run(gather_logprobs, hidden, head, ids, upstream, vocab_tile=97, token_chunk=10, **kw)
    assert chunked[0].shape == (37, n_ids) and chunked[1].topk_ids.shape == (37, 5)
    assert all(t.grad_fn is None and not t.requires_grad for t in vars(chunked[1]).values())
    if n_ids > 1:  # the repeated id scores the same
        torch.testing.assert_close(chunked[0][:, -1], chunked[0][:, 0], rtol=0, atol=0)


@pytest.mark.parametrize("head_kind", ["f32", "q8_0"])
def test_matches_float64_at_gemma_vocab(head_kind):
    """V = 262144 with the default tiles: the float32 kernel within its proven bound of the
    exact result (the dense float32 path is no oracle here: its one 262144-term reduction
    may be summed in any order, bound gamma(262144) = 1.6% of the terms)."""
    hidden, weights, ids, upstream = problem(262144, 3, 64, 2, seed=1)
    head = HEADS[head_kind](weights)
    kw = {"softcap": 30.0, "entropy": True, "topk": 8}  # default tile sizes
    exact = reference(hidden, head, ids, upstream, **kw)
    bounds = error_bounds(hidden, head, ids, upstream, softcap=30.0, n_chain=vocab_chain(262144, VOCAB_TILE),
                          topk_ids=exact[1].topk_ids)
    assert_near_reference(run(gather_logprobs, hidden, head, ids, upstream, **kw), exact, bounds)


def test_dense_reference_matches_torch_losses():
    """The oracle itself against F.cross_entropy and Categorical.entropy, all in float64."""
    hidden, weights, ids, _ = problem(300, 20, 32, 1)
    logits = hidden.double() @ weights.double().T  # [N, V]
    expected_lp = -F.cross_entropy(logits, ids[:, 0], reduction="none")  # [N]
    expected_entropy = torch.distributions.Categorical(logits=logits).entropy()  # [N]
    head64 = FrozenWeight("output.weight", weights.double(), QT.F64, tuple(weights.shape))
    lp, stats = token_logprobs(hidden.double(), head64, ids[:, 0], path="dense", entropy=True,
                               compute_dtype=torch.float64)
    torch.testing.assert_close(lp, expected_lp, rtol=1e-12, atol=1e-12)  # float64 vs float64: ~1e-15 apart
    torch.testing.assert_close(stats.entropy, expected_entropy, rtol=1e-12, atol=1e-12)
    # and both float32 paths within their proven bounds of it
    zeros = torch.zeros(20, 1)
    for path, tile in (("dense", None), ("chunked", 64)):
        lp32, stats32 = token_logprobs(hidden, dense_head(weights), ids[:, 0], path=path, entropy=True, vocab_tile=64)
        bounds = error_bounds(hidden, dense_head(weights), ids, zeros, softcap=0.0, n_chain=vocab_chain(300, tile))
        within(f"{path} logprobs", lp32[:, None], expected_lp[:, None], bounds["logprobs"])
        within(f"{path} entropy", stats32.entropy, expected_entropy, bounds["entropy"])


def test_finite_differences_float64():
    hidden, weights, ids, _ = problem(50, 4, 8, 3)
    head = FrozenWeight("output.weight", weights.double(), QT.F64, (50, 8))
    kw = {"compute_dtype": torch.float64, "softcap": 1.5, "vocab_tile": 7, "token_chunk": 3}
    leaf = hidden.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda h: gather_logprobs(h, head, ids, **kw)[0], (leaf,))


def test_bfloat16_compute_close_to_float32():
    # Logits come out of the matmul rounded to bfloat16 (8 mantissa bits; ~0.016 at |z| ~ 4) and
    # the softmax sums them in float32. Stated tolerance: logprobs within 0.05 and gradients within
    # 2% (relative norm); measured on these shapes over 3 seeds: <= 0.021 and <= 0.33%.
    hidden, weights, ids, upstream = problem(8192, 64, 256, 2)
    head = dense_head(weights)
    lp32, _, g32 = run(gather_logprobs, hidden, head, ids, upstream)
    lp16, _, g16 = run(gather_logprobs, hidden, head, ids, upstream, compute_dtype=torch.bfloat16)
    assert lp16.dtype == torch.float32 and g16.dtype == torch.float32
    assert (lp16 - lp32).abs().max() < 0.05
    assert (g16 - g32).norm() / g32.norm() < 0.02


class CountingHead(FrozenWeight):
    """A real FrozenWeight that counts how often a vocabulary tile is dequantized."""

    tiles_read = 0

    def borrow_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        self.tiles_read += 1
        return super().borrow_rows(start, stop, dtype)


def test_each_head_tile_is_dequantized_once_per_training_step():
    """The forward reads every tile once and takes the gradient on the way; the backward reads
    only the ids' rows, and its gradient is the one a recomputing backward would give."""
    hidden, weights, ids, upstream = problem(1000, 37, 64, 1)
    source = q8_0_head(weights)
    head = CountingHead(source.name, source.data, source.qtype, source.shape)
    leaf = hidden.clone().requires_grad_()
    logprobs, _ = gather_logprobs(leaf, head, ids, vocab_tile=97, token_chunk=10)  # 11 tiles, 4 chunks
    assert head.tiles_read == 11
    (upstream * logprobs).sum().backward()
    assert head.tiles_read == 11
    exact = reference(hidden, source, ids, upstream, entropy=False)
    bounds = error_bounds(hidden, source, ids, upstream, softcap=0.0, n_chain=vocab_chain(1000, 97))
    within("grad", leaf.grad, exact[2], bounds["grad"])


def test_backward_keeps_nothing_of_vocab_size():
    n_vocab, n_rows, n_embd, n_ids = 5000, 16, 32, 3
    hidden, weights, ids, _ = problem(n_vocab, n_rows, n_embd, n_ids)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gather_logprobs(hidden.requires_grad_(), dense_head(weights), ids, vocab_tile=512, entropy=True, topk=4)
    assert sum(s.numel() for s in saved) <= n_rows * (n_embd + n_ids + 1), saved
