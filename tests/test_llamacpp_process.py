"""retrograd's Python API and llama-cpp-python in one process: both orders run and the
process exits 0, and llama.cpp's process-wide log callback stays valid through interpreter
teardown (it used to be a ctypes callback that teardown freed while llama.cpp still held it:
the next llama.cpp log line, e.g. from freeing a context, was a SIGSEGV)."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from gguf import GGMLQuantizationType as QT
from gguf_factory import write_tiny_model

from retrograd.gguf.file import GGUFFile
from retrograd.runtime.llamacpp import AMX_BUILD, AMX_MATMUL, REPACK_BUFFER

HEADER = """
import gc, os, sys
from retrograd.runtime.bundled import default_model_path
P = str(default_model_path())
"""


def run_script(tmp_path, body: str, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(HEADER + textwrap.dedent(body))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})}, cwd=tmp_path)
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def test_api_then_llama_cpp_exits_cleanly(tmp_path):
    """The issue's script: the Python API first, then a llama_cpp.Llama of the same file that
    is still alive when the interpreter shuts down."""
    r = run_script(tmp_path, """
        import retrograd, llama_cpp
        m = retrograd.load_model(P)
        ids = m.tokenize("hello")
        ours = m.logits(ids)
        llm = llama_cpp.Llama(P, logits_all=True)
        llm.eval(ids)
        print("done", tuple(ours.shape), len(llm.scores[0]), flush=True)
    """)
    assert "done (1, 49152) 49152" in r.stdout


def test_llama_cpp_then_api_exits_cleanly(tmp_path):
    """llama.cpp first (imported through retrograd.runtime.llamacpp, which every user of llama.cpp in
    this process must go through for the AMX workaround), then the Python API."""
    r = run_script(tmp_path, """
        from retrograd.runtime.llamacpp import llama_cpp
        llm = llama_cpp.Llama(P, logits_all=True)
        ids = llm.tokenize(b"hello", add_bos=False)
        llm.eval(ids)
        import retrograd
        m = retrograd.load_model(P)
        assert m.tokenize("hello") == ids, (m.tokenize("hello"), ids)
        ours = m.logits(ids)
        print("done", tuple(ours.shape), len(llm.scores[0]), flush=True)
    """)
    assert "done (1, 49152) 49152" in r.stdout


@pytest.mark.parametrize("show_logs", [False, True], ids=["silent", "RETROGRAD_LLAMA_LOG=1"])
def test_llama_cpp_logs_safely_after_module_teardown(tmp_path, show_logs):
    """Interpreter teardown clears module namespaces and collects what they held, and
    llama.cpp objects still alive then are freed afterwards, logging as they go. Do that to
    retrograd.runtime.llamacpp while a model and context are alive, then decode and free them: the
    process must live (a ctypes log callback made this a SIGSEGV). llama.cpp stays silent
    unless RETROGRAD_LLAMA_LOG=1, which shows llama.cpp's own log."""
    r = run_script(tmp_path, """
        import retrograd.runtime.llamacpp
        from retrograd.runtime.llamacpp import llama_cpp
        llm = llama_cpp.Llama(P, n_ctx=64, verbose=True)
        vars(retrograd.runtime.llamacpp).clear()
        gc.collect()
        garbage = [bytearray(64) for _ in range(100_000)]  # reuse whatever was freed
        llm.eval(llm.tokenize(b"The capital of France is"))
        llm.close()  # llama.cpp logs while freeing the context
        print("alive", flush=True)
    """, env={"RETROGRAD_LLAMA_LOG": "1" if show_logs else ""})
    assert "alive" in r.stdout
    llama_lines = [ln for ln in r.stderr.splitlines() if ln.startswith(("llama_model_loader:", "~llama_context:"))]
    assert bool(llama_lines) == show_logs, r.stderr[-2000:]


@pytest.mark.skipif(REPACK_BUFFER is None, reason="this llama.cpp build has no CPU_REPACK buffer")
@pytest.mark.parametrize("amx_setting", ["", "off"], ids=["amx-as-checked", "RETROGRAD_LLAMA_AMX=off"])
def test_q4_0_weights_are_repacked_from_a_read_file_and_decode_as_a_plain_load(tmp_path, amx_setting):
    """The sampler's model load reads, not maps, a file whose Q4_0 weights CPU_REPACK (or AMX)
    holds, and those weights go there: where AMX's matmul works, to the AMX buffer; on an AMX
    build where it does not, to CPU_REPACK by name (llama.cpp's log says so), and only the
    matmul weights (not the embedding table, read by row); elsewhere by llama.cpp's own
    choice. The logits are those of llama.cpp loading the file plainly (mapped). A file
    without such weights (Q8_0, which only AMX holds) is still mapped."""
    model = write_tiny_model(tmp_path / "tiny-q4_0.gguf", "llama", qtype=QT.Q4_0)
    other = write_tiny_model(tmp_path / "tiny-q8_0.gguf", "llama", qtype=QT.Q8_0)
    expected = {name for name, t in GGUFFile(model).tensors.items()
                if t.qtype == QT.Q4_0 and name.startswith("blk.") and t.shape[0] % 8 == 0}
    r = run_script(tmp_path, f"""
        import numpy as np
        from pathlib import Path
        from retrograd.runtime.llamacpp import llama_cpp
        from retrograd.sampler.engine import Engine, Feed
        path, ids = {str(model)!r}, list(range(5, 45))
        def engine(path):
            return Engine(Path(path), n_ctx=64, n_seq_max=1, n_batch=64, kv_dtype="f32", n_threads=2, n_outputs=64)
        ours_engine = engine(path)
        (ours,) = ours_engine.decode([Feed(0, 0, ids, want_logits=True, every_logits=True)])
        ours_engine.close()
        llm = llama_cpp.Llama(path, n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, n_threads=2, type_k=0, type_v=0)
        llm.eval(ids)
        plain = np.array(llm.scores[:len(ids)])
        llm.close()
        print("max dlogit", float(np.abs(ours - plain).max()), "max logit", float(np.abs(plain).max()), flush=True)
        engine({str(other)!r}).close()
    """, env={"RETROGRAD_LLAMA_LOG": "1", "RETROGRAD_LLAMA_AMX": amx_setting})
    amx = AMX_MATMUL and amx_setting != "off"
    # one line per load, in order: ours (Q4_0), llama-cpp-python's (Q4_0), ours (Q8_0)
    q8_0_load = "none" if amx else "mmap"
    assert re.findall(r"\(load_mode = (\w+)\)", r.stderr) == ["none", "mmap", q8_0_load], r.stderr[-3000:]
    assert re.search(f"{'AMX' if amx else 'CPU_REPACK'} model buffer size", r.stderr), r.stderr[-3000:]
    repacked = set(re.findall(r"tensor (\S+) \(.*\) buffer type overridden to CPU_REPACK", r.stderr))
    assert repacked == (expected if AMX_BUILD and not amx else set()) and len(expected) == 14
    gap, scale = map(float, re.search(r"max dlogit (\S+) max logit (\S+)", r.stdout).groups())
    assert gap < 1e-3 * scale, (gap, scale)
