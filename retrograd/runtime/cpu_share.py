"""Sharing the CPU with other programs: torch's thread count follows the machine's load.

torch's OpenMP threads meet at a barrier after every op. On an idle machine they spin there
for a moment, which is what makes the many short ops of a small micro-batch cheap (waking
sleeping threads instead, OMP_WAIT_POLICY=PASSIVE, made the Rust retrograd's smoke GRPO
shape 2x slower on an idle 2-core VM). Beside another busy program the same barrier is
ruinous: one of our threads waits, spinning or asleep, for the other one to be scheduled
again (3x slower per training step than one thread). So before each optimizer step (and
scoring pass) the trainer measures how many cores other processes used since the last look
and keeps torch to the cores left: on 2 cores beside one busy program, one thread, which
never waits for anyone. The count only changes at step boundaries. It can change a result
only by float32 summation order (on the AMD EPYC we test, not at all: a test compares); a
run that must repeat bit for bit on a busy machine sets `threads_follow_load = false`.
"""

from __future__ import annotations

import time

import psutil
import torch

MIN_INTERVAL = 0.5  # seconds between two looks: shorter windows are dominated by noise


class CpuShare:
    """`adjust()` sets torch's threads to min(`threads`, cores left by other processes), at
    least 1. Inactive (a no-op) when `adaptive` is false or training runs on a GPU."""

    def __init__(self, threads: int, *, adaptive: bool = True, clock=time.monotonic):
        self.limit = threads
        self.active = adaptive and threads > 1
        self.threads = threads
        self._clock = clock
        self._process = psutil.Process()
        self._last = self._sample()
        self.others = 0.0  # cores other processes used over the last window

    def _sample(self) -> tuple[float, float, dict[int, float]]:
        """(wall, machine busy CPU seconds, CPU seconds of this process and of each of its
        descendants: reward programs and local workers are this run's own work)."""
        machine = psutil.cpu_times()
        busy = machine.user + machine.nice + machine.system + getattr(machine, "irq", 0.0) + getattr(machine, "softirq", 0.0)
        own = {}
        for p in (self._process, *self._process.children(recursive=True)):
            try:
                t = p.cpu_times()
            except psutil.Error:  # ended since it was listed
                continue
            own[p.pid] = t.user + t.system
        return self._clock(), busy, own

    def adjust(self) -> int:
        """Look at the load since the last look (at most every MIN_INTERVAL s) and set the threads."""
        if not self.active or self._clock() - self._last[0] < MIN_INTERVAL:
            return self.threads
        now = self._sample()
        wall = now[0] - self._last[0]
        ours = sum(seconds - self._last[2].get(pid, 0.0) for pid, seconds in now[2].items())
        self.others = max(0.0, (now[1] - self._last[1]) - ours) / wall
        self._last = now
        wanted = threads_left(self.limit, self.others)
        if wanted != self.threads:
            torch.set_num_threads(wanted)
            self.threads = wanted
        return self.threads


def threads_left(limit: int, others: float, cores: int | None = None) -> int:
    """Threads that fit beside `others` cores of other work on a machine of `cores` cores
    (its usable CPUs by default), at most `limit`, at least 1."""
    cores = cores or usable_cores()
    return max(1, min(limit, round(cores - others)))


def usable_cores() -> int:
    try:
        return len(psutil.Process().cpu_affinity())
    except (AttributeError, psutil.Error):
        return psutil.cpu_count() or 1
