"""`type = "sandbox"`: one long-lived bubblewrap (`bwrap`) sandbox per trajectory,
for machines without a Docker daemon. No root needed.

The bwrap owns the sandbox's namespaces (user, PID, network with loopback only, IPC,
UTS "sandbox", cgroup) and its mounts: /usr (and the /bin, /lib... links) read-only,
a synthetic /etc, a fresh /proc, a read-only /dev with the usual devices and a sized
/dev/shm, /work and /tmp on sized tmpfs (Limits.workspace_mb, tmp_mb, shm_mb) that
persist across the sandbox's calls, and a read-only root. Nothing else of the host
exists inside, and nothing of the sandbox lands on the host's disk. Its PID 1 is
launcher.py: each call's command runs as its child, and when the command ends (or
its timeout comes) every process it left is SIGKILLed, so between calls the sandbox
holds files only.

What bounds it:
- a seccomp filter (syscall_filter.py) refusing unshare, setns, mount, ptrace,
  keyctl, bpf and the like, plus `--disable-userns` where bwrap has it (>= 0.8);
- total memory (processes + tmpfs files) and processes: a cgroup leaf per sandbox
  where the host allows one (cgroups.py: memory_mb, no swap, pids); elsewhere the
  launcher's watchdog sums resident memory, tmpfs and System V shared memory every
  50 ms and SIGKILLs the running command past memory_mb (a burst between two looks
  can go over), and RLIMIT_NPROC, counted per user namespace, so per sandbox, caps
  processes;
- per command: RLIMIT_AS and RLIMIT_FSIZE = memory_mb, RLIMIT_CPU = its timeout, no
  core files. `cpus` is not enforced.
When run as root, bwrap and everything in it run as uid/gid 65534 on the host."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from retrograd.rollouts.sandbox import cgroups, syscall_filter
from retrograd.rollouts.sandbox.base import (
    KILL_GRACE_SECS,
    CappedBuffer,
    ExecResult,
    Sandbox,
    SandboxBroken,
    SandboxError,
    pump,
)
from retrograd.rollouts.sandbox.options import EnvironmentOptions

NOBODY = 65534
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
ENV = {"PATH": SANDBOX_PATH, "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
ETC_FILES = {
    "passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/work:/bin/sh\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost\n",
}
HOST_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")  # read-only, when present
LAUNCHER = (Path(__file__).parent / "launcher.py").read_bytes()
LAUNCHER_PATH = "/etc/retrograd-launcher.py"  # read-only inside, like the rest of /etc
START_SECS = 30.0  # for bwrap and the launcher to come up
EXTRA_PIDS = 2  # bwrap's outer process and the launcher, in the cgroup's pids bound
# Holds bwrap back until the host has put this shell (and so all it starts) in the sandbox's cgroup.
WAIT_FOR_CGROUP = 'read -r go && exec "$@" </dev/null'


class NamespaceBackend:
    def __init__(self, options: EnvironmentOptions):
        self.options = options
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxError("[agent.environment] type = 'sandbox' needs bwrap (bubblewrap) on PATH; install it "
                               "(Debian/Ubuntu: apt-get install -y bubblewrap) or use type = 'container'")
        self.python = shutil.which("python3", path=SANDBOX_PATH)  # seen inside through the /usr bind
        if self.python is None:
            raise SandboxError("[agent.environment] type = 'sandbox' needs python3 in /usr for its launcher "
                               "(Debian/Ubuntu: apt-get install -y python3) or use type = 'container'")
        features = subprocess.run([self.bwrap, "--help"], capture_output=True, text=True, check=False).stdout
        if "--size" not in features:
            raise SandboxError(f"[agent.environment] type = 'sandbox': {self.bwrap} is too old to size its tmpfs "
                               f"mounts (--size needs bubblewrap >= 0.7); upgrade it or use type = 'container'")
        self.disable_userns = "--disable-userns" in features
        self.seccomp = syscall_filter.compile_filter()
        self.cgroups = cgroups.find_hierarchy()
        if self.cgroups is not None:
            self.cgroups.reap_orphans()
        self.live: set[NamespaceSandbox] = set()  # created and not destroyed
        self.identity = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
        self.fixed_args = self._fixed_args()
        self._check_works()

    def _fixed_args(self) -> list[str]:
        limits = self.options.limits
        args = [self.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--as-pid-1",
                "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            path = Path("/", name)
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                args += ["--ro-bind", str(path), str(path)]
        args += ["--proc", "/proc", "--dev", "/dev",
                 *_tmpfs("/dev/shm", "1777", limits.shm_size_mb), "--remount-ro", "/dev",
                 *_tmpfs("/work", "0755", limits.workspace_size_mb), *_tmpfs("/tmp", "1777", limits.tmp_size_mb),
                 "--dir", "/etc"]
        for name in HOST_ETC:
            if Path("/etc", name).exists():
                args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        args += ["--disable-userns"] if self.disable_userns else []
        return args + ["--clearenv", "--chdir", "/work"]

    def _check_works(self) -> None:
        probe = self.create()
        result = probe.exec(["true"], timeout=30)
        probe.destroy()
        if result.exit_code != 0:
            raise SandboxError(f"[agent.environment] type = 'sandbox': a test command failed in a new sandbox: "
                               f"exit {result.exit_code}: {result.stderr.decode(errors='replace').strip()[:200]}")

    def create(self) -> NamespaceSandbox:
        sandbox = NamespaceSandbox(self)
        self.live.add(sandbox)
        return sandbox

    def close(self) -> None:
        """Destroys the sandboxes still alive, leased ones included."""
        for sandbox in list(self.live):
            sandbox.destroy()


class NamespaceSandbox(Sandbox):
    scratch_dirs = ("/dev/shm",)  # a tmpfs that persists across calls, like /work and /tmp

    def __init__(self, backend: NamespaceBackend):
        super().__init__(backend.options.limits)
        self.backend = backend
        self._destroyed = threading.Lock()
        memory = self.limits.memory_mb << 20
        try:
            self.cgroup = (backend.cgroups.make_leaf(memory, self.limits.pids + EXTRA_PIDS)
                           if backend.cgroups is not None else None)
        except OSError as error:
            raise SandboxError(f"[agent.environment] type = 'sandbox': cannot make the sandbox's cgroup: "
                               f"{error}") from None
        self.control, launcher_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {"control_fd": launcher_end.fileno(), "env": ENV, "watch_bytes": 0 if self.cgroup else memory,
                  "rlimits": {"RLIMIT_AS": memory, "RLIMIT_FSIZE": memory, "RLIMIT_NPROC": self.limits.pids,
                              "RLIMIT_CORE": 0}}
        data = {f"/etc/{name}": _memfd(text.encode()) for name, text in ETC_FILES.items()}
        data[LAUNCHER_PATH] = _memfd(LAUNCHER)
        seccomp = _memfd(backend.seccomp)
        files = [arg for path, fd in data.items() for arg in ("--ro-bind-data", str(fd), path)]
        command = [*backend.fixed_args, *files, "--remount-ro", "/", "--seccomp", str(seccomp),
                   "--", backend.python, "-I", "-S", LAUNCHER_PATH, json.dumps(config)]
        if self.cgroup is not None:
            command = ["/bin/sh", "-c", WAIT_FOR_CGROUP, "sh", *command]
        try:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE if self.cgroup else subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, pass_fds=(launcher_end.fileno(), seccomp, *data.values()),
                start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, **backend.identity)
        except BaseException:
            self.control.close()
            if self.cgroup is not None:
                self.cgroup.remove()
            raise
        finally:
            launcher_end.close()
            for fd in (seccomp, *data.values()):
                os.close(fd)
        try:
            self._wait_until_ready()
        except BaseException:
            self.destroy()
            raise

    def _wait_until_ready(self) -> None:
        if self.cgroup is not None:
            try:
                self.cgroup.add(self.process.pid)
                self.process.stdin.write(b"go\n")
                self.process.stdin.close()
            except OSError as error:
                raise SandboxError(f"[agent.environment] type = 'sandbox': cannot start the sandbox in its cgroup: "
                                   f"{error}") from None
        self.control.settimeout(START_SECS)
        try:
            ready = self.control.recv(16)
        except OSError:
            ready = b""
        self.control.settimeout(None)
        if ready != b"ready":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            reason = self.process.stderr.read().decode(errors="replace").strip().splitlines() or ["no message"]
            raise SandboxError(f"[agent.environment] type = 'sandbox': bwrap could not start a sandbox: {reason[0]} "
                               f"(unprivileged user namespaces may be disabled; try type = 'container')")

    def _exec(self, argv: tuple[str, ...], stdin: bytes, timeout: float) -> ExecResult:
        deadline = time.monotonic() + timeout
        request = json.dumps({"argv": list(argv), "cpu": math.ceil(timeout) + 1}).encode()
        (stdin_read, stdin_write), (out_read, out_write), (err_read, err_write), (status_read, status_write) = (
            os.pipe(), os.pipe(), os.pipe(), os.pipe())
        ours = {stdin_write, out_read, err_read, status_read}
        try:
            try:
                socket.send_fds(self.control, [request], [stdin_read, out_write, err_write, status_write])
            except OSError as error:
                raise SandboxBroken(f"the sandbox's launcher is gone ({error.strerror})") from None
            finally:
                for fd in (stdin_read, out_write, err_write, status_write):
                    os.close(fd)
            limit = self.limits.max_output_bytes
            out, err, status = CappedBuffer(limit), CappedBuffer(limit), CappedBuffer(16)
            reads = {out_read: out.write, err_read: err.write, status_read: status.write}

            def end_stdin():
                ours.discard(stdin_write)
                os.close(stdin_write)

            finished = pump(reads, stdin_write, stdin, end_stdin, deadline)
            if not finished:
                with contextlib.suppress(OSError):  # a launcher that is gone has closed the streams too
                    self.control.send(b"kill")
                if not pump(reads, None, b"", lambda: None, time.monotonic() + KILL_GRACE_SECS):
                    raise SandboxBroken("the sandbox did not stop its command after the timeout")
        finally:
            for fd in ours:
                os.close(fd)
        if not status.data.isdigit():
            raise SandboxBroken("the sandbox's launcher died (out of memory?)")
        return ExecResult(exit_code=int(status.data), stdout=bytes(out.data), stderr=bytes(err.data),
                          timed_out=not finished, truncated=out.truncated or err.truncated)

    def destroy(self) -> None:
        """Closing the control socket ends the launcher and with it the PID namespace;
        SIGKILL to bwrap's session makes sure (--die-with-parent takes the launcher)."""
        with self._destroyed:
            self.backend.live.discard(self)
            self.control.close()
            if self.process.returncode is None:  # not reaped yet, so the pid is still bwrap's
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            for stream in (self.process.stdin, self.process.stderr):
                if stream is not None:
                    stream.close()
            if self.cgroup is not None:
                self.cgroup.remove()


def _tmpfs(path: str, mode: str, size_mb: int) -> list[str]:
    return ["--perms", mode, "--size", str(size_mb << 20), "--tmpfs", path]


def _memfd(data: bytes) -> int:
    """A file descriptor reading `data` from its start, for bwrap to consume."""
    fd = os.memfd_create("retrograd-sandbox")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
