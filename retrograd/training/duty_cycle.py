"""`training.max_gpu_duty_cycle`: leave a shared GPU regular gaps.

Each compute burst (an optimizer step, a scoring pass) is timed on the device: the burst
starts after the device has finished earlier work and ends when its own work is done
(synchronize). After a burst the scheduler sleeps just long enough that, over a sliding
window of recent bursts, busy / (busy + idle) stays at or below the limit. It frees compute
time, not memory. On the CPU there is nothing to share this way: the limit is accepted and
has no effect (training.threads is the CPU knob). llama.cpp's generation counts as a burst
only when it runs on a GPU (for_generation).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class DutyStats:
    busy: float = 0.0  # seconds of device work inside bursts
    idle: float = 0.0  # seconds slept by the scheduler
    wall_start: float = 0.0

    def observed(self) -> float:
        return self.busy / (self.busy + self.idle) if self.busy + self.idle else 0.0


class DutyCycle:
    """limit in (0, 1]; `synchronize` waits for the device (torch.cuda.synchronize on a GPU);
    `clock` and `sleep` are injectable for tests."""

    def __init__(
        self,
        limit: float,
        synchronize: Callable[[], None],
        *,
        window: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        assert 0 < limit <= 1, "validated by the config"
        self.limit, self.window = limit, window
        self._sync, self._clock, self._sleep = synchronize, clock, sleep
        self._history: deque[tuple[float, float]] = deque()  # (busy, idle) of recent bursts
        self.stats = DutyStats(wall_start=clock())

    @property
    def active(self) -> bool:
        return self.limit < 1.0

    @contextlib.contextmanager
    def burst(self):
        """Wrap one compute burst; sleeps afterwards when the window's share is too high."""
        if not self.active:
            yield
            return
        self._sync()
        start = self._clock()
        yield
        self._sync()
        busy = self._clock() - start
        idle = self._needed_idle(busy)
        if idle > 0:
            self._sleep(idle)
        self._history.append((busy, idle))
        self.stats.busy += busy
        self.stats.idle += idle
        while len(self._history) > 1 and sum(b + i for b, i in self._history) > self.window:
            self._history.popleft()

    def _needed_idle(self, busy: float) -> float:
        """Idle time after this burst so that the window's busy share is <= limit."""
        past_busy = sum(b for b, _ in self._history)
        past_idle = sum(i for _, i in self._history)
        total_busy = past_busy + busy
        # busy / (busy + idle) <= limit  <=>  idle >= busy (1 - limit) / limit
        return max(0.0, total_busy * (1.0 - self.limit) / self.limit - past_idle)


def for_generation(duty: DutyCycle, sampler) -> DutyCycle:
    """The scheduler for llama.cpp's generation bursts: the run's own where this process's
    llama.cpp runs layers on a GPU, inert where it samples on the CPU (or in rollout workers).
    A CPU sampler beside a CUDA trainer must not sleep for a GPU it leaves idle: on an H200
    with CPU sampling, gating generation too halved the update rate at duty 0.5 while the GPU
    was busy 9% of the time."""
    placement = getattr(sampler, "placement", None)
    return duty if getattr(placement, "layers_offloaded", 0) else DutyCycle(1.0, lambda: None)


def for_device(limit: float, device, notify: Callable[[str], None]) -> DutyCycle:
    """The scheduler for a torch device: real on CUDA, inert (with one notice) on the CPU."""
    if device.type == "cuda":
        import torch

        return DutyCycle(limit, lambda: torch.cuda.synchronize(device))
    if limit < 1.0:
        notify(f"training.max_gpu_duty_cycle = {limit} has no effect on the CPU (use training.threads to leave cores free)")
    return DutyCycle(1.0, lambda: None)
