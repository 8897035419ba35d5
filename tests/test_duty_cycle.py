"""The sleep-gated scheduler behind training.max_gpu_duty_cycle, driven by a fake clock
and a fake device."""

from types import SimpleNamespace

import torch

from retrograd.training.duty_cycle import DutyCycle, for_device, for_generation


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
    assert len(dev.slept) == 20 and all(abs(s - 0.2) < 1e-9 for s in dev.slept)  # idle == busy at 50 %
    assert abs(dev.now - 8.0) < 1e-9  # 20 bursts of 0.2 s busy + 0.2 s idle


def test_uneven_bursts_and_a_quarter_limit():
    bursts = [0.1, 0.5, 0.05, 0.3, 0.2]
    duty, dev = run_bursts(0.25, bursts)
    assert abs(duty.stats.observed() - 0.25) < 1e-9
    assert abs(duty.stats.busy - sum(bursts)) < 1e-9 and abs(duty.stats.idle - 3 * duty.stats.busy) < 1e-9
    # each burst pays for itself at once: idle = busy * (1 - limit) / limit = 3 * busy
    assert len(dev.slept) == len(bursts) and all(abs(s - 3 * b) < 1e-9 for s, b in zip(dev.slept, bursts))


def test_limit_one_never_sleeps_nor_synchronizes():
    duty, dev = run_bursts(1.0, [0.3] * 5)
    assert dev.slept == [] and dev.syncs == 0 and not duty.active


def test_a_pause_between_bursts_does_not_pay_for_later_ones():
    """Only the scheduler's own sleeps count as idle: a long pause outside any burst (the
    device idle, or busy with someone else's work) must not let the next bursts run back to
    back, and the window keeps just the recent bursts however long the run."""
    dev = FakeDevice()
    duty = DutyCycle(0.5, dev.synchronize, window=1.0, clock=dev.clock, sleep=dev.sleep)
    for busy in [0.2] * 5:
        with duty.burst():
            dev.submit(busy)
    dev.now += 100.0  # a pause between bursts, 100 windows long
    for busy in [0.2] * 10:
        with duty.burst():
            dev.submit(busy)
    assert len(dev.slept) == 15 and all(abs(s - 0.2) < 1e-9 for s in dev.slept)
    assert abs(dev.now - (100.0 + 15 * 0.4)) < 1e-9
    assert dev.syncs == 2 * 15  # one before and one after each burst
    # the history is trimmed to the window (plus the burst that crossed it): 0.4 s per burst
    assert sum(b + i for b, i in duty._history) <= 1.0 + 0.4 + 1e-9 and len(duty._history) <= 3


def test_a_long_burst_long_ago_does_not_throttle_bursts_now():
    """One 5 s burst pays its own 5 s of sleep at once; the short bursts after it each sleep
    exactly their own length (limit 0.5), whether or not the long one is still in the window."""
    duty, dev = run_bursts(0.5, [5.0] + [0.1] * 30, window=2.0)
    assert len(dev.slept) == 31
    assert abs(dev.slept[0] - 5.0) < 1e-9 and all(abs(s - 0.1) < 1e-9 for s in dev.slept[1:])
    assert abs(duty.stats.observed() - 0.5) < 1e-9


def test_cpu_device_is_inert_and_says_so_once():
    notes = []
    duty = for_device(0.5, torch.device("cpu"), notes.append)
    assert not duty.active and duty.limit == 1.0
    assert len(notes) == 1 and "max_gpu_duty_cycle = 0.5 has no effect on the CPU" in notes[0]
    with duty.burst():  # inert: yields at once, accounts nothing
        pass
    assert duty.stats.busy == 0.0 and duty.stats.idle == 0.0
    again = for_device(1.0, torch.device("cpu"), notes.append)
    assert not again.active and again.limit == 1.0 and len(notes) == 1  # no limit asked for: no note


def test_generation_is_a_burst_only_where_llama_cpp_offloads():
    """A CUDA trainer beside a CPU llama.cpp: generation is not paced (the GPU idles through
    it); with layers on a GPU, generation shares the trainer's scheduler and its window."""
    from retrograd.sampler import Placement

    trainer = DutyCycle(0.5, lambda: None)
    on_cpu = SimpleNamespace(placement=Placement((), 0, 31))
    on_gpu = SimpleNamespace(placement=Placement(("CUDA0 (NVIDIA H200)",), 31, 31))
    assert not for_generation(trainer, on_cpu).active
    assert not for_generation(trainer, None).active  # a torchrun rank that only trains
    assert for_generation(trainer, on_gpu) is trainer
