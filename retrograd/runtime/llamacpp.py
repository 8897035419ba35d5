"""Process-wide setup every user of llama.cpp goes through: import llama_cpp from here.

- llama.cpp logs go nowhere unless RETROGRAD_LLAMA_LOG=1 (they would drown our output);
  with it they go to stderr through llama.cpp's own logger. Either way the process-wide log
  callback is native code, never a Python (ctypes) callback: llama.cpp keeps that pointer
  for the life of the process and logs while freeing models and contexts, and a ctypes
  callback dies with its module during interpreter teardown, so any llama.cpp object freed
  after that (or any log line from a thread or a C++ destructor at exit) would jump into
  freed memory: SIGSEGV, exit status 139, after all the work is done.
- `gpu_devices` names the GPUs this llama.cpp build can offload to (none for a CPU build),
  and `gpu_offload_warning` is the line a run prints when torch has a CUDA GPU but llama.cpp
  would sample on the CPU.
- On a CPU with AMX, llama.cpp built with -march=native (what `pip install
  llama-cpp-python` does) moves quantized weights into its AMX "extra" buffer. Built by GCC
  12 (Debian 12) that buffer's matmul dies on its first decode, and in a process where
  torch's bf16 matmuls use AMX too, on the first decode after one (SIGILL): see amx_check,
  which asks a child process, once per build and CPU, whether it works with the remedy
  applied here, the tiles configured before every llama_decode in this process (ours and
  llama_cpp.Llama's). bin/setup builds llama.cpp so that it does; there the AMX buffer
  decodes 16 sequences of a 0.5B Q4_0 model in 30 ms against CPU_REPACK's 64 (2-core Xeon).
  Where it does not, or with RETROGRAD_LLAMA_AMX=off, every model this process loads has
  the extra buffers turned off. A model loaded before this module is imported keeps them,
  so plain `import llama_cpp` users must import this first.
- Turning the extra buffers off also turns off the other one, CPU_REPACK, whose interleaved
  Q4_0/Q4_K layout and GEMM decode 16 sequences of a 0.5B Q4_0 model in 91 ms instead of
  137. `load_llama_model` then puts those weights back there by name (a tensor buffer
  override); it names only the weights CPU_REPACK has a layout for, since llama.cpp
  dereferences a missing layout while loading any other tensor placed there.
- Where weights go to CPU_REPACK or AMX, `load_llama_model` reads the file rather than
  mapping it: the repacked weights are copies, and a mapping would keep the file's pages
  of them resident as well.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as C
from llama_cpp._ggml import libggml

from retrograd.runtime import amx_check


def _native_silent_logger():
    """A log callback that does nothing, in native code that lives as long as the process.

    llama.cpp calls `callback(level, text, user_data)` and ignores the result. C's `abs` is
    such a function: it reads the first argument (the level, an int) and touches nothing
    else; the other two arguments are ignored, which every C calling convention we run on
    allows (arguments in registers or caller-cleaned stack). No Python runs on a log line,
    so nothing can be freed under llama.cpp at interpreter teardown."""
    libc = ctypes.CDLL(None) if os.name == "posix" else ctypes.cdll.msvcrt
    return ctypes.cast(libc.abs, C.llama_log_callback)


def _without_extra_buffers(default_params=C.llama_model_default_params):
    params = default_params()  # bound here, not looked up in this module's globals (gone at teardown)
    params.use_extra_bufts = False
    return params


def _with_tiles_configured(llama_decode, tiles):
    """llama_decode after loading ggml's AMX tile shapes on the caller's OpenMP team (every
    name bound here: a decode may come after interpreter teardown has cleared this module)."""
    def decode(ctx, batch, configure=tiles.configure_tiles, n_threads=C.llama_n_threads, n_batch_threads=C.llama_n_threads_batch):
        configure(max(n_threads(ctx), n_batch_threads(ctx)))
        return llama_decode(ctx, batch)

    return decode


AMX_BUILD = b"AMX_INT8 = 1" in C.llama_print_system_info()
AMX_MATMUL = False  # the quantized weights go to llama.cpp's AMX buffer
if AMX_BUILD:
    amx_check.request_amx()
    _tiles = amx_check.tiles() if os.environ.get("RETROGRAD_LLAMA_AMX") != "off" else None
    AMX_MATMUL = _tiles is not None and amx_check.amx_matmul_works(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so")
    if AMX_MATMUL:
        C.llama_decode = _with_tiles_configured(C.llama_decode, _tiles)  # also used by llama_cpp.Llama
    else:
        C.llama_model_default_params = _without_extra_buffers  # also used by llama_cpp.Llama

# This also replaces llama-cpp-python's own logger (a ctypes callback it installs when
# llama_cpp is imported, with the same teardown hazard). A NULL pointer selects llama.cpp's
# built-in stderr logger.
LOG_CALLBACK = C.llama_log_callback() if os.environ.get("RETROGRAD_LLAMA_LOG") else _native_silent_logger()
C.llama_log_set(LOG_CALLBACK, ctypes.c_void_p(0))

# ggml-backend.h: the device list every llama.cpp model load picks its devices from.
libggml.ggml_backend_dev_count.restype = ctypes.c_size_t
libggml.ggml_backend_dev_get.restype, libggml.ggml_backend_dev_get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libggml.ggml_backend_dev_type.restype, libggml.ggml_backend_dev_type.argtypes = ctypes.c_int, [ctypes.c_void_p]
for _text in (libggml.ggml_backend_dev_name, libggml.ggml_backend_dev_description):
    _text.restype, _text.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
_DEVICE_GPU, _DEVICE_IGPU = 1, 2  # enum ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL, META

REBUILD_HINT = (
    "bin/setup (with the CUDA toolkit's nvcc installed), or CMAKE_ARGS=-DGGML_CUDA=on pip install --force-reinstall "
    "--no-deps --no-cache-dir --no-binary llama-cpp-python 'llama-cpp-python<0.4'"
)


class _TensorOverride(ctypes.Structure):  # llama.h: struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# ggml-cpu/repack.cpp, x86 with AVX2: the 2-D types CPU_REPACK interleaves, rows a multiple of 8
_REPACKED_TYPES = ("Q4_0", "Q4_K")
# ggml-cpu/amx/common.h, qtype_has_amx_kernels: the types the AMX buffer holds
_AMX_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
_MATMUL_WEIGHT = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|attn_qkv|ffn_gate|ffn_up|ffn_down)\.weight")


def _repack_buffer_type() -> int | None:
    """CPU_REPACK, from the CPU backend's extra buffer types (None when this build has none)."""
    vp = ctypes.c_void_p
    libggml.ggml_backend_dev_by_type.restype, libggml.ggml_backend_dev_by_type.argtypes = vp, [ctypes.c_int]
    libggml.ggml_backend_dev_backend_reg.restype, libggml.ggml_backend_dev_backend_reg.argtypes = vp, [vp]
    libggml.ggml_backend_reg_get_proc_address.restype = vp
    libggml.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
    libggml.ggml_backend_buft_name.restype, libggml.ggml_backend_buft_name.argtypes = ctypes.c_char_p, [vp]
    cpu = libggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not cpu:
        return None
    address = libggml.ggml_backend_reg_get_proc_address(libggml.ggml_backend_dev_backend_reg(cpu), b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return None
    extra = ctypes.CFUNCTYPE(ctypes.POINTER(vp), vp)(address)(cpu)
    i = 0
    while extra and extra[i]:
        if libggml.ggml_backend_buft_name(extra[i]) == b"CPU_REPACK":
            return extra[i]
        i += 1
    return None


REPACK_BUFFER = _repack_buffer_type()


def load_llama_model(path: Path, read_tensors: Callable[[], Mapping]):
    """llama_model_load_from_file with this module's defaults. read_tensors: the file's tensor
    table (retrograd.gguf.file.GGUFFile.tensors), read where this build repacks weights. A
    file with weights CPU_REPACK or AMX holds is read rather than mapped, and where the extra
    buffers are off the CPU_REPACK ones are named to go there (see the module's docstring).
    NULL when llama.cpp refuses the file."""
    params = C.llama_model_default_params()
    copied = (_REPACKED_TYPES if REPACK_BUFFER is not None else ()) + (_AMX_TYPES if AMX_MATMUL else ())
    weights = {name: t.qtype.name for name, t in read_tensors().items()
               if _MATMUL_WEIGHT.fullmatch(name) and t.qtype.name in copied and len(t.shape) == 2
               and t.shape[0] % 8 == 0} if copied else {}
    keep = None
    named = [name for name, qtype in weights.items() if qtype in _REPACKED_TYPES]
    if AMX_BUILD and not AMX_MATMUL and named:  # the extra buffers are off: name the weights
        pattern = "^(" + "|".join(re.escape(n) for n in named) + ")$"
        keep = (_TensorOverride * 2)(_TensorOverride(pattern.encode(), REPACK_BUFFER), _TensorOverride(None, None))
        params.tensor_buft_overrides = ctypes.cast(keep, ctypes.c_void_p)
    if weights:
        # read, not mapped: a repacked weight is a copy, and a mapping keeps the file's pages
        # of it resident beside that copy (0.5B Q4_0 after a decode, raw llama.cpp: 494 MiB
        # RSS mapped, 310 read on a Zen 3 AVX2 build; the sampler 0.51 against 0.34 GiB on AMX)
        if "load_mode" in dict(type(params)._fields_):
            params.load_mode = C.LLAMA_LOAD_MODE_NONE
        else:  # llama-cpp-python before load_mode
            params.use_mmap = False
    model = C.llama_model_load_from_file(str(path).encode(), params)
    del keep  # read only while loading
    return model


def gpu_devices() -> tuple[str, ...]:
    """'NAME (description)' of each device a model load offloads to by default: every
    dedicated GPU, else the first integrated one (llama.cpp's rule); empty on a CPU build."""
    gpus, igpus = [], []
    for i in range(libggml.ggml_backend_dev_count()):
        dev = libggml.ggml_backend_dev_get(i)
        kind = libggml.ggml_backend_dev_type(dev)
        if kind in (_DEVICE_GPU, _DEVICE_IGPU):
            name = f"{libggml.ggml_backend_dev_name(dev).decode()} ({libggml.ggml_backend_dev_description(dev).decode()})"
            (gpus if kind == _DEVICE_GPU else igpus).append(name)
    return tuple(gpus or igpus[:1])


def gpu_offload_warning(torch_has_cuda: bool) -> str | None:
    """One line when torch trains on a CUDA GPU but this llama.cpp build samples on the CPU."""
    if not torch_has_cuda or C.llama_supports_gpu_offload():
        return None
    return (
        "warning: torch sees a CUDA GPU but this llama-cpp-python build has no GPU backend, so rollouts are "
        f"sampled on the CPU; rebuild it with CUDA: {REBUILD_HINT}"
    )


__all__ = ["C", "gpu_devices", "gpu_offload_warning", "llama_cpp", "load_llama_model"]
