"""`type = "container"`: one hardened Docker container per trajectory.

Hardening (notes §5): no network, read-only root with tmpfs /work and /tmp,
a non-root user, every capability dropped, no-new-privileges, memory == memory+swap,
pids and CPU limits, rlimits on open files and file size (no core dumps), a sized
/dev/shm, no host devices (Docker's standard null, zero, full, random, urandom, tty
only), a private cgroup namespace and a fixed hostname (so that no container id
leaks into observations). PID 1 (KEEPER) reaps orphans (it is the container's init)
and, on SIGUSR1, SIGKILLs every other process: that is how a timeout kills a
command's whole tree, even a fork bomb that leaves no pid for a helper process. A
call that ends normally sweeps its leftover processes itself (RUN_THEN_SWEEP).
Docker's own init (`init=True`) cannot take PID 1's place: the keeper would then be
PID 2, and the sweep's `kill -9 -1` would stop the container.

`verify` runs as `verify_user`, whose processes the policy's uid can neither
signal nor edit; the keeper cannot signal them either, so a verify that times out
costs the container (it is killed, and the pool replaces it).

`allow_network = true` uses Docker's default bridge: the host's services and cloud
metadata addresses are reachable too (NETWORK_WARNING is printed at start-up).

Commands run through the exec API; its hijacked stream is opened here on a raw
socket, so no byte can hide in an HTTP client's read-ahead buffer."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
import uuid
from collections.abc import Callable

import docker
import docker.errors
import docker.types

from retrograd.rollouts.sandbox.base import (
    KILL_GRACE_SECS,
    WIPE_SCRIPT,
    CappedBuffer,
    ExecResult,
    Sandbox,
    SandboxBroken,
    SandboxError,
    pump,
)
from retrograd.rollouts.sandbox.options import (
    DEFAULT_IMAGE,
    NETWORK_WARNING,
    WHERE,
    EnvironmentOptions,
    host_path_problem,
)
from retrograd.runtime import owner

LABEL_RUN = "retrograd.pool"  # the run id
LABEL_HOST = "retrograd.host"
LABEL_OWNER = "retrograd.runtime.owner"  # owner.process_tag() of the process that created it
LABEL_INSTANCE = "retrograd.instance"  # one pool; close() removes exactly these
# PID 1, the container's init. In Python where the image has python3: it waits in sigwaitinfo, reaps
# every child and never forks, so no pids limit can stop it. A shell init must fork its next `sleep`
# when a sweep kills the last one; with every pid still held by dying processes, that fork fails,
# the shell exits, and the container stops with it. Images without python3 get that shell.
KEEPER_PY = """import os, signal
wanted = {signal.SIGCHLD, signal.SIGUSR1}
signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
while True:
    if signal.sigwaitinfo(wanted).si_signo == signal.SIGUSR1:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:  # nothing left to kill; an init must not exit on an error
            pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except OSError:  # no children left
        pass
"""
KEEPER = ["sh", "-c", 'command -v python3 >/dev/null && exec python3 -I -S -c "$0"; '
                      "trap 'kill -9 -1' USR1; while :; do sleep 2147483647 & wait $!; done", KEEPER_PY]
KILL_SIGNAL = "SIGUSR1"
# Runs "$@", then SIGKILLs whatever it left behind: a call's processes end with the call, as in the
# namespace sandbox, so the state between calls is the filesystem alone (and a fork bomb dies).
RUN_THEN_SWEEP = '"$@"; status=$?; kill -9 -1 2>/dev/null; exit $status'
CACHE_MOUNT = "/opt/cache"
NOFILE = 1024  # open files per process
KILLED = 128 + 9  # the exit code of a command killed at its timeout


class DockerBackend:
    def __init__(self, options: EnvironmentOptions):
        self.options = options
        self.endpoint = _endpoint()
        self.client = _connect(self.endpoint, options.pool.max_live)
        self.image_id = _image_id(self.client, options.image, self.endpoint)  # for the run's record
        self.labels = {LABEL_RUN: options.run_id or f"pid-{os.getpid()}", LABEL_HOST: owner.host_name(),
                       LABEL_OWNER: owner.process_tag(), LABEL_INSTANCE: uuid.uuid4().hex}
        _check_named_volume(self.client, options)
        reap_orphans(self.client)
        if options.allow_network:
            print(f"warning: {NETWORK_WARNING}", file=sys.stderr, flush=True)

    def create(self) -> ContainerSandbox:
        limits, (uid, gid) = self.options.limits, self.options.uid_gid
        # Workspace, /tmp and /dev/shm live in the container's memory (options.Limits sizes them), so
        # that a full disk is an ENOSPC the model sees, not an OOM kill. No file may outgrow the workspace.
        work_mb, tmp_mb, shm_mb = limits.workspace_size_mb, limits.tmp_size_mb, limits.shm_size_mb
        ulimits = [docker.types.Ulimit(name=name, soft=value, hard=value)
                   for name, value in (("nofile", NOFILE), ("fsize", work_mb << 20), ("core", 0))]
        try:
            container = self.client.containers.run(
                self.image_id, KEEPER, detach=True, labels=self.labels, user=self.options.user,
                hostname="sandbox", working_dir="/work",
                environment={"HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                             "PATH": "/usr/local/bin:/usr/bin:/bin"},
                network_mode="bridge" if self.options.allow_network else "none",
                read_only=True,
                tmpfs={"/work": f"rw,nosuid,nodev,size={work_mb}m,mode=0755,uid={uid},gid={gid}",
                       "/tmp": f"rw,nosuid,nodev,size={tmp_mb}m,mode=1777"},
                cap_drop=["ALL"], security_opt=["no-new-privileges"],
                mem_limit=f"{limits.memory_mb}m", memswap_limit=f"{limits.memory_mb}m",
                pids_limit=limits.pids, nano_cpus=int(limits.cpus * 1e9), cgroupns="private",
                ulimits=ulimits, shm_size=f"{shm_mb}m",  # and no devices=: no host device is passed in
                runtime=self.options.runtime,
                volumes={self.options.cache_volume_source: {"bind": CACHE_MOUNT, "mode": "ro"}}
                if self.options.cache_volume else None,
            )
        except docker.errors.DockerException as error:
            raise SandboxError(f"[agent.environment] type = 'container': cannot start a container from "
                               f"{self.options.image!r}: {_short(error)}") from None
        return ContainerSandbox(self, container.id)

    def close(self) -> None:
        remove_containers(self.client, {LABEL_INSTANCE: self.labels[LABEL_INSTANCE]})

    def open_exec_stream(self, exec_id: str) -> tuple[socket.socket, bytes]:
        """Starts an exec attached to a fresh connection; returns the socket and the
        first stream bytes that arrived together with the response head."""
        body = b'{"Detach":false,"Tty":false}'
        sock = _dial(self.endpoint)
        try:
            sock.settimeout(30)
            sock.sendall(f"POST /v{self.client.api.api_version}/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
                         f"Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                if not chunk:
                    raise OSError("the daemon closed the exec stream")
                head += chunk
            head, _, rest = head.partition(b"\r\n\r\n")
            status = head.split(b"\r\n", 1)[0]
            if status.split(b" ")[1:2] not in ([b"101"], [b"200"]):
                raise OSError(f"exec start answered {status.decode(errors='replace')!r}")
            return sock, rest
        except BaseException:
            sock.close()
            raise


class ContainerSandbox(Sandbox):
    scratch_dirs = ("/dev/shm", "/dev/mqueue")
    # System V IPC objects live in no folder: ipcrm removes those of the user that runs it.
    wipe_script = "ipcrm --all 2>/dev/null; " + WIPE_SCRIPT

    def __init__(self, backend: DockerBackend, container_id: str):
        super().__init__(backend.options.limits)
        self.backend = backend
        self.id = container_id

    def reset(self) -> bool:
        """The verifier's leftovers go first: in the sticky /tmp and /dev/shm only their owner
        may remove them. Its wipe fails on the policy's files; the policy's own wipe, next,
        removes those and checks that everything is empty."""
        self.exec(self.wipe_command(), timeout=30, as_verifier=True)
        return super().reset()

    def _exec(self, argv: tuple[str, ...], stdin: bytes, timeout: float) -> ExecResult:
        return self._run(argv, stdin, timeout, self.backend.options.user)

    def _exec_as_verifier(self, argv: tuple[str, ...], stdin: bytes, timeout: float) -> ExecResult:
        return self._run(argv, stdin, timeout, self.backend.options.verify_user)

    def _run(self, argv: tuple[str, ...], stdin: bytes, timeout: float, user: str) -> ExecResult:
        api = self.backend.client.api
        limit = self.limits.max_output_bytes
        out, err = CappedBuffer(limit), CappedBuffer(limit)
        frames = FrameReader({1: out.write, 2: err.write})
        try:
            exec_id = api.exec_create(self.id, ["sh", "-c", RUN_THEN_SWEEP, "sh", *argv], stdin=True,
                                      user=user, workdir="/work")["Id"]
            sock, first = self.backend.open_exec_stream(exec_id)
        except (docker.errors.DockerException, OSError) as error:
            raise SandboxBroken(f"container exec failed: {_short(error)}") from None
        with sock:
            frames.feed(first)
            fd = sock.fileno()
            finished = pump({fd: frames.feed}, fd, stdin, lambda: _shutdown_write(sock),
                            time.monotonic() + timeout)
            if not finished:
                # The keeper kills the policy's processes; only the container's end kills the verifier's.
                self._kill(KILL_SIGNAL if user == self.backend.options.user else "SIGKILL")
                if not pump({fd: frames.feed}, None, b"", _nothing, time.monotonic() + KILL_GRACE_SECS):
                    raise SandboxBroken("a command survived the timeout kill")
        return ExecResult(exit_code=self._exit_code(exec_id) if finished else KILLED, stdout=bytes(out.data),
                          stderr=bytes(err.data), timed_out=not finished, truncated=out.truncated or err.truncated)

    def _exit_code(self, exec_id: str) -> int:
        deadline = time.monotonic() + KILL_GRACE_SECS
        while True:
            try:
                state = self.backend.client.api.exec_inspect(exec_id)
            except docker.errors.DockerException as error:
                raise SandboxBroken(f"container exec inspect failed: {_short(error)}") from None
            if state["ExitCode"] is not None and not state["Running"]:
                return state["ExitCode"]
            if time.monotonic() > deadline:
                raise SandboxBroken("a command kept running after its output closed")
            time.sleep(0.01)

    def _kill(self, signal: str) -> None:
        """SIGUSR1 to PID 1, which SIGKILLs every other process; needs no free pid.
        SIGKILL ends the container."""
        try:
            self.backend.client.api.kill(self.id, signal=signal)
        except docker.errors.DockerException as error:
            raise SandboxBroken(f"container kill failed: {_short(error)}") from None

    def destroy(self) -> None:
        _remove(self.backend.client, self.id)


class FrameReader:
    """Docker's multiplexed exec stream: an 8-byte header (stream id, three zero
    bytes, big-endian payload length) before each payload; 1 = stdout, 2 = stderr."""

    def __init__(self, sinks: dict[int, Callable[[bytes], None]]):
        self.sinks = sinks
        self.buffer = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while len(self.buffer) >= 8:
            stream, size = struct.unpack(">BxxxL", self.buffer[:8])
            if len(self.buffer) < 8 + size:
                return
            self.sinks.get(stream, _nothing)(bytes(self.buffer[8:8 + size]))
            del self.buffer[:8 + size]


def _check_named_volume(client: docker.DockerClient, options: EnvironmentOptions) -> None:
    """A named cache volume must exist (Docker would create an empty one) and, when it binds a
    host folder, pass the checks of a host path (options.py)."""
    name = options.cache_volume
    if name is None or name.startswith("/"):
        return
    key = f"{WHERE}.cache_volume = {name!r}"
    try:
        volume = client.volumes.get(name)
    except docker.errors.NotFound:
        raise SandboxError(f"{key}: no such volume on the Docker daemon; create it (docker volume create {name}) "
                           f"or name a host path") from None
    except docker.errors.DockerException as error:
        raise SandboxError(f"{key}: cannot inspect the volume: {_short(error)}") from None
    device = (volume.attrs.get("Options") or {}).get("device", "")
    problem = host_path_problem(device, options.cache_volume_roots) if device.startswith("/") else None
    if problem:
        raise SandboxError(f"{key} binds the host path {device}: {problem}")


# --- reaper ---------------------------------------------------------------------------------------

def reap_orphans(client: docker.DockerClient) -> int:
    """Removes containers whose owner process on this host is gone (a SIGKILLed run)."""
    here = owner.host_name()
    orphans = [container for container in _labelled(client, {LABEL_HOST: here})
               if owner.is_dead(container.labels.get(LABEL_OWNER, ""))]
    for container in orphans:
        _remove(client, container.id)
    return len(orphans)


def remove_containers(client: docker.DockerClient, labels: dict[str, str]) -> None:
    for container in _labelled(client, labels):
        _remove(client, container.id)


def _labelled(client: docker.DockerClient, labels: dict[str, str]) -> list:
    try:
        return client.containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in labels.items()]},
                                      ignore_removed=True)
    except docker.errors.DockerException:
        return []  # the daemon went away: nothing we can remove now; the next run's reaper will


def _remove(client: docker.DockerClient, container_id: str) -> None:
    try:
        client.api.remove_container(container_id, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as error:
        if error.status_code != 409:  # 409: removal already in progress
            raise


# --- talking to the daemon ------------------------------------------------------------------------

def _endpoint() -> str:
    url = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if not url.startswith(("unix://", "tcp://")) or os.environ.get("DOCKER_TLS_VERIFY"):
        raise SandboxError(f"DOCKER_HOST = {url!r}: the container sandbox supports unix:// and plain tcp:// "
                           f"daemons (no TLS, no ssh)")
    return url


def _dial(url: str) -> socket.socket:
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://"):].rstrip("/").rpartition(":")
        return socket.create_connection((host, int(port)), timeout=30)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(url[len("unix://"):])
    except OSError:
        sock.close()
        raise
    return sock


def _connect(url: str, max_live: int) -> docker.DockerClient:
    try:
        client = docker.DockerClient(base_url=url, max_pool_size=max_live + 4)
        client.ping()
    except docker.errors.DockerException as error:
        raise SandboxError(f"no Docker daemon reachable at {url} (DOCKER_HOST): {_short(error)}; "
                           f"start one, or set [agent.environment] type = 'sandbox'") from None
    return client


def _image_id(client: docker.DockerClient, image: str, url: str) -> str:
    try:
        return client.images.get(image).id
    except docker.errors.ImageNotFound:
        ours = image.split(":")[0] == DEFAULT_IMAGE.split(":")[0]
        how = f"bin/build-sandbox-image {image}" if ours else f"docker pull {image}"
        raise SandboxError(f"[agent.environment].image = {image!r} is not on the Docker daemon at {url}; "
                           f"get it with: {how}") from None
    except docker.errors.DockerException as error:
        raise SandboxError(f"cannot inspect image {image!r} at {url}: {_short(error)}") from None


def _short(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:300]


def _shutdown_write(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _nothing(*_) -> None:
    pass
