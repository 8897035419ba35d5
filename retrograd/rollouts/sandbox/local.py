"""`type = "local"`: a temporary directory on this host, no isolation at all.
Refused unless `allow_unsandboxed = true` (checked in options.py). Only the exec
timeout and the output cap apply; paths under the temp dir can leak into
observations, so runs are not fully deterministic (notes §5). Folders live in the
private per-user parent of cleanup.py and are removed without following the links
a command may have planted."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

import psutil

from retrograd.rollouts.sandbox.base import ExecResult, Sandbox, run_process
from retrograd.rollouts.sandbox.cleanup import force_remove, make_folder
from retrograd.rollouts.sandbox.options import EnvironmentOptions


class LocalBackend:
    def __init__(self, options: EnvironmentOptions):
        self.options = options
        self.root = make_folder("local")

    def create(self) -> LocalSandbox:
        return LocalSandbox(self.options, Path(tempfile.mkdtemp(dir=self.root)))

    def close(self) -> None:
        force_remove(self.root)


class LocalSandbox(Sandbox):
    def __init__(self, options: EnvironmentOptions, directory: Path):
        super().__init__(options.limits)
        self.directory = directory
        self.workdir = str(directory / "work")
        self.tmpdir = str(directory / "tmp")
        os.mkdir(self.workdir)
        os.mkdir(self.tmpdir)

    def _exec(self, argv: tuple[str, ...], stdin: bytes, timeout: float) -> ExecResult:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.workdir, "TMPDIR": self.tmpdir,
               "LANG": "C.UTF-8"}
        return run_process(argv, stdin, timeout, self.limits.max_output_bytes, kill_tree=_kill_tree,
                           cwd=self.workdir, env=env)

    def destroy(self) -> None:
        force_remove(self.directory)


def _kill_tree(proc: subprocess.Popen) -> None:
    """The session and every descendant still attached; a daemon that re-parented
    itself away escapes, which is why this environment is opt-in."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for process in children:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
