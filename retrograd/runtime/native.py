"""Small C libraries for the CPU, built once per machine and called through ctypes.

A library is compiled with the system C compiler (a fraction of a second) into
$XDG_CACHE_HOME/retrograd (or ~/.cache/retrograd) for this machine's CPU, named by a hash of
its source, the flags and the CPU's features, and written atomically so concurrent processes
agree. Without a compiler, or with $RETROGRAD_NO_COMPILE set, `load` returns None and callers
use torch. OpenMP binds to the libgomp torch has already loaded, so torch.set_num_threads
governs it too. `-ffp-contract=off` keeps the compiler from fusing a multiply and an add, so a
loop that does torch's float operations in torch's order gives torch's bits; a library that
does not aim for torch's bits asks for fused ones (`load(..., fma=True)`): the gated product's
rank-r sums are half the instructions then (backward 15% faster on a Xeon).
`-fno-trapping-math` changes no value: it lets GCC turn a float comparison in a loop (a
clamp, a select) into a vector blend on AVX2, where it otherwise keeps the loop scalar
(AVX-512 has masks and vectorizes either way). On a Zen 3 EPYC the FFN's gated product
(kernels/gated.py) then took half the time forward and three quarters backward.
`-fno-thread-jumps` changes no value either: GCC 12 threads exp's clamp (an argument above 88)
into a path of its own, folds that path's sigmoid to a subnormal constant and, vectorizing,
multiplies every lane by it, so every vector of the gated product's forward took a microcode
assist: 7.1 instead of 3.2 ms per layer in 0.5B bf16 SFT on a 2-core Xeon. clang refuses that
flag, so it goes only to GCC.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-std=c11")
GCC_FLAGS = ("-fno-thread-jumps",)
NATIVE = ("-march=native",)
FUSED = "-ffp-contract=fast"  # after FLAGS' -ffp-contract=off, which it overrides

# C helpers the libraries share: bfloat16 in and out, rounded as torch rounds
BF16 = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* torch's float -> bfloat16: round to nearest even; NaN as torch's scalar conversion writes it */
static inline uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
"""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "retrograd"


def compiler() -> str | None:
    if os.environ.get("RETROGRAD_NO_COMPILE"):
        return None
    return next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)), None)


def cpu() -> str:
    """What -march=native compiles for: the first CPU's model and feature flags (Linux), else
    the platform's processor name. Part of a library's name, so a cache directory shared by
    machines with other CPUs never hands one a library with instructions it lacks."""
    try:
        with open("/proc/cpuinfo") as info:
            return "".join(line for line in itertools.islice(info, 40) if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def is_gcc(cc: str) -> bool:
    """Whether `cc` is GCC rather than clang (which `cc` and `gcc` can also name, as on macOS)."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "clang" not in version.lower()


def build(stem: str, source: str, cc: str, fma: bool = False) -> Path:
    """`source` compiled for this CPU (-march=native: vector code the machine has, e.g.
    AVX-512 on a Xeon), or for the architecture's baseline where the compiler refuses that."""
    fused = (FUSED,) if fma else ()
    key = hashlib.sha256((source + " ".join(FLAGS + GCC_FLAGS + NATIVE + fused) + cpu()).encode()).hexdigest()[:16]
    lib = cache_dir() / f"{stem}-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, built = Path(tmp) / f"{stem}.c", Path(tmp) / lib.name
        src.write_text(source)
        flags = FLAGS + (GCC_FLAGS if is_gcc(cc) else ()) + fused
        try:
            subprocess.run([cc, *flags, *NATIVE, "-o", str(built), str(src)], check=True, capture_output=True)
        except subprocess.CalledProcessError:
            subprocess.run([cc, *flags, "-o", str(built), str(src)], check=True, capture_output=True)
        os.replace(built, lib)
    return lib


def load(stem: str, source: str, *, fma: bool = False) -> ctypes.CDLL | None:
    """The library built from `source` (with fused multiply-adds if `fma`), or None where it
    cannot be built or loaded (no compiler, no OpenMP headers, a read-only cache, ...)."""
    cc = compiler()
    if cc is None:
        return None
    try:
        return ctypes.CDLL(str(build(stem, source, cc, fma)))
    except (OSError, subprocess.CalledProcessError):
        return None
