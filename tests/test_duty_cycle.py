"""The sleep-gated scheduler behind training.max_gpu_duty_cycle, driven by a fake clock
and a fake device."""

import torch

from retrograd.training.duty_cycle import DutyCycle, for_device


class FakeDevice:
    """Work submitted to it finishes `busy` seconds after the burst starts; synchronize
    advances the clock to then."""

    def __init__(self):
        self.now = 0.0
        self.pending_until = 0.0
        self.slept: list[float] = []
        self.syncs = 0

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds

    def synchronize(self):
        self.syncs += 1
        self.now = max(self.now, self.pending_until)

    def submit(self, seconds):
        self.pending_until = self.now + seconds


def run_bursts(limit, bursts, window=10.0):
    dev = FakeDevice()
    duty = DutyCycle(limit, dev.synchronize, window=window, clock=dev.clock, sleep=dev.sleep)
    for busy in bursts:
        with duty.burst():
            dev.submit(busy)
    return duty, dev


def test_busy_share_stays_at_the_limit():
    duty, dev = run_bursts(0.5, [0.2] * 20)
    assert abs(duty.stats.observed() - 0.5) < 1e-9
    assert all(abs(s - 0.2) < 1e-9 for s in dev.slept)  # idle == busy at 50 %
    assert abs(dev.now - 8.0) < 1e-9  # 20 bursts of 0.2 s busy + 0.2 s idle


def test_uneven_bursts_and_a_quarter_limit():
    duty, dev = run_bursts(0.25, [0.1, 0.5, 0.05, 0.3, 0.2])
    assert duty.stats.observed() <= 0.25 + 1e-9
    assert abs(duty.stats.idle - 3 * duty.stats.busy) < 1e-9


def test_limit_one_never_sleeps_nor_synchronizes():
    duty, dev = run_bursts(1.0, [0.3] * 5)
    assert dev.slept == [] and dev.syncs == 0 and not duty.active


def test_window_forgets_old_idle_time():
    """A long pause long ago does not pay for bursts now: only the window counts."""
    dev = FakeDevice()
    duty = DutyCycle(0.5, dev.synchronize, window=1.0, clock=dev.clock, sleep=dev.sleep)
    for busy in [0.2] * 10:
        with duty.burst():
            dev.submit(busy)
    assert all(s > 0 for s in dev.slept)


def test_cpu_device_is_inert_and_says_so_once():
    notes = []
    duty = for_device(0.5, torch.device("cpu"), notes.append)
    assert not duty.active and len(notes) == 1 and "no effect on the CPU" in notes[0]
    assert for_device(1.0, torch.device("cpu"), notes.append) and len(notes) == 1
