"""The container backend's bounds seen from inside (rlimits, /dev/shm, devices, PID 1), what a
reused container forgets between leases, and which cache volumes are refused. Refusals are
config-level and need no Docker; the rest runs against the real daemon (marker `container`)."""

from __future__ import annotations

import dataclasses
import os
import socket

import docker
import pytest

from retrograd.errors import ConfigError
from retrograd.rollouts.sandbox import (
    DEFAULT_IMAGE,
    EnvironmentOptions,
    Limits,
    PoolOptions,
    SandboxError,
    ScenarioEnv,
    open_environment,
)
from retrograd.rollouts.sandbox.container import CACHE_MOUNT, KEEPER, NOFILE, DockerBackend

LIMITS = Limits(memory_mb=256, pids=64, exec_timeout_secs=10, max_output_bytes=8192)
WORK_BYTES, SHM_BYTES = LIMITS.workspace_size_mb << 20, LIMITS.shm_size_mb << 20
STANDARD_DEVICES = {"null", "zero", "full", "random", "urandom", "tty"}


def run(sandbox, command: str) -> str:
    result = sandbox.exec(["sh", "-c", command])
    assert result.exit_code == 0 and not result.timed_out, result
    return result.stdout.decode()


@pytest.fixture(scope="module")
def pool():
    with open_environment(EnvironmentOptions(type="container", limits=LIMITS,
                                             pool=PoolOptions(max_live=2, reuse="workspace"))) as pool:
        yield pool


@pytest.fixture
def sandbox(pool):
    sandbox = pool.acquire()
    yield sandbox
    sandbox.close()


# --- bounds seen from inside --------------------------------------------------------------------

@pytest.mark.container
def test_rlimits_bound_open_files_file_size_and_core_dumps(sandbox):
    assert run(sandbox, "ulimit -n").strip() == str(NOFILE)
    limits = run(sandbox, "cat /proc/self/limits")
    assert f"Max file size             {WORK_BYTES}" in limits and "Max core file size        0" in limits
    opened = sandbox.exec(["python3", "-c", f"fs = [open('/dev/null') for _ in range({NOFILE + 10})]"])
    assert opened.exit_code == 1 and b"Too many open files" in opened.stderr
    # One byte past the limit, in a sparse file (no space used): the kernel refuses with SIGXFSZ.
    beyond = sandbox.exec(["sh", "-c", f"dd if=/dev/zero of=big bs=1 count=1 seek={WORK_BYTES} 2>/dev/null"])
    assert beyond.exit_code == 128 + 25  # SIGXFSZ
    assert sandbox.exec(["sh", "-c", f"dd if=/dev/zero of=big bs=1 count=1 seek={WORK_BYTES - 1}"]).exit_code == 0


@pytest.mark.container
def test_dev_shm_is_sized_and_no_host_device_is_present(sandbox):
    size = run(sandbox, "python3 -c \"import os; s = os.statvfs('/dev/shm'); print(s.f_blocks * s.f_frsize)\"")
    assert int(size) == SHM_BYTES
    assert sandbox.exec(["sh", "-c", f"head -c {SHM_BYTES + 4096} /dev/zero > /dev/shm/fill"]).exit_code != 0
    devices = set(run(sandbox, "find /dev -type c -o -type b").split())
    assert {path.removeprefix("/dev/") for path in devices} <= STANDARD_DEVICES | {"pts/ptmx"}
    assert sandbox.exec(["sh", "-c", "mknod /dev/shm/sda b 8 0"]).exit_code != 0
    host = docker.from_env().containers.get(sandbox.id).attrs["HostConfig"]
    assert not host["Devices"] and not host["DeviceRequests"] and not host["Privileged"]


@pytest.fixture(scope="module")
def image_without_python():
    """The default image less python3: the container's init falls back to a shell."""
    client = docker.from_env()
    container = client.containers.run(DEFAULT_IMAGE, ["sh", "-c", "rm -f /usr/bin/python3*"], user="root",
                                      detach=True)
    try:
        assert container.wait()["StatusCode"] == 0
        image = container.commit(repository="retrograd-sandbox-test", tag="no-python3")
    finally:
        container.remove(force=True)
    yield "retrograd-sandbox-test:no-python3"
    client.images.remove(image.id, force=True)


@pytest.mark.container
@pytest.mark.parametrize("image, init", [("default", ["python3", "-I", "-S", "-c"]), ("no python3", KEEPER[:2])])
def test_pid_1_is_an_init_that_reaps_orphans(request, image, init):
    options = EnvironmentOptions(type="container", limits=LIMITS, pool=PoolOptions(max_live=1))
    if image == "no python3":
        options = dataclasses.replace(options, image=request.getfixturevalue("image_without_python"))
    with open_environment(options) as pool:
        sandbox = pool.acquire()
        assert run(sandbox, "tr '\\0' ' ' < /proc/1/cmdline").split(" ")[:len(init)] == init
        # 5 calls x 30 orphans that exit at once: more than pids = 64 if PID 1 left them as zombies.
        for _ in range(5):
            run(sandbox, "for i in $(seq 30); do (true &); done")
        zombies = run(sandbox, "grep -l '^State:.*Z' /proc/[0-9]*/status 2>/dev/null | wc -l")
        assert int(zombies) == 0
        # A timeout's SIGUSR1 kills the command's whole tree and leaves PID 1 running.
        spun = sandbox.exec(["sh", "-c", "(sleep 300 &); while :; do :; done"], timeout=1)
        assert spun.timed_out and run(sandbox, "echo alive") == "alive\n"
        assert "sleep 300" not in run(sandbox, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")


# --- what a reused container forgets ------------------------------------------------------------

SHMGET = "python3 -c 'import ctypes; assert ctypes.CDLL(None).shmget(0, 4096, 0o1600) >= 0'"  # System V
LEFTOVERS = f"echo s > /dev/shm/policy; touch /dev/mqueue/policy; mkdir /tmp/d; echo t > /tmp/d/f; {SHMGET}"
VERIFIER_LEFTOVERS = (f"echo s > /dev/shm/verifier; touch /dev/mqueue/verifier; mkdir /tmp/v; chmod 700 /tmp/v; "
                      f"touch /tmp/v/f; {SHMGET}")


@pytest.mark.container
def test_reuse_forgets_shm_mqueue_ipc_and_the_verifiers_files(pool):
    first = pool.acquire()
    run(first, LEFTOVERS)
    verify = ScenarioEnv.from_json({"verify": {"command": VERIFIER_LEFTOVERS}}, "v").verify
    assert first.verify(verify, timeout=10) == 1.0
    assert run(first, "ls /dev/mqueue /dev/shm") == "/dev/mqueue:\npolicy\nverifier\n\n/dev/shm:\npolicy\nverifier\n"
    assert run(first, "ipcs -m | grep -c 0x") == "2\n"
    first.close()
    again = pool.acquire()
    assert again.id == first.id  # the same container, wiped
    assert run(again, "ls -A /dev/shm /dev/mqueue /tmp /work") == "/dev/mqueue:\n\n/dev/shm:\n\n/tmp:\n\n/work:\n"
    assert run(again, "ipcs -m | grep -c 0x || true") == "0\n"
    again.close()


@pytest.mark.container
def test_a_verify_that_times_out_scores_0_and_costs_only_its_container(pool):
    sandbox = pool.acquire()
    # exec: the wait must not need a fork, or a bomb that fills the pids limit first makes
    # the verifier exit early (no timeout, a kept container), as it did once in CI
    bomb = ScenarioEnv.from_json({"verify": {"command": "b(){ b | b & }; b; exec sleep 100"}}, "v").verify
    assert sandbox.verify(bomb, timeout=2) == 0.0
    sandbox.close()
    assert pool.idle_count == 0  # killed with the verifier's processes, not wiped and kept
    fresh = pool.acquire()
    assert fresh.id != sandbox.id and run(fresh, "echo ok") == "ok\n"
    fresh.close()


# --- cache volumes ------------------------------------------------------------------------------

def options(volume: str, *roots: str) -> EnvironmentOptions:
    table = {"type": "container", "cache_volume": volume, "cache_volume_roots": list(roots)}
    return EnvironmentOptions.from_table(table)


@pytest.fixture
def with_socket(tmp_path):
    folder = tmp_path / "cache"
    (folder / "deep").mkdir(parents=True)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(folder / "deep" / "agent.sock"))
    yield folder
    server.close()


def refusal(volume: str, *roots: str) -> str:
    with pytest.raises(ConfigError) as error:
        options(volume, *roots)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("volume", ["/", "/run", "/var/run", "/run/user", "/var/run/../run"])
def test_cache_volume_refuses_the_root_and_the_socket_folders(volume):
    message = refusal(volume, "/")  # even when every path is allowed
    assert message.startswith(f"[agent.environment].cache_volume = {volume!r}: sharing ") and "refused" in message


def test_cache_volume_refuses_a_folder_holding_a_socket(with_socket, tmp_path):
    message = refusal(str(with_socket), str(tmp_path))
    assert message == (f"[agent.environment].cache_volume = {str(with_socket)!r}: {with_socket}/deep/agent.sock is a "
                       f"socket; a path holding sockets is refused")


def test_cache_volume_must_lie_under_an_allowed_root(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert "under any of [agent.environment].cache_volume_roots (none set)" in refusal(str(tmp_path / "a"))
    assert f"under any of [agent.environment].cache_volume_roots ({tmp_path / 'b'})" in refusal(
        str(tmp_path / "a"), str(tmp_path / "b"))
    (tmp_path / "b" / "link").symlink_to(tmp_path / "a")  # a link out of the root does not count
    assert f"{tmp_path / 'a'} is not under" in refusal(str(tmp_path / "b" / "link"), str(tmp_path / "b"))
    assert "does not exist" in refusal(str(tmp_path / "b" / "missing"), str(tmp_path / "b"))
    assert "':' or ','" in refusal(str(tmp_path / "b") + ":/work", str(tmp_path))
    assert "[agent.environment].cache_volume_roots: 'cache' is not an absolute path" in refusal("hf", "cache")
    assert "expected a list of strings" in refusal("hf", 3)
    assert "expected a Docker volume name or an absolute host path" in refusal("../etc")


def test_cache_volume_accepted_under_a_root(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "cache")
    accepted = options(str(tmp_path / "link"), str(tmp_path))
    assert accepted.cache_volume_source == str(tmp_path / "cache")  # mounted without the link
    assert options("hf-cache").cache_volume_source == "hf-cache"


@pytest.mark.container
def test_an_allowed_cache_folder_is_mounted_read_only(tmp_path):
    (tmp_path / "weights.txt").write_text("cached\n")
    os.chmod(tmp_path, 0o755)
    with open_environment(EnvironmentOptions(type="container", limits=LIMITS, cache_volume=str(tmp_path),
                                             cache_volume_roots=(str(tmp_path),))) as pool:
        sandbox = pool.acquire()
        assert run(sandbox, f"cat {CACHE_MOUNT}/weights.txt") == "cached\n"
        assert sandbox.exec(["touch", f"{CACHE_MOUNT}/new"]).exit_code != 0
        sandbox.close()


@pytest.mark.container
def test_a_named_volume_must_exist_and_may_not_bind_a_refused_folder():
    client = docker.from_env()
    with pytest.raises(SandboxError, match=r"cache_volume = 'retrograd-test-missing': no such volume"):
        DockerBackend(EnvironmentOptions(type="container", cache_volume="retrograd-test-missing"))
    volume = client.volumes.create("retrograd-test-binds-run", driver="local",
                                   driver_opts={"type": "none", "o": "bind", "device": "/run"})
    try:
        with pytest.raises(SandboxError, match=r"binds the host path /run: sharing /run is refused"):
            DockerBackend(EnvironmentOptions(type="container", cache_volume=volume.name, cache_volume_roots=("/",)))
    finally:
        volume.remove()


# --- network ------------------------------------------------------------------------------------

@pytest.mark.container
def test_allow_network_warns_once_at_start_up(capsys):
    DockerBackend(EnvironmentOptions(type="container")).close()
    assert capsys.readouterr().err == ""
    DockerBackend(EnvironmentOptions(type="container", allow_network=True)).close()
    assert capsys.readouterr().err == ("warning: [agent.environment].allow_network = true: sandboxed commands can "
                                       "reach this host's services, its network and cloud metadata addresses "
                                       "(169.254.169.254)\n")
