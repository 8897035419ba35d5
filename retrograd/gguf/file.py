"""Open a GGUF file: metadata by key, tensors by name, every way the file can be wrong
turned into one GGUFError line naming it.

We walk the header ourselves instead of using gguf.GGUFReader: the reader builds numpy
views for every element of every array, which takes 16.7 s for Gemma-3's 262144-token
vocabulary (3.5 s for SmolLM2) before anything else can happen; this walk skips string
arrays in one pass and decodes them only when asked (0.1 s). Types, sizes and block codecs
still come from the gguf package.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from retrograd.errors import GGUFError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows first), the reverse of GGUF's ne
    n_bytes: int
    data: np.ndarray  # a read-only view into the memory-mapped file


@dataclass(frozen=True)
class _StringArray:
    """A string array left undecoded: (offset of the first length prefix, element count)."""

    offset: int
    count: int


class _Cursor:
    def __init__(self, buf: np.ndarray, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, n: int) -> np.ndarray:
        if n < 0 or self.pos + n > self.buf.size:
            raise GGUFError(f"{self.path}: truncated header (needs byte {self.pos + n}, the file has {self.buf.size})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, dtype: np.dtype):
        return self.take(dtype.itemsize).view(dtype)[0].item()

    def u32(self) -> int:
        return self.scalar(_SCALARS[GGUFValueType.UINT32])

    def u64(self) -> int:
        return self.scalar(_SCALARS[GGUFValueType.UINT64])

    def string(self) -> str:
        raw = self.take(self.u64()).tobytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: damaged header (a string at byte {self.pos - len(raw)} is not UTF-8)") from None

    def skip_strings(self, count: int) -> _StringArray:
        """Step over `count` length-prefixed strings, reading only the lengths."""
        start, view, pos = self.pos, memoryview(self.buf), self.pos
        try:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", view, pos)[0]
        except struct.error:
            pos = self.buf.size + 1
        if pos > self.buf.size:
            raise GGUFError(f"{self.path}: truncated header (a string array runs past the end of the file)")
        self.pos = pos
        return _StringArray(start, count)

    def value_type(self) -> GGUFValueType:
        raw = self.u32()
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFError(f"{self.path}: damaged header (unknown value type {raw} at byte {self.pos - 4})") from None

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.value_type(), self.u64()
            if etype == GGUFValueType.STRING:
                return self.skip_strings(count)
            if etype == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = _SCALARS[etype]
            values = self.take(dtype.itemsize * count).view(dtype)
            return [bool(v) for v in values] if etype == GGUFValueType.BOOL else values.tolist()
        value = self.scalar(_SCALARS[vtype])
        return bool(value) if vtype == GGUFValueType.BOOL else value


class GGUFFile:
    """A validated, memory-mapped GGUF file: metadata by key and tensors by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        buf = _map(self.path)
        self._buf = buf
        cur = _Cursor(buf, self.path)
        if cur.take(4).tobytes() != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (it starts with {buf[:4].tobytes()!r}, a GGUF file starts with b'GGUF')")
        version = cur.u32()
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (supported: 2, 3; big-endian files are not)")
        n_tensors, n_kv = cur.u64(), cur.u64()
        if n_kv > buf.size or n_tensors > buf.size:
            raise GGUFError(f"{self.path}: damaged header ({n_kv} keys and {n_tensors} tensors cannot fit in {buf.size} bytes)")
        self._kv: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            if key in self._kv:
                raise GGUFError(f"{self.path}: damaged header (duplicate key {key})")
            self._kv[key] = cur.value(cur.value_type())
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if n_dims > 4:
                raise GGUFError(f"{self.path}: damaged header (tensor {name} has {n_dims} dimensions)")
            ne = [cur.u64() for _ in range(n_dims)]
            raw_type, offset = cur.u32(), cur.u64()
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name} has unknown type id {raw_type}") from None
            infos.append((name, qtype, ne, offset))
        alignment = int(self._kv.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {alignment} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, qtype, ne, offset in infos:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: damaged header (duplicate tensor {name})")
            self.tensors[name] = self._tensor(name, qtype, ne, data_start + offset)

    def _tensor(self, name: str, qtype: GGMLQuantizationType, ne: list[int], start: int) -> TensorInfo:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(ne)) or (1,)
        n_elements = int(np.prod(shape))
        if ne and ne[0] % block_size:
            raise GGUFError(f"{self.path}: tensor {name} rows of {ne[0]} values are not whole {qtype.name} blocks")
        n_bytes = n_elements // block_size * type_size
        if start + n_bytes > self._buf.size:
            raise GGUFError(f"{self.path}: truncated: tensor {name} ends at byte {start + n_bytes} but the file has {self._buf.size}")
        raw = self._buf[start : start + n_bytes]
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:  # block types (and BF16): rows of bytes
            data = raw.reshape(*shape[:-1], -1)
        return TensorInfo(name, qtype, shape, n_bytes, data)

    def get(self, key: str, default: Any = None) -> Any:
        value = self._kv.get(key, default)
        return self._strings(value) if isinstance(value, _StringArray) else value

    def require(self, key: str) -> Any:
        if key not in self._kv:
            raise GGUFError(f"{self.path}: missing metadata key {key}")
        return self.get(key)

    def array_length(self, key: str) -> int | None:
        value = self._kv.get(key)
        return value.count if isinstance(value, _StringArray) else (len(value) if isinstance(value, list) else None)

    def keys(self) -> list[str]:
        return list(self._kv)

    def _strings(self, arr: _StringArray) -> list[str]:
        cur = _Cursor(self._buf, self.path)
        cur.pos = arr.offset
        return [cur.string() for _ in range(arr.count)]

    @property
    def size(self) -> int:
        return int(self._buf.size)


def _map(path: Path) -> np.ndarray:
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if path.is_dir():
        raise GGUFError(f"{path}: is a directory, expected a .gguf model file")
    try:
        size = path.stat().st_size
        if size == 0:
            raise GGUFError(f"{path}: empty file, expected a GGUF model")
        return np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise GGUFError(f"{path}: cannot read ({e.strerror})") from None
