"""Open a GGUF file through the gguf package and turn every way it can be wrong into one
GGUFError line naming the file. Nothing here parses GGUF itself."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType

from retrograd.errors import GGUFError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows first), the reverse of GGUF's ne
    n_bytes: int
    data: np.ndarray  # a read-only view into the memory-mapped file


class GGUFFile:
    """A validated, memory-mapped GGUF file: metadata by key and tensors by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = _read(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)  # data_offset is absolute
            if end > size or t.data.nbytes != t.n_bytes:
                raise GGUFError(f"{self.path}: truncated: tensor {t.name} ends at byte {end} but the file has {size}")
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(t.name, t.tensor_type, shape, int(t.n_bytes), t.data)

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:  # a damaged value region
            raise GGUFError(f"{self.path}: metadata key {key} is unreadable ({e})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: missing metadata key {key}")
        return value

    def keys(self) -> list[str]:
        return list(self.reader.fields)

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def _read(path: Path) -> GGUFReader:
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if path.is_dir():
        raise GGUFError(f"{path}: is a directory, expected a .gguf model file")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read ({e.strerror})") from None
    if not head:
        raise GGUFError(f"{path}: empty file, expected a GGUF model")
    if head != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF file starts with b'GGUF')")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return GGUFReader(path, "r")
    except Exception as e:
        reason = str(e) or type(e).__name__
        raise GGUFError(f"{path}: damaged or truncated GGUF ({reason})") from None

