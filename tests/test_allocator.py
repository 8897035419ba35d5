"""The command line restarts itself on jemalloc where the system has it, with freed pages kept
until the kernel wants them, and leaves no LD_PRELOAD or MALLOC_CONF behind for what it starts
(reward scripts, sandboxes, tools)."""

import json
import os
import subprocess
import sys

import pytest
import sandboxes

from retrograd.runtime import allocator

# A process that does what `retrograd`'s main does first, then reports on itself and on a child.
REPORT = """
import ctypes, json, os, subprocess
from retrograd.runtime import allocator
allocator.restart_on_jemalloc()
child = subprocess.run(["sh", "-c", 'echo "${LD_PRELOAD-unset} ${MALLOC_CONF-unset}"'], capture_output=True, text=True).stdout.strip()
decay = None
if allocator.loaded_jemalloc():  # jemalloc's own view of the option, through its control interface
    value, size = ctypes.c_ssize_t(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
    assert ctypes.CDLL(None).mallctl(b"opt.muzzy_decay_ms", ctypes.byref(value), ctypes.byref(size), None, 0) == 0
    decay = value.value
print(json.dumps({"pid": os.getpid(), "allocator": allocator.current(), "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
                  "MALLOC_CONF": os.environ.get("MALLOC_CONF"), "marker": os.environ.get(allocator.RESTARTED_ENV),
                  "child": child, "muzzy_decay_ms": decay}))
"""


def report(**env) -> tuple[dict, int]:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", allocator.CHOICE_ENV)}
    process = subprocess.Popen([sys.executable, "-c", REPORT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=base | env)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0 and err == "", err
    return json.loads(out), process.pid


@pytest.fixture(scope="module")
def jemalloc() -> str:
    library = allocator.jemalloc_library()
    if library is None:
        message = "no jemalloc on this machine (apt-get install -y libjemalloc2)"
        if sandboxes.in_ci():
            pytest.fail(f"{message}; .ci/run installs it")
        pytest.skip(message)
    return library


def test_a_command_restarts_on_jemalloc_once_and_its_children_do_not_inherit_it(jemalloc):
    seen, pid = report()
    assert seen["pid"] == pid  # exec, not a second process
    assert seen["allocator"] == f"jemalloc ({jemalloc})" and seen["muzzy_decay_ms"] == -1
    assert seen["LD_PRELOAD"] is None and seen["MALLOC_CONF"] is None and seen["marker"] is None
    assert seen["child"] == "unset unset"


def test_a_users_own_malloc_conf_replaces_ours_and_stays(jemalloc):
    seen, _ = report(MALLOC_CONF="muzzy_decay_ms:5000")
    assert seen["allocator"] == f"jemalloc ({jemalloc})" and seen["muzzy_decay_ms"] == 5000
    assert seen["MALLOC_CONF"] == "muzzy_decay_ms:5000" and seen["child"] == "unset muzzy_decay_ms:5000"


def test_system_choice_and_a_users_own_preload_keep_glibc(jemalloc):
    seen, _ = report(**{allocator.CHOICE_ENV: "system"})
    assert seen["allocator"] == f"system malloc ({allocator.CHOICE_ENV}=system)" and seen["child"] == "unset unset"
    seen, _ = report(LD_PRELOAD="libm.so.6")
    assert not seen["allocator"].startswith("jemalloc")
    assert seen["LD_PRELOAD"] == "libm.so.6" and seen["child"] == "libm.so.6 unset"


def test_preflight_probes_run_on_the_runs_allocator(jemalloc, monkeypatch):
    """A probe child gets the preload `retrograd train` would run with, so it measures the same heap."""
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    monkeypatch.delenv(allocator.CHOICE_ENV, raising=False)
    assert allocator.preload_env() == {"LD_PRELOAD": jemalloc, "MALLOC_CONF": allocator.SETTINGS}
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")
    assert allocator.preload_env() == {"LD_PRELOAD": jemalloc}
    monkeypatch.setenv(allocator.CHOICE_ENV, "system")
    allocator.jemalloc_library.cache_clear()
    try:
        assert allocator.preload_env() == {}
    finally:
        allocator.jemalloc_library.cache_clear()


def test_preflight_names_the_allocator(jemalloc, smollm2):
    run = subprocess.run([sys.executable, "-m", "retrograd", "preflight", "--model", str(smollm2)],
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.CHOICE_ENV)})
    assert run.returncode == 0, run.stderr
    assert f"allocator      jemalloc ({jemalloc})" in run.stdout.splitlines()


def test_an_unknown_choice_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, "-m", "retrograd", "--help"], capture_output=True, text=True, timeout=60,
                         env=os.environ | {allocator.CHOICE_ENV: "tcmalloc"})
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == f"error: {allocator.CHOICE_ENV}=tcmalloc: expected jemalloc or system\n"
