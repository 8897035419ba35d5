"""Real isolation: Docker containers (a real daemon and the image from
bin/build-sandbox-image) and bubblewrap namespaces. Hostile commands must be
contained and seen by the model as tool errors, leaving the sandbox usable.

Docker tests (marked `container`) skip only when no daemon is reachable, bubblewrap tests
(marked `namespace`) when bwrap cannot run; under CI=true either fails instead. CI (.ci/run)
runs, as root:
  apt-get install -y docker.io bubblewrap debootstrap
  nohup dockerd >/tmp/dockerd.log 2>&1 &  (then wait until `docker info` answers)
  bin/build-sandbox-image"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import docker
import docker.errors
import psutil
import pytest
from sandboxes import unavailable

from retrograd.rollouts.sandbox import (
    DEFAULT_IMAGE,
    EnvironmentOptions,
    Limits,
    PoolOptions,
    SandboxError,
    open_environment,
)
from retrograd.rollouts.sandbox.container import LABEL_INSTANCE, LABEL_RUN, DockerBackend
from retrograd.rollouts.tools import TIMED_OUT, ToolCatalog

LIMITS = Limits(cpus=1.0, memory_mb=256, pids=64, exec_timeout_secs=2, max_output_bytes=4096)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def docker_client():
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as error:
        unavailable(f"no Docker daemon reachable ({str(error).splitlines()[0][:120]}); see this module's docstring")
    try:
        client.images.get(DEFAULT_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"the daemon runs but {DEFAULT_IMAGE} is missing: run bin/build-sandbox-image")
    return client


@pytest.fixture(scope="module", params=[pytest.param("container", marks=pytest.mark.container),
                                        pytest.param("sandbox", marks=pytest.mark.namespace)])
def pool(request):
    if request.param == "container":
        request.getfixturevalue("docker_client")
    pool = open_environment(EnvironmentOptions(type=request.param, limits=LIMITS, pool=PoolOptions(max_live=4)))
    yield pool
    pool.close()


@pytest.fixture
def sandbox(pool):
    sandbox = pool.acquire()
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="module")
def tools():
    return ToolCatalog.builtin().toolset()


def host_processes_with(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def most_children(marker: str) -> int:
    """Children (zombies included) of the host process with `marker` that has the most."""
    counts = [0]
    for process in host_processes_with(marker):
        try:
            counts.append(len(process.children()))
        except psutil.NoSuchProcess:
            pass
    return max(counts)


def assert_still_usable(tools, sandbox):
    assert tools.call(sandbox, "bash", {"command": "echo still here"}).content == "still here\n"


# --- containment, both backends -----------------------------------------------------------------

def test_fork_bomb_is_contained(tools, sandbox):
    marker = f"bomb{uuid.uuid4().hex[:8]}"
    result = tools.call(sandbox, "bash", {"command": f"b(){{ b | b & }}; b; sleep 100 # {marker}"})
    assert result.is_error and result.content == TIMED_OUT.format(seconds=LIMITS.exec_timeout_secs)
    time.sleep(0.3)
    assert host_processes_with(marker) == []
    assert_still_usable(tools, sandbox)


def test_endless_command_is_killed(tools, sandbox):
    marker, nap = f"spin{uuid.uuid4().hex[:8]}", f"sleep {uuid.uuid4().int % 10**6 + 10**6}"
    result = tools.call(sandbox, "bash", {"command": f"({nap} &); while :; do :; done # {marker}"})
    assert result.is_error and result.content == TIMED_OUT.format(seconds=LIMITS.exec_timeout_secs)
    time.sleep(0.3)
    assert host_processes_with(marker) == [] and host_processes_with(nap) == []
    assert_still_usable(tools, sandbox)


def test_writing_4_gib_stops_at_the_limit(tools, sandbox):
    result = tools.call(sandbox, "bash", {"command": "head -c 4G /dev/zero > big"})
    assert result.is_error
    size = int(tools.call(sandbox, "bash", {"command": "wc -c < big"}).content)
    assert 0 < size <= LIMITS.memory_mb << 20
    tools.call(sandbox, "bash", {"command": "rm big"})
    assert_still_usable(tools, sandbox)


def test_memory_limit(tools, sandbox):
    result = tools.call(sandbox, "python", {"code": "x = bytearray(1 << 30); print('allocated')"})
    assert result.is_error and "allocated" not in result.content
    assert_still_usable(tools, sandbox)


def test_no_network_to_the_hosts_loopback(tools, sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); print('connected')"
    result = tools.call(sandbox, "python", {"code": code})
    assert result.is_error and "connected" not in result.content
    assert accepted == []
    socket.create_connection(("127.0.0.1", port), timeout=1).close()  # the server itself works
    deadline = time.monotonic() + 2
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(accepted) == 1
    server.close()


def test_host_files_are_invisible(tools, sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host-only secret")
    for call in [("read_file", {"path": str(secret)}), ("bash", {"command": f"cat {secret}; ls {REPO}"})]:
        result = tools.call(sandbox, *call)
        assert result.is_error and "host-only secret" not in result.content
    assert "pyproject.toml" not in tools.call(sandbox, "bash", {"command": "ls -a /work /tmp; ls ~"}).content


def test_two_sandboxes_observe_byte_identical_results(pool, tools):
    actions = [
        ("write_file", {"path": "src/main.py", "content": "import sys\nprint(sys.argv[1:])\n"}),
        ("bash", {"command": "python3 src/main.py a b; id; hostname; pwd; env | sort; cat /proc/self/cgroup"}),
        ("list_dir", {}), ("grep", {"pattern": "print"}), ("read_file", {"path": "src/main.py"}),
        ("edit_file", {"path": "src/main.py", "old_string": "argv[1:]", "new_string": "argv"}),
        ("python", {"code": "import os; print(sorted(os.listdir('.')), os.getuid())"}),
        ("bash", {"command": "ls /nope"}), ("submit", {"answer": "done"}),
    ]
    first, second = pool.acquire(), pool.acquire()
    observations = [[tools.call(sandbox, name, args) for name, args in actions] for sandbox in (first, second)]
    first.close()
    second.close()
    assert observations[0] == observations[1]
    assert not any(result.broken for result in observations[0])


# --- Docker only --------------------------------------------------------------------------------

def containers(client, **labels) -> list:
    return client.containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in labels.items()]},
                                  ignore_removed=True)


@pytest.mark.container
def test_container_is_hardened(docker_client):
    with open_environment(EnvironmentOptions(type="container", limits=LIMITS)) as pool:
        sandbox = pool.acquire()
        attrs = docker_client.containers.get(sandbox.id).attrs
        host = attrs["HostConfig"]
        assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"]
        assert host["SecurityOpt"] == ["no-new-privileges"] and host["PidsLimit"] == LIMITS.pids
        assert host["Memory"] == host["MemorySwap"] == LIMITS.memory_mb << 20 and host["NanoCpus"] == 10**9
        assert set(host["Tmpfs"]) == {"/work", "/tmp"} and not host["Binds"]
        assert attrs["Config"]["User"] == "65534:65534" and attrs["Config"]["Hostname"] == "sandbox"
        assert attrs["Config"]["Labels"][LABEL_RUN] == f"pid-{os.getpid()}"
        sandbox.close()


@pytest.mark.container
def test_close_leaves_no_container(docker_client):
    pool = open_environment(EnvironmentOptions(type="container", limits=LIMITS, pool=PoolOptions(min_idle=1)))
    instance = pool.backend.labels[LABEL_INSTANCE]
    leased = pool.acquire()
    pool.prewarm(wait=True)
    assert len(containers(docker_client, **{LABEL_INSTANCE: instance})) == 2
    pool.close()  # the leased one goes too
    assert containers(docker_client, **{LABEL_INSTANCE: instance}) == []
    assert leased.broken is False


CHILD = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a child that does not exit
from retrograd.rollouts.sandbox import EnvironmentOptions, PoolOptions, open_environment
pool = open_environment(EnvironmentOptions(type="container", run_id=sys.argv[1], pool=PoolOptions(min_idle=1)))
sandbox = pool.acquire()
pool.prewarm(wait=True)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def child():
    """A real process holding a pool: one leased and one idle container."""
    run_id = f"test-child-{uuid.uuid4().hex[:8]}"
    process = subprocess.Popen([sys.executable, "-c", CHILD, run_id], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    yield process, run_id
    process.kill()
    process.wait()


@pytest.mark.container
def test_sigint_removes_the_runs_containers(docker_client, child):
    child, run_id = child
    assert len(containers(docker_client, **{LABEL_RUN: run_id})) == 2
    child.send_signal(signal.SIGINT)
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:  # once in many runs (a loaded CI machine): say where it waits
        child.send_signal(signal.SIGUSR1)
        time.sleep(1)
        child.kill()
        pytest.fail(f"the child did not exit within 30 s of SIGINT; its threads:\n{child.communicate()[1][-6000:]}")
    assert containers(docker_client, **{LABEL_RUN: run_id}) == []


@pytest.mark.container
def test_sigkill_leftovers_are_reaped_by_the_next_pool(docker_client, child):
    child, run_id = child
    child.kill()
    child.wait(timeout=30)
    assert len(containers(docker_client, **{LABEL_RUN: run_id})) == 2  # SIGKILL cleans nothing up
    DockerBackend(EnvironmentOptions(type="container")).close()  # a new pool starts: the reaper runs
    assert containers(docker_client, **{LABEL_RUN: run_id}) == []


@pytest.mark.container
def test_a_timeout_kill_needs_no_free_pid(docker_client, tools):
    """The verifier's uid holds every pid (the policy's kill cannot touch it) when a timeout's
    SIGUSR1 comes: init kills and reaps without forking. A shell init forked its next `sleep`
    then, failed on EAGAIN and exited, stopping the container (a CI run lost that race to the
    dying processes of a fork bomb)."""
    marker = f"fill{uuid.uuid4().hex[:8]}"
    fill_and_hold = (f"import os, time  # {marker}\n"
                     "children = 0\n"
                     "while children < 1000:\n"
                     "    try:\n"
                     "        if os.fork() == 0:\n"
                     "            os._exit(0)\n"
                     "    except OSError:\n"
                     "        break\n"
                     "    children += 1\n"
                     "time.sleep(3)\n"
                     "print('held', children)\n")
    pool = open_environment(EnvironmentOptions(type="container", limits=LIMITS, pool=PoolOptions(max_live=1)))
    try:
        sandbox = pool.acquire()
        held = []
        verifier = threading.Thread(target=lambda: held.append(
            sandbox.exec(("python3", "-c", fill_and_hold), timeout=10, as_verifier=True)))
        verifier.start()
        # Every pid is taken once the filler's zombies, its shell, the filler and PID 1 (and a shell
        # init's `sleep`) fill the limit.
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and most_children(marker) < LIMITS.pids - 4:
            time.sleep(0.05)
        assert most_children(marker) >= LIMITS.pids - 4
        time.sleep(0.2)  # the filler's last fork, which fails
        docker_client.api.kill(sandbox.id, signal="SIGUSR1")
        verifier.join()
        assert held[0].stdout.startswith(b"held ") and int(held[0].stdout.split()[1]) < LIMITS.pids
        assert_still_usable(tools, sandbox)
    finally:
        pool.close()


@pytest.mark.container
def test_pool_limits_reuse_and_prewarm(docker_client, tools):
    options = EnvironmentOptions(type="container", limits=LIMITS, pool=PoolOptions(
        max_live=2, min_idle=2, reuse="workspace", max_leases_per_container=2))
    with open_environment(options) as pool:
        pool.prewarm(wait=True)
        instance = {LABEL_INSTANCE: pool.backend.labels[LABEL_INSTANCE]}
        warm = {container.id for container in containers(docker_client, **instance)}
        assert len(warm) == 2
        first = pool.acquire()
        assert first.id in warm
        tools.call(first, "bash", {"command": "echo data > kept.txt; echo t > /tmp/t; (sleep 500 &)"})
        first.close()  # wiped and back to the idle list
        leases = [pool.acquire(), pool.acquire()]
        with pytest.raises(SandboxError, match="max_live = 2"):
            pool.acquire(timeout=0.2)
        assert {sandbox.id for sandbox in leases} == warm
        again = next(sandbox for sandbox in leases if sandbox.id == first.id)
        assert tools.call(again, "bash", {"command": "ls -A /work /tmp"}).content == "/tmp:\n\n/work:\n"
        for sandbox in leases:
            sandbox.close()
        deadline = time.monotonic() + 10
        while len(containers(docker_client, **instance)) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(containers(docker_client, **instance)) == 1  # the twice-leased one retired
        metrics = pool.metrics()
        assert metrics["env/pool_reuse_fraction"] == pytest.approx(1 / 3)
        assert metrics["env/live_containers_max"] == 2


@pytest.mark.container
def test_a_vanished_container_breaks_the_trajectory(docker_client, tools):
    with open_environment(EnvironmentOptions(type="container", limits=LIMITS)) as pool:
        sandbox = pool.acquire()
        docker_client.containers.get(sandbox.id).remove(force=True)
        result = tools.call(sandbox, "bash", {"command": "echo hi"})
        assert result.broken and result.is_error
        sandbox.close()
        assert pool.metrics()["env/sandbox_broken_fraction"] == 1.0


@pytest.mark.container
def test_missing_image_says_how_to_build_it(docker_client):
    with pytest.raises(SandboxError, match=r"bin/build-sandbox-image retrograd-sandbox:missing$"):
        open_environment(EnvironmentOptions(type="container", image="retrograd-sandbox:missing"))


def test_no_daemon_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no.sock")
    with pytest.raises(SandboxError) as error:
        open_environment(EnvironmentOptions(type="container"))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"no Docker daemon reachable at unix://{tmp_path}/no.sock")
