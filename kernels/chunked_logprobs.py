"""Log-probabilities of chosen token ids under a huge frozen output head, never as [N, V] logits.

SFT cross-entropy, GRPO and distillation all need log_softmax(z)[n, ids[n, k]] with
z = softcap(hidden @ W^T) / temperature (the rollout algorithms score tokens at the temperature
they were sampled at; everything else at 1). Done densely at Gemma-3 scale (V = 262144, N = 2048) the float32
logits alone take 2 GiB, and the softmax and its gradient as much again each. Here the
vocabulary streams by in tiles and the tokens in chunks, so only one
`token_chunk x vocab_tile` block of logits exists at a time:

- forward: one pass over the head's tiles; each block's log-sum-exp is merged into a running
  per-row one (online softmax), along with the entropy and top-k extras, and the logits of
  the ids that fall in the tile are picked out.
- the gradient is taken in that same pass. d logp[n, k] / d hidden[n] = (c'_id W[id] - E_p[c' W]) / T
  (c' the softcap's slope) does not depend on the upstream gradient, so when a backward will
  follow, the forward also merges each block's `softmax-weighted rows of W` into a running
  per-row mean, rescaled as the log-sum-exp grows (the output accumulator of flash attention,
  with W as the values). The backward then only gathers the W rows of the ids and combines
  them with that mean: no block of logits is computed twice, and no tile is read again. This
  is Liger's fused linear cross-entropy idea (the gradient taken in the forward); the Cut
  Cross Entropy alternative (Wijmans et al. 2024) recomputes every block in the backward, one
  more `[N, V] x E` matmul and one more read of the head per step. Nothing of size V is saved
  between the passes: the mean is `[N, E]`, like the hidden states it replaces.

The tile loop sits outside the chunk loop, so a quantized head is dequantized once per pass
(once per training step), never once per token chunk. Matmuls run in `compute_dtype`;
everything summed across tiles (log-sum-exp, entropy, the gradient's mean) stays in float32
or wider.

`dense_gather_logprobs` computes the same thing from materialised logits: the oracle for
tests and the fallback (`LOGPROB_PATHS` picks one by name, as torchtune's and Liger's
chunked losses keep a plain path beside the fused one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from retrograd.kernels.frozen import FrozenWeight

# Default sizes, from a 64 MiB budget for the transient memory at Gemma-3's head (V = 262144,
# E = 640, N = 2048). Alive at the peak: the two block buffers, 2 * c * t * 4 B (a third with a
# softcap when the gradient is taken), and two tile-sized float32 arrays (the dequantized tile
# plus its decode temporary or the GEMM's packed copy), 2 * t * E * 4 B. With t = 2048, c = 512
# that is 8 + 10 = 18 MiB, and 18 MiB is the measured RSS peak with a float32 head; with a Q8_0
# head glibc's reuse of the freed tiles added up to 21 MiB more (24-39 MiB over three runs).
# Half the budget is left for that slack (4096-row Q8_0 tiles reached 85 MiB at E = 576).
# c = 512 rows keeps the GEMMs efficient; wider tiles were not faster (measured with
# `benchmarks/chunked_logprobs.py --sweep`).
VOCAB_TILE = 2048
TOKEN_CHUNK = 512


@dataclass(frozen=True)
class LogprobStats:
    """Detached per-row extras of the full distribution; None when not asked for."""

    entropy: torch.Tensor | None = None  # [N]
    topk_ids: torch.Tensor | None = None  # [N, k], most likely first
    topk_logprobs: torch.Tensor | None = None  # [N, k]


@dataclass(frozen=True)
class _Plan:
    compute_dtype: torch.dtype
    softcap: float
    temperature: float
    vocab_tile: int
    token_chunk: int
    entropy: bool
    topk: int

    @property
    def sum_dtype(self) -> torch.dtype:
        """float32 for float32/bfloat16/float16 matmuls, float64 for float64 (gradcheck)."""
        return torch.promote_types(self.compute_dtype, torch.float32)


def _check(hidden: torch.Tensor, head: FrozenWeight, ids: torch.Tensor, plan: _Plan) -> None:
    n_vocab, n_embd = head.shape
    assert hidden.dim() == 2 and hidden.shape[1] == n_embd, f"hidden {list(hidden.shape)} vs head {head}"
    assert ids.dim() == 2 and ids.shape[0] == hidden.shape[0], f"ids {list(ids.shape)} vs hidden {list(hidden.shape)}"
    assert ids.dtype == torch.long, f"ids must be int64, got {ids.dtype}"
    assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < n_vocab), f"ids outside [0, {n_vocab})"
    assert plan.softcap >= 0 and plan.temperature > 0 and plan.vocab_tile > 0 and plan.token_chunk > 0, plan
    assert 0 <= plan.topk <= n_vocab, f"topk {plan.topk} > vocab {n_vocab}"


def _spans(total: int, step: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, step):
        yield start, min(start + step, total)


class _Blocks:
    """`[chunk, tile]` buffers reused by every block of a pass: the logits, their exp, and (with
    a softcap, when the gradient is taken) the exp times the softcap's slope. Fresh tensors per
    block would leave glibc to recycle them and its heap then grows to several times the
    blocks that are ever alive."""

    def __init__(self, plan: _Plan, n_rows: int, n_vocab: int, device: torch.device):
        size = min(plan.token_chunk, n_rows) * min(plan.vocab_tile, n_vocab)
        self.plan = plan
        self._logits = torch.empty(size, dtype=plan.sum_dtype, device=device)
        self._scratch = torch.empty(size, dtype=plan.sum_dtype, device=device)
        self._sloped: torch.Tensor | None = None

    def logits(self, hidden: torch.Tensor, tile: torch.Tensor) -> torch.Tensor:
        """softcap(hidden @ tile^T) / temperature -> [c, t] in sum_dtype, written into the logits buffer."""
        z = self._logits[: hidden.shape[0] * tile.shape[0]].view(hidden.shape[0], tile.shape[0])  # [c, t]
        if hidden.dtype == z.dtype:
            torch.mm(hidden, tile.T, out=z)
        else:
            z.copy_(hidden @ tile.T)
        if self.plan.softcap > 0:
            z.div_(self.plan.softcap).tanh_().mul_(self.plan.softcap)
        if self.plan.temperature != 1.0:
            z.div_(self.plan.temperature)
        return z

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        return self._scratch[: like.numel()].view(like.shape)

    def gradient_weights(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """e * c'(z): the exp of the block's logits times the softcap's slope at them (1 - tanh^2,
        tanh = z T / cap), or e itself without a softcap. Leaves z and e as they are."""
        if self.plan.softcap == 0:
            return e
        if self._sloped is None:
            self._sloped = torch.empty_like(self._logits)
        out = self._sloped[: z.numel()].view(z.shape)
        return _softcap_slope(z, self.plan, out=out).mul_(e)


def _softcap_slope(z: torch.Tensor, plan: _Plan, out: torch.Tensor | None = None) -> torch.Tensor:
    """d(cap tanh(x / cap)) / dx = 1 - tanh^2 at logits z = cap tanh(x / cap) / T."""
    return torch.mul(z, plan.temperature / plan.softcap, out=out).square_().neg_().add_(1.0)


def _local_ids(ids: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each id inside the tile [start, start + width) (clamped) and whether it is there."""
    local = ids - start  # [c, K]
    inside = (local >= 0) & (local < width)  # [c, K]
    return local.clamp(0, width - 1), inside


def _merge_topk(vals: torch.Tensor, ids: torch.Tensor, z: torch.Tensor, start: int):
    """Running top-k `[c, k]` (logits, ids) merged with a block of logits `[c, t]` starting at id `start`."""
    k = vals.shape[1]
    block_vals, cols = z.topk(min(k, z.shape[1]), dim=1)  # [c, k']
    cand_vals = torch.cat([vals, block_vals], dim=1)  # [c, k + k']
    cand_ids = torch.cat([ids, cols + start], dim=1)  # [c, k + k']
    best_vals, best = cand_vals.topk(k, dim=1)  # [c, k]
    return best_vals, cand_ids.gather(1, best)


def _stream_forward(hidden: torch.Tensor, head: FrozenWeight, ids: torch.Tensor, plan: _Plan, with_grad: bool):
    """-> (logprobs [N, K], LogprobStats, gradient parts), with one pass over the head's tiles.
    The gradient parts, with `with_grad` (else None), are what the backward needs besides the
    ids' rows of W: the softcap's slope c' at the ids [N, K] (None without a softcap) and
    E_p[c' W] [N, E]."""
    n_rows, n_ids = ids.shape
    n_vocab, n_embd = head.shape
    h = hidden.to(plan.compute_dtype)  # [N, E]
    new = {"dtype": plan.sum_dtype, "device": hidden.device}
    lse = torch.full((n_rows,), float("-inf"), **new)  # [N]
    picked = torch.zeros(n_rows, n_ids, **new)  # [N, K] logits at ids
    mean_logit = torch.zeros(n_rows, **new)  # [N] E_p[z], for the entropy lse - E_p[z]
    mean_row = torch.zeros(n_rows, n_embd, **new) if with_grad else None  # [N, E] E_p[c' W]
    top_vals = torch.full((n_rows, plan.topk), float("-inf"), **new)  # [N, k]
    top_ids = torch.zeros(n_rows, plan.topk, dtype=torch.long, device=hidden.device)  # [N, k]

    blocks = _Blocks(plan, n_rows, n_vocab, hidden.device)
    for start, stop in _spans(n_vocab, plan.vocab_tile):
        tile = head.borrow_rows(start, stop, plan.compute_dtype).to(hidden.device)  # [t, E]
        for r0, r1 in _spans(n_rows, plan.token_chunk):
            z = blocks.logits(h[r0:r1], tile)  # [c, t]
            peak = z.amax(1, keepdim=True)  # [c, 1]
            e = torch.sub(z, peak, out=blocks.scratch(z)).exp_()  # [c, t]
            mass = e.sum(1)  # [c]
            block_lse = peak.squeeze(1) + mass.log()  # [c]
            merged = torch.logaddexp(lse[r0:r1], block_lse)  # [c]
            if mean_row is not None:  # rescale the rows merged so far, add this block's (weights e^(z - peak))
                weighted = (blocks.gradient_weights(z, e).to(plan.compute_dtype) @ tile).to(plan.sum_dtype)  # [c, E]
                mean_row[r0:r1].mul_((lse[r0:r1] - merged).exp()[:, None])
                mean_row[r0:r1].addcmul_(weighted, (peak.squeeze(1) - merged).exp()[:, None])
            if plan.entropy:
                block_mean = e.mul_(z).sum(1) / mass  # [c] E_p[z] within the block
                mean_logit[r0:r1] = (
                    mean_logit[r0:r1] * (lse[r0:r1] - merged).exp() + block_mean * (block_lse - merged).exp()
                )
            lse[r0:r1] = merged

            local, inside = _local_ids(ids[r0:r1], start, stop - start)  # [c, K]
            picked[r0:r1] = torch.where(inside, z.gather(1, local), picked[r0:r1])

            if plan.topk:
                top_vals[r0:r1], top_ids[r0:r1] = _merge_topk(top_vals[r0:r1], top_ids[r0:r1], z, start)
        del tile  # before the next one is decoded, so two tiles are never alive together

    stats = LogprobStats(
        entropy=lse - mean_logit if plan.entropy else None,
        topk_ids=top_ids if plan.topk else None,
        topk_logprobs=top_vals - lse[:, None] if plan.topk else None,
    )
    id_slope = _softcap_slope(picked, plan) if with_grad and plan.softcap > 0 else None  # [N, K]
    return picked - lse[:, None], stats, None if mean_row is None else (id_slope, mean_row)


def _gathered_backward(
    head: FrozenWeight, ids: torch.Tensor, id_slope: torch.Tensor | None, mean_row: torch.Tensor, grad: torch.Tensor,
    plan: _Plan,
) -> torch.Tensor:
    """d(sum grad * logprobs)/d hidden = (sum_k grad_k c'_k W[id_k] - (sum_k grad_k) E_p[c' W]) / T -> [N, E]."""
    g = grad.to(plan.sum_dtype)  # [N, K]
    coef = g if id_slope is None else g * id_slope  # [N, K]
    grad_hidden = mean_row * -g.sum(1, keepdim=True)  # [N, E]
    for k in range(ids.shape[1]):  # one [N, E] gather at a time: distillation's K may be large
        grad_hidden.addcmul_(head.rows(ids[:, k], plan.compute_dtype).to(plan.sum_dtype), coef[:, k : k + 1])
    return grad_hidden.div_(plan.temperature) if plan.temperature != 1.0 else grad_hidden


class _ChunkedLogprobs(torch.autograd.Function):
    """Outputs (logprobs, entropy, topk_ids, topk_logprobs); only logprobs is differentiable."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head: FrozenWeight, ids: torch.Tensor, plan: _Plan, with_grad: bool):
        logprobs, stats, gradient_parts = _stream_forward(hidden, head, ids, plan, with_grad)
        if gradient_parts is not None:
            ctx.save_for_backward(ids, *gradient_parts)
            ctx.head, ctx.plan, ctx.hidden_dtype = head, plan, hidden.dtype
        extras = (stats.entropy, stats.topk_ids, stats.topk_logprobs)
        ctx.mark_non_differentiable(*(t for t in extras if t is not None))
        return logprobs, *extras

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs: torch.Tensor, *_extras):
        ids, id_slope, mean_row = ctx.saved_tensors
        grad_hidden = _gathered_backward(ctx.head, ids, id_slope, mean_row, grad_logprobs, ctx.plan)
        return grad_hidden.to(ctx.hidden_dtype), None, None, None, None


def gather_logprobs(
    hidden: torch.Tensor,
    head: FrozenWeight,
    ids: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float32,
    softcap: float = 0.0,
    temperature: float = 1.0,
    vocab_tile: int = VOCAB_TILE,
    token_chunk: int = TOKEN_CHUNK,
    entropy: bool = False,
    topk: int = 0,
) -> tuple[torch.Tensor, LogprobStats]:
    """log_softmax(softcap(hidden @ W^T) / temperature)[n, ids[n, k]] -> ([N, K], stats), streamed
    over tiles.

    hidden `[N, E]` holds only the positions that carry loss; ids `[N, K]` may repeat. The result
    is differentiable w.r.t. hidden; the head gets no gradient. softcap > 0 means z -> cap*tanh(z/cap).
    The entropy and top-k extras are of the same tempered distribution.
    """
    plan = _Plan(compute_dtype, float(softcap), float(temperature), vocab_tile, token_chunk, entropy, topk)
    _check(hidden, head, ids, plan)
    with_grad = torch.is_grad_enabled() and hidden.requires_grad  # a no_grad pass skips the gradient's mean
    logprobs, *extras = _ChunkedLogprobs.apply(hidden, head, ids, plan, with_grad)
    return logprobs, LogprobStats(*extras)


def dense_gather_logprobs(
    hidden: torch.Tensor,
    head: FrozenWeight,
    ids: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float32,
    softcap: float = 0.0,
    temperature: float = 1.0,
    vocab_tile: int = VOCAB_TILE,
    token_chunk: int = TOKEN_CHUNK,
    entropy: bool = False,
    topk: int = 0,
) -> tuple[torch.Tensor, LogprobStats]:
    """The same result from materialised `[N, V]` logits (plain autograd).

    Takes the tiling arguments only so the two paths are interchangeable; it ignores them.
    """
    plan = _Plan(compute_dtype, float(softcap), float(temperature), vocab_tile, token_chunk, entropy, topk)
    _check(hidden, head, ids, plan)
    z = (hidden.to(compute_dtype) @ head.dense(compute_dtype).to(hidden.device).T).to(plan.sum_dtype)  # [N, V]
    if plan.softcap > 0:
        z = plan.softcap * torch.tanh(z / plan.softcap)
    logp = torch.log_softmax(z / plan.temperature, dim=-1)  # [N, V]
    full = logp.detach()  # [N, V]
    top_logprobs, top_ids = full.topk(topk, dim=-1)  # [N, k]
    stats = LogprobStats(
        entropy=-(full.exp() * full).sum(-1) if entropy else None,
        topk_ids=top_ids if topk else None,
        topk_logprobs=top_logprobs if topk else None,
    )
    return logp.gather(1, ids), stats


LogprobFn = Callable[..., tuple[torch.Tensor, LogprobStats]]
LOGPROB_PATHS: dict[str, LogprobFn] = {"chunked": gather_logprobs, "dense": dense_gather_logprobs}


def token_logprobs(
    hidden: torch.Tensor, head: FrozenWeight, targets: torch.Tensor, *, path: str = "chunked", **kw
) -> tuple[torch.Tensor, LogprobStats]:
    """One target per row (SFT, GRPO): targets `[N]` -> (logprobs `[N]`, stats)."""
    logprobs, stats = LOGPROB_PATHS[path](hidden, head, targets[:, None], **kw)  # [N, 1]
    return logprobs[:, 0], stats
