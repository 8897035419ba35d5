"""Does this llama.cpp build's AMX matmul work on this machine? Asked once per build and CPU.

Two things stand in its way:
- GCC 12's `_tile_loadconfig` (amxtileintrin.h) tells the compiler that `ldtilecfg` reads 8
  bytes of its 64-byte tile configuration, so GCC drops the stores of the tile shapes and
  ggml's AMX matmul loads a configuration whose unused entries are stack garbage: the CPU
  refuses it (#GP: SIGSEGV on the first decode). `pip install llama-cpp-python` on Debian
  12 builds exactly that; bin/setup builds with `-fno-dse -fno-tree-dse`, which keeps them.
- ggml configures a thread's tiles once, on its first AMX matmul, and oneDNN (torch's bf16
  matmuls, on the same OpenMP threads) releases them after each of its own: the next decode
  dies with SIGILL on `tilezero`. So before every llama_decode, `configure_tiles` loads
  ggml's tile shapes on each thread of the caller's OpenMP team (the team ggml's decode
  then runs on). A decode on a thread of its own instead would need a second OpenMP pool,
  and with more OpenMP threads than cores libgomp stops spinning at its barriers: GRPO's
  training ran 25% slower that way.
A working AMX buffer decodes 16 sequences of a 0.5B Q4_0 model in 30 ms where CPU_REPACK
takes 64 (2-core Xeon).

The question is answered by a child process (a crash must not take the caller with it):
`python -m retrograd.runtime.amx_check` writes a one-layer Q4_0 llama and decodes 16
sequences with the extra buffers off, then on (the weights in the AMX buffer, which
llama.cpp's log must confirm), releasing the team's tiles before each decode as oneDNN
would and configuring them as the caller will; it prints `ok` when the logits agree. The
verdict is cached beside the C libraries, keyed by the CPU backend library's path, size
and time, by the CPU and by the source of `configure_tiles`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from retrograd.runtime import native

TILES_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

/* ggml-cpu/amx/mmq.cpp's shapes: tmm0-1 B (8 x 64 bytes), tmm2-3 A (16 x 32), tmm4-7 C (16 x 64).
   Constant data: GCC 12 cannot drop stores that do not exist. */
static const struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} GGML_TILES = {1, 0, {0}, {64, 64, 32, 32, 64, 64, 64, 64}, {8, 8, 16, 16, 16, 16, 16, 16}};

__attribute__((target("amx-tile"))) void configure_tiles(int n_threads) {
    #pragma omp parallel num_threads(n_threads)
    _tile_loadconfig(&GGML_TILES);
}

__attribute__((target("amx-tile"))) void release_tiles(int n_threads) {
    #pragma omp parallel num_threads(n_threads)
    _tile_release();
}
"""

# one block: 16 sequences are the AMX kernel's rows (one sequence takes the AVX512-VNNI path);
# widths that are multiples of the kernel's 64-column and 32-row blocks
_EMBD, _FF, _HEADS, _VOCAB, _SEQUENCES = 256, 512, 4, 64, 16
# of the largest logit: both sides quantize activations to Q8_0, only the summation order
# differs (measured 3e-8 of logits up to 0.26); a wrong tile shape is off by the logits' size
_LOGIT_TOLERANCE = 1e-3


def _write_model(path: Path) -> None:
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("amx-check")
    w.add_context_length(64)
    w.add_embedding_length(_EMBD)
    w.add_block_count(1)
    w.add_feed_forward_length(_FF)
    w.add_head_count(_HEADS)
    w.add_head_count_kv(_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("none")  # llama.cpp adds vocab_size dummy tokens: no tokenizer needed
    w.add_vocab_size(_VOCAB)

    def put(name: str, shape: tuple[int, ...], qtype: QT = QT.F32) -> None:
        values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if qtype == QT.F32:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    put("token_embd.weight", (_VOCAB, _EMBD))
    put("output_norm.weight", (_EMBD,))
    put("output.weight", (_VOCAB, _EMBD))
    put("blk.0.attn_norm.weight", (_EMBD,))
    put("blk.0.ffn_norm.weight", (_EMBD,))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        put(f"blk.0.{name}.weight", (_EMBD, _EMBD), QT.Q4_0)
    put("blk.0.ffn_gate.weight", (_FF, _EMBD), QT.Q4_0)
    put("blk.0.ffn_up.weight", (_FF, _EMBD), QT.Q4_0)
    put("blk.0.ffn_down.weight", (_EMBD, _FF), QT.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def request_amx() -> None:
    """Ask Linux for AMX tile state for this process (it traps the first use otherwise)."""
    if sys.platform == "linux" and platform.machine() == "x86_64":
        try:
            ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        except (OSError, AttributeError):
            pass  # no AMX or no permission: llama.cpp then has no AMX code to run either


def tiles():
    """The library with configure_tiles(n_threads) and release_tiles(n_threads), or None."""
    return native.load("amx-tiles", TILES_SOURCE)


def _logits(C, path: Path, extra_buffers: bool, team=None) -> list[float]:
    params = C.llama_model_default_params()
    params.use_extra_bufts = extra_buffers
    model = C.llama_model_load_from_file(str(path).encode(), params)
    cparams = C.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_seq_max = 64, 64, _SEQUENCES
    cparams.n_threads = cparams.n_threads_batch = 2
    ctx = C.llama_init_from_model(model, cparams)
    batch = C.llama_batch_init(_SEQUENCES, 0, _SEQUENCES)
    out: list[float] = []
    for pos in range(2):
        batch.n_tokens = _SEQUENCES
        for i in range(_SEQUENCES):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = (i * 7 + pos) % _VOCAB, pos, 1, 1
            batch.seq_id[i][0] = i
        if team is not None:  # what oneDNN leaves behind, then what the caller does
            team.release_tiles(2)
            team.configure_tiles(2)
        if C.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        out += [C.llama_get_logits_ith(ctx, i)[v] for i in range(_SEQUENCES) for v in range(_VOCAB)]
    return out


def main() -> None:
    """The child: exits 0 printing `ok` when the AMX buffer holds the weights and agrees."""
    request_amx()
    import llama_cpp.llama_cpp as C

    team = tiles()
    if team is None:
        print("the tile configuration helper could not be built")
        sys.stdout.flush()
        os._exit(0)
    log: list[bytes] = []
    keep = C.llama_log_callback(lambda level, text, data: log.append(text or b""))
    C.llama_log_set(keep, None)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "amx-check.gguf"
        _write_model(path)
        plain = _logits(C, path, extra_buffers=False)
        amx = _logits(C, path, extra_buffers=True, team=team)
    if not any(b"AMX model buffer" in line for line in log):
        print("the weights did not go to the AMX buffer")
    else:
        gap = max(abs(a - b) for a, b in zip(amx, plain))
        print("ok" if gap <= _LOGIT_TOLERANCE * max(map(abs, plain)) else f"logits differ by {gap:.3g}")
    sys.stdout.flush()
    os._exit(0)  # no teardown: llama.cpp would log into a dead Python callback


def _verdict_file(library: Path) -> Path:
    stat = library.stat()
    key = hashlib.sha256(f"{library.resolve()} {stat.st_size} {stat.st_mtime_ns} {native.cpu()} {TILES_SOURCE}".encode()).hexdigest()[:16]
    return native.cache_dir() / f"llama-amx-{key}"


def amx_matmul_works(library: Path) -> bool:
    """The cached verdict for `library` (llama.cpp's CPU backend) on this CPU, asked of a
    child process the first time (every time where the library is not where we look)."""
    try:
        verdict = _verdict_file(library)
        return verdict.read_text().strip() == "ok"
    except OSError:
        pass
    try:
        child = subprocess.run([sys.executable, "-m", "retrograd.runtime.amx_check"], capture_output=True, text=True, timeout=120)
        answer = child.stdout.strip().splitlines()[-1:] if child.returncode == 0 else [f"child exited {child.returncode}"]
    except subprocess.TimeoutExpired:
        answer = ["child timed out"]
    try:
        verdict = _verdict_file(library)
        verdict.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=verdict.parent, delete=False) as tmp:
            tmp.write((answer or ["no answer"])[0] + "\n")
        os.replace(tmp.name, verdict)
    except OSError:
        pass  # a read-only cache, or no library where we look: ask again next time
    return answer == ["ok"]


if __name__ == "__main__":
    main()
