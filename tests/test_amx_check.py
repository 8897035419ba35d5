"""Whether llama.cpp's AMX matmul works is asked of a child process once per build and CPU
(retrograd/runtime/amx_check.py): the child itself against this machine's llama.cpp, and
the cached verdict."""

import os
import subprocess
import sys
import textwrap

import pytest
from gguf import GGMLQuantizationType as QT
from gguf_factory import write_tiny_model

from retrograd.runtime import amx_check
from retrograd.runtime.llamacpp import AMX_BUILD, AMX_MATMUL


@pytest.mark.skipif(not AMX_BUILD, reason="this llama.cpp build has no AMX code")
def test_the_amx_matmul_of_this_build_works():
    """bin/setup builds llama.cpp so that GCC keeps the tile shapes' stores: the child places
    the weights in the AMX buffer, decodes 16 sequences and agrees with the plain kernels
    (with GCC 12's defaults it dies with SIGSEGV on ldtilecfg instead)."""
    child = subprocess.run([sys.executable, "-m", "retrograd.runtime.amx_check"], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.strip() == "ok", (child.returncode, child.stdout, child.stderr[-2000:])
    assert AMX_MATMUL == (os.environ.get("RETROGRAD_LLAMA_AMX") != "off")


def test_the_verdict_is_asked_once_per_library(tmp_path, monkeypatch):
    """A crashed child is a no, remembered; another build (size, time) of the library is asked
    again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    library = tmp_path / "libggml-cpu.so"
    library.write_bytes(b"first build")
    asked = []

    def child(answer):
        def run(argv, **kwargs):
            asked.append(argv)
            return subprocess.CompletedProcess(argv, *answer)
        return run

    monkeypatch.setattr(amx_check.subprocess, "run", child((-11, "", "")))
    assert amx_check.amx_matmul_works(library) is False
    assert asked == [[sys.executable, "-m", "retrograd.runtime.amx_check"]]
    (verdict,) = (tmp_path / "cache" / "retrograd").glob("llama-amx-*")
    assert verdict.read_text() == "child exited -11\n"

    monkeypatch.setattr(amx_check.subprocess, "run", child((0, "ok\n", "")))
    assert amx_check.amx_matmul_works(library) is False and len(asked) == 1, "the cached verdict, not a new child"

    library.write_bytes(b"another build")
    assert amx_check.amx_matmul_works(library) is True and len(asked) == 2
    assert amx_check.amx_matmul_works(library) is True and len(asked) == 2

    elsewhere = tmp_path / "not-here" / "libggml-cpu.so"  # another packaging: asked, nothing cached
    assert amx_check.amx_matmul_works(elsewhere) is True and len(asked) == 3
    assert amx_check.amx_matmul_works(elsewhere) is True and len(asked) == 4
    assert len(list((tmp_path / "cache" / "retrograd").glob("llama-amx-*"))) == 2


@pytest.mark.skipif(not AMX_MATMUL, reason="llama.cpp's AMX buffer is off here")
def test_a_decode_after_torch_used_the_tiles_on_the_same_thread_lives(tmp_path):
    """oneDNN releases the AMX tiles after its bf16 matmuls, and ggml configures a thread's
    tiles only once: a decode on the thread torch just used died with SIGILL (exit 132) until
    every llama_decode loaded the tile shapes on its OpenMP team first (checked by calling the
    unwrapped function)."""
    model = write_tiny_model(tmp_path / "tiny-q4_0.gguf", "llama", qtype=QT.Q4_0)
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from retrograd.runtime.llamacpp import llama_cpp
        llm = llama_cpp.Llama({str(model)!r}, n_ctx=64, n_batch=64, n_threads=2, verbose=False)
        a, b = torch.randn(256, 896, dtype=torch.bfloat16), torch.randn(896, 4864, dtype=torch.bfloat16)
        for round in range(3):
            llm.reset()
            llm.eval(list(range(5, 25)))  # 20 rows: the AMX kernel's tiles
            (a @ b).sum().item()  # oneDNN's AMX kernel, on this thread and torch's pool
        print("alive", flush=True)
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "alive" in r.stdout, (r.returncode, r.stderr[-2000:])
