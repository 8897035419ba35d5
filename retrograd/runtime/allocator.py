"""The C allocator: jemalloc where the system has it, since glibc's heap keeps what training frees.

A pass allocates activations whose sizes change with every micro-batch's token count and
frees them again. glibc's malloc raises its mmap threshold as it goes, so these land in its
main heap, which keeps the freed pages resident and grows from step to step: quantized SFT on
a 1.5B Q4_0 llama held 3.8 GiB of free heap beside 0.3 GiB in use after 4 steps. With
jemalloc preloaded the same runs peaked at 0.56-0.78x the memory at the same speed (Xeon,
README, "Speed and memory beside TRL"). It has to be in place before the process's first malloc, so the command
line restarts itself once with LD_PRELOAD set (`restart_on_jemalloc`); the variable is
removed again at once, so reward scripts, sandboxes and tools start with the user's own
environment. RETROGRAD_ALLOCATOR=system keeps glibc's malloc; an LD_PRELOAD of the user's
own is left alone.

jemalloc runs with `muzzy_decay_ms:-1` (MALLOC_CONF, added and removed like LD_PRELOAD; a
MALLOC_CONF of the user's own replaces it). By default it hands pages freed for 10 s back with
MADV_DONTNEED, and the next pass faults them in again, zeroed by the kernel: an eighth of a
0.5B bf16 SFT step on a 2-core Xeon (1.00 -> 0.87 s) and of a GRPO update's training. With the
setting those pages are MADV_FREE'd instead, which the kernel takes back only when it needs
the memory, and jemalloc reuses them without a fault; they count in the RSS until taken (peak
+2%, and the RSS between steps stays at the peak).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from functools import cache
from pathlib import Path

from retrograd.errors import ConfigError

CHOICE_ENV = "RETROGRAD_ALLOCATOR"  # "jemalloc" (the default: where found) or "system"
RESTARTED_ENV = "RETROGRAD_PRELOADED"  # set for the restarted process: the variables it added, comma-separated
SETTINGS = "muzzy_decay_ms:-1"  # jemalloc's MALLOC_CONF: see the module docstring


def chose_system() -> bool:
    """Whether RETROGRAD_ALLOCATOR says `system`; a value other than system or jemalloc is an error."""
    choice = os.environ.get(CHOICE_ENV, "jemalloc").strip().lower()
    if choice not in ("jemalloc", "system"):
        raise ConfigError(f"{CHOICE_ENV}={os.environ[CHOICE_ENV]}: expected jemalloc or system")
    return choice == "system"


@cache
def jemalloc_library() -> str | None:
    """The jemalloc this machine would preload (e.g. `libjemalloc.so.2`, Debian's libjemalloc2),
    or None: not installed, or RETROGRAD_ALLOCATOR=system."""
    if sys.platform != "linux" or chose_system():
        return None  # LD_PRELOAD is the Linux loader's
    return ctypes.util.find_library("jemalloc")


def preload_env() -> dict[str, str]:
    """What a child process's environment needs to run on jemalloc as `retrograd train` would
    (preflight's probes, so they measure the run's allocator): empty where it would not."""
    library = jemalloc_library()
    if library is None or os.environ.get("LD_PRELOAD"):
        return {}
    return {"LD_PRELOAD": library} | ({} if "MALLOC_CONF" in os.environ else {"MALLOC_CONF": SETTINGS})


def restart_on_jemalloc() -> None:
    """Re-execute this command (same pid, arguments and environment) with jemalloc preloaded,
    once; in the restarted process remove the variables it added (jemalloc has read them by
    then). Returns where nothing is to be done or the exec fails (the command then runs on
    glibc's malloc)."""
    added = os.environ.pop(RESTARTED_ENV, None)
    if added is not None:
        for name in added.split(","):
            os.environ.pop(name, None)
        return
    env = preload_env()
    if not env:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], os.environ | env | {RESTARTED_ENV: ",".join(env)})
    except OSError:
        return


def loaded_jemalloc() -> str | None:
    """The jemalloc library this process runs on (`libjemalloc.so.2`), or None."""
    try:
        libraries = {line.rsplit("/", 1)[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "/" in line}
    except OSError:
        return None
    return min((name for name in libraries if "jemalloc" in name), default=None)


def hands_back_freed_memory() -> bool:
    """Whether what a pass frees leaves the process rather than staying in its heap: on
    jemalloc, not on glibc's malloc (the module docstring). Merging small micro-batches into
    larger passes (model/activation_memory.py) lowers live memory, but glibc's heap keeps the
    larger passes' freed blocks, so there it can raise what the process takes."""
    return loaded_jemalloc() is not None


def current() -> str:
    """The allocator this process runs on, for the start-up lines."""
    preloaded = loaded_jemalloc()
    if preloaded:
        return f"jemalloc ({preloaded})"
    if chose_system():
        return f"system malloc ({CHOICE_ENV}=system)"
    if jemalloc_library() is None:
        return "system malloc (no jemalloc found: installing libjemalloc2 lowers a run's peak memory)"
    return "system malloc"
