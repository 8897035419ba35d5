"""Options, the pool's leasing rules and the exec contract, on the cheap backends
(the local temp dir and bubblewrap namespaces). Docker: test_sandbox_isolation.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil
import pytest

from retrograd.errors import ConfigError
from retrograd.rollouts.sandbox import (
    EnvironmentOptions,
    Limits,
    PoolOptions,
    SandboxError,
    SandboxPool,
    ScenarioEnv,
    open_environment,
)
from retrograd.rollouts.sandbox.local import LocalBackend

needs_bwrap = pytest.mark.namespace  # skips without a working bwrap, fails under CI=true (conftest.py)


def local_options(**pool) -> EnvironmentOptions:
    return EnvironmentOptions(type="local", allow_unsandboxed=True, limits=Limits(exec_timeout_secs=1),
                              pool=PoolOptions(**pool))


class CountingBackend(LocalBackend):
    """The real local backend, counting what it creates."""

    def __init__(self, options):
        super().__init__(options)
        self.created = 0

    def create(self):
        self.created += 1
        return super().create()


# --- options ------------------------------------------------------------------------------------

def test_defaults_are_retrograds():
    options = EnvironmentOptions.from_table({"type": "container"})
    assert options.limits == Limits(cpus=1.0, memory_mb=1024, pids=256, exec_timeout_secs=30, max_output_bytes=65536)
    assert options.pool == PoolOptions(max_live=8, min_idle=0, reuse="never", max_leases_per_container=32)
    assert options.setup_timeout_secs == 300 and options.verify_timeout == 30 and not options.allow_network


def test_every_problem_is_reported_on_one_line():
    table = {"type": "container", "limits": {"cpus": "two", "pids": 2}, "pool": {"min_idle": 9, "reuse": "always"},
             "colour": "red", "allow_unsandboxed": True}
    with pytest.raises(ConfigError) as error:
        EnvironmentOptions.from_table(table)
    message = str(error.value)
    assert "\n" not in message
    for expected in ["[agent.environment].limits.cpus = 'two': expected a number",
                     "[agent.environment].limits.pids = 2: expected an integer >= 8",
                     "[agent.environment].pool.min_idle = 9", "[agent.environment].pool.reuse = 'always'",
                     "[agent.environment].colour: unknown key",
                     "[agent.environment].allow_unsandboxed = True: only applies to type = 'local'"]:
        assert expected in message


@pytest.mark.parametrize("table, expected", [
    ({"type": "local"}, "set allow_unsandboxed = true"),
    ({"type": "container", "user": "0:0"}, "running as root is refused"),
    ({"type": "container", "user": "root"}, "running as root is refused"),
    ({"type": "container", "cache_volume": "/var/run/docker.sock"}, "mounting the Docker socket is refused"),
    ({"type": "sandbox", "image": "python:3.12"}, "only applies to type = 'container'"),
    ({"type": "vm"}, "expected one of container, sandbox, local"),
])
def test_refusals(table, expected):
    with pytest.raises(ConfigError, match=expected):
        EnvironmentOptions.from_table(table)


def test_scenario_env_parsing():
    env = ScenarioEnv.from_json({"files": {"b.txt": "2", "a/b.py": "1"}, "setup": ["make", ["python3", "x.py"]],
                                 "verify": {"command": "test -f done", "reward_on_success": 2},
                                 "summary": ["cat", "a/b.py"], "toolset": "python"}, "s.jsonl:1 metadata.env")
    assert env.files == (("a/b.py", "1"), ("b.txt", "2"))
    assert env.setup == (("sh", "-c", "make"), ("python3", "x.py"))
    assert env.verify.command == ("sh", "-c", "test -f done") and env.verify.reward_on_success == 2.0
    with pytest.raises(ConfigError) as error:
        ScenarioEnv.from_json({"files": {"../x": "", "/etc/passwd": ""}, "setup": [3], "verify": {"cmd": "x"},
                               "extra": 1}, "s.jsonl:2 metadata.env")
    message = str(error.value)
    for expected in ["s.jsonl:2 metadata.env.extra: unknown key", "path '../x'", "path '/etc/passwd'",
                     "setup[0] = 3", "s.jsonl:2 metadata.env.verify"]:
        assert expected in message


# --- the pool -----------------------------------------------------------------------------------

def test_max_live_makes_a_larger_group_wait():
    pool = SandboxPool(LocalBackend(local_options()), PoolOptions(max_live=2))
    first, second = pool.acquire(), pool.acquire()
    with pytest.raises(SandboxError, match="max_live = 2"):
        pool.acquire(timeout=0.1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=10)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # still waiting for a lease
    first.close()
    waiter.join()
    assert got and pool.metrics()["env/live_containers_max"] == 2
    second.close()
    got[0].close()
    pool.close()


def test_reuse_workspace_wipes_and_retires():
    backend = CountingBackend(local_options())
    pool = SandboxPool(backend, PoolOptions(max_live=1, reuse="workspace", max_leases_per_container=2))
    sandbox = pool.acquire()
    sandbox.exec(["sh", "-c", "mkdir -p deep/er && echo x > deep/er/f && chmod 000 deep/er && echo t > $TMPDIR/t"])
    sandbox.close()
    again = pool.acquire()
    assert again is sandbox and os.listdir(again.workdir) == [] and os.listdir(again.tmpdir) == []
    again.close()  # second lease: retired
    third = pool.acquire()
    assert third is not sandbox and backend.created == 2
    third.close()
    assert pool.metrics()["env/pool_reuse_fraction"] == pytest.approx(1 / 3)
    pool.close()  # waits for the background destruction
    assert not Path(sandbox.workdir).exists()


def test_reuse_never_destroys_each_sandbox():
    pool = SandboxPool(LocalBackend(local_options()), PoolOptions(max_live=2))
    sandbox = pool.acquire()
    sandbox.close()
    pool.close()  # waits for background destruction
    assert not Path(sandbox.workdir).exists()


def test_prewarm_fills_min_idle_without_passing_max_live():
    backend = CountingBackend(local_options())
    pool = SandboxPool(backend, PoolOptions(max_live=3, min_idle=2))
    leased = pool.acquire()
    pool.prewarm(wait=True)
    assert pool.idle_count == 2 and backend.created == 3
    pool.prewarm(wait=True)
    assert backend.created == 3  # already warm
    warm = [pool.acquire(), pool.acquire()]
    assert backend.created == 3  # both served from the idle list
    pool.prewarm(wait=True)
    assert pool.idle_count == 0  # max_live reached: nothing more
    for sandbox in [leased, *warm]:
        sandbox.close()
    pool.close()
    assert not list(backend.root.parent.glob(backend.root.name))


def test_metrics_count_timeouts():
    pool = SandboxPool(LocalBackend(local_options()), PoolOptions())
    sandbox = pool.acquire()
    sandbox.exec(["true"])
    sandbox.exec(["sleep", "5"], timeout=0.2)
    sandbox.close()
    metrics = pool.metrics(reset=True)
    assert metrics["env/exec_timeout_fraction"] == 0.5 and metrics["env/sandbox_broken_fraction"] == 0
    assert set(metrics) == {"env/container_create_ms", "env/acquire_ms_mean", "env/pool_reuse_fraction",
                            "env/live_containers_max", "env/exec_timeout_fraction", "env/sandbox_broken_fraction"}
    assert pool.metrics()["env/exec_timeout_fraction"] == 0
    pool.close()


# --- the exec contract, on both host backends ---------------------------------------------------

@pytest.fixture(params=["local", pytest.param("sandbox", marks=needs_bwrap)])
def sandbox(request):
    options = EnvironmentOptions(type=request.param, allow_unsandboxed=request.param == "local",
                                 limits=Limits(exec_timeout_secs=1, max_output_bytes=1000, memory_mb=256, pids=32))
    pool = open_environment(options)
    sandbox = pool.acquire()
    yield sandbox
    sandbox.close()
    pool.close()


def test_exec_moves_large_stdin_and_caps_output(sandbox):
    data = os.urandom(3 << 20)
    result = sandbox.exec(["sh", "-c", "wc -c; head -c 5000 /dev/zero >&2"], stdin=data)
    assert result.stdout.split() == [str(len(data)).encode()] and result.exit_code == 0
    assert result.stderr == bytes(1000) and result.truncated and not result.timed_out


def test_exec_timeout_kills_the_whole_tree(sandbox):
    marker = f"{time.time_ns() % 10**9}"
    start = time.monotonic()
    result = sandbox.exec(["sh", "-c", f"(setsid sleep 1{marker} &); sleep 2{marker}"], timeout=0.5)
    assert result.timed_out and result.exit_code == 137 and time.monotonic() - start < 5
    if sandbox.workdir == "/work":  # isolated: even the setsid'd grandchild is gone
        time.sleep(0.2)
        assert not [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    else:
        assert not [p for p in psutil.process_iter(["cmdline"]) if f"2{marker}" in " ".join(p.info["cmdline"] or [])]


def test_prepare_and_verify(sandbox):
    env = ScenarioEnv.from_json({"files": {"src/app.py": "print('hi')\n"}, "setup": ["python3 src/app.py > out.txt"],
                                 "verify": {"command": "grep -q hi out.txt", "reward_on_success": 3}}, "s:1")
    sandbox.prepare(env, setup_timeout=5, where="s:1")
    assert sandbox.verify(env.verify, timeout=5) == 3.0
    sandbox.exec(["rm", "out.txt"])
    assert sandbox.verify(env.verify, timeout=5) == 0.0
    failing = ScenarioEnv.from_json({"setup": ["true", "echo broken >&2; exit 7"]}, "s:2")
    with pytest.raises(SandboxError, match=r"^s:2.setup\[1\] \(sh -c 'echo broken >&2; exit 7'\): exited with 7: "
                                           r"broken$"):
        sandbox.prepare(failing, setup_timeout=5, where="s:2")
