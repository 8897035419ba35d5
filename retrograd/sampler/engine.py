"""One llama.cpp model and one generation context, through the C API of llama-cpp-python.

The context holds `n_seq_max` sequences (seq ids 0..n_seq_max-1) of `n_ctx` positions each.
The KV cache is split (`kv_unified = false`): every sequence has its own stream of n_ctx
cells, filled from cell 0 in position order. So a sequence's cells, and the order in which
attention visits them, depend only on its own tokens, never on its neighbours in the
batch: that is what makes sampling reproducible whatever the concurrency. The price is that
sharing a prompt copies a whole stream (`llama_memory_seq_cp` across streams only copies
full buffers; for SmolLM2 at n_ctx 512 and f16 that is 12 MB), after which the copy is
trimmed to the shared prefix.

KV modes (retrograd-notes §3 `fast_sampling_context`, `kv_dtype`): "f16" halves KV memory
and runs flash attention (llama.cpp's AUTO: on wherever the backend has it); "f32" keeps
f32 cells and llama.cpp's plain attention, whose softmax and products stay in f32 (its
flash attention casts f32 K/V to f16, so "f32" with flash attention would sample exactly
the numbers "f16" does).

Split KV keeps a sequence's cells to itself, but not its numbers: how llama.cpp computes a
token row depends on the ubatch it lands in (one row or several, fewer or more than 64
query rows of a sequence, which ids are consecutive; see sampler.py, which therefore only
ever hands this class two shapes of batch). For Gemma-3 Q4_K_M a decode of 8 rows or more
was also measured to give each row slightly different logits than a smaller one (both KV
modes, llama-cpp-python 0.3.36 on CPU); the sampler's steps always have the same row count.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.errors import GGUFError
from retrograd.gguf.file import GGUFFile
from retrograd.runtime.llamacpp import C, gpu_devices, load_llama_model

# kv_dtype -> (ggml type of K and V, flash attention mode)
KV_MODES = {
    "f16": (C.GGML_TYPE_F16, C.LLAMA_FLASH_ATTN_TYPE_AUTO),
    "f32": (C.GGML_TYPE_F32, C.LLAMA_FLASH_ATTN_TYPE_DISABLED),
}
MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ


@dataclass(frozen=True)
class Feed:
    """Tokens of one sequence for one llama_decode, placed from position `start`."""

    seq_id: int
    start: int
    tokens: list[int]
    want_logits: bool  # logits of the last token
    pad: bool = False  # filler: its logits are computed (want_logits) but not copied out
    every_logits: bool = False  # logits of every token ([k, V]; scoring a prompt)


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp runs a model loaded with its default n_gpu_layers (-1: all): every
    layer (the blocks and the output layer) on the GPU devices it picks, else on the CPU."""

    devices: tuple[str, ...]  # empty: the CPU
    layers_offloaded: int
    layers: int  # the model's blocks plus its output layer

    @classmethod
    def for_model(cls, n_layer: int) -> Placement:
        devices = gpu_devices()
        return cls(devices, n_layer + 1 if devices else 0, n_layer + 1)

    def describe(self) -> str:
        return f"{', '.join(self.devices) or 'cpu'}, {self.layers_offloaded}/{self.layers} layers offloaded"


class Engine:
    def __init__(self, path: Path, *, n_ctx: int, n_seq_max: int, n_batch: int, kv_dtype: str, n_threads: int,
                 n_outputs: int = 0):
        self.path = Path(path)
        self.n_ctx, self.n_seq_max, self.n_batch = n_ctx, n_seq_max, n_batch
        self.model = load_llama_model(self.path, lambda: GGUFFile(self.path).tensors)
        if not self.model:
            raise GGUFError(f"{self.path}: llama.cpp cannot load this model")
        self.placement = Placement.for_model(C.llama_model_n_layer(self.model))
        # lfm2's conv layers: a sequence's state cannot be cut back to an earlier position
        self.recurrent = bool(C.llama_model_is_recurrent(self.model) or C.llama_model_is_hybrid(self.model))
        self.vocab = C.llama_model_get_vocab(self.model)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        self.eog_ids = frozenset(t for t in range(self.n_vocab) if C.llama_vocab_is_eog(self.vocab, t))
        params = _context_params(n_ctx, n_seq_max, n_batch, kv_dtype, n_threads, n_outputs)
        self.ctx = C.llama_init_from_model(self.model, params)
        if not self.ctx:
            C.llama_model_free(self.model)
            raise GGUFError(
                f"{self.path}: llama.cpp cannot create a context of {n_seq_max} x {n_ctx} tokens ({kv_dtype} KV)"
            )
        assert C.llama_n_ctx_seq(self.ctx) >= n_ctx, (C.llama_n_ctx_seq(self.ctx), n_ctx)
        self.memory = C.llama_get_memory(self.ctx)
        self.batch = C.llama_batch_init(n_batch, 0, 1)
        self._token = np.ctypeslib.as_array(self.batch.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(n_batch,))
        self._n_seq_id = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n_batch,))
        self._logits = np.ctypeslib.as_array(self.batch.logits, shape=(n_batch,))
        self._adapter = None

    def decode(self, feeds: list[Feed]) -> list[np.ndarray | None]:
        """One llama_decode over all feeds -> per feed, a copy of its last token's logits [V]
        (None without want_logits, or for a pad), or with every_logits those of all its
        tokens [k, V]."""
        assert self.ctx, "the sampler is closed"
        n = 0
        rows_at = []
        for f in feeds:
            k = len(f.tokens)
            self._token[n : n + k] = f.tokens
            self._pos[n : n + k] = np.arange(f.start, f.start + k)
            self._n_seq_id[n : n + k] = 1
            self._logits[n : n + k] = 0
            for i in range(n, n + k):
                self.batch.seq_id[i][0] = f.seq_id
            n += k
            if f.every_logits:
                self._logits[n - k : n] = 1
                rows_at.append(range(n - k, n))
                continue
            if f.want_logits:
                self._logits[n - 1] = 1
            rows_at.append(n - 1 if f.want_logits and not f.pad else None)
        assert 0 < n <= self.n_batch, n
        self.batch.n_tokens = n
        rc = C.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise GGUFError(f"{self.path}: llama_decode failed with status {rc} on a batch of {n} tokens")
        return [None if i is None else np.stack([self._row(j) for j in i]) if isinstance(i, range) else self._row(i)
                for i in rows_at]

    def _row(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()

    def keep(self, seq_id: int, n: int) -> bool:
        """Drop positions >= n of a sequence; False if llama.cpp cannot (then nothing is kept)."""
        if C.llama_memory_seq_rm(self.memory, seq_id, n, -1):
            return True
        C.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        return False

    def copy(self, src: int, dst: int) -> None:
        """Replace sequence dst by a copy of src (the buffer copy runs at the next decode)."""
        C.llama_memory_seq_rm(self.memory, dst, -1, -1)
        C.llama_memory_seq_cp(self.memory, src, dst, -1, -1)

    def clear(self) -> None:
        C.llama_memory_clear(self.memory, False)

    def set_adapter(self, adapter) -> None:
        """Make `adapter` (a llama_adapter_lora pointer, or None for the base) the only one applied."""
        if adapter is None:
            C.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            adapters = (C.llama_adapter_lora_p_ctypes * 1)(adapter)
            scales = (ctypes.c_float * 1)(1.0)
            C.llama_set_adapters_lora(self.ctx, adapters, 1, scales)

    def load_adapter(self, path: Path):
        assert self.model, "the sampler is closed"
        adapter = C.llama_adapter_lora_init(self.model, str(path).encode())
        if not adapter:
            raise GGUFError(f"{path}: llama.cpp refuses this LoRA adapter for {self.path.name}")
        return adapter

    def free_adapter(self, adapter) -> None:
        C.llama_adapter_lora_free(adapter)

    def close(self) -> None:
        if self.ctx:
            C.llama_batch_free(self.batch)
            C.llama_free(self.ctx)
            C.llama_model_free(self.model)  # also frees every adapter still loaded on it
            self.ctx = self.model = None


def _context_params(n_ctx: int, n_seq_max: int, n_batch: int, kv_dtype: str, n_threads: int, n_outputs: int):
    p = C.llama_context_default_params()
    p.n_ctx = n_ctx * n_seq_max  # split KV: llama.cpp gives each sequence n_ctx / n_seq_max
    p.n_seq_max = n_seq_max
    p.kv_unified = False
    p.n_batch = n_batch
    p.n_ubatch = min(n_batch, 512)
    p.n_outputs_max = max(n_seq_max, n_outputs)  # one logits row per sequence and decode, or n_outputs when scoring
    p.n_threads = p.n_threads_batch = n_threads
    kv_type, p.flash_attn_type = KV_MODES[kv_dtype]
    p.type_k = p.type_v = kv_type
    p.swa_full = True  # sliding-window layers keep every position, so a trimmed sequence can grow again
    p.no_perf = True
    return p
