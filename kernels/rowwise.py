"""RMSNorm and rotary embeddings, forward and backward, in C for the CPU (built by
retrograd/runtime/native.py), on float32 rows (a norm may write its output, and read its
gradient, in bf16).

In torch an RMSNorm is six passes over [tokens, width] forward (square, mean, add, rsqrt,
two products) and autograd's backward about ten; RoPE slices each head into halves,
multiplies four times, adds, and concatenates, and its backward undoes each of those. On a
0.5B llama at 374 tokens the two norms and the q/k rotations of a layer took about 2.4 ms
forward and backward, 5% of a bf16 step. Here each is one pass over the rows each way.

Forward values equal torch's: the rotation is the same products and sums, each rounded as
torch rounds them (no contraction into FMA: native.FLAGS), and the norm differs only in its
sum of squares' order (an ulp of the scale). Backward applies the derivative's closed form
(for RoPE the rotation by minus the angle), so gradients agree with autograd's to float32
rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import string
from functools import cache

import torch

from retrograd.runtime import native

COMMON = native.BF16 + r"""
#include <math.h>

static inline float f32_in(float x) { return x; }
static inline float f32_out(float x) { return x; }


/* x [T, H, D] -> y: the first 2 * half dims of each head turned by the angle whose cos and
   sin [T, half] give (sign -1: by minus it, the backward), the rest copied. neox pairs
   (i, i + half), else (2i, 2i + 1). */
void rope(const float *x, const float *cos_, const float *sin_, float *y, int64_t T, int64_t H, int64_t D,
          int64_t half, int neox, float sign, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if(T * H * D >= 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * half, *s = sin_ + t * half;
        for (int64_t h = 0; h < H; h++) {
            const float *in = x + (t * H + h) * D;
            float *out = y + (t * H + h) * D;
            const int64_t stride = neox ? 1 : 2, other = neox ? half : 1;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = in[i * stride], b = in[i * stride + other], si = sign * s[i];
                out[i * stride] = a * c[i] - b * si;
                out[i * stride + other] = a * si + b * c[i];
            }
            for (int64_t i = 2 * half; i < D; i++) out[i] = in[i];
        }
    }
}
"""

# the norm per element type of its output (and of the gradient that comes back for it)
NORM = string.Template(r"""
/* y = x * r * w per row of n, r = 1 / sqrt(mean(x^2) + eps) kept in rstd [T]; y in $elem */
void rms_forward$suffix(const float *x, const float *w, float eps, $elem *y, float *rstd, int64_t T, int64_t n, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if(T * n >= 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *row = x + t * n;
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t i = 0; i < n; i++) sum += row[i] * row[i];
        const float r = 1.0f / sqrtf(sum / (float)n + eps);
        rstd[t] = r;
        $elem *out = y + t * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] = $store(row[i] * r * w[i]);
    }
}

/* dx = r (g w) - x r^3 mean(g w x), the derivative of y = x r w through r as well; g in $elem */
void rms_backward$suffix(const $elem *g, const float *x, const float *w, const float *rstd, float *dx,
                  int64_t T, int64_t n, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if(T * n >= 32768)
    for (int64_t t = 0; t < T; t++) {
        const $elem *gr = g + t * n;
        const float *xr = x + t * n;
        float dot = 0.0f;
        #pragma omp simd reduction(+:dot)
        for (int64_t i = 0; i < n; i++) dot += $load(gr[i]) * w[i] * xr[i];
        const float r = rstd[t], c = r * r * r * dot / (float)n;
        float *out = dx + t * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] = r * ($load(gr[i]) * w[i]) - xr[i] * c;
    }
}
""")

ELEMENTS = {torch.float32: ("float", "f32_in", "f32_out"), torch.bfloat16: ("uint16_t", "from_bf16", "bf16")}
SUFFIXES = {torch.float32: "", torch.bfloat16: "_bf16"}
SOURCE = COMMON + "".join(NORM.substitute(suffix=SUFFIXES[t], elem=e, load=load, store=store) for t, (e, load, store) in ELEMENTS.items())

P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@cache
def _library() -> ctypes.CDLL | None:
    lib = native.load("rowwise", SOURCE)
    if lib is not None:
        for suffix in SUFFIXES.values():
            forward, backward = getattr(lib, "rms_forward" + suffix), getattr(lib, "rms_backward" + suffix)
            forward.argtypes, backward.argtypes = [P, P, F32, P, P, I64, I64, INT], [P, P, P, P, P, I64, I64, INT]
            forward.restype = backward.restype = None
        lib.rope.argtypes = [P, P, P, P, I64, I64, I64, I64, INT, F32, INT]
        lib.rope.restype = None
    return lib


def available() -> bool:
    """Whether the library is built (building it now if not: a model load does this, so the
    one-time build never lands inside a timed first step)."""
    return _library() is not None


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the C pass takes these: float32 on the CPU, and the library built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and available()


class RMSNormFunction(torch.autograd.Function):
    """x [..., n] float32, weight [n] -> x / sqrt(mean(x^2) + eps) * weight in `dtype` (float32
    or bf16: rounded as the float32 result's cast would be, without the cast's passes each
    way); saves x and the per-row scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        x = x.contiguous()
        n = x.shape[-1]
        y, rstd = torch.empty_like(x, dtype=dtype), x.new_empty(x.numel() // n)
        getattr(_library(), "rms_forward" + SUFFIXES[dtype])(
            x.data_ptr(), weight.data_ptr(), eps, y.data_ptr(), rstd.data_ptr(), rstd.numel(), n, torch.get_num_threads())
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        x, weight, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch.empty_like(x)
        getattr(_library(), "rms_backward" + SUFFIXES[grad.dtype])(
            grad.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dx.data_ptr(), rstd.numel(), x.shape[-1],
            torch.get_num_threads())
        return dx, None, None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool, sign: float) -> torch.Tensor:
    T, H, D = x.shape
    y = torch.empty_like(x)
    _library().rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), T, H, D, cos.shape[-1], int(neox), sign,
                    torch.get_num_threads())
    return y


class RopeFunction(torch.autograd.Function):
    """x [T, H, D] float32 turned by cos, sin [T, n_rot/2]; backward turns the gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.neox = neox
        return _rotate(x.contiguous(), cos, sin, neox, 1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        cos, sin = ctx.saved_tensors
        return _rotate(grad.float().contiguous(), cos, sin, ctx.neox, -1.0), None, None, None
