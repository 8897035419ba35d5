"""Process-wide setup every user of llama.cpp goes through: import llama_cpp from here.

- llama.cpp logs go nowhere unless RETROGRAD_LLAMA_LOG=1 (they would drown our output).
- On a CPU with AMX, llama.cpp built with -march=native (what `pip install
  llama-cpp-python` does) moves quantized weights into its AMX "extra" buffers, whose
  matmul dies with SIGILL on tilezero (seen on an AVX10/AMX Xeon VM where oneDNN's AMX
  works). There we ask the kernel for AMX tile state and turn the extra buffers off for
  every model this process loads; llama.cpp then uses its plain AVX-512 kernels.
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


@C.llama_log_callback
def _silent(level, text, user_data):  # noqa: ARG001
    pass


def _without_extra_buffers():
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


_default_model_params = C.llama_model_default_params
AMX_BUILD = b"AMX_INT8 = 1" in C.llama_print_system_info()
if AMX_BUILD:
    _request_amx()
    C.llama_model_default_params = _without_extra_buffers  # also used by llama_cpp.Llama

if not os.environ.get("RETROGRAD_LLAMA_LOG"):
    C.llama_log_set(_silent, ctypes.c_void_p(0))

__all__ = ["llama_cpp", "C"]
