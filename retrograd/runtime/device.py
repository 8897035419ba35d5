"""Which device torch trains on: `auto` (a CUDA GPU when torch sees one, else the CPU),
`cpu`, or `gpu` (an error when there is none)."""

from __future__ import annotations

import platform

import psutil
import torch

from retrograd.errors import DeviceError

DEVICE_CHOICES = ("auto", "cpu", "gpu")


def resolve_device(name: str = "auto") -> torch.device:
    if name not in DEVICE_CHOICES:
        raise DeviceError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    has_gpu = torch.cuda.is_available()
    if name == "gpu" and not has_gpu:
        raise DeviceError("device gpu: torch sees no CUDA GPU on this machine (use --device cpu or auto)")
    return torch.device("cuda:0" if has_gpu and name != "cpu" else "cpu")


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{device} ({p.name}, {p.total_memory / 2**30:.0f} GiB)"
    return f"cpu ({torch.get_num_threads()} threads of {psutil.cpu_count()} logical cores, {cpu_name()})"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def off_device(device: torch.device, *, sampling: bool) -> list[str]:
    """What would fall back to the CPU when training on a GPU: preflight's report, and
    training.require_gpu_resident's check at the start of a run (`sampling`: the run
    generates rollouts with llama.cpp). Nothing when the device is the CPU itself."""
    from retrograd.runtime.llamacpp import C  # here: asking loads llama.cpp, which choosing a device does not need

    if device.type != "cpu" and sampling and not C.llama_supports_gpu_offload():
        return ["rollout generation (this llama-cpp-python build has no GPU backend: llama.cpp samples on the CPU)"]
    return []
