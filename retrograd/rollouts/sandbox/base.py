"""What every sandbox offers a trajectory: `exec` with a timeout and capped output,
scenario files and setup, verify, workspace reset and close. The backends
(container.py, namespace.py, local.py) implement only `_exec` and `destroy`, and
`_exec_as_verifier` where they have a second uid to run verify under."""

from __future__ import annotations

import abc
import contextlib
import os
import posixpath
import selectors
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from retrograd.errors import RetrogradError
from retrograd.rollouts.sandbox.options import Limits, ScenarioEnv, VerifySpec

# Writes stdin to $1, creating parent directories; only sh, mkdir, dirname and cat are needed.
# Exit codes 3-5 say why it failed, in WRITE_ERRORS' fixed words (no host path, no errno text).
WRITE_SCRIPT = ('[ -d "$1" ] && exit 3; mkdir -p -- "$(dirname -- "$1")" 2>/dev/null || exit 4; '
                'cat > "$1" 2>/dev/null || exit 5')
WRITE_ERRORS = {3: "it is a directory", 4: "its parent directory cannot be created",
                5: "it cannot be written (no space left or no permission)"}
# Empties the workspace ($1) and the other scratch dirs ($2...) and fails unless all end up empty.
WIPE_SCRIPT = ('chmod -R u+rwX -- "$@" 2>/dev/null; chmod 755 "$1" 2>/dev/null; '
               'find "$@" -mindepth 1 -delete 2>/dev/null; '
               'test -z "$(find "$@" -mindepth 1 -print -quit)"')
# Writes stdin to the path $2/$3/.../$N under the workspace $1, replacing whatever is there. A link or
# file on the way is removed, never followed, and so is the bytecode Python may have cached for it.
RESTORE_SCRIPT = ('chmod u+rwx -- "$1" 2>/dev/null; cd -- "$1" || exit 4; shift; '
                  'while [ $# -gt 1 ]; do '
                  '{ [ -L "$1" ] || { [ -e "$1" ] && [ ! -d "$1" ]; }; } && rm -f -- "$1"; '
                  '[ -d "$1" ] || mkdir -- "$1" || exit 4; chmod u+rwx -- "$1"; cd -- "$1" || exit 4; shift; done; '
                  'chmod -R u+rwX -- "$1" 2>/dev/null; rm -rf -- "$1" "__pycache__/${1%.py}".* || exit 5; '
                  'cat > "$1" || exit 5')
# Runs "$@" (after $1, the text of a sitecustomize.py) as a trusted program: verify, or a tool whose
# output the trainer believes. Python finds nothing of the workspace before its own modules: no script
# dir or cwd first on sys.path (PYTHONSAFEPATH; the sitecustomize, written to a fresh private dir, appends
# it last), no user site under a HOME the policy can write, no bytecode written into the workspace.
TRUSTED_SCRIPT = ('g=$(mktemp -d) || exit 125; printf %s "$1" > "$g/sitecustomize.py" || exit 125; shift; '
                  'export HOME="$g" PYTHONPATH="$g" PYTHONSAFEPATH=1 PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1; '
                  '"$@"; status=$?; rm -rf -- "$g"; exit $status')
SITE_CUSTOMIZE = """\
import os, sys
main = sys.argv[0] if sys.argv else ""
sys.path.append(os.getcwd() if main in ("", "-", "-c", "-m") else
                os.path.dirname(os.path.realpath(main)) if os.path.isfile(main) else main)
"""
KILL_GRACE_SECS = 5.0  # after a timeout kill, how long the streams may take to close


class SandboxError(RetrogradError):
    """A sandbox cannot be provided (no daemon, missing image or tool) or a scenario's setup failed."""


class SandboxBroken(RetrogradError):
    """The sandbox itself failed (container gone, daemon error): the trajectory is lost."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int  # 128 + N when killed by signal N
    stdout: bytes  # at most limits.max_output_bytes each
    stderr: bytes
    timed_out: bool = False  # killed at the timeout, with every process it started
    truncated: bool = False  # stdout or stderr went past max_output_bytes


class Sandbox(abc.ABC):
    """One trajectory's private machine. One call at a time: a trajectory acts in
    sequence, and a timeout kill may take down everything running in the sandbox.
    `workdir` is the workspace as commands see it (`/work` except for `local`)."""

    workdir = "/work"
    tmpdir = "/tmp"
    scratch_dirs: tuple[str, ...] = ()  # other places a command can leave files in; reset empties them too
    wipe_script = WIPE_SCRIPT

    def __init__(self, limits: Limits):
        self.limits = limits
        self.broken = False
        self.leases = 0  # episodes served, counted by the pool
        self.exec_count = 0
        self.timeout_count = 0
        self.release: Callable[[Sandbox], None] | None = None  # set by the pool while leased

    def exec(self, argv: Sequence[str], stdin: bytes = b"", timeout: float | None = None,
             as_verifier: bool = False) -> ExecResult:
        """`as_verifier`: run as the verifier's uid where the backend has one (see _exec_as_verifier)."""
        if self.broken:
            raise SandboxBroken("the sandbox is broken and cannot run commands")
        timeout = self.limits.exec_timeout_secs if timeout is None else timeout
        run = self._exec_as_verifier if as_verifier else self._exec
        try:
            result = run(tuple(argv), bytes(stdin), float(timeout))
        except SandboxBroken:
            self.broken = True
            raise
        self.exec_count += 1
        self.timeout_count += result.timed_out
        return result

    def write(self, path: str, data: bytes) -> ExecResult:
        return self.exec(["sh", "-c", WRITE_SCRIPT, "sh", path], stdin=data)

    def prepare(self, env: ScenarioEnv, setup_timeout: float, where: str) -> None:
        """Writes the scenario's files into the workspace, then runs its setup commands
        within `setup_timeout` seconds in all; any failure raises SandboxError."""
        deadline = time.monotonic() + setup_timeout
        for path, text in env.files:
            result = self.write(posixpath.join(self.workdir, path), text.encode())
            if result.exit_code != 0:
                why = WRITE_ERRORS.get(result.exit_code, f"exit code {result.exit_code}")
                raise SandboxError(f"{where}.files: cannot write {path!r}: {why}")
        for i, argv in enumerate(env.setup):
            result = self.exec(argv, timeout=max(deadline - time.monotonic(), 0.001))
            if result.timed_out:
                raise SandboxError(f"{where}.setup[{i}] ({shlex.join(argv)}): did not finish within the "
                                   f"{setup_timeout:g} s setup budget")
            if result.exit_code != 0:
                raise SandboxError(f"{where}.setup[{i}] ({shlex.join(argv)}): exited with {result.exit_code}: "
                                   f"{_first_line(result.stderr or result.stdout)}")

    def verify(self, spec: VerifySpec, timeout: float, stdin: bytes = b"") -> float:
        """The terminal reward: reward_on_success when the command exits 0 in time, else 0.0.
        The check files are written afresh first (no command of the policy runs any more),
        then the command runs as a trusted program, as the verifier."""
        deadline = time.monotonic() + timeout
        for path, text in spec.check_files:
            parts = posixpath.normpath(path).split("/")
            result = self.exec(["sh", "-c", RESTORE_SCRIPT, "sh", self.workdir, *parts], stdin=text.encode(),
                               timeout=max(deadline - time.monotonic(), 0.001))
            if result.exit_code != 0 or result.timed_out:  # the policy filled or locked its workspace
                return 0.0
        result = self.exec(trusted(spec.command), stdin=stdin, timeout=max(deadline - time.monotonic(), 0.001),
                           as_verifier=True)
        return spec.reward_on_success if result.exit_code == 0 and not result.timed_out else 0.0

    def close(self) -> None:
        """Ends this trajectory's lease: the pool wipes and keeps it, or destroys it.
        Closing again does nothing (the sandbox may already serve someone else)."""
        release, self.release = self.release, None
        if release is not None:
            release(self)

    def destroy_quietly(self) -> None:
        with contextlib.suppress(Exception):  # best effort: the backend's close and the reaper sweep the rest
            self.destroy()

    def reset(self) -> bool:
        """Makes the sandbox look new for the next episode; False when that failed."""
        result = self.exec(self.wipe_command(), timeout=30)
        return result.exit_code == 0 and not result.timed_out

    def wipe_command(self) -> list[str]:
        return ["sh", "-c", self.wipe_script, "sh", self.workdir, self.tmpdir, *self.scratch_dirs]

    @abc.abstractmethod
    def _exec(self, argv: tuple[str, ...], stdin: bytes, timeout: float) -> ExecResult:
        """Run argv in the sandbox (the backend's own way), bounded by `timeout` and the limits."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Remove the sandbox and everything it started."""

    def _exec_as_verifier(self, argv: tuple[str, ...], stdin: bytes, timeout: float) -> ExecResult:
        """Like _exec, as a uid that the policy's commands run under neither, so that they cannot
        change what verify reads or runs. A backend without a second uid runs it as the policy's;
        its calls still never overlap the policy's (they leave no process behind)."""
        return self._exec(argv, stdin, timeout)


def trusted(argv: Sequence[str]) -> list[str]:
    """argv wrapped to run as a trusted program (TRUSTED_SCRIPT)."""
    return ["sh", "-c", TRUSTED_SCRIPT, "sh", SITE_CUSTOMIZE, *argv]


def _first_line(data: bytes) -> str:
    lines = data.decode("utf-8", "replace").strip().splitlines()
    return lines[0] if lines else "(no output)"


# --- moving bytes with a deadline ---------------------------------------------------------------

class CappedBuffer:
    """Keeps the first `limit` bytes of a stream and remembers whether more came."""

    def __init__(self, limit: int):
        self.data = bytearray()
        self.limit = limit
        self.truncated = False

    def write(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        self.truncated |= len(chunk) > room
        self.data += chunk[:max(room, 0)]


def pump(reads: dict[int, Callable[[bytes], None]], write_fd: int | None, data: bytes,
         end_write: Callable[[], None], deadline: float) -> bool:
    """Writes `data` to `write_fd` (then calls `end_write`) while feeding whatever
    arrives on `reads` to its sink, until every read fd reached EOF. Returns False
    when the deadline came first. A write fd may also be a read fd (a socket)."""
    pending = memoryview(data)
    if write_fd is not None and not pending:
        end_write()
        write_fd = None

    def interest(fd: int) -> int:
        return (selectors.EVENT_READ if fd in reads else 0) | (selectors.EVENT_WRITE if fd == write_fd else 0)

    with selectors.DefaultSelector() as selector:
        for fd in set(reads) | ({write_fd} - {None}):
            os.set_blocking(fd, False)
            selector.register(fd, interest(fd))
        while reads:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return False
            for key, events in selector.select(timeout):
                fd, finished_writing = key.fd, False
                if events & selectors.EVENT_WRITE:
                    try:
                        pending = pending[os.write(fd, pending[:1 << 16]):]
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError:  # the command stopped reading: drop the rest of stdin
                        pending = pending[len(pending):]
                    if not pending:
                        write_fd, finished_writing = None, True
                if events & selectors.EVENT_READ:
                    try:
                        chunk = os.read(fd, 1 << 16)
                    except (BlockingIOError, InterruptedError):
                        chunk = None
                    except OSError:
                        chunk = b""
                    if chunk:
                        reads[fd](chunk)
                    elif chunk == b"":
                        del reads[fd]
                if interest(fd):
                    selector.modify(fd, interest(fd))
                else:
                    selector.unregister(fd)
                if finished_writing:
                    end_write()
    return True


def exit_status(returncode: int) -> int:
    """subprocess reports death by signal N as -N; shells and Docker say 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def run_process(argv: Sequence[str], stdin: bytes, timeout: float, limit: int,
                kill_tree: Callable[[subprocess.Popen], None], **popen) -> ExecResult:
    """Runs a host process (local and namespace sandboxes) in its own session;
    at the deadline `kill_tree` ends it and everything it started."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, **popen)
    except FileNotFoundError:
        return ExecResult(exit_code=127, stdout=b"", stderr=f"{argv[0]}: command not found\n".encode())
    out, err = CappedBuffer(limit), CappedBuffer(limit)
    deadline = time.monotonic() + timeout
    with proc:
        finished = pump({proc.stdout.fileno(): out.write, proc.stderr.fileno(): err.write},
                        proc.stdin.fileno(), stdin, proc.stdin.close, deadline)
        try:
            proc.wait(max(deadline - time.monotonic(), 0) if finished else 0)
        except subprocess.TimeoutExpired:
            finished = False
        if not finished:
            kill_tree(proc)
            proc.wait()
    return ExecResult(exit_code=exit_status(proc.returncode), stdout=bytes(out.data), stderr=bytes(err.data),
                      timed_out=not finished, truncated=out.truncated or err.truncated)
