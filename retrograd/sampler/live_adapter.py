"""The live LoRA: after each optimizer step the new weights go to llama.cpp as a file.

llama.cpp 0.3.36 can only load an adapter from a GGUF file, so a refresh is: write the
adapter with retrograd.gguf.adapter.write_adapter to memory-backed storage,
llama_adapter_lora_init, set it on the context as the only adapter, free the previous one.
The folder is /dev/shm when the machine has one, so nothing touches a disk; it is removed
when the sampler closes (or the process exits).

The file differs from an export in one way: its rank is padded with zeros to a multiple of
RANK_MULTIPLE, and alpha scaled to keep alpha / r. llama.cpp multiplies B [n_out, r] by
A x with its f32 GEMM (llamafile's sgemm) only when r is a multiple of the SIMD width (16
floats on AVX512, 8 on AVX2); below that, every output element is its own length-r dot
product. On AVX512, rank 8 made the adapter cost 15% of SmolLM2's batched decode; padded to
16, 4-7%.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.errors import GGUFError
from retrograd.gguf.adapter import LoRAWeights, adapter_tensors, check_shapes, write_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.runtime.llamacpp import C
from retrograd.sampler.engine import Engine

SHM = Path("/dev/shm")
RANK_MULTIPLE = 16 if b"AVX512 = 1" in C.llama_print_system_info() else 8


@dataclass(frozen=True)
class RefreshTiming:
    """Seconds spent in each part of one adapter refresh."""

    write_s: float  # write_adapter to the memory-backed file
    init_s: float  # llama_adapter_lora_init
    set_s: float  # llama_set_adapters_lora, then freeing the previous adapter

    @property
    def total_s(self) -> float:
        return self.write_s + self.init_s + self.set_s


class LiveAdapter:
    def __init__(self, engine: Engine):
        self.engine = engine
        base = GGUFFile(engine.path)
        self.arch = str(base.require("general.architecture"))
        self.base_shapes = {name: t.shape for name, t in base.tensors.items()}
        self.folder = Path(tempfile.mkdtemp(prefix="retrograd-adapter-", dir=SHM if SHM.is_dir() else None))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)
        self.file = self.folder / "adapter.gguf"
        self.current = None  # the llama_adapter_lora pointer applied now
        self._layout = None  # (alpha, names and shapes) of the file as last written whole
        self._views: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # its A and B data, memory-mapped

    def refresh(self, adapter, alpha: float | None) -> RefreshTiming:
        """adapter: a retrograd.model.lora.Adapter, {base weight name: LoRAWeights} (then alpha is
        required), or None for the base model."""
        t0 = time.perf_counter()
        if adapter is not None:
            self._write(*_tensors_and_alpha(adapter, alpha))
        t1 = time.perf_counter()
        loaded = self.engine.load_adapter(self.file) if adapter is not None else None
        t2 = time.perf_counter()
        self.engine.set_adapter(loaded)
        if self.current is not None:
            self.engine.free_adapter(self.current)
        self.current = loaded
        t3 = time.perf_counter()
        return RefreshTiming(t1 - t0, t2 - t1, t3 - t2)

    def _write(self, tensors: dict[str, LoRAWeights], alpha: float) -> None:
        """The adapter file, rank-padded (see padded_for_llama): written whole when its layout
        (alpha, names, shapes) is new, else only the float32 data of the first r ranks
        overwritten in place through a memory map (the same bytes; for rank 8 on SmolLM2 2 ms
        instead of 17). Safe because llama.cpp copies an adapter's tensors into its own buffers
        while loading it."""
        layout = (alpha, tuple((name, w.a.shape, w.b.shape) for name, w in tensors.items()))
        if layout == self._layout:
            for name, w in tensors.items():
                a, b = self._views[name]
                rank = w.a.shape[-2]
                a[..., :rank, :] = w.a
                b[..., :rank] = w.b
            return
        self._layout, self._views = None, {}  # the file is replaced: until it is mapped, nothing is written in place
        check_shapes(tensors, self.base_shapes)  # before padding, which assumes one rank
        padded, padded_alpha = padded_for_llama(tensors, alpha)
        write_adapter(self.file, padded, arch=self.arch, alpha=padded_alpha, base_shapes=self.base_shapes)
        written = GGUFFile(self.file)
        data = np.memmap(self.file, dtype=np.uint8, mode="r+")

        def view(name: str, shape: tuple[int, ...]) -> np.ndarray:
            info = written.tensors[name]
            return data[info.offset: info.offset + info.n_bytes].view(np.float32).reshape(shape)

        self._views = {name: (view(f"{name}.lora_a", w.a.shape), view(f"{name}.lora_b", w.b.shape))
                       for name, w in padded.items()}
        self._layout = layout

    def close(self) -> None:
        """Detach and free the adapter (before the model goes) and remove the folder."""
        if self.current is not None and self.engine.ctx:
            self.engine.set_adapter(None)
            self.engine.free_adapter(self.current)
        self.current = None
        self._cleanup()


def padded_for_llama(tensors: dict[str, LoRAWeights], alpha: float) -> tuple[dict[str, LoRAWeights], float]:
    """The same adapter at the next multiple of RANK_MULTIPLE: A gains zero rows, B zero
    columns, and alpha grows with r, so alpha / r and every product are unchanged."""
    rank = next(iter(tensors.values())).a.shape[-2] if tensors else 0
    padded = -(-rank // RANK_MULTIPLE) * RANK_MULTIPLE
    if padded == rank:
        return tensors, alpha
    out = {}
    for name, w in tensors.items():
        a = np.zeros(w.a.shape[:-2] + (padded, w.a.shape[-1]), np.float32)
        b = np.zeros(w.b.shape[:-1] + (padded,), np.float32)
        a[..., :rank, :] = w.a
        b[..., :rank] = w.b
        out[name] = LoRAWeights(a, b)
    return out, alpha * padded / rank


def _tensors_and_alpha(adapter, alpha: float | None) -> tuple[dict[str, LoRAWeights], float]:
    if isinstance(adapter, dict):
        if alpha is None:
            raise GGUFError("sampler.set_adapter: alpha is required when the adapter is given as tensors")
        return adapter, float(alpha)
    return adapter_tensors(adapter), float(adapter.alpha if alpha is None else alpha)
