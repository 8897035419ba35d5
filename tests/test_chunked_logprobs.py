"""The streamed log-prob kernel against materialised logits, torch's own losses and finite differences."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from retrograd.kernels.chunked_logprobs import dense_gather_logprobs, gather_logprobs, token_logprobs
from retrograd.kernels.frozen import FrozenWeight

TOL = {"rtol": 1e-5, "atol": 1e-5}


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


def assert_same(chunked, dense, tol=TOL):
    (lp_c, st_c, g_c), (lp_d, st_d, g_d) = chunked, dense
    torch.testing.assert_close(lp_c, lp_d, **tol)
    torch.testing.assert_close(g_c, g_d, **tol)
    if st_d.entropy is not None:
        torch.testing.assert_close(st_c.entropy, st_d.entropy, **tol)
    if st_d.topk_ids is not None:
        assert torch.equal(st_c.topk_ids, st_d.topk_ids)
        torch.testing.assert_close(st_c.topk_logprobs, st_d.topk_logprobs, **tol)


@pytest.mark.parametrize("head_kind", ["f32", "q8_0"])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("n_ids", [1, 4])
def test_matches_dense_across_ragged_tiles(head_kind, softcap, n_ids):
    # 1000 = 10 tiles of 97 + 30, 37 = 3 chunks of 10 + 7: every edge case of the loops at once.
    hidden, weights, ids, upstream = problem(1000, 37, 64, n_ids)
    head = HEADS[head_kind](weights)
    kw = {"softcap": softcap, "entropy": True, "topk": 5}
    chunked = run(gather_logprobs, hidden, head, ids, upstream, vocab_tile=97, token_chunk=10, **kw)
    assert_same(chunked, run(dense_gather_logprobs, hidden, head, ids, upstream, **kw))
    assert chunked[0].shape == (37, n_ids) and chunked[1].topk_ids.shape == (37, 5)
    assert all(t.grad_fn is None and not t.requires_grad for t in vars(chunked[1]).values())
    if n_ids > 1:  # the repeated id scores the same
        torch.testing.assert_close(chunked[0][:, -1], chunked[0][:, 0], rtol=0, atol=0)


@pytest.mark.parametrize("head_kind", ["f32", "q8_0"])
def test_matches_dense_at_gemma_vocab(head_kind):
    hidden, weights, ids, upstream = problem(262144, 3, 64, 2, seed=1)
    head = HEADS[head_kind](weights)
    kw = {"softcap": 30.0, "entropy": True, "topk": 8}  # default tile sizes
    assert_same(
        run(gather_logprobs, hidden, head, ids, upstream, **kw),
        run(dense_gather_logprobs, hidden, head, ids, upstream, **kw),
    )


def test_dense_reference_matches_torch_losses():
    """The oracle itself against F.cross_entropy and Categorical.entropy on the same logits."""
    hidden, weights, ids, _ = problem(300, 20, 32, 1)
    logits = hidden @ weights.T  # [N, V]
    expected_lp = -F.cross_entropy(logits, ids[:, 0], reduction="none")  # [N]
    expected_entropy = torch.distributions.Categorical(logits=logits).entropy()  # [N]
    for path in ("dense", "chunked"):
        lp, stats = token_logprobs(hidden, dense_head(weights), ids[:, 0], path=path, entropy=True, vocab_tile=64)
        torch.testing.assert_close(lp, expected_lp, **TOL)
        torch.testing.assert_close(stats.entropy, expected_entropy, **TOL)


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

    def row_range(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        self.tiles_read += 1
        return super().row_range(start, stop, dtype)


def test_each_head_tile_is_dequantized_once_per_pass():
    hidden, weights, ids, upstream = problem(1000, 37, 64, 1)
    source = q8_0_head(weights)
    head = CountingHead(source.name, source.data, source.qtype, source.shape)
    leaf = hidden.requires_grad_()
    logprobs, _ = gather_logprobs(leaf, head, ids, vocab_tile=97, token_chunk=10)  # 11 tiles, 4 chunks
    assert head.tiles_read == 11
    (upstream * logprobs).sum().backward()
    assert head.tiles_read == 22


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
