"""The llama.cpp LoRA adapter GGUF: what `llama-cli --lora adapter.gguf` loads.

Layout (llama.cpp src/llama-adapter.cpp, convert_lora_to_gguf.py): `general.type =
"adapter"`, `general.architecture` = the base's, `adapter.type = "lora"`,
`adapter.lora.alpha` as float32, and for each adapted base weight `<name>` exactly two
tensors `<name>.lora_a` (numpy shape [r, n_in]) and `<name>.lora_b` ([n_out, r]); nothing
else. A stack of expert matrices [n_expert, n_out, n_in] (ffn_*_exps) gets a pair per
expert, stacked the same way: lora_a [n_expert, r, n_in], lora_b [n_expert, n_out, r]
(llama.cpp's build_lora_mm_id multiplies them with ggml_mul_mat_id, expert by expert).
llama.cpp scales by alpha / r with r read from the tensor shapes. GGUF Q/K rows are
already in llama.cpp's rotary layout, and our LoRA trains on those rows directly, so B is
written as trained: never permuted.

llama-cpp-python 0.3.36 crashes on an adapter whose shapes do not fit the base, so every
shape is checked against the base model before anything is written.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from retrograd.errors import GGUFError
from retrograd.gguf.file import GGUFFile

ADAPTER_DTYPES = {"f32": np.float32, "f16": np.float16}


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted weight, as exported: A [r, n_in], B [n_out, r] (an expert stack: [n_expert, ...] each)."""

    a: np.ndarray
    b: np.ndarray


def adapter_tensors(adapter) -> dict[str, LoRAWeights]:
    """An in-memory retrograd.model.lora.Adapter -> numpy float32 tensors by base weight name."""
    import torch  # here: `retrograd merge` reads adapters in a process that never loads torch (200 MB)

    out = {}
    for name, layer in adapter.layers.items():
        with torch.no_grad():
            out[name] = LoRAWeights(layer.lora_a.detach().float().cpu().numpy(), layer.lora_b.detach().float().cpu().numpy())
    return out


def check_shapes(tensors: dict[str, LoRAWeights], base_shapes: dict[str, tuple[int, ...]]) -> int:
    """Every pair fits its base weight [n_out, n_in] (or expert stack [n_expert, n_out, n_in])
    and all share one rank of at least 1; returns the rank (0: no tensors)."""
    ranks = set()
    for name, w in tensors.items():
        if name not in base_shapes:
            raise GGUFError(f"adapter weight {name} does not exist in the base model")
        if len(base_shapes[name]) not in (2, 3):
            raise GGUFError(
                f"adapter weight {name}: the base's {list(base_shapes[name])} is not a matrix or an expert stack"
            )
        *stack, n_out, n_in = base_shapes[name]
        r = w.a.shape[-2] if w.a.ndim >= 2 else 0
        if w.a.shape != (*stack, r, n_in) or w.b.shape != (*stack, n_out, r) or r == 0:
            lead = "".join(f"{n}, " for n in stack)
            raise GGUFError(
                f"adapter weight {name}: lora_a {list(w.a.shape)} / lora_b {list(w.b.shape)} do not fit the base "
                f"{list(base_shapes[name])} (expected [{lead}r, {n_in}] and [{lead}{n_out}, r], r >= 1)"
            )
        ranks.add(r)
    if len(ranks) > 1:
        raise GGUFError(f"adapter weights have different ranks {sorted(ranks)}")
    return ranks.pop() if ranks else 0


def check_fits(loaded: AdapterFile, path: Path, base_name: str, arch: str, base_shapes: dict[str, tuple[int, ...]]) -> int:
    """Refuse, in one line naming both files, an adapter not made for this base: another
    architecture, no LoRA pair, or a pair that does not fit its weight [n_out, n_in] in
    base_shapes. Returns the rank."""
    if loaded.arch != arch:
        raise GGUFError(f"adapter {path}: made for architecture {loaded.arch!r}, but the base model {base_name} is {arch!r}")
    if not loaded.tensors:
        raise GGUFError(f"adapter {path}: holds no LoRA tensors")
    try:
        return check_shapes(loaded.tensors, base_shapes)
    except GGUFError as e:
        raise GGUFError(f"adapter {path} does not fit the base model {base_name}: {e}") from None


def read_fitting_adapter(path: Path, base: GGUFFile) -> AdapterFile:
    """The adapter at `path`, checked against the base GGUF before llama.cpp (which crashes
    on shapes that do not fit) or a merge sees it."""
    if not path.is_file():
        raise GGUFError(f"adapter {path}: no such file")
    loaded = read_adapter(path)
    shapes = {name: tuple(t.shape) for name, t in base.tensors.items() if len(t.shape) in (2, 3)}  # 3: expert stacks
    check_fits(loaded, path, base.path.name, base.get_str("general.architecture"), shapes)
    return loaded


def write_adapter(
    path: str | os.PathLike,
    tensors: dict[str, LoRAWeights],
    *,
    arch: str,
    alpha: float,
    base_shapes: dict[str, tuple[int, ...]],
    dtype: str = "f32",
    name: str = "retrograd LoRA",
) -> Path:
    """Write atomically: a temporary file in the same folder, renamed over `path`."""
    check_shapes(tensors, base_shapes)
    path = Path(path)
    np_dtype = ADAPTER_DTYPES[dtype]
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_name(name)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for weight_name, t in tensors.items():
            w.add_tensor(f"{weight_name}.lora_a", np.ascontiguousarray(t.a, dtype=np_dtype))
            w.add_tensor(f"{weight_name}.lora_b", np.ascontiguousarray(t.b, dtype=np_dtype))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@dataclass(frozen=True)
class AdapterFile:
    arch: str
    alpha: float
    tensors: dict[str, LoRAWeights]

    @property
    def rank(self) -> int:
        return next(iter(self.tensors.values())).a.shape[-2] if self.tensors else 0


def read_adapter(path: str | os.PathLike) -> AdapterFile:
    """Read a llama.cpp LoRA GGUF (ours or from convert_lora_to_gguf.py)."""
    f = GGUFFile(path)
    kind, adapter_type = f.get_str("general.type"), f.get_str("adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise GGUFError(f"{f.path}: not a LoRA adapter (general.type={kind!r:.64}, adapter.type={adapter_type!r:.64})")
    alpha = f.get_float("adapter.lora.alpha", 0.0)
    if not math.isfinite(alpha):
        raise GGUFError(f"{f.path}: adapter.lora.alpha is {alpha}, expected a finite number")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, t in f.tensors.items():
        base, _, suffix = name.rpartition(".")
        if suffix not in ("lora_a", "lora_b"):
            raise GGUFError(f"{f.path}: unexpected tensor {name!r} in a LoRA adapter")
        try:
            values = np.asarray(gguf.quants.dequantize(t.data, t.qtype), dtype=np.float32).reshape(t.shape)
        except NotImplementedError:
            raise GGUFError(f"{f.path}: tensor {name!r} has type {t.qtype.name}, which cannot be dequantized") from None
        pairs.setdefault(base, {})[suffix] = values
    tensors = {}
    for base, p in pairs.items():
        if set(p) != {"lora_a", "lora_b"}:
            raise GGUFError(f"{f.path}: {base} has only {', '.join(p)}")
        tensors[base] = LoRAWeights(p["lora_a"], p["lora_b"])
    return AdapterFile(str(f.get_str("general.architecture")), alpha, tensors)
