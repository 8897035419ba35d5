"""Process-wide setup every user of llama.cpp goes through: import llama_cpp from here.

- llama.cpp logs go nowhere unless RETROGRAD_LLAMA_LOG=1 (they would drown our output);
  with it they go to stderr through llama.cpp's own logger. Either way the process-wide log
  callback is native code, never a Python (ctypes) callback: llama.cpp keeps that pointer
  for the life of the process and logs while freeing models and contexts, and a ctypes
  callback dies with its module during interpreter teardown, so any llama.cpp object freed
  after that (or any log line from a thread or a C++ destructor at exit) would jump into
  freed memory: SIGSEGV, exit status 139, after all the work is done.
- On a CPU with AMX, llama.cpp built with -march=native (what `pip install
  llama-cpp-python` does) moves quantized weights into its AMX "extra" buffers, whose
  matmul dies with SIGILL on tilezero (seen on an AVX10/AMX Xeon VM where oneDNN's AMX
  works). There we ask the kernel for AMX tile state and turn the extra buffers off for
  every model this process loads; llama.cpp then uses its plain AVX-512 kernels. A model
  loaded before this module is imported keeps the AMX buffers: on that VM its first decode
  dies with SIGSEGV on ldtilecfg, so plain `import llama_cpp` users must import this first.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import llama_cpp
import llama_cpp.llama_cpp as C

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _request_amx() -> None:
    if sys.platform == "linux" and platform.machine() == "x86_64":
        try:
            ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        except (OSError, AttributeError):
            pass  # no AMX or no permission: llama.cpp then has no AMX code to run either


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


AMX_BUILD = b"AMX_INT8 = 1" in C.llama_print_system_info()
if AMX_BUILD:
    _request_amx()
    C.llama_model_default_params = _without_extra_buffers  # also used by llama_cpp.Llama

# This also replaces llama-cpp-python's own logger (a ctypes callback it installs when
# llama_cpp is imported, with the same teardown hazard). A NULL pointer selects llama.cpp's
# built-in stderr logger.
LOG_CALLBACK = C.llama_log_callback() if os.environ.get("RETROGRAD_LLAMA_LOG") else _native_silent_logger()
C.llama_log_set(LOG_CALLBACK, ctypes.c_void_p(0))

__all__ = ["llama_cpp", "C"]
