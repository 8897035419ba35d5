"""`type = "sandbox"`: every call runs in fresh Linux namespaces made by
bubblewrap (`bwrap`), for machines without a Docker daemon. No root needed.

What a command sees: its own user, PID, network (loopback only), IPC, UTS
(hostname "sandbox") and cgroup namespaces; /usr (and the /bin, /lib... links)
read-only; a synthetic /etc; fresh /proc and /dev; the sandbox's workspace at
/work and its own /tmp, both persistent across its calls. Nothing else of the
host (home, /root, the repository, the host's /tmp) exists inside.

Limits are rlimits set by `prlimit` *inside* the new user namespace, where the
process count is per sandbox: address space = memory_mb, CPU time = the call's
timeout, processes = pids, file size = memory_mb. `cpus` has no rlimit and is
not enforced here. The call's PID namespace dies with it, so a timeout (or the
end of the call) kills every process it started. When run as root, commands
drop to uid/gid 65534 on the host too."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from retrograd.rollouts.sandbox import owner
from retrograd.rollouts.sandbox.base import ExecResult, Sandbox, SandboxError, force_remove, run_process
from retrograd.rollouts.sandbox.options import EnvironmentOptions

NOBODY = 65534
DIR_PREFIX = "retrograd-ns-"
ETC_FILES = {
    "passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/work:/bin/sh\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost\n",
}
HOST_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")  # read-only, when present


class NamespaceBackend:
    def __init__(self, options: EnvironmentOptions):
        self.options = options
        self.bwrap = shutil.which("bwrap")
        self.prlimit = shutil.which("prlimit")
        if self.bwrap is None or self.prlimit is None:
            missing = "bwrap (bubblewrap)" if self.bwrap is None else "prlimit (util-linux)"
            raise SandboxError(f"[agent.environment] type = 'sandbox' needs {missing} on PATH; install it "
                               f"(Debian/Ubuntu: apt-get install -y bubblewrap util-linux) or use type = 'container'")
        reap_orphan_dirs(Path(tempfile.gettempdir()))
        self.root = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{owner.process_tag()}-"))
        self.drop_to_nobody = os.geteuid() == 0  # as root, RLIMIT_NPROC would not apply: run as nobody
        self.root.chmod(0o711)  # the sandbox user must reach its own directories below
        etc = self.root / "etc"
        etc.mkdir()
        for name, text in ETC_FILES.items():
            (etc / name).write_text(text)
        self.fixed_args = self._fixed_args(etc)
        self._check_works()

    def _fixed_args(self, etc: Path) -> list[str]:
        args = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session",
                "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
                "--ro-bind", "/usr", "/usr"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            path = Path("/", name)
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                args += ["--ro-bind", str(path), str(path)]
        args += ["--proc", "/proc", "--dev", "/dev", "--dir", "/etc"]
        for name in ETC_FILES:
            args += ["--ro-bind", str(etc / name), f"/etc/{name}"]
        for name in HOST_ETC:
            if Path("/etc", name).exists():
                args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        return args + ["--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/work",
                       "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8", "--chdir", "/work"]

    def _check_works(self) -> None:
        probe = self.create()
        result = probe.exec(["true"], timeout=30)
        probe.destroy()
        if result.exit_code != 0:
            self.close()
            reason = result.stderr.decode(errors="replace").strip().splitlines() or [f"exit {result.exit_code}"]
            raise SandboxError(f"[agent.environment] type = 'sandbox': bwrap cannot create namespaces here: "
                               f"{reason[0]} (unprivileged user namespaces may be disabled; try type = 'container')")

    def create(self) -> NamespaceSandbox:
        directory = Path(tempfile.mkdtemp(dir=self.root))
        directory.chmod(0o711)
        for sub in ("work", "tmp"):
            (directory / sub).mkdir()
            if self.drop_to_nobody:
                os.chown(directory / sub, NOBODY, NOBODY)
        return NamespaceSandbox(self, directory)

    def close(self) -> None:
        force_remove(self.root)


class NamespaceSandbox(Sandbox):
    def __init__(self, backend: NamespaceBackend, directory: Path):
        super().__init__(backend.options.limits)
        self.backend = backend
        self.directory = directory

    def _exec(self, argv: tuple[str, ...], stdin: bytes, timeout: float) -> ExecResult:
        memory = self.limits.memory_mb << 20
        rlimits = [f"--as={memory}", f"--fsize={memory}", f"--cpu={math.ceil(timeout) + 1}",
                   f"--nproc={self.limits.pids}", "--core=0"]
        command = [*self.backend.fixed_args, "--bind", str(self.directory / "work"), "/work",
                   "--bind", str(self.directory / "tmp"), "/tmp", "--", self.backend.prlimit, *rlimits, "--", *argv]
        identity = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if self.backend.drop_to_nobody else {}
        return run_process(command, stdin, timeout, self.limits.max_output_bytes, kill_tree=_kill_session,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, **identity)

    def destroy(self) -> None:
        force_remove(self.directory)


def _kill_session(proc: subprocess.Popen) -> None:
    """bwrap runs in its own session; its sandbox child dies with it (--die-with-parent)
    and takes the whole PID namespace along."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reap_orphan_dirs(parent: Path) -> int:
    """Removes workspace trees left by runs that died without cleaning up."""
    orphans = []
    for path in parent.glob(f"{DIR_PREFIX}*"):
        tag = "-".join(path.name[len(DIR_PREFIX):].split("-")[:2])
        if path.is_dir() and owner.is_dead(tag):
            orphans.append(path)
    for path in orphans:
        force_remove(path)
    return len(orphans)
