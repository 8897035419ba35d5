"""Fold a LoRA adapter into its base model: one standalone GGUF that llama.cpp loads
without `--lora`, like llama.cpp's own export-lora tool.

Each adapted weight becomes W + scale·B·A (an expert stack: each expert's W_e + scale·B_e·A_e),
with llama.cpp's scale (alpha / rank, or 1 when the adapter's alpha is 0), computed in
float32 from the dequantized base weight and written in the chosen type; every other
tensor is copied byte for byte and every metadata key of the base is kept. `same`
re-quantizes a merged weight to the base weight's own type: gguf's numpy quantizers where
they exist (the legacy block types), llama.cpp's own quantizer (ggml_quantize_chunk,
without an importance matrix) for the K-quants; a type neither can write (i-quants need an
importance matrix) falls back to f16, and so does q8_0 for rows that are not whole 32-value
blocks, each said in `notes`.

Memory: tensor data is read with plain file reads, one tensor at a time, never through
the memory map (its pages would count in the resident set); only the header is mapped.
The output goes to a temporary file beside `out`, renamed when complete.
"""

from __future__ import annotations

import ctypes
import functools
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from retrograd.errors import GGUFError, RetrogradError
from retrograd.gguf.adapter import AdapterFile, read_fitting_adapter
from retrograd.gguf.file import GGUFFile, TensorInfo

MERGE_TYPES = {"f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0, "same": None}
COPY_CHUNK = 16 * 2**20  # bytes per read when copying an untouched tensor


@dataclass(frozen=True)
class MergePlan:
    """Everything checked, nothing written yet."""

    base: GGUFFile
    adapter: AdapterFile
    out: Path
    scale: float
    types: dict[str, QT]  # merged weight -> the type it is written in
    notes: tuple[str, ...]  # one line per fallback

    def n_bytes(self, t: TensorInfo) -> int:
        """A tensor's size in the merged file."""
        qtype = self.types.get(t.name)
        if qtype is None:
            return t.n_bytes
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        return int(np.prod(t.shape)) // block_size * type_size


def check_out(out: Path, inputs: dict[str, Path], option: str = "--out") -> None:
    """`out` must not overwrite an input and its folder must exist."""
    for what, path in inputs.items():
        if out.resolve() == Path(path).resolve() or (out.exists() and Path(path).exists() and out.samefile(path)):
            raise RetrogradError(f"{option} {out} is the {what}: write the merged model to another file")
    if out.is_dir():
        raise RetrogradError(f"{option} {out}: is a directory, expected a .gguf file name")
    if not out.parent.is_dir():
        raise RetrogradError(f"{option} {out}: folder {out.parent} does not exist")


def plan_merge(model: Path, adapter: Path, out: Path, merge_type: str = "f16") -> MergePlan:
    """Check the inputs against each other before anything is written."""
    if merge_type not in MERGE_TYPES:
        raise RetrogradError(f"--type {merge_type!r}: expected one of {', '.join(MERGE_TYPES)}")
    out = Path(out)
    check_out(out, {"base model (--model)": model, "adapter (--adapter)": adapter})
    base = GGUFFile(model)
    if base.get_str("general.type") == "adapter":
        raise GGUFError(f"--model {model}: is an adapter, expected a base model")
    lora = read_fitting_adapter(Path(adapter), base)
    types, notes = {}, []
    for name in lora.tensors:
        t = base.tensors[name]
        if not _dequantizable(t.qtype):
            raise GGUFError(f"--model {model}: {name} is {t.qtype.name}, which cannot be read to merge into")
        types[name], note = _output_type(t, merge_type)
        if note:
            notes.append(f"{name}: {note}, written as F16")
    scale = lora.alpha / lora.rank if lora.alpha else 1.0  # llama.cpp's rule (llama-graph.cpp, build_lora_mm)
    return MergePlan(base, lora, out, scale, types, tuple(notes))


def write_merged(plan: MergePlan, on_tensor: Callable[[str], None] = lambda name: None) -> Path:
    """Write the merged model tensor by tensor into a temporary file, then rename it."""
    base = plan.base
    tmp = plan.out.with_name(f".{plan.out.name}.{uuid.uuid4().hex[:12]}.tmp")  # not mkstemp: its 0600 would stick
    try:
        _write_header(plan, tmp)
        alignment = base.get_int("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        with open(base.path, "rb") as src, open(tmp, "ab") as dst:
            for t in base.tensors.values():
                dst.write(bytes(-dst.tell() % alignment))
                if t.name in plan.types:
                    dst.write(np.ascontiguousarray(_merged(plan, t, src)).data)
                else:
                    _copy(src, dst, t.offset, t.n_bytes)
                on_tensor(t.name)
            dst.write(bytes(-dst.tell() % alignment))
        os.replace(tmp, plan.out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return plan.out


def merge(model: Path, adapter: Path, out: Path, merge_type: str = "f16") -> MergePlan:
    """plan_merge + write_merged, for callers without a progress bar."""
    plan = plan_merge(model, adapter, out, merge_type)
    write_merged(plan)
    return plan


def _output_type(t: TensorInfo, merge_type: str) -> tuple[QT, str | None]:
    """The merged weight's type, and why it falls back to F16 when it does."""
    qtype = t.qtype if merge_type == "same" else MERGE_TYPES[merge_type]
    block_size = GGML_QUANT_SIZES[qtype][0]
    if t.shape[-1] % block_size:
        return QT.F16, f"rows of {t.shape[-1]} values are not whole {qtype.name} blocks of {block_size}"
    if _quantizer(qtype) is None:
        return QT.F16, f"{qtype.name} needs an importance matrix to quantize"
    return qtype, None


def _write_header(plan: MergePlan, path: str) -> None:
    """Metadata and tensor infos, through gguf's writer; tensor data follows separately."""
    base = plan.base
    w = gguf.GGUFWriter(path, base.get_str("general.architecture"))
    for key in base.keys():
        if key == "general.alignment":
            w.add_custom_alignment(base.get_int(key))
        elif key != "general.architecture":  # the writer's first key already
            vtype, etype = base.value_type(key)
            w.add_key_value(key, base.get(key), vtype, sub_type=etype)
    for t in base.tensors.values():
        w.add_tensor_info(t.name, t.shape, np.float32, plan.n_bytes(t), raw_dtype=plan.types.get(t.name, t.qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def _copy(src, dst, offset: int, n_bytes: int) -> None:
    src.seek(offset)
    while n_bytes:
        chunk = src.read(min(COPY_CHUNK, n_bytes))
        if not chunk:
            raise GGUFError(f"{src.name}: changed while merging (ended early)")
        dst.write(chunk)
        n_bytes -= len(chunk)


def _merged(plan: MergePlan, t: TensorInfo, src) -> np.ndarray:
    """W + scale·B·A, in float32, encoded in the planned type."""
    src.seek(t.offset)
    raw = np.fromfile(src, dtype=np.uint8, count=t.n_bytes)
    if raw.size != t.n_bytes:
        raise GGUFError(f"{plan.base.path}: changed while merging (ended early)")
    rows = raw.reshape(-1, t.n_bytes // int(np.prod(t.shape[:-1])))  # an expert stack's matrices one under another
    weight = np.asarray(gguf.quants.dequantize(rows, t.qtype), dtype=np.float32).reshape(t.shape)
    lora = plan.adapter.tensors[t.name]
    weight += np.float32(plan.scale) * (lora.b @ lora.a)  # an expert stack: per expert, B_e A_e
    return _quantizer(plan.types[t.name])(weight.reshape(-1, t.shape[-1]))


def _dequantizable(qtype: QT) -> bool:
    try:
        gguf.quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


@functools.cache
def _quantizer(qtype: QT) -> Callable[[np.ndarray], np.ndarray] | None:
    """float32 rows -> the type's bytes: gguf's numpy codec, else llama.cpp's; None when
    neither can write the type without an importance matrix."""
    try:
        gguf.quants.quantize(np.zeros((1, GGML_QUANT_SIZES[qtype][0]), np.float32), qtype)
        return lambda rows: gguf.quants.quantize(rows, qtype)
    except NotImplementedError:
        pass
    ggml = _ggml()
    if ggml.ggml_quantize_requires_imatrix(int(qtype)):
        return None
    return lambda rows: _ggml_quantize(ggml, rows, qtype)


def _ggml_quantize(ggml, rows: np.ndarray, qtype: QT) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n_rows, n_per_row = rows.shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    out = np.empty((n_rows, n_per_row // block_size * type_size), np.uint8)
    written = ggml.ggml_quantize_chunk(int(qtype), rows.ctypes.data, out.ctypes.data, 0, n_rows, n_per_row, None)
    assert written == out.nbytes, (qtype.name, written, out.nbytes)
    return out


@functools.cache
def _ggml():
    """llama.cpp's libggml as llama-cpp-python loaded it, with the signatures we call."""
    from retrograd.runtime.llamacpp import libggml  # here: only K-quant merges need llama.cpp loaded

    libggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    libggml.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
    ]
    libggml.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    libggml.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return libggml
