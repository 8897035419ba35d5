"""Torch dequantizers for GGUF block types.

Each codec turns a `[n_blocks, type_size]` uint8 tensor into `[n_blocks, block_size]`
float32 values and equals `gguf.quants.dequantize` bit for bit: the float operations
are the same and happen in the same order (scale products first, then one multiply and
one add or subtract), as in ggml's `dequantize_row_*` reference code.

`dequantize(raw, qtype, shape, dtype)` is the entry point. On the CPU it runs the C loops
of `native_dequant.py` (the same operations in the same order, 2-10x faster than these
codecs compiled by torch.compile, which they replace); these torch codecs serve other
devices and machines without a C compiler. Tests check both against gguf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from retrograd.kernels import native_dequant

QK_K = 256


@dataclass(frozen=True)
class BlockCodec:
    qtype: QT
    block_size: int  # values per block
    type_size: int  # bytes per block
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]


CODECS: dict[QT, BlockCodec] = {}


def _codec(qtype: QT):
    def register(fn):
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        CODECS[qtype] = BlockCodec(qtype, block_size, type_size, fn)
        return fn

    return register


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 at byte `offset` of each block -> float32 column [n, 1]. The
    whole row is reinterpreted (every block size is even), so no copy of the two bytes is made."""
    return blocks.view(torch.float16)[:, offset // 2, None].to(torch.float32)


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """[n, groups*width] bytes -> [n, groups, 2*width]: low nibbles, then high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, groups, 1, width) >> torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, groups, 2 * width)


def _bits(qh: torch.Tensor, n_bits: int) -> torch.Tensor:
    """[n, B] bytes -> [n, B*8] single bits, little-endian within each byte."""
    n = qh.shape[0]
    shifts = torch.arange(n_bits, dtype=torch.uint8, device=qh.device).reshape(1, 1, n_bits)
    return ((qh.reshape(n, -1, 1) >> shifts) & 1).reshape(n, -1)


@_codec(QT.F32)
def _f32(blocks):
    return blocks.contiguous().view(torch.float32)


@_codec(QT.F16)
def _f16_blocks(blocks):
    return blocks.contiguous().view(torch.float16).to(torch.float32)


@_codec(QT.BF16)
def _bf16(blocks):
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


@_codec(QT.Q8_0)
def _q8_0(blocks):
    # 2 bytes f16 scale + 32 int8
    d = _f16(blocks, 0)
    q = blocks.view(torch.int8)[:, 2:].to(torch.float32)
    return q * d


@_codec(QT.Q4_0)
def _q4_0(blocks):
    # 2 bytes f16 scale + 16 bytes of nibbles, offset 8
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], 1, 16).reshape(blocks.shape[0], 32).to(torch.int8) - 8
    return d * q.to(torch.float32)


@_codec(QT.Q4_1)
def _q4_1(blocks):
    # f16 scale + f16 min + 16 bytes of nibbles
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:], 1, 16).reshape(blocks.shape[0], 32).to(torch.float32)
    return d * q + m


@_codec(QT.Q5_0)
def _q5_0(blocks):
    # f16 scale + 4 bytes of 5th bits + 16 bytes of nibbles, offset 16
    d = _f16(blocks, 0)
    qh = _bits(blocks[:, 2:6], 8)
    ql = _nibbles(blocks[:, 6:], 1, 16).reshape(blocks.shape[0], 32)
    q = (ql | (qh << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


@_codec(QT.Q5_1)
def _q5_1(blocks):
    # f16 scale + f16 min + 4 bytes of 5th bits + 16 bytes of nibbles
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    qh = _bits(blocks[:, 4:8], 8)
    ql = _nibbles(blocks[:, 8:], 1, 16).reshape(blocks.shape[0], 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return d * q + m


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte, 6-bit scale/min table shared by Q4_K and Q5_K -> two [n, 8]."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


@_codec(QT.Q4_K)
def _q4_k(blocks):
    # f16 d + f16 dmin + 12 bytes scales + 128 bytes nibbles; 8 sub-blocks of 32
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _k_scales(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:], 4, 32).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


@_codec(QT.Q5_K)
def _q5_k(blocks):
    # f16 d + f16 dmin + 12 bytes scales + 32 bytes of 5th bits + 128 bytes nibbles
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _k_scales(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 8, 1)
    qh = (qh & 1).reshape(n, 8, 32)
    ql = _nibbles(blocks[:, 48:], 4, 32).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


@_codec(QT.Q6_K)
def _q6_k(blocks):
    # 128 bytes low nibbles + 64 bytes high 2-bit pairs + 16 int8 scales + f16 d
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128], 2, 64).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    scales = blocks.view(torch.int8)[:, 192:208].to(torch.float32)
    d = _f16(blocks, 208)
    dl = (d * scales).reshape(n, 16, 1)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def dequantize(
    raw: torch.Tensor, qtype: QT, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Raw GGUF bytes (uint8, any shape whose byte count is whole blocks) -> `shape` in `dtype`,
    written into `out` when given (a contiguous tensor of `shape` and `dtype`: on the CPU's C
    path in float32 or bfloat16 nothing new is allocated).

    `shape` is the torch (row-major) shape, i.e. the reverse of GGUF's `ne`. On the CPU the
    block types run in native_dequant's C loops when they are built (the same bits), on
    other devices in the torch codecs above.
    """
    codec = CODECS.get(qtype)
    if codec is None:
        raise ValueError(f"no torch dequantizer for {qtype.name}; supported: {supported_names()}")
    blocks = raw.reshape(-1, codec.type_size)
    if out is not None:
        assert out.shape == shape and out.dtype == dtype and out.is_contiguous(), (out.shape, out.dtype, shape, dtype)
    if raw.device.type == "cpu" and native_dequant.available(qtype):
        written = dtype if dtype in native_dequant.OUTPUTS else torch.float32
        values = native_dequant.dequantize_blocks(blocks, qtype, out=out if written == dtype else None, dtype=written)
    else:
        values = codec.dequantize_blocks(blocks)
    if out is None:
        return values.to(dtype).reshape(shape)
    return out if values.data_ptr() == out.data_ptr() else out.copy_(values.reshape(shape))


def supported_names() -> str:
    return ", ".join(t.name for t in CODECS)
