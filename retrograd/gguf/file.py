"""Open a GGUF file: metadata by key, tensors by name, every way the file can be wrong
turned into one GGUFError line naming it.

We walk the header ourselves instead of using gguf.GGUFReader: the reader builds numpy
views for every element of every array, which takes 16.7 s for Gemma-3's 262144-token
vocabulary (3.5 s for SmolLM2) before anything else can happen. This walk only records
where each value lies and decodes it when asked, so opening costs neither time nor memory
for arrays nobody reads (a hostile 100 MB array included). Types, sizes and block codecs
still come from the gguf package.

The file may come from anywhere, so the walk checks what llama.cpp's own parser (ggml
gguf.cpp) checks, with exact integer arithmetic, before anything is allocated: counts and
lengths against the bytes left, no arrays of arrays, a uint32 power-of-two alignment, at
most four dimensions whose product fits int64, short unique tensor names, and tensors
stored in order, each at the aligned offset after the previous one and inside the file. A
header we accept is one llama.cpp parses too. Typed getters (get_int, get_str, ...) turn
a value of the wrong type into the same kind of error.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from retrograd.errors import GGUFError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_TENSOR_NAME_BYTES = 63  # llama.cpp's GGML_MAX_NAME is 64 with the terminating zero
MAX_ARRAY_ELEMENTS = 2**30  # llama.cpp's GGUF_MAX_ARRAY_ELEMENTS
INT64_MAX = 2**63 - 1

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
INTEGER_TYPES = frozenset(_SCALARS) - {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.BOOL}
FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_QTYPES = {int(qtype): qtype for qtype in GGML_QUANT_SIZES}  # tensor types with a known block layout


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows first), the reverse of GGUF's ne
    n_bytes: int
    data: np.ndarray  # a read-only view into the memory-mapped file
    offset: int  # where the data starts in the file, for reading it without the map


@dataclass(frozen=True)
class _Field:
    """A metadata value not yet decoded: its type, the byte where it starts (an array's
    first element, a string's length prefix) and, for an array, element type and count."""

    vtype: GGUFValueType
    offset: int
    etype: GGUFValueType | None = None
    count: int = 1

    def describe(self) -> str:
        return self.vtype.name.lower() if self.etype is None else f"an array of {self.count} {self.etype.name.lower()}"


def _quote(text: str, limit: int = 64) -> str:
    """A name from the file, fit for a one-line message: quoted, escaped, shortened."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


class _Cursor:
    def __init__(self, buf: np.ndarray, path: Path, pos: int = 0):
        self.buf, self.view, self.path, self.pos = buf, memoryview(buf), path, pos

    @property
    def remaining(self) -> int:
        return self.buf.size - self.pos

    def take(self, n: int) -> np.ndarray:
        if n > self.remaining:
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
        (span,) = self.string_spans(1)
        return self.text(*span)

    def string_spans(self, count: int) -> Iterator[tuple[int, int]]:
        """(start, end) of each of `count` length-prefixed strings, read one by one against
        the end of the file; the cursor moves past each."""
        view, end, pos = self.view, self.buf.size, self.pos
        for _ in range(count):
            start = pos + 8
            pos = start + (struct.unpack_from("<Q", view, pos)[0] if start <= end else 0)
            if pos > end:
                raise GGUFError(f"{self.path}: truncated header (a string at byte {start - 8} runs past the end of the file)")
            self.pos = pos
            yield start, pos

    def text(self, start: int, end: int) -> str:
        try:
            return str(self.view[start:end], "utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: damaged header (a string at byte {start - 8} is not UTF-8)") from None

    def value_type(self) -> GGUFValueType:
        raw = self.u32()
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFError(f"{self.path}: damaged header (unknown value type {raw} at byte {self.pos - 4})") from None

    def skip_value(self, key: str) -> _Field:
        """Step over the value of `key`, checking that it fits in the file."""
        vtype, start = self.value_type(), self.pos
        if vtype == GGUFValueType.STRING:
            self.take(self.u64())
            return _Field(vtype, start)
        if vtype != GGUFValueType.ARRAY:
            self.take(_SCALARS[vtype].itemsize)
            return _Field(vtype, start)
        etype, count = self.value_type(), self.u64()
        if etype == GGUFValueType.ARRAY:
            raise GGUFError(f"{self.path}: metadata {_quote(key)} is an array of arrays, which llama.cpp does not read")
        if count > MAX_ARRAY_ELEMENTS:
            raise GGUFError(f"{self.path}: metadata {_quote(key)} is an array of {count} elements (at most {MAX_ARRAY_ELEMENTS})")
        start = self.pos
        if etype == GGUFValueType.STRING:
            for _ in self.string_spans(count):  # only the lengths are read
                pass
        else:
            self.take(_SCALARS[etype].itemsize * count)
        return _Field(vtype, start, etype, count)


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
        self._kv: dict[str, _Field] = {}
        for _ in range(n_kv):
            key = cur.string()
            if not key:
                raise GGUFError(f"{self.path}: damaged header (an empty metadata key at byte {cur.pos - 8})")
            if key in self._kv:
                raise GGUFError(f"{self.path}: damaged header (duplicate key {_quote(key)})")
            self._kv[key] = cur.skip_value(key)
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        alignment = self._alignment()
        data_start = _pad(cur.pos, alignment)
        self.tensors: dict[str, TensorInfo] = {}
        expected_offset = 0  # llama.cpp's layout: in order, each padded to the alignment
        for name, qtype, ne, offset in infos:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: damaged header (duplicate tensor {_quote(name)})")
            if offset != expected_offset:
                raise GGUFError(
                    f"{self.path}: damaged header (tensor {_quote(name)} starts at data offset {offset}, expected {expected_offset})"
                )
            self.tensors[name] = self._tensor(name, qtype, ne, data_start + offset)
            expected_offset += _pad(self.tensors[name].n_bytes, alignment)

    def _tensor_info(self, cur: _Cursor) -> tuple[str, GGMLQuantizationType, list[int], int]:
        name = cur.string()
        if len(name.encode()) > MAX_TENSOR_NAME_BYTES:
            raise GGUFError(f"{self.path}: tensor name {_quote(name)} is longer than {MAX_TENSOR_NAME_BYTES} bytes")
        n_dims = cur.u32()
        if n_dims > MAX_DIMS:
            raise GGUFError(f"{self.path}: damaged header (tensor {_quote(name)} has {n_dims} dimensions, at most {MAX_DIMS})")
        ne = [cur.u64() for _ in range(n_dims)]
        raw_type, offset = cur.u32(), cur.u64()
        qtype = _QTYPES.get(raw_type)
        if qtype is None:
            raise GGUFError(f"{self.path}: tensor {_quote(name)} has unknown type id {raw_type}")
        return name, qtype, ne, offset

    def _alignment(self) -> int:
        field = self._kv.get("general.alignment")
        if field is None:
            return DEFAULT_ALIGNMENT
        alignment = self._decode(field) if field.vtype == GGUFValueType.UINT32 else None
        if not alignment or alignment & (alignment - 1):
            shown = alignment if alignment is not None else field.describe()
            raise GGUFError(f"{self.path}: metadata general.alignment is {shown}, expected a uint32 power of two")
        return alignment

    def _tensor(self, name: str, qtype: GGMLQuantizationType, ne: list[int], start: int) -> TensorInfo:
        """Exact integer sizes, checked against int64 and the file before any view is made."""
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(ne)) or (1,)
        n_elements = 1
        for n in ne:
            n_elements *= n
        if 0 in ne or n_elements > INT64_MAX:  # llama.cpp allows empty tensors; no model has one, numpy chokes on some
            problem = "an empty dimension" if 0 in ne else "more elements than int64 counts"
            raise GGUFError(f"{self.path}: damaged header (tensor {_quote(name)} has shape {list(shape)}, {problem})")
        if shape[-1] % block_size:
            raise GGUFError(f"{self.path}: tensor {_quote(name)} rows of {shape[-1]} values are not whole {qtype.name} blocks")
        n_bytes = n_elements // block_size * type_size
        if start + n_bytes > self._buf.size:
            raise GGUFError(
                f"{self.path}: truncated: tensor {_quote(name)} ends at byte {start + n_bytes} but the file has {self._buf.size}"
            )
        raw = self._buf[start : start + n_bytes]
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:  # block types (and BF16): rows of bytes
            data = raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)
        return TensorInfo(name, qtype, shape, n_bytes, data, start)

    def get(self, key: str, default: Any = None) -> Any:
        field = self._kv.get(key)
        return default if field is None else self._decode(field)

    def require(self, key: str) -> Any:
        if key not in self._kv:
            raise GGUFError(f"{self.path}: missing metadata key {key}")
        return self.get(key)

    def get_int(self, key: str, default: int | None = None) -> int | None:
        return self._typed(key, default, INTEGER_TYPES, "an integer")

    def get_float(self, key: str, default: float | None = None) -> float | None:
        return self._typed(key, default, FLOAT_TYPES, "a float")

    def get_str(self, key: str, default: str | None = None) -> str | None:
        return self._typed(key, default, {GGUFValueType.STRING}, "a string")

    def get_ints(self, key: str) -> list[int] | None:
        """An array of integers, such as a per-layer head count."""
        return self._typed(key, None, INTEGER_TYPES, "an array of integers", array=True)

    def get_flags(self, key: str) -> list[bool] | None:
        """An array of booleans or integers (non-zero: true), such as a per-layer switch."""
        values = self._typed(key, None, INTEGER_TYPES | {GGUFValueType.BOOL}, "an array of booleans or integers", array=True)
        return None if values is None else [bool(v) for v in values]

    def get_strs(self, key: str) -> list[str] | None:
        return self._typed(key, None, {GGUFValueType.STRING}, "an array of strings", array=True)

    def _typed(self, key: str, default: Any, vtypes: set | frozenset, expected: str, array: bool = False) -> Any:
        field = self._kv.get(key)
        if field is None:
            return default
        if (field.etype if array else field.vtype) not in vtypes:
            raise GGUFError(f"{self.path}: metadata {key} is {field.describe()}, expected {expected}")
        return self._decode(field)

    def value_type(self, key: str) -> tuple[GGUFValueType, GGUFValueType | None]:
        """(type, element type of an array or None): what re-writing the value needs."""
        field = self._kv[key]
        return field.vtype, field.etype

    def array_length(self, key: str) -> int | None:
        field = self._kv.get(key)
        return None if field is None or field.etype is None else field.count

    def keys(self) -> list[str]:
        return list(self._kv)

    def _decode(self, field: _Field) -> Any:
        cur = _Cursor(self._buf, self.path, field.offset)
        if field.vtype == GGUFValueType.STRING:
            return cur.string()
        if field.etype == GGUFValueType.STRING:
            return [cur.text(start, end) for start, end in cur.string_spans(field.count)]
        vtype = field.vtype if field.etype is None else field.etype
        values = cur.take(_SCALARS[vtype].itemsize * field.count).view(_SCALARS[vtype])
        if vtype == GGUFValueType.BOOL:
            values = values.astype(bool)
        return values[0].item() if field.etype is None else values.tolist()

    @property
    def size(self) -> int:
        return int(self._buf.size)


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


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
