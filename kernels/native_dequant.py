"""GGUF block dequantizers in C for the CPU, built once per machine (retrograd/runtime/native.py)
and called through ctypes.

torch.compile's kernels for the block types ran at 0.6-3.4 GiB/s of float32 output on our
2-core EPYC, eager torch at 1.6-7 GiB/s; these C loops at 3.3-17 GiB/s by type (Q4_0
8-11), so a 1.5B Q4_0 base dequantizes in well under a second per pass instead of 2.5-4 s.
Each loop does the float operations of `dequant.py`'s torch codec in the same order, so the
results are the same bits (tests compare both with gguf.quants). Each block type has a
float32 and a bfloat16 output. Without a compiler `available()` is False and callers use the
torch codecs.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from retrograd.runtime import native

SOURCE = native.BF16 + r"""

static inline float f16(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            int shifts = 0;
            while (!(man & 0x400)) { man <<= 1; shifts++; }
            bits = sign | ((uint32_t)(113 - shifts) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* the 6-bit scale and min of sub-block s (0..7) from Q4_K/Q5_K's 12-byte table */
static inline void k_scale(const uint8_t *t, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = t[s] & 63;
        *mn = t[s + 4] & 63;
    } else {
        *sc = (t[s + 4] & 0x0f) | ((t[s - 4] >> 6) << 4);
        *mn = (t[s + 4] >> 4) | ((t[s] >> 6) << 4);
    }
}

/* NAME(blocks, out, n, threads) writes float32 and NAME_bf16 bfloat16 (each value rounded
   once from the float32 NAME writes): the block decoder NAME_block run over n blocks */
#define DRIVERS(name, type_size, block_size) \
void name(const uint8_t *blocks, float *out, int64_t n, int threads) { \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(n >= 1024)") \
    for (int64_t i = 0; i < n; i++) name##_block(blocks + i * (type_size), out + i * (block_size)); \
} \
void name##_bf16(const uint8_t *blocks, uint16_t *out, int64_t n, int threads) { \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(n >= 1024)") \
    for (int64_t i = 0; i < n; i++) { \
        float y[block_size]; \
        name##_block(blocks + i * (type_size), y); \
        for (int j = 0; j < (block_size); j++) out[i * (block_size) + j] = bf16(y[j]); \
    } \
}

static inline void q8_0_block(const uint8_t *b, float *y) {
    float d = f16(b);
    for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}
DRIVERS(q8_0, 34, 32)

/* On AVX-512, types whose 4-bit values GCC's loops converted one at a time (Q4_0 to bfloat16
   at a third of Q8_0's speed) take 16 lanes at a time through GCC's and clang's vector
   extensions: the same float operations lane for lane, so the same bits. Measured on a 2-core
   Xeon, 2 threads, bf16 out, per 4.4M values: Q4_0 1.19 -> 0.50 ms, Q4_1 0.84 -> 0.52, Q4_K
   0.55 -> 0.45, Q5_K (Q4_K's code) 0.72 -> 0.70. Built for AVX2 or SSE the same vector code
   ran 1.5-6x slower than the loops (GCC splits the 64-byte vectors lane by lane), so there, and
   for the other types, the loops stay. */
#ifdef __AVX512F__
#define LANES16 1
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

static inline u8x16 bytes(const uint8_t *p) {
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

/* 16 small values (< 128) minus `offset`, as floats: masked bytes widen well, raw ones do not */
static inline f32x16 lanes(u8x16 v, int offset) {
    return __builtin_convertvector(__builtin_convertvector(v, i32x16) - offset, f32x16);
}

static inline void put(float *y, f32x16 v) { memcpy(y, &v, 64); }
#endif

static inline void q4_0_block(const uint8_t *b, float *y) {
    float d = f16(b);
#ifdef LANES16
    u8x16 q = bytes(b + 2);
    put(y, d * lanes(q & 0x0f, 8));
    put(y + 16, d * lanes(q >> 4, 8));
#else
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[2 + j] & 0x0f) - 8);
        y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
#endif
}
DRIVERS(q4_0, 18, 32)

static inline void q4_1_block(const uint8_t *b, float *y) {
    float d = f16(b), m = f16(b + 2);
#ifdef LANES16
    u8x16 q = bytes(b + 4);
    put(y, d * lanes(q & 0x0f, 0) + m);
    put(y + 16, d * lanes(q >> 4, 0) + m);
#else
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b[4 + j] & 0x0f) + m;
        y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
#endif
}
DRIVERS(q4_1, 20, 32)

static inline void q5_0_block(const uint8_t *b, float *y) {
    float d = f16(b);
    uint32_t qh = u32(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)((b[6 + j] & 0x0f) | (((qh >> j) & 1) << 4)) - 16);
        y[j + 16] = d * (float)((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}
DRIVERS(q5_0, 22, 32)

static inline void q5_1_block(const uint8_t *b, float *y) {
    float d = f16(b), m = f16(b + 2);
    uint32_t qh = u32(b + 4);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[8 + j] & 0x0f) | (((qh >> j) & 1) << 4)) + m;
        y[j + 16] = d * (float)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
}
DRIVERS(q5_1, 24, 32)

/* one Q4_K or Q5_K block; qh (the fifth bits) is NULL for Q4_K, and inlining folds the test away */
static inline void k_block(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, float *y) {
    float d = f16(b), dmin = f16(b + 2);
    for (int s = 0; s < 8; s++) {
        int sc, mn;
        k_scale(b + 4, s, &sc, &mn);
        float dl = d * (float)sc, ml = dmin * (float)mn;
        const uint8_t *q = qs + 32 * (s / 2);
#ifdef LANES16
        for (int l = 0; l < 32; l += 16) {
            u8x16 v = s % 2 ? bytes(q + l) >> 4 : bytes(q + l) & 0x0f;
            if (qh)
                v |= ((bytes(qh + l) >> s) & 1) << 4;
            put(y + 32 * s + l, dl * lanes(v, 0) - ml);
        }
#else
        int shift = 4 * (s % 2);
        for (int l = 0; l < 32; l++) {
            int high = qh ? ((qh[l] >> s) & 1) << 4 : 0;
            y[32 * s + l] = dl * (float)(((q[l] >> shift) & 0x0f) | high) - ml;
        }
#endif
    }
}
static inline void q4_k_block(const uint8_t *b, float *y) { k_block(b, NULL, b + 16, y); }
DRIVERS(q4_k, 144, 256)
static inline void q5_k_block(const uint8_t *b, float *y) { k_block(b, b + 16, b + 48, y); }
DRIVERS(q5_k, 176, 256)

static inline void q6_k_block(const uint8_t *b, float *y) {
    const int8_t *scales = (const int8_t *)(b + 192);
    float d = f16(b + 208);
    for (int s = 0; s < 8; s++) {  /* 32 values: half g, quarter r of it */
        int g = s / 4, r = s % 4;
        const uint8_t *ql = b + 64 * g + 32 * (r % 2), *qh = b + 128 + 32 * g;
        int lo_shift = 4 * (r / 2), hi_shift = 2 * r;
        float d0 = d * (float)scales[2 * s], d1 = d * (float)scales[2 * s + 1];
        for (int l = 0; l < 32; l++) {
            int q = (((ql[l] >> lo_shift) & 0x0f) | (((qh[l] >> hi_shift) & 3) << 4)) - 32;
            y[32 * s + l] = (l < 16 ? d0 : d1) * (float)q;
        }
    }
}
DRIVERS(q6_k, 210, 256)
"""

FUNCTIONS = {QT.Q8_0: "q8_0", QT.Q4_0: "q4_0", QT.Q4_1: "q4_1", QT.Q5_0: "q5_0", QT.Q5_1: "q5_1",
             QT.Q4_K: "q4_k", QT.Q5_K: "q5_k", QT.Q6_K: "q6_k"}
OUTPUTS = {torch.float32: "", torch.bfloat16: "_bf16"}  # output dtype -> the function's suffix


@cache
def _library() -> ctypes.CDLL | None:
    lib = native.load("dequant", SOURCE)
    if lib is None:
        return None  # the torch codecs do the same work
    for name in FUNCTIONS.values():
        for suffix in OUTPUTS.values():
            fn = getattr(lib, name + suffix)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            fn.restype = None
    return lib


def build() -> bool:
    """Build (or find) the library now: a model load does this, so the one-time build is
    never inside a timed first step (preflight's probe compares its steps with the run's)."""
    return _library() is not None


def available(qtype: QT) -> bool:
    return qtype in FUNCTIONS and _library() is not None


def dequantize_blocks(blocks: torch.Tensor, qtype: QT, out: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[n_blocks, type_size]` uint8 on the CPU -> `[n_blocks, block_size]` in `dtype` (float32,
    or bfloat16: the float32 values rounded as torch rounds them, with no float32 copy written),
    written into `out` when given (contiguous, of that dtype and that many values)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = blocks.contiguous()
    assert blocks.dtype == torch.uint8 and blocks.device.type == "cpu" and blocks.shape[-1] == type_size
    assert dtype in OUTPUTS, dtype
    if out is None:
        out = torch.empty(blocks.shape[0], block_size, dtype=dtype)
    assert out.dtype == dtype and out.is_contiguous() and out.numel() == blocks.shape[0] * block_size
    getattr(_library(), FUNCTIONS[qtype] + OUTPUTS[dtype])(blocks.data_ptr(), out.data_ptr(), blocks.shape[0], torch.get_num_threads())
    return out
