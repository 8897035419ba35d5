"""The `.topk` sidecar: the teacher's k most likely tokens, with their log-probs, at every
supervised position of an SFT-style corpus, written once by `retrograd distill-teacher` so
that offline distillation never loads the teacher.

Layout (little-endian):

    magic        8 bytes   b"RGTOPK\\x00\\x01"
    header_len   uint64    bytes of the JSON header that follows
    header       JSON      version, k, rows, vocab_size, tokenizer_fingerprint,
                           corpus_fingerprint, teacher, teacher_fingerprint, backend
    padding      to a multiple of 64 bytes
    ids          int32     [rows, k], most likely first
    logprobs     float32   [rows, k], log-softmax over the full vocabulary (temperature 1)

Row r is the r-th supervised position of the corpus in file order (examples in order, each
one's supervised positions in order). The corpus fingerprint hashes exactly those token ids
and masks, so a sidecar is refused for any other data, template, context length or
tokenization; the tokenizer fingerprint is the vocabulary's (teacher/vocabulary.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from retrograd.errors import DataError

MAGIC = b"RGTOPK\x00\x01"
VERSION = 1
ALIGNMENT = 64
ID_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")


@dataclass(frozen=True)
class SidecarHeader:
    k: int
    rows: int
    vocab_size: int
    tokenizer_fingerprint: str
    corpus_fingerprint: str
    teacher: str  # the teacher GGUF's file name, for people reading the header
    teacher_fingerprint: str
    backend: str  # "llama.cpp" or "torch"
    version: int = VERSION

    @property
    def data_bytes(self) -> int:
        return self.rows * self.k * (ID_DTYPE.itemsize + LOGPROB_DTYPE.itemsize)


@dataclass(frozen=True)
class Sidecar:
    path: Path
    header: SidecarHeader
    ids: np.ndarray  # [rows, k] int32, memory-mapped
    logprobs: np.ndarray  # [rows, k] float32, memory-mapped


def corpus_fingerprint(sequences: Iterable) -> str:
    """Hash of every sequence's ids and loss mask, in order (anything with .ids and .mask)."""
    h = hashlib.sha256()
    for s in sequences:
        h.update(np.asarray(s.ids, dtype="<i4").tobytes())
        h.update(np.packbits(np.asarray(s.mask, dtype=bool)).tobytes())
        h.update(struct.pack("<Q", len(s.ids)))
    return h.hexdigest()[:32]


def _prefix(header: SidecarHeader) -> bytes:
    text = json.dumps(asdict(header), sort_keys=True).encode()
    head = MAGIC + struct.pack("<Q", len(text)) + text
    return head + b"\x00" * (-len(head) % ALIGNMENT)


def write_sidecar(path: Path, header: SidecarHeader, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> Path:
    """Write `header` and the (ids [n, k], logprobs [n, k]) chunks, in row order, atomically:
    a crash leaves no half-written sidecar under `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    ids_at = len(_prefix(header))
    logprobs_at = ids_at + header.rows * header.k * ID_DTYPE.itemsize
    written = 0
    try:
        with open(tmp, "wb") as f:
            f.write(_prefix(header))
            f.truncate(ids_at + header.data_bytes)
            for ids, logprobs in chunks:
                assert ids.shape == logprobs.shape and ids.shape[1:] == (header.k,), (ids.shape, logprobs.shape)
                f.seek(ids_at + written * header.k * ID_DTYPE.itemsize)
                f.write(np.ascontiguousarray(ids, dtype=ID_DTYPE).tobytes())
                f.seek(logprobs_at + written * header.k * LOGPROB_DTYPE.itemsize)
                f.write(np.ascontiguousarray(logprobs, dtype=LOGPROB_DTYPE).tobytes())
                written += ids.shape[0]
        assert written == header.rows, f"wrote {written} rows, the header says {header.rows}"
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_sidecar(path: Path, key: str = "distill.sidecar") -> Sidecar:
    """Open a sidecar (memory-mapped); a file that is not one is one DataError line."""
    path = Path(path)
    where = f"{key} {path}"
    if not path.is_file():
        raise DataError(f"{where}: no such file (write it with `retrograd distill-teacher CONFIG.toml`)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 8)
        if len(start) < len(MAGIC) + 8 or start[: len(MAGIC)] != MAGIC:
            raise DataError(f"{where}: not a retrograd top-k sidecar (bad magic)")
        (length,) = struct.unpack("<Q", start[len(MAGIC) :])
        try:
            fields = json.loads(f.read(min(length, size)))
            header = SidecarHeader(**fields)
        except (ValueError, TypeError) as e:
            raise DataError(f"{where}: damaged header ({e})") from None
    if header.version != VERSION:
        raise DataError(f"{where}: sidecar version {header.version}; this retrograd reads version {VERSION}")
    if not 1 <= header.k <= header.vocab_size or header.rows < 0:
        raise DataError(
            f"{where}: damaged header (k = {header.k}, rows = {header.rows}, vocab_size = {header.vocab_size})"
        )
    ids_at = len(_prefix(header))
    if size != ids_at + header.data_bytes:
        raise DataError(
            f"{where}: {size} bytes, expected {ids_at + header.data_bytes} for {header.rows} rows of k = {header.k}"
        )
    shape = (header.rows, header.k)
    ids = np.memmap(path, ID_DTYPE, "r", offset=ids_at, shape=shape) if header.rows else np.zeros(shape, ID_DTYPE)
    logprobs_at = ids_at + header.rows * header.k * ID_DTYPE.itemsize
    logprobs = (
        np.memmap(path, LOGPROB_DTYPE, "r", offset=logprobs_at, shape=shape)
        if header.rows
        else np.zeros(shape, LOGPROB_DTYPE)
    )
    return Sidecar(path, header, ids, logprobs)


def check_sidecar(
    sidecar: Sidecar, *, tokenizer_fingerprint: str, corpus_fingerprint: str, rows: int, vocab_size: int, data: Path
) -> None:
    """Refuse a sidecar written for other data or another tokenizer, in one line."""
    h, where = sidecar.header, f"distill.sidecar {sidecar.path}"
    rerun = "; rewrite it with `retrograd distill-teacher CONFIG.toml`"
    if h.tokenizer_fingerprint != tokenizer_fingerprint or h.vocab_size != vocab_size:
        raise DataError(
            f"{where} was written with another tokenizer (fingerprint {h.tokenizer_fingerprint[:12]}, "
            f"{h.vocab_size} tokens) than the student's ({tokenizer_fingerprint[:12]}, {vocab_size} tokens){rerun}"
        )
    if h.corpus_fingerprint != corpus_fingerprint or h.rows != rows:
        raise DataError(
            f"{where} was written for other data than {data} (corpus fingerprint {h.corpus_fingerprint[:12]} "
            f"with {h.rows} positions, the data gives {corpus_fingerprint[:12]} with {rows}){rerun}"
        )


def row_offsets(n_trained: Sequence[int]) -> np.ndarray:
    """First sidecar row of each sequence, from their supervised-token counts -> [n + 1]."""
    return np.concatenate([[0], np.cumsum(np.asarray(n_trained, dtype=np.int64))])
