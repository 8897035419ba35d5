"""Rewards for GRPO: an external program speaking the retrograd reward protocol, or a Python function.

Every reward is a `Reward`: `score(prompts, completions) -> rewards` for one batch, then `close()`
(or use it as a context manager). A prompt is the content of the last user message, without
template markup (`prompt_of`), exactly what retrograd's reward programs expect, so they run unchanged.

Reward command protocol (retrograd-reward/1), one JSON object per line on each side:
- we send `{"prompt": ..., "completion": ...}` per answer, plus `"reference"` (the answer a held-out
  record ends with) where the prompt has one; the program replies `{"reward": <finite>}` per request,
  in order. In a run with a judge (`judge_weight_allowed`), a reply may add `"judge_weight": <finite
  >= 0>`, which replaces grpo.judge_weight for that completion; `judge_weights` then holds each
  reply's (None where it gave none). Its argv runs directly, never through a shell; a program path with a slash
  resolves against the working directory, a bare name against PATH.
- persistent (default): one worker for the whole run. It must echo the handshake
  `{"protocol":"retrograd-reward/1"}`; each request carries `_retrograd_batch` / `_retrograd_index`
  and each reply echoes both; `{"_retrograd_batch_end": B}` closes a batch and is echoed too. Lines
  are flushed because stdin stays open; a stdout line holds at most 8 MiB; a late or extra line is a
  protocol error; a failed batch kills the worker (the next batch starts a fresh one); `close()`
  closes stdin and kills the process group shortly after if it has not exited.
- oneshot: one process per batch that reads all of stdin and needs no extra fields.
`timeout_seconds` bounds each batch, start-up included. A program runs in its own session, and any
failure kills its whole process group, so what it spawned dies with it.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import json
import math
import numbers
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from retrograd.errors import RetrogradError

HANDSHAKE = {"protocol": "retrograd-reward/1"}
MAX_LINE_BYTES = 8 * 1024 * 1024
_CLOSE_GRACE_SECONDS = 2.0  # what a persistent worker gets to exit on its own once stdin is closed
_EXIT_GRACE_SECONDS = 0.5  # how long a program whose stdout ended gets to show its exit
_POLL_SECONDS = 0.05  # how often a wait checks whether the program itself has exited
_READ_BYTES = 64 * 1024
_STDERR_KEPT_BYTES = 64 * 1024
_STDERR_TAIL_LINES = 5
_EXCERPT_CHARS = 120


References = Sequence[str | None] | None


class RewardError(RetrogradError):
    """A reward program or function failed, or cannot be set up; the message names it and the cause."""


class Reward(abc.ABC):
    """One batch in, one finite reward per completion out, in order."""

    judge_weight_allowed = False  # set by a run with a judge: a program's replies may carry "judge_weight"
    judge_weights: Sequence[float | None] = ()  # the last batch's, one per reply (reward programs only)

    @abc.abstractmethod
    def score(self, prompts: list[str], completions: list[str], references: References = None) -> list[float]:
        """The rewards of `completions` (each answering the prompt at the same index, whose
        reference answer is at that index of `references`: None where it has none)."""

    def close(self) -> None:
        """Release what the reward holds (a worker process); scoring again afterwards starts afresh."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def prompt_of(messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt a reward sees: the content of the last user message of a chat."""
    user_contents = [message["content"] for message in messages if message["role"] == "user"]
    assert user_contents, "rollout prompts end on a user message"
    return user_contents[-1]


def make_reward(
    *,
    command: Sequence[str] | None = None,
    mode: str = "persistent",
    timeout_seconds: float = 300.0,
    function: str | None = None,
) -> Reward:
    """The reward a run configured: `command` (argv, with `mode` and `timeout_seconds`) or
    `function` ("module:function" or "path/to/file.py:function"). Checks what it can now, so a
    missing program or module fails before any model is loaded."""
    if (command is None) == (function is None):
        raise RewardError("a reward needs exactly one of reward_command (argv) or reward_function ('module:function')")
    if function is not None:
        return FunctionReward(function)
    if mode not in _COMMAND_REWARDS:
        raise RewardError(f"reward_mode {mode!r} is not one of {', '.join(map(repr, _COMMAND_REWARDS))}")
    return _COMMAND_REWARDS[mode](command, timeout_seconds)


# ---------------------------------------------------------------------------------------------
# In-process rewards


class FunctionReward(Reward):
    """A Python function `f(prompts: list[str], completions: list[str]) -> list[float]` scores a whole
    batch at once, like a TRL reward function; a batch with reference answers also passes
    `reference=` (a list, None where a prompt has none), as TRL passes a dataset's columns."""

    def __init__(self, spec: str):
        self.spec = spec
        self._function = _load_function(spec)

    def score(self, prompts: list[str], completions: list[str], references: References = None) -> list[float]:
        assert len(prompts) == len(completions)
        columns = {"reference": list(references)} if references and any(r is not None for r in references) else {}
        try:
            result = self._function(list(prompts), list(completions), **columns)
        except Exception as exc:  # any failure of user code ends the run with one line naming it
            raise RewardError(
                f"reward function {self.spec!r} raised {type(exc).__name__}: {_one_line(str(exc))}"
            ) from exc
        rewards = result.tolist() if hasattr(result, "tolist") else result  # numpy / torch vectors
        n = len(completions)
        if not isinstance(rewards, (list, tuple)) or len(rewards) != n:
            raise RewardError(
                f"reward function {self.spec!r} returned {_describe(rewards)} for {n} completions, "
                f"expected a list of {n} finite numbers"
            )
        values = [_finite(reward) for reward in rewards]
        if None in values:
            index = values.index(None)
            raise RewardError(
                f"reward function {self.spec!r} returned {rewards[index]!r} at index {index}, expected a finite number"
            )
        return values


def _load_function(spec: str):
    module_name, colon, function_name = spec.rpartition(":")  # rpartition: a Windows path has a colon too
    if not colon or not module_name or not function_name.isidentifier():
        raise RewardError(f"reward_function {spec!r} must look like 'module:function' or 'path/to/file.py:function'")
    is_path = module_name.endswith(".py") or "/" in module_name or os.sep in module_name
    try:
        module = _import_file(Path(module_name)) if is_path else _import_from_cwd(module_name)
    except RewardError:
        raise
    except Exception as exc:  # ImportError, or anything the module raises while it loads
        raise RewardError(
            f"reward_function {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {_one_line(str(exc))}"
        ) from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(f"reward_function {spec!r}: {module_name!r} has no function {function_name!r}")
    return function


def _import_file(path: Path):
    if not path.is_file():
        raise RewardError(
            f"reward_function file {str(path)!r} not found (relative to the working directory {os.getcwd()})"
        )
    name = f"_retrograd_reward_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickle look their module up here
    module_spec.loader.exec_module(module)
    return module


def _import_from_cwd(name: str):
    """Import with the working directory searched first, as `python -m` would; the installed
    `retrograd` script does not have it on sys.path."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # the module may have been written after the directory was listed
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(cwd)


# ---------------------------------------------------------------------------------------------
# Reward programs


class CommandReward(Reward):
    """What both protocol modes share: a checked argv and the per-batch deadline."""

    def __init__(self, argv: Sequence[str], timeout_seconds: float):
        if isinstance(argv, str) or not argv or not all(isinstance(arg, str) for arg in argv):
            raise RewardError(f"reward_command {argv!r} must be a non-empty list of strings (argv, no shell)")
        if not (isinstance(timeout_seconds, (int, float)) and 0 < timeout_seconds < math.inf):
            raise RewardError(f"reward_timeout_seconds {timeout_seconds!r} must be a positive number of seconds")
        _check_program(argv[0])
        self.argv = list(argv)
        self.timeout_seconds = float(timeout_seconds)

    def _error(self, process: _Process | None, failure: _Failure) -> RewardError:
        """Kill the program's group and say what went wrong, with its exit status and stderr tail."""
        message = f"reward program {shlex.join(self.argv)!r} {failure}"
        if process is not None:
            status = process.kill()
            if status:
                message += f" ({_describe_status(status)})"
            if tail := process.stderr_tail():
                message += f"; stderr: {tail}"
        return RewardError(message)


class PersistentCommandReward(CommandReward):
    """One worker serves every batch of the run (reward_mode = "persistent")."""

    def __init__(self, argv: Sequence[str], timeout_seconds: float):
        super().__init__(argv, timeout_seconds)
        self._process: _Process | None = None
        self._batch = 0

    def score(self, prompts: list[str], completions: list[str], references: References = None) -> list[float]:
        assert len(prompts) == len(completions)
        if not completions:
            return []
        deadline = time.monotonic() + self.timeout_seconds  # the first batch's deadline covers start-up
        try:
            if self._process is None:
                self._process = _Process(self.argv, self.timeout_seconds)
                self._handshake(deadline)
            return self._exchange(_requests(prompts, completions, references), deadline)
        except _Failure as failure:
            process, self._process = self._process, None
            raise self._error(process, failure) from None
        finally:
            self._batch += 1

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.close_stdin()
            process.wait(time.monotonic() + _CLOSE_GRACE_SECONDS)
            process.kill()

    def _handshake(self, deadline: float) -> None:
        expected = _json_line(HANDSHAKE).decode().strip()
        self._process.send(_json_line(HANDSHAKE))
        try:
            line = self._process.expect_line(deadline, f"the echo of the protocol handshake {expected}")
            if _decoded(line) != HANDSHAKE:
                raise _Failure(f"answered the protocol handshake with {_excerpt(line)} instead of echoing {expected}")
        except _Failure as failure:
            raise _Failure(
                f"{failure}: a program that reads all of stdin before answering speaks only the one-shot "
                'protocol; set reward_mode = "oneshot", or make it echo the handshake'
            ) from None

    def _exchange(self, requests: list[dict], deadline: float) -> list[float]:
        process, batch, n = self._process, self._batch, len(requests)
        if (stray := process.line_now()) is not None:
            raise _Failure(f"printed a line after batch {batch - 1} ended: {_excerpt(stray)}")
        numbered = [request | {"_retrograd_batch": batch, "_retrograd_index": i} for i, request in enumerate(requests)]
        end = {"_retrograd_batch_end": batch}
        process.send(b"".join(map(_json_line, [*numbered, end])))
        answers = []
        for index in range(n):
            request = f"request {index + 1} of {n} (batch {batch})"
            line = process.expect_line(deadline, f"the answer to {request}")
            if isinstance(answer := _decoded(line), dict) and "_retrograd_batch_end" in answer:
                raise _Failure(f"ended batch {batch} after {index} answers for {n} requests")
            echo = {"_retrograd_batch": batch, "_retrograd_index": index}
            answers.append(_reward_in(line, echo, request, self.judge_weight_allowed))
        line = process.expect_line(deadline, f"the echo of the end of batch {batch}")
        if _decoded(line) != end:
            raise _Failure(f"answered the end of batch {batch} with {_excerpt(line)}, expected {json.dumps(end)}")
        self.judge_weights = [weight for _, weight in answers]
        return [reward for reward, _ in answers]


class OneshotCommandReward(CommandReward):
    """A fresh process per batch reads every request, then answers (reward_mode = "oneshot")."""

    def score(self, prompts: list[str], completions: list[str], references: References = None) -> list[float]:
        assert len(prompts) == len(completions)
        if not completions:
            return []
        deadline = time.monotonic() + self.timeout_seconds
        process = None
        try:
            process = _Process(self.argv, self.timeout_seconds)
            requests = _requests(prompts, completions, references)
            process.send(b"".join(map(_json_line, requests)))
            process.close_stdin()
            answers = self._answers(process, len(requests), deadline, self.judge_weight_allowed)
            status = process.wait(deadline)
            if status is None:
                raise _Failure(f"printed its answers but did not exit within {self.timeout_seconds:g}s")
            if status != 0:
                raise _Failure("failed after printing its answers")
        except _Failure as failure:
            raise self._error(process, failure) from None
        process.kill()  # whatever it left running in its group goes with it
        self.judge_weights = [weight for _, weight in answers]
        return [reward for reward, _ in answers]

    @staticmethod
    def _answers(process: _Process, n: int, deadline: float, judge_weight: bool) -> list[tuple[float, float | None]]:
        answers = []
        while (line := process.next_line(deadline, _awaited_in_oneshot(len(answers), n))) is not None:
            if len(answers) == n:
                raise _Failure(f"printed more than {n} lines for {n} requests, extra line: {_excerpt(line)}")
            answers.append(_reward_in(line, {}, f"request {len(answers) + 1} of {n}", judge_weight))
        if len(answers) < n:
            raise _Failure(f"{process.how_output_ended()} after printing {len(answers)} answers for {n} requests")
        return answers


def _requests(prompts: list[str], completions: list[str], references: References) -> list[dict]:
    """The protocol's requests: prompt and completion, and the reference answer where there is one."""
    references = references or [None] * len(prompts)
    return [{"prompt": prompt, "completion": completion} | ({"reference": reference} if reference is not None else {})
            for prompt, completion, reference in zip(prompts, completions, references, strict=True)]


def _awaited_in_oneshot(answered: int, n: int) -> str:
    return f"the answer to request {answered + 1} of {n}" if answered < n else "the end of its output"


_COMMAND_REWARDS = {"persistent": PersistentCommandReward, "oneshot": OneshotCommandReward}


# ---------------------------------------------------------------------------------------------
# Lines of the protocol


class _Failure(Exception):
    """Something the program did wrong, said as the rest of a sentence that starts with its name."""


def _json_line(obj: dict) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return (text + "\n").encode("utf-8", "replace")  # "replace": a lone surrogate cannot go out as UTF-8


def _decoded(line: bytes):
    """The JSON value of a line, or None when it is not JSON (no valid reply is null)."""
    try:
        return json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None


def _reward_in(line: bytes, echo: dict, what: str, judge_weight: bool = False) -> tuple[float, float | None]:
    """The reward of one reply, which must be exactly {"reward": <finite number>} plus the echoed
    fields (and, where `judge_weight`, optionally "judge_weight": <finite >= 0>), and that weight."""
    answer = _decoded(line)
    expected = ", ".join(['"reward": <finite number>', *(f'"{key}": {value}' for key, value in echo.items())])
    if answer is None:
        raise _Failure(f"answered {what} with {_excerpt(line)}, which is not JSON; expected {{{expected}}}")
    if isinstance(answer, dict) and "judge_weight" in answer and not judge_weight:
        raise _Failure(f'answered {what} with a "judge_weight", which needs a [grpo.judge]: {_excerpt(line)}')
    keys = answer.keys() - {"judge_weight"} if isinstance(answer, dict) else None
    shape_ok = keys == {"reward", *echo}
    if not shape_ok or any(answer[key] != value for key, value in echo.items()):
        raise _Failure(f"answered {what} with {_excerpt(line)}, expected {{{expected}}}")
    reward = _finite(answer["reward"])
    if reward is None:
        raise _Failure(f"answered {what} with reward {answer['reward']!r}, expected a finite number")
    weight = answer.get("judge_weight")
    if weight is not None and ((weight := _finite(weight)) is None or weight < 0):
        raise _Failure(f"answered {what} with judge_weight {answer['judge_weight']!r}, expected a finite number >= 0")
    return reward, weight


def _finite(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer too big for a float
        return None
    return number if math.isfinite(number) else None


def _excerpt(line: bytes) -> str:
    text = line.decode("utf-8", "replace")
    return repr(text[:_EXCERPT_CHARS]) + ("..." if len(text) > _EXCERPT_CHARS else "")


def _one_line(text: str) -> str:
    return " | ".join(part.strip() for part in text.splitlines() if part.strip())


def _describe(value) -> str:
    if isinstance(value, (list, tuple)):
        return f"{len(value)} values"
    return f"a {type(value).__name__}"


def _describe_status(status: int) -> str:
    if status >= 0:
        return f"exit status {status}"
    try:
        return f"killed by {signal.Signals(-status).name}"
    except ValueError:  # a real-time signal has no name
        return f"killed by signal {-status}"


def _check_program(program: str) -> None:
    """Fail at set-up rather than at the first batch when the program cannot run. exec resolves a
    name with a slash against the working directory and a bare name against PATH; so do we."""
    if "/" in program or os.sep in program:
        path = Path(program)
        if not path.is_file():
            raise RewardError(
                f"reward program {program!r} not found (relative paths resolve against the working directory {os.getcwd()})"
            )
        if not os.access(path, os.X_OK):
            raise RewardError(
                f"reward program {program!r} is not executable: chmod +x it, or run it through its interpreter, "
                f'e.g. ["python3", "{program}"]'
            )
    elif shutil.which(program) is None:
        hint = f"; write './{program}' for the file in the working directory" if Path(program).is_file() else ""
        raise RewardError(f"reward program {program!r} not found on PATH{hint}")


# ---------------------------------------------------------------------------------------------
# The process


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone (PermissionError: only zombies left, on macOS)
        pass


class _Process:
    """A reward program in its own session, so that killing its process group also kills what it
    spawned. Its three pipes are non-blocking and pumped by one selector while we wait for a line:
    no threads, and no deadlock however much it prints on stdout or stderr."""

    def __init__(self, argv: list[str], timeout_seconds: float):
        self.timeout_seconds = timeout_seconds
        try:
            self._popen = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
        except OSError as exc:
            raise _Failure(f"cannot be started: {exc.strerror or exc}") from None
        # Kills the group even when an owner forgets close(), at the latest when the interpreter exits.
        self._group_killer = weakref.finalize(self, _kill_group, self._popen.pid)
        self._selector = selectors.DefaultSelector()
        for stream, handler, event in (
            (self._popen.stdout, self._read_stdout, selectors.EVENT_READ),
            (self._popen.stderr, self._read_stderr, selectors.EVENT_READ),
        ):
            os.set_blocking(stream.fileno(), False)
            self._selector.register(stream, event, handler)
        os.set_blocking(self._popen.stdin.fileno(), False)
        self._pending = bytearray()  # bytes still to write to stdin
        self._close_stdin_when_sent = False
        self._partial = bytearray()  # stdout after the last newline
        self._lines: deque[bytes] = deque()
        self._stdout_open = True
        self._stderr = bytearray()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def send(self, data: bytes) -> None:
        if self._popen.stdin.fileno() not in self._registered_fds():
            self._selector.register(self._popen.stdin, selectors.EVENT_WRITE, self._write_stdin)
        self._pending += data

    def close_stdin(self) -> None:
        """Close stdin once everything sent so far is written: the program sees end of input."""
        if self._pending:
            self._close_stdin_when_sent = True
        elif not self._popen.stdin.closed:
            self._popen.stdin.close()

    def next_line(self, deadline: float, what: str) -> bytes | None:
        """The next stdout line, or None once stdout is closed or the program exited without printing more."""
        while not self._lines:
            if not self._stdout_open:
                return None
            if self._popen.poll() is not None:
                self._drain()  # what it printed before exiting, not waiting for children that hold stdout
                self._end_stdout()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Failure(f"timed out after {self.timeout_seconds:g}s (reward_timeout_seconds) waiting for {what}")
            self._pump(min(remaining, _POLL_SECONDS))
        return self._lines.popleft()

    def expect_line(self, deadline: float, what: str) -> bytes:
        line = self.next_line(deadline, what)
        if line is None:
            raise _Failure(f"{self.how_output_ended()} before sending {what}")
        return line

    def how_output_ended(self) -> str:
        """A program that exits closes stdout a moment before the exit is visible: wait that moment."""
        try:
            self._popen.wait(_EXIT_GRACE_SECONDS)
            return "exited"
        except subprocess.TimeoutExpired:
            return "closed its stdout"

    def line_now(self) -> bytes | None:
        """A line already printed, without waiting: between batches there must be none."""
        self._drain()
        return self._lines.popleft() if self._lines else None

    def wait(self, deadline: float) -> int | None:
        """The exit status, or None if the program still runs at the deadline."""
        while (status := self._popen.poll()) is None and (remaining := deadline - time.monotonic()) > 0:
            self._pump(min(remaining, _POLL_SECONDS))
        return status

    def kill(self) -> int | None:
        """Kill the whole group and reap the program; its exit status if it had exited by itself."""
        status = self._popen.poll()
        self._group_killer()
        self._popen.wait()
        for stream in (self._popen.stdin, self._popen.stdout):
            self._forget(stream)
        self._drain()  # the last of stderr, for the error message
        self._selector.close()
        for stream in (self._popen.stdin, self._popen.stdout, self._popen.stderr):
            self._close_quietly(stream)
        return status

    def stderr_tail(self) -> str:
        lines = [line.strip() for line in self._stderr.decode("utf-8", "replace").splitlines() if line.strip()]
        return " | ".join(line[:200] for line in lines[-_STDERR_TAIL_LINES:])

    def _pump(self, timeout: float) -> int:
        """Move bytes between us and the program for up to `timeout` seconds; returns the events handled."""
        if not self._selector.get_map():
            time.sleep(timeout)
            return 0
        events = self._selector.select(timeout)
        for key, _ in events:
            key.data()
        return len(events)

    def _drain(self) -> None:
        while self._pump(0):
            pass

    def _read(self, stream) -> bytes | None:
        """Up to one chunk; b"" at end of file, None when there is nothing to take right now."""
        try:
            chunk = os.read(stream.fileno(), _READ_BYTES)
        except BlockingIOError:
            return None
        if not chunk:
            self._forget(stream)
        return chunk

    def _read_stdout(self) -> None:
        chunk = self._read(self._popen.stdout)
        if chunk == b"":
            self._end_stdout()
        if not chunk:
            return
        start = len(self._partial)
        self._partial += chunk
        while (end := self._partial.find(b"\n", start)) >= 0:
            self._lines.append(bytes(self._partial[:end]))
            del self._partial[: end + 1]
            start = 0
        if len(self._partial) > MAX_LINE_BYTES:
            raise _Failure(f"printed a stdout line longer than {MAX_LINE_BYTES // 2**20} MiB")

    def _end_stdout(self) -> None:
        """No more stdout will be read: a last line without a newline still counts."""
        if self._partial:
            self._lines.append(bytes(self._partial))
            self._partial.clear()
        self._stdout_open = False

    def _read_stderr(self) -> None:
        self._stderr += self._read(self._popen.stderr) or b""
        del self._stderr[:-_STDERR_KEPT_BYTES]

    def _write_stdin(self) -> None:
        try:
            written = os.write(self._popen.stdin.fileno(), self._pending[:_READ_BYTES])
        except BlockingIOError:
            return
        except BrokenPipeError:  # it stopped reading; its answers (or its exit) say what went wrong
            written = len(self._pending)
        del self._pending[:written]
        if not self._pending:
            self._forget(self._popen.stdin)
            if self._close_stdin_when_sent:
                self._popen.stdin.close()

    def _registered_fds(self) -> set[int]:
        return {key.fd for key in self._selector.get_map().values()}

    def _forget(self, stream) -> None:
        if not stream.closed and stream.fileno() in self._registered_fds():
            self._selector.unregister(stream)

    @staticmethod
    def _close_quietly(stream) -> None:
        try:
            stream.close()
        except OSError:  # a broken pipe while flushing: the program is gone anyway
            pass
