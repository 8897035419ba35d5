"""An FFN's gated product silu(gate) * up, fused with the LoRA deltas on gate and up, in C for
the CPU (built by retrograd/runtime/native.py), for bf16 and for float32 compute.

In torch (bf16) the forward is nine passes over [tokens, n_ff] tensors per layer (each delta added
into a float32 copy of its projection, both rounded for backward, silu, the product, its
rounding) and the backward about ten (the product rule in four bf16 passes, autograd's
float32 casts of the two gradients and back, the LoRA factors' gradients from float32
copies). Each pass is memory-bound: on a 0.5B llama they took over a quarter of a bf16 pass.
Here each direction is one pass over the rows, the values in registers from the bf16
projections to the bf16 outputs, and the backward also sums the factors' gradients from the
float32 derivatives it has just computed (torch's path rounds them to bf16 first). At high
ranks those products are the BLAS's instead (BLAS_RANK): the pass reads the deltas, or writes
the float32 derivatives, as [T, F] float32, and the matmuls run beside it.

A delta is scale * (x A^T) B^T: the caller passes h = x A^T [T, r] and bt = (scale B)^T [r, F]
in float32, and gets dL/dh and dL/dbt back. The math is `GatedProduct`'s (model/layers.py)
in float32, with exp by a polynomial good to a few ulp (torch's own vector exp differs by as
much): results agree with the torch path to bf16's rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import string
from functools import cache

import torch

from retrograd.runtime import native

COMMON = native.BF16 + r"""
#include <omp.h>

#define BLOCK 128  /* columns at a time: float32 values of a row's block stay in L1 */
#define ROWS 8     /* rows per task: bt's block and the factors' gradient sums are read once per ROWS rows */
#define RANK_TILE 8  /* ranks whose gradients one pass over d sums */

/* exp(x) within a few ulp for |x| < 87, Cephes' reduction and polynomial; vectorizes */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round(x / ln 2) */
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + exp_poly(-x)); }

/* The factors' gradients from the float32 derivatives d of m rows' block for ranks k0..k0+kt:
   dbt[k, f] += sum_i d[i, f] h[i, k] (this thread's sums, one load and store per m rows),
   dh[i, k] += sum_f d[i, f] bt[k, f]. kt is a constant where it is inlined: the kt ranks'
   sums stay in registers and each value of d is loaded once for all of them. */
static inline __attribute__((always_inline)) void rank_tile_grads(
        const float (*d)[BLOCK], int64_t m, const float *h, const float *bt, float *dbt, float *dh,
        int64_t r, int64_t F, int64_t n, int64_t k0, const int kt) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        float s[RANK_TILE][16] = {{0}};
        for (int64_t i = 0; i < m; i++)
            for (int k = 0; k < kt; k++) {
                const float hk = h[i * r + k0 + k];
                #pragma omp simd
                for (int j = 0; j < 16; j++) s[k][j] += d[i][j0 + j] * hk;
            }
        for (int k = 0; k < kt; k++) {
            float *db = dbt + (k0 + k) * F + j0;
            #pragma omp simd
            for (int j = 0; j < 16; j++) db[j] += s[k][j];
        }
    }
    for (int64_t i = 0; i < m; i++) {
        float acc[RANK_TILE][16] = {{0}};
        for (int64_t j0 = 0; j0 < n; j0 += 16)
            for (int k = 0; k < kt; k++) {
                const float *b = bt + (k0 + k) * F + j0;
                #pragma omp simd
                for (int j = 0; j < 16; j++) acc[k][j] += d[i][j0 + j] * b[j];
            }
        for (int k = 0; k < kt; k++) {
            float sum = 0.0f;
            for (int j = 0; j < 16; j++) sum += acc[k][j];
            dh[i * r + k0 + k] += sum;
        }
    }
}

/* All r ranks' gradients, RANK_TILE at a time, then tiles of 4, 2 and 1 for the rest. A rank
   at a time, the multiply-adds waited on loads of d: at rank 8 and 376 x 4864 in bf16 the
   backward took 3.5 ms, now 2.3 (1.2 without deltas; Xeon, 2 threads). */
static inline void low_rank_grads(const float (*d)[BLOCK], int64_t m, const float *h, const float *bt,
                                  float *dbt, float *dh, int64_t r, int64_t F, int64_t n) {
    int64_t k0 = 0;
    for (; k0 + RANK_TILE <= r; k0 += RANK_TILE) rank_tile_grads(d, m, h, bt, dbt, dh, r, F, n, k0, RANK_TILE);
    if (k0 + 4 <= r) { rank_tile_grads(d, m, h, bt, dbt, dh, r, F, n, k0, 4); k0 += 4; }
    if (k0 + 2 <= r) { rank_tile_grads(d, m, h, bt, dbt, dh, r, F, n, k0, 2); k0 += 2; }
    if (k0 < r) rank_tile_grads(d, m, h, bt, dbt, dh, r, F, n, k0, 1);
}

static inline float f32_in(float x) { return x; }
static inline float f32_out(float x) { return x; }
"""

# one forward and backward per element type: $elem in memory, $load/$store to and from float32
TEMPLATE = string.Template(r"""
/* v[i] = y[i] + h[i] . bt[:, block] for m rows' block: a 16-column slice of bt is read once
   for all m rows and their sums are independent. A row at a time, bt (r x F, 155 KB at rank 8
   and F 4864) came from L2 for every row: the forward at that size took 2.1 ms, now 1.6 (1.0
   without deltas). y and v rows are F and BLOCK apart. */
static inline void with_delta$suffix(float (*v)[BLOCK], const $elem *y, int64_t m, const float *h, const float *bt,
                              int64_t r, int64_t F, int64_t n) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        float d[ROWS][16] = {{0}};
        for (int64_t k = 0; k < r; k++) {
            const float *b = bt + k * F + j0;
            float hk[ROWS];
            for (int i = 0; i < ROWS; i++) hk[i] = i < m ? h[i * r + k] : 0.0f;
            for (int i = 0; i < ROWS; i++) {
                #pragma omp simd
                for (int j = 0; j < 16; j++) d[i][j] += hk[i] * b[j];
            }
        }
        for (int64_t i = 0; i < m; i++) {
            #pragma omp simd
            for (int j = 0; j < 16; j++) v[i][j0 + j] = $load(y[i * F + j0 + j]) + d[i][j];
        }
    }
}

/* v[i] = y[i] + delta[i] for m rows' block, the delta's product done by the BLAS (rows F apart). */
static inline void with_dense$suffix(float (*v)[BLOCK], const $elem *y, int64_t m, const float *delta, int64_t F, int64_t n) {
    for (int64_t i = 0; i < m; i++) {
        #pragma omp simd
        for (int64_t j = 0; j < n; j++) v[i][j] = $load(y[i * F + j]) + delta[i * F + j];
    }
}

/* gate = yg + delta_g, up = yu + delta_u in float32; writes gate and up (what backward reads;
   NULL: not needed) and silu(gate) * up, each rounded once to $elem. A delta is either its
   factors (h, bt, r) or its float32 product [T, F] (dg, du; NULL: from the factors, which with
   r = 0 mean none). F is a multiple of 16. A task is a group of ROWS rows, walked a column
   block at a time (as backward). */
void silu_forward$suffix(const $elem *yg, const $elem *yu,
                  const float *hg, const float *bgt, int64_t rg, const float *hu, const float *but, int64_t ru,
                  const float *dg, const float *du,
                  $elem *gate, $elem *up, $elem *out, int64_t T, int64_t F, int threads) {
    const int64_t groups = (T + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads) if(T * F >= 65536)
    for (int64_t q = 0; q < groups; q++) {
        const int64_t t0 = q * ROWS, m = T - t0 < ROWS ? T - t0 : ROWS;
        for (int64_t f0 = 0; f0 < F; f0 += BLOCK) {
            const int64_t n = F - f0 < BLOCK ? F - f0 : BLOCK;
            float g[ROWS][BLOCK], u[ROWS][BLOCK];
            if (dg) with_dense$suffix(g, yg + t0 * F + f0, m, dg + t0 * F + f0, F, n);
            else with_delta$suffix(g, yg + t0 * F + f0, m, hg + t0 * rg, bgt + f0, rg, F, n);
            if (du) with_dense$suffix(u, yu + t0 * F + f0, m, du + t0 * F + f0, F, n);
            else with_delta$suffix(u, yu + t0 * F + f0, m, hu + t0 * ru, but + f0, ru, F, n);
            for (int64_t i = 0; i < m; i++) {
                const int64_t at = (t0 + i) * F + f0;
                if (gate) {
                    #pragma omp simd
                    for (int64_t j = 0; j < n; j++) { gate[at + j] = $store(g[i][j]); up[at + j] = $store(u[i][j]); }
                }
                #pragma omp simd
                for (int64_t j = 0; j < n; j++) out[at + j] = $store(g[i][j] * sigmoid(g[i][j]) * u[i][j]);
            }
        }
    }
}

/* From dL/dout, gate and up: writes dL/dgate, dL/dup (in $elem) and, for each delta given by
   its factors, per-thread partial sums of dL/dbt [threads, r, F] and of dL/dh [threads, T, r]
   (zeroed by the caller); for a delta whose products the BLAS does, dL/dgate or dL/dup in
   float32 (dg32, du32 [T, F]; NULL: not wanted). F is a multiple of 16. A task is a group of
   ROWS rows, walked a column block at a time. */
void silu_backward$suffix(const $elem *grad, const $elem *gate, const $elem *up, $elem *dgate, $elem *dup,
                   const float *hg, const float *bgt, float *dbgt, float *dhg, int64_t rg,
                   const float *hu, const float *but, float *dbut, float *dhu, int64_t ru,
                   float *dg32, float *du32, int64_t T, int64_t F, int threads) {
    const int64_t groups = (T + ROWS - 1) / ROWS;
    #pragma omp parallel num_threads(threads) if(T * F >= 65536)
    {
        const int id = omp_get_thread_num();
        float *my_dbgt = dbgt + id * rg * F, *my_dhg = dhg + id * T * rg;
        float *my_dbut = dbut + id * ru * F, *my_dhu = dhu + id * T * ru;
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < groups; q++) {
            const int64_t t0 = q * ROWS, m = T - t0 < ROWS ? T - t0 : ROWS;
            for (int64_t f0 = 0; f0 < F; f0 += BLOCK) {
                const int64_t n = F - f0 < BLOCK ? F - f0 : BLOCK;
                float dg[ROWS][BLOCK], du[ROWS][BLOCK];
                for (int64_t i = 0; i < m; i++) {
                    const int64_t at = (t0 + i) * F + f0;
                    #pragma omp simd
                    for (int64_t j = 0; j < n; j++) {
                        float d = $load(grad[at + j]), g = $load(gate[at + j]), u = $load(up[at + j]);
                        float s = sigmoid(g);
                        du[i][j] = d * (g * s);
                        dg[i][j] = d * u * (s * (1.0f + g * (1.0f - s)));
                        dgate[at + j] = $store(dg[i][j]);
                        dup[at + j] = $store(du[i][j]);
                    }
                    if (dg32) {
                        #pragma omp simd
                        for (int64_t j = 0; j < n; j++) dg32[at + j] = dg[i][j];
                    }
                    if (du32) {
                        #pragma omp simd
                        for (int64_t j = 0; j < n; j++) du32[at + j] = du[i][j];
                    }
                }
                low_rank_grads(dg, m, hg + t0 * rg, bgt + f0, my_dbgt + f0, my_dhg + t0 * rg, rg, F, n);
                low_rank_grads(du, m, hu + t0 * ru, but + f0, my_dbut + f0, my_dhu + t0 * ru, ru, F, n);
            }
        }
    }
}
""")

TYPES = {torch.bfloat16: ("uint16_t", "from_bf16", "bf16"), torch.float32: ("float", "f32_in", "f32_out")}
SUFFIXES = {torch.bfloat16: "_bf16", torch.float32: "_f32"}
SOURCE = COMMON + "".join(TEMPLATE.substitute(suffix=SUFFIXES[t], elem=e, load=load, store=store)
                          for t, (e, load, store) in TYPES.items())

P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# From this rank on the deltas' products go to the BLAS, the C pass reading (forward) or writing
# (backward) them as float32 [T, F]: measured in a 0.5B bf16 step (Xeon), the C pass's own
# products are faster at rank 24 and below (through memory at rank 16: +6-9%), the BLAS's from
# rank 32 (-5%; rank 64 -16%).
BLAS_RANK = 32
# Rows per call where it does: bounds those float32 temporaries (whole, at 8192 tokens and F
# 8960, they would be 587 MB).
BLAS_ROWS = 512


@cache
def _library() -> ctypes.CDLL | None:
    lib = native.load("gated", SOURCE, fma=True)
    for suffix in SUFFIXES.values() if lib is not None else ():
        forward, backward = getattr(lib, "silu_forward" + suffix), getattr(lib, "silu_backward" + suffix)
        forward.argtypes = [P, P, P, P, I64, P, P, I64, P, P, P, P, P, I64, I64, INT]
        backward.argtypes = [P, P, P, P, P, P, P, P, P, I64, P, P, P, P, I64, P, P, I64, I64, INT]
        forward.restype = backward.restype = None
    return lib


def available() -> bool:
    """Whether the library is built (building it now if not: a model load does this, so the
    one-time build never lands inside a timed first step)."""
    return _library() is not None


def _ptr(t: torch.Tensor | None, row: int = 0) -> int | None:
    """The address of row `row` of t (None: NULL)."""
    return None if t is None else t.data_ptr() + row * t.stride(0) * t.element_size()


def _factors(low_rank: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(h [T, r], bt [r, F]) -> float32, contiguous where the C pass reads them, and r; None ->
    no delta. (bt is a transposed view: the BLAS reads it as it is.)"""
    if low_rank is None:
        return None, None, 0
    h, bt = (x.float() for x in low_rank)
    r = h.shape[1]
    return (h, bt, r) if r >= BLAS_RANK else (h.contiguous(), bt.contiguous(), r)


def _in_c(factors: tuple[torch.Tensor | None, torch.Tensor | None, int]):
    """The factors whose products the C pass computes itself: below BLAS_RANK, else none."""
    return (None, None, 0) if factors[2] >= BLAS_RANK else factors


def _rows(T: int, factors) -> int:
    """Rows per C call: all of them, or BLAS_ROWS where a delta's products are the BLAS's."""
    return BLAS_ROWS if any(r >= BLAS_RANK for _, _, r in factors) else max(T, 1)  # (range's step)


def silu_forward(yg: torch.Tensor, yu: torch.Tensor, low_rank_g, low_rank_u, keep: bool):
    """yg, yu: [T, F] in bf16 or float32; low_rank_*: (h [T, r], bt [r, F]) or None -> (gate,
    up, out) in yg's dtype, gate and up (with their deltas) None unless `keep` (for backward)."""
    T, F = yg.shape
    yg, yu = yg.contiguous(), yu.contiguous()  # held here: a temporary's pointer would dangle
    factors = [_factors(low_rank_g), _factors(low_rank_u)]
    gate, up = (torch.empty_like(yg), torch.empty_like(yu)) if keep else (None, None)
    out = torch.empty_like(yg)
    rows = _rows(T, factors)
    dense = [torch.empty(min(rows, T), F) if r >= BLAS_RANK else None for _, _, r in factors]  # float32 deltas
    (hg, bgt, rg), (hu, but, ru) = (_in_c(f) for f in factors)
    forward = getattr(_library(), "silu_forward" + SUFFIXES[yg.dtype])
    for t0 in range(0, T, rows):
        n = min(rows, T - t0)
        dg, du = (torch.mm(h[t0:t0 + n], bt, out=d[:n]) if d is not None else None for (h, bt, _), d in zip(factors, dense))
        forward(_ptr(yg, t0), _ptr(yu, t0), _ptr(hg, t0), _ptr(bgt), rg, _ptr(hu, t0), _ptr(but), ru, _ptr(dg), _ptr(du),
                _ptr(gate, t0), _ptr(up, t0), _ptr(out, t0), n, F, torch.get_num_threads())
    return gate, up, out


def silu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, low_rank_g, low_rank_u):
    """dL/dout, gate, up: [T, F] in one dtype -> dL/dgate, dL/dup (in it) and, per delta given,
    (dL/dh [T, r], dL/dbt [r, F]) in float32 (else None)."""
    T, F = gate.shape
    threads = torch.get_num_threads()
    grad = grad.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    factors = [_factors(low_rank_g), _factors(low_rank_u)]
    rows = _rows(T, factors)
    dense = [torch.empty(min(rows, T), F) if r >= BLAS_RANK else None for _, _, r in factors]  # float32 dL/dgate, dL/dup
    (hg, bgt, rg), (hu, but, ru) = in_c = [_in_c(f) for f in factors]
    low = [(torch.empty(T, r), torch.zeros(r, F)) if r else None for _, _, r in factors]
    backward = getattr(_library(), "silu_backward" + SUFFIXES[gate.dtype])
    for t0 in range(0, T, rows):
        n = min(rows, T - t0)
        sums = [(torch.zeros(threads, n, r), torch.zeros(threads, r, F)) if r else (None, None) for _, _, r in in_c]
        (dhg, dbgt), (dhu, dbut) = sums
        derivatives = [d[:n] if d is not None else None for d in dense]
        backward(_ptr(grad, t0), _ptr(gate, t0), _ptr(up, t0), _ptr(dgate, t0), _ptr(dup, t0),
                 _ptr(hg, t0), _ptr(bgt), _ptr(dbgt), _ptr(dhg), rg, _ptr(hu, t0), _ptr(but), _ptr(dbut), _ptr(dhu), ru,
                 _ptr(derivatives[0]), _ptr(derivatives[1]), n, F, threads)
        for (h, bt, r), d, (dh, dbt), grads in zip(factors, derivatives, sums, low):
            if d is not None:  # dL/dh = d bt^T, dL/dbt = h^T d
                torch.mm(d, bt.t(), out=grads[0][t0:t0 + n])
                grads[1].addmm_(h[t0:t0 + n].t(), d)
            elif r:  # the threads' sums
                torch.sum(dh, 0, out=grads[0][t0:t0 + n])
                grads[1].add_(dbt.sum(0))
    return dgate, dup, *low
