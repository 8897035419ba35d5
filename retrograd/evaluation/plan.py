"""`retrograd preflight RUN.toml`: will this run fit in memory, and how long will a step take?

Each answer is measured, not computed: a probe runs the run's own recipe in a child process,
with the file's model, ctx, micro-batch, LoRA, dtypes and rollout shapes, for a few steps
(updates, for rollout algorithms) and without evaluation, checkpoints or the real output. The
parent samples the child's memory (its process tree's RSS) every 20 ms and stops its whole
session once it passes the budget; a child that runs out of memory or that the kernel kills
did not fit either. The peak of the
probe is the predicted peak; the mean time of the steps after the first is the predicted time
per step.

When the run does not fit, the planner climbs down the tuning guide's ladder, each rung from
the file as written: a smaller training.micro_batch (SFT, preference and offline distillation
raise gradient_accumulation with it and stop at ctx, keeping the step's size), a lower
training.generation_concurrency (rollout algorithms sampling here), gradient checkpointing with
bf16 checkpoints; then all of them together. It probes a rung's candidates
from the least to the most invasive and names the first that fits, with its measured numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from retrograd.config import Config
from retrograd.kernels.frozen import HOST_MEMORY_ENV
from retrograd.runtime import allocator
from retrograd.runtime.memory import tree_rss_bytes

PROBE_UNITS = {"steps": 4, "updates": 2}  # the first of each is warm-up and not timed
# ...and then on until this much time was timed: a few one-second steps sample a VM whose speed
# drifts by a third within a minute too briefly to stand for a run of many.
PROBE_MIN_TIMED_SECONDS = 6.0
MIN_MICRO_BATCH = 16
WATCH_INTERVAL = 0.02


@dataclass(frozen=True)
class Probe:
    """What one probe measured. `fits` is False when it passed the budget (it was stopped)."""

    label: str  # "as configured" or "rung N"
    rung: str  # what the rung lowers ("" as configured)
    changes: tuple[tuple[str, object], ...]  # (TOML key, value) against the file as written
    fits: bool
    peak_bytes: int  # host RSS of the probe's process tree, sampled every 20 ms
    setup_bytes: int  # the same when the first step began (model, adapter, sampler loaded)
    load_seconds: float
    step_seconds: tuple[float, ...]  # every step (update) the probe ran
    unit: str  # "steps" or "updates"
    total_units: int  # in the full run
    weights: str
    stopped_at: str = ""  # where a probe over budget was stopped
    failure: str = ""  # a rung whose run failed for another reason (the error's first line)

    @property
    def seconds_per_unit(self) -> float | None:
        """Mean of the steps after the first (the first pays one-off warm-up)."""
        timed = self.step_seconds[1:] or self.step_seconds
        return statistics.fmean(timed) if timed else None


class ProbeFailed(Exception):
    """The probe's run stopped with an error of its own (bad data, a diverged loss, ...)."""


# ----------------------------------------------------------------------------- the child


class _ProbeDone(Exception):
    pass


class _ProbeReporter:
    """The recipe's reporter in the child: sends each event to the parent as a JSON line and
    ends the run after `units` steps."""

    def __init__(self, out, units: int | None):
        self.out, self.units, self.base, self.unit = out, units, None, ""
        self.timed_from = 0.0  # when the warm-up step ended

    def _send(self, **event) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

    def message(self, text: str) -> None:
        self._send(kind="message", text=text)

    def start(self, total: int, columns: list[str], unit: str) -> None:
        self.base, self.unit = None, unit
        self._send(kind="start", total=total, unit=unit)

    def row(self, values: dict) -> None:
        pass

    def advance(self, done: int, status: str) -> None:
        if self.unit not in PROBE_UNITS:  # a table before training (offline distillation's teacher pass)
            return
        if self.base is None:  # the first call reports where the run starts
            self.base = done
            return
        self._send(kind="step", done=done)
        if done - self.base == 1:
            self.timed_from = time.monotonic()
        if self.units is not None:
            if done - self.base >= self.units:
                raise _ProbeDone
        elif done - self.base >= PROBE_UNITS[self.unit] and time.monotonic() - self.timed_from >= PROBE_MIN_TIMED_SECONDS:
            raise _ProbeDone

    def finish(self) -> None:
        pass

    def checkpoint(self, path: Path) -> None:
        pass


def _child(config_file: str, units: int | None, events_fd: int) -> None:
    from retrograd.errors import RetrogradError
    from retrograd.recipes import RECIPES

    cfg = pickle.loads(Path(config_file).read_bytes())
    out = os.fdopen(events_fd, "w")
    reporter = _ProbeReporter(out, units)
    try:
        RECIPES[cfg.run.algorithm](cfg, reporter)
    except _ProbeDone:
        pass
    except RetrogradError as e:
        reporter._send(kind="error", text=str(e))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, traceback in the log
        import traceback

        traceback.print_exc()
        first_line = (str(e).splitlines() or [""])[0]
        out_of_memory = isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in first_line
        reporter._send(kind="out_of_memory" if out_of_memory else "error", text=f"{type(e).__name__}: {first_line}")
    reporter._send(kind="end")
    out.close()
    os._exit(0)  # no waiting on the sampler's or the loaders' threads


# ----------------------------------------------------------------------------- the parent


def run_probe(cfg: Config, budget: int, *, units: int | None = None, label: str = "as configured", rung: str = "",
              changes: tuple = (), on_event=None) -> Probe:
    """Run the recipe of `cfg` for `units` steps in a child process (a session of its own, so
    that it and everything it started can be stopped together), stopping it past `budget`
    bytes of host memory. A child the kernel killed, or that ran out of memory, did not fit."""
    with tempfile.TemporaryDirectory(prefix="retrograd-preflight-") as scratch:
        scratch = Path(scratch)
        (scratch / "config.pickle").write_bytes(pickle.dumps(cfg.scratch_run(scratch / "probe.gguf")))
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        log_path = scratch / "probe.log"
        with open(log_path, "wb") as log:
            child = subprocess.Popen(
                [sys.executable, "-c", f"from retrograd.evaluation.plan import _child; _child({str(scratch / 'config.pickle')!r}, {units}, {write_fd})"],
                pass_fds=(write_fd,), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=os.environ | allocator.preload_env() | {"PYTHONWARNINGS": "ignore", HOST_MEMORY_ENV: str(budget)},
            )
        os.close(write_fd)
        watcher = _Watcher(child, budget)
        try:
            return watcher.follow(read_fd, (label, rung, changes), on_event, log_path)
        finally:
            os.close(read_fd)
            _stop(child)


class _Watcher:
    def __init__(self, child: subprocess.Popen, budget: int):
        self.child, self.budget = child, budget
        self.started = time.monotonic()
        self.peak = self.setup = 0
        self.load_seconds = 0.0
        self.step_ends: list[float] = []
        self.total, self.unit, self.weights, self.where = 0, "steps", "", "loading the model"

    def follow(self, fd: int, names: tuple, on_event, log_path: Path) -> Probe:
        buffer = b""
        ended, error = False, None
        while not ended:
            rss = tree_rss_bytes(self.child.pid)
            self.peak = max(self.peak, rss)
            if rss > self.budget:
                _stop(self.child)
                return self._probe(names, fits=False)
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                chunk = None
            if chunk == b"" and self.child.poll() is not None:
                break
            buffer += chunk or b""
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                event = json.loads(line)
                ended |= event["kind"] == "end"
                error = event["text"] if event["kind"] == "error" else error
                if event["kind"] == "out_of_memory":
                    self.where += f" ({event['text']})"
                    return self._probe(names, fits=False)
                self._note(event, rss)
                if on_event:
                    on_event(event)
            if not chunk:
                time.sleep(WATCH_INTERVAL)
        if error is not None:
            raise ProbeFailed(error.splitlines()[0])
        if not ended:
            if self.child.wait() == -signal.SIGKILL:  # the kernel's out-of-memory killer, most likely
                self.where += " (killed by the kernel: out of memory)"
                return self._probe(names, fits=False)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
            raise ProbeFailed(f"the probe ended without a result (exit status {self.child.returncode}; {tail[0] if tail else 'no output'})")
        return self._probe(names, fits=True)

    def _note(self, event: dict, rss: int) -> None:
        now = time.monotonic()
        if event["kind"] == "message" and event["text"].startswith("weights: "):
            self.weights = event["text"].removeprefix("weights: ")
        elif event["kind"] == "start" and event["unit"] in PROBE_UNITS:
            self.total, self.unit = event["total"], event["unit"]
            self.setup, self.load_seconds = rss, now - self.started
            self.step_ends = [now]
            self.where = f"{self.unit[:-1]} 1"
        elif event["kind"] == "step":
            self.step_ends.append(now)
            self.where = f"{self.unit[:-1]} {len(self.step_ends)}"

    def _probe(self, names: tuple, *, fits: bool) -> Probe:
        ends = self.step_ends
        label, rung, changes = names
        return Probe(
            label=label, rung=rung, changes=changes, fits=fits, peak_bytes=self.peak, setup_bytes=self.setup,
            load_seconds=self.load_seconds, step_seconds=tuple(b - a for a, b in zip(ends, ends[1:])),
            unit=self.unit, total_units=self.total, weights=self.weights, stopped_at="" if fits else self.where,
        )


def _stop(child: subprocess.Popen) -> None:
    """Kill the child's session (it and what it started), then any descendant that left it."""
    try:
        descendants = psutil.Process(child.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in descendants:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    child.wait()


# ----------------------------------------------------------------------------- the ladder


def rungs(cfg: Config) -> list[tuple[str, list[tuple[tuple[str, object], ...]]]]:
    """The tuning guide's ladder for this run: (rung, candidates from the least to the most
    invasive), each candidate the keys it changes; rungs with no candidate left out."""
    t = cfg.training
    # SFT, preference and offline distillation keep a step's tokens with more accumulation; above ctx, so
    # that every example still fits a micro-batch and a step keeps its examples
    sft_like = cfg.run.algorithm in ("sft", "preference") or (cfg.run.algorithm == "distill" and cfg.distill.mode == "topk_offline")
    floor = max(MIN_MICRO_BATCH, t.ctx) if sft_like else MIN_MICRO_BATCH
    smaller = []
    mb, accumulation = t.micro_batch, t.gradient_accumulation
    while mb // 2 >= floor:
        mb, accumulation = mb // 2, accumulation * 2
        smaller.append((("training.micro_batch", mb),) + ((("training.gradient_accumulation", accumulation),) if sft_like else ()))
    ladder = [("a smaller micro_batch", smaller)]
    concurrency = generation_concurrency(cfg)
    if concurrency is not None and not (cfg.rollout and cfg.rollout.workers):  # remote workers' memory is theirs
        fewer = []
        while concurrency > 1:
            concurrency //= 2
            fewer.append((("training.generation_concurrency", concurrency),))
        ladder.append(("a lower generation_concurrency", fewer))
    if not t.gradient_checkpointing or t.checkpoint_dtype != "bf16":
        ladder.append(("gradient checkpointing in bf16", [(("training.gradient_checkpointing", True), ("training.checkpoint_dtype", "bf16"))]))
    used = [candidates for _, candidates in ladder if candidates]
    if len(used) > 1:  # from each rung's mildest candidate to its last, together
        together = [tuple(change for candidates in used for change in candidates[min(k, len(candidates) - 1)])
                    for k in range(max(map(len, used)))]
        ladder.append(("all of these together", together))
    return [(name, candidates) for name, candidates in ladder if candidates]


def generation_concurrency(cfg: Config) -> int | None:
    """The sequences llama.cpp decodes together in this run, or None when it samples nothing."""
    from retrograd.recipes.common import rollout_sampler_options

    per_update = {
        "ppo": lambda: cfg.ppo.rollout_batch_size,
        "grpo": lambda: cfg.grpo.prompts_per_update * cfg.grpo.group_size,
        "agent_grpo": lambda: cfg.agent.scenarios_per_update * cfg.agent.group_size,
        "distill": lambda: cfg.distill.prompts_per_update * cfg.distill.samples_per_prompt if cfg.distill.mode == "on_policy" else None,
    }.get(cfg.run.algorithm, lambda: None)()
    return None if per_update is None else rollout_sampler_options(cfg, per_update).n_seq_max


def with_changes(cfg: Config, changes: tuple[tuple[str, object], ...]) -> Config:
    training = dataclasses.replace(cfg.training, **{key.split(".", 1)[1]: value for key, value in changes})
    return dataclasses.replace(cfg, training=training)


@dataclass(frozen=True)
class Plan:
    budget: int
    configured: Probe
    remedy: Probe | None  # the first rung's candidate that fits, when the file as written does not
    tried: tuple[Probe, ...]  # every probe after the first, in order


def plan(cfg: Config, budget: int, *, units: int | None = None, on_probe=None, on_event=None) -> Plan:
    """Probe the run as written; when it does not fit, the ladder's first candidate that does."""
    configured = run_probe(cfg, budget, units=units, on_event=on_event)
    if on_probe:
        on_probe(configured)
    tried: list[Probe] = []
    if configured.fits:
        return Plan(budget, configured, None, ())
    for number, (name, candidates) in enumerate(rungs(cfg), 1):
        for changes in candidates:
            try:
                probe = run_probe(with_changes(cfg, changes), budget, units=units, label=f"rung {number}", rung=name,
                                  changes=changes, on_event=on_event)
            except ProbeFailed as e:  # this candidate cannot run (the next may): say why, go on
                probe = Probe(f"rung {number}", name, changes, False, 0, 0, 0.0, (), configured.unit, configured.total_units,
                              "", failure=str(e))
            tried.append(probe)
            if on_probe:
                on_probe(probe)
            if probe.fits:
                return Plan(budget, configured, probe, tuple(tried))
    return Plan(budget, configured, None, tuple(tried))


def _toml(value) -> str:
    return "true" if value is True else "false" if value is False else json.dumps(value)


def default_budget() -> int:
    """Host memory a run may use: what the system reports available."""
    return psutil.virtual_memory().available


def parse_size(text: str) -> int:
    """'3GiB', '512MiB', '2.5G', '800M' -> bytes (binary units; a unit is required)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    s = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        value = float(s[:-1]) if s and s[-1] in units else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r}: expected a size above zero with its unit, such as 3GiB or 512MiB")
    return int(value * units[s[-1]])


def verdict(cfg: Config, result: Plan) -> list[str]:
    """The plan's conclusion, as the command prints it after the probes' lines."""
    if result.configured.fits:
        return ["status: fits as configured"]
    if result.remedy is None:
        return ["status: does not fit, not even with every rung of the ladder; a smaller ctx or model, or more memory"]
    out = [f"status: does not fit as configured; {result.remedy.label} of the ladder ({result.remedy.rung}) fits. In {cfg.path.name}:", "  [training]"]
    return out + [f"  {key.split('.', 1)[1]} = {_toml(value)}" for key, value in result.remedy.changes]


def probe_line(probe: Probe, budget: int) -> str:
    head = f"{probe.label:<14} " + (", ".join(f"{key.split('.', 1)[1]} = {_toml(value)}" for key, value in probe.changes) + ": " if probe.changes else "")
    if probe.failure:
        return head + f"failed: {probe.failure}"
    if not probe.fits:
        return head + f"does not fit: over {_gib(budget)} during {probe.stopped_at} (probe stopped)"
    per = probe.seconds_per_unit
    timing = "no steps timed"
    if per is not None:
        total = per * probe.total_units + probe.load_seconds
        timing = (f"{per:.2f} s per {probe.unit[:-1]} × {probe.total_units} {probe.unit} ≈ {_duration(total)} "
                  f"with {probe.load_seconds:.1f} s of loading")
    return head + f"peak {_gib(probe.peak_bytes)} ({probe.peak_bytes / budget:.0%} of the budget), {timing}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
