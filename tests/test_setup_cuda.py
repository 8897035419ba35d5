"""CUDA where there is a GPU: bin/setup's choice of llama.cpp backend (with fake nvidia-smi and
nvcc on PATH, in --dry-run mode on a copy of the script), the run-start warning when torch has
CUDA but llama.cpp does not, where the sampler runs, and benchmarks/gpu_check.sh's refusal
on a machine without a GPU. The GPU path itself needs a GPU: benchmarks/gpu_check.sh."""

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from retrograd.runtime.llamacpp import C, gpu_devices, gpu_offload_warning

REPO = Path(__file__).resolve().parent.parent
GPU_LINE = "GPU 0: NVIDIA H200 (UUID: GPU-0)"
# on x86 llama.cpp is built keeping the AMX tile configuration's stores (retrograd/runtime/amx_check.py)
FLAGS = "+fno-dse" if platform.machine() == "x86_64" else ""


def fake_tool(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / name
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)


@pytest.fixture
def checkout(tmp_path):
    """bin/setup and pyproject.toml alone, so nothing touches this checkout's .venv."""
    (tmp_path / "bin").mkdir()
    shutil.copy(REPO / "bin" / "setup", tmp_path / "bin" / "setup")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def setup_dry_run(checkout: Path, *args, gpu=False, nvcc=False, **env):
    fake = checkout / "fake-bin"
    fake.mkdir(exist_ok=True)
    if gpu:
        fake_tool(fake, "nvidia-smi", f'echo "{GPU_LINE}"')
    if nvcc:
        fake_tool(fake, "nvcc", "echo nvcc")
    environment = {
        "PATH": f"{fake}:/usr/bin:/bin",
        "HOME": str(checkout),
        "CUDA_HOME": str(checkout / "no-cuda"),
        "PYTHON": "/bin/false",  # creating a venv fails loudly instead of running
    } | env
    return subprocess.run(
        [str(checkout / "bin" / "setup"), "--dry-run", *args],
        cwd=checkout, env=environment, capture_output=True, text=True, timeout=60,
    )


def commands(result) -> list[str]:
    return [line.removeprefix("would run: ") for line in result.stdout.splitlines() if line.startswith("would run: ")]


def llama_build(result) -> str | None:
    return next((c for c in commands(result) if "CMAKE_ARGS=" in c), None)


def cuda_build(result) -> str | None:
    build = llama_build(result)
    return build if build and "-DGGML_CUDA=on" in build else None


def cpu_build(result) -> str | None:
    build = llama_build(result)
    return build if build and "-DGGML_CUDA=off" in build and "CUDACXX" not in build else None


def test_setup_builds_llama_cpp_with_cuda_where_there_is_a_compiler(checkout):
    r = setup_dry_run(checkout, gpu=True, nvcc=True)
    assert r.returncode == 0, r.stderr
    assert f"llama.cpp backend cuda (GPU: {GPU_LINE}" in r.stderr
    build = cuda_build(r)
    assert build is not None, r.stdout
    for part in ("CMAKE_ARGS=-DGGML_CUDA=on", "FORCE_CMAKE=1", f"CUDACXX={checkout}/fake-bin/nvcc",
                 "--no-binary llama-cpp-python", "--no-cache-dir", "--force-reinstall", "llama-cpp-python>=0.3.16,<0.4"):
        assert part in build, build
    steps = commands(r)
    assert steps.index(build) < steps.index("pip install -q -e ."), "the CUDA build comes before the package pulls a CPU one"
    assert "pip install -q torch" in steps  # CUDA torch where there is a GPU
    assert r.stdout.rstrip().endswith(f" llama.cpp=cuda{FLAGS} base"), "the stamp records the backend"


def test_setup_finds_nvcc_in_cuda_home(checkout):
    fake_tool(checkout / "cuda" / "bin", "nvcc", "echo nvcc")
    r = setup_dry_run(checkout, gpu=True, CUDA_HOME=str(checkout / "cuda"))
    assert r.returncode == 0, r.stderr
    assert "CMAKE_ARGS=-DGGML_CUDA=on" in (cuda_build(r) or ""), r.stdout


def test_setup_with_a_compiler_but_no_gpu_builds_for_the_cpu(checkout):
    """Machines here carry a CUDA toolkit without a GPU: a CUDA build would not even load."""
    r = setup_dry_run(checkout, nvcc=True)
    assert r.returncode == 0, r.stderr
    assert "llama.cpp backend cpu (GPU: none" in r.stderr and "warning" not in r.stderr
    assert cuda_build(r) is None and cpu_build(r) is not None
    assert "pip install -q torch==2.13.0" in commands(r)  # no GPU: the CPU torch wheel
    assert r.stdout.rstrip().endswith(f" llama.cpp=cpu{FLAGS} base")


def test_setup_warns_when_a_gpu_has_no_compiler(checkout):
    r = setup_dry_run(checkout, gpu=True)
    assert r.returncode == 0, r.stderr
    assert "llama.cpp backend cpu" in r.stderr
    warning = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "no CUDA compiler" in warning[0] and "rerun bin/setup" in warning[0], r.stderr
    assert cuda_build(r) is None and cpu_build(r) is not None
    assert r.stdout.rstrip().endswith(f" llama.cpp=cpu{FLAGS} base")


def test_setup_without_gpu_or_compiler_builds_for_the_cpu_quietly(checkout):
    r = setup_dry_run(checkout, "--test")
    assert r.returncode == 0, r.stderr
    assert "llama.cpp backend cpu (GPU: none" in r.stderr and "warning" not in r.stderr
    assert cuda_build(r) is None and "pip install -q -e .[test]" in commands(r)
    steps = commands(r)
    assert steps.index(cpu_build(r)) < steps.index("pip install -q -e .[test]"), "built before the package pulls a wheel"
    assert r.stdout.rstrip().endswith(f" llama.cpp=cpu{FLAGS} test")


def test_setup_rebuilds_a_cpu_build_once_a_compiler_appears(checkout):
    (checkout / ".venv").mkdir()
    (checkout / ".venv" / ".retrograd-setup").write_text(f"0123456789abcdef llama.cpp=cpu{FLAGS} base\n")
    assert "CMAKE_ARGS=-DGGML_CUDA=on" in (cuda_build(setup_dry_run(checkout, gpu=True, nvcc=True)) or "")
    (checkout / ".venv" / ".retrograd-setup").write_text(f"0123456789abcdef llama.cpp=cuda{FLAGS} base\n")
    assert llama_build(setup_dry_run(checkout, gpu=True, nvcc=True)) is None, "already built with CUDA"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the flags are for x86's AMX code")
def test_setup_builds_llama_cpp_keeping_the_amx_tile_stores(checkout):
    """GCC 12 drops the stores of ggml's AMX tile shapes unless dead-store elimination is off;
    a build from before the flags (its stamp says plain `cpu`) is built again."""
    (checkout / ".venv").mkdir()
    (checkout / ".venv" / ".retrograd-setup").write_text("0123456789abcdef llama.cpp=cpu base\n")
    build = cpu_build(setup_dry_run(checkout))
    assert build is not None
    for flags in ("-DCMAKE_C_FLAGS='-fno-dse -fno-tree-dse'", "-DCMAKE_CXX_FLAGS='-fno-dse -fno-tree-dse'"):
        assert flags in build, build


def test_setup_is_up_to_date_when_the_stamp_matches_the_backend(checkout):
    r = setup_dry_run(checkout, gpu=True, nvcc=True)
    stamp = r.stdout.splitlines()[-1].split(": ", 1)[1]
    (checkout / ".venv").mkdir()
    (checkout / ".venv" / ".retrograd-setup").write_text(stamp + "\n")
    env = {"PATH": f"{checkout / 'fake-bin'}:/usr/bin:/bin", "CUDA_HOME": "/nonexistent", "PYTHON": "/bin/false"}
    again = subprocess.run([str(checkout / "bin" / "setup")], cwd=checkout, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == again.stderr == "", again.stderr
    os.remove(checkout / "fake-bin" / "nvcc")  # the same stamp, but now the backend would be the CPU's
    changed = subprocess.run([str(checkout / "bin" / "setup")], cwd=checkout, env=env, capture_output=True, text=True, timeout=60)
    assert changed.returncode != 0 and "llama.cpp backend cpu" in changed.stderr, "it set up again (and PYTHON=false stopped it)"


def test_setup_refuses_a_forced_cuda_backend_without_a_compiler(checkout):
    r = setup_dry_run(checkout, gpu=True, RETROGRAD_LLAMA_BACKEND="cuda")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "RETROGRAD_LLAMA_BACKEND=cuda" in lines[0] and "nvcc" in lines[0], r.stderr


def test_the_offload_warning_names_the_fix():
    if C.llama_supports_gpu_offload():
        assert gpu_offload_warning(True) is None
    else:
        line = gpu_offload_warning(True)
        assert "\n" not in line and "sampled on the CPU" in line and "bin/setup" in line and "-DGGML_CUDA=on" in line
    assert gpu_offload_warning(False) is None


def test_train_warns_at_start_when_torch_has_cuda_but_llama_cpp_does_not(tmp_path, monkeypatch):
    import torch

    from retrograd import recipes
    from retrograd.cli import app

    started = []

    class Done:
        def summary(self):
            return "done"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(recipes.RECIPES, "grpo", lambda cfg, reporter, resume: started.append(cfg) or Done())
    monkeypatch.setitem(recipes.RECIPES, "sft", lambda cfg, reporter, resume: started.append(cfg) or Done())
    monkeypatch.setattr(C, "llama_supports_gpu_offload", lambda: False)
    (tmp_path / "prompts.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    grpo = tmp_path / "grpo.toml"
    grpo.write_text(f'[run]\nalgorithm = "grpo"\n[output]\npath = "{tmp_path}/a.gguf"\n[grpo]\nprompts = "{tmp_path}/prompts.jsonl"\n'
                    f'reward_function = "{tmp_path}/r.py:reward"\nupdates = 1\nprompts_per_update = 1\ngroup_size = 2\ngrpo_epochs = 1\n'
                    f'clip_range_low = 0.2\nclip_range_high = 0.2\nkl_coefficient = 0.0\n[grpo.sampling]\nmax_new_tokens = 4\n')
    sft = tmp_path / "sft.toml"
    sft.write_text(f'[run]\nalgorithm = "sft"\n[output]\npath = "{tmp_path}/a.gguf"\n[sft]\ndata = "{tmp_path}/data.jsonl"\n')

    out = CliRunner().invoke(app, ["train", str(grpo)])
    assert out.exit_code == 0, out.output
    warnings = [line for line in out.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "sampled on the CPU" in warnings[0] and "-DGGML_CUDA=on" in warnings[0], out.output
    assert len(started) == 1, "the run goes on after the warning"

    out = CliRunner().invoke(app, ["train", str(sft)])
    assert out.exit_code == 0 and "warning:" not in out.output, "SFT never samples with llama.cpp"


def test_the_sampler_says_where_it_runs(smollm2):
    from retrograd.gguf.file import GGUFFile
    from retrograd.gguf.spec import read_spec
    from retrograd.sampler import Sampler, SamplerOptions

    n_layer = read_spec(GGUFFile(smollm2)).n_layer
    with Sampler(smollm2, SamplerOptions(n_ctx=32, n_seq_max=2)) as sampler:
        placement = sampler.placement
    assert placement.layers == n_layer + 1
    assert placement.devices == gpu_devices()
    assert placement.layers_offloaded == (n_layer + 1 if placement.devices else 0)
    if not C.llama_supports_gpu_offload():
        assert placement.describe() == f"cpu, 0/{n_layer + 1} layers offloaded"


@pytest.mark.parametrize("broken", ["no nvidia-smi", "torch without CUDA"])
def test_gpu_check_refuses_without_a_gpu(tmp_path, broken):
    fake = tmp_path / "bin"
    if broken == "no nvidia-smi":
        fake_tool(fake, "nvidia-smi", "exit 9")
        python = str(REPO / ".venv" / "bin" / "python")
    else:
        fake_tool(fake, "nvidia-smi", f'echo "{GPU_LINE}"')
        fake_tool(fake, "python", "exit 1")  # torch.cuda.is_available() is False
        python = str(fake / "python")
    env = {"PATH": f"{fake}:/usr/bin:/bin", "PYTHON": python}
    r = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU"), r.stderr
