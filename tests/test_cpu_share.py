"""Sharing the CPU: torch's threads follow the load of other processes (runtime/cpu_share.py),
without changing the numbers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import retrograd
from retrograd.model.lora import attach_lora
from retrograd.runtime.cpu_share import CpuShare, threads_left, usable_cores
from retrograd.training.batches import LogprobOptions
from retrograd.training.scoring import Rollout, plan_shared, scored_micro_batches


def test_threads_left_is_the_cores_other_work_leaves():
    assert threads_left(2, 0.0, cores=2) == 2
    assert threads_left(2, 0.3, cores=2) == 2  # background noise keeps both
    assert threads_left(2, 0.95, cores=2) == 1  # one busy program: one thread, which never waits
    assert threads_left(2, 3.0, cores=2) == 1  # never fewer than one
    assert threads_left(4, 1.0, cores=16) == 4  # never more than asked for
    assert threads_left(16, 2.2, cores=16) == 14


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def stranger() -> int:
    """A busy process that is not ours (not a descendant: its parent exits at once); its pid."""
    out = subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(usable_cores() < 2, reason="one core: there is no thread to give up")
def test_a_busy_process_beside_the_run_takes_a_thread_and_gives_it_back(restore_threads):
    cores = usable_cores()
    torch.set_num_threads(cores)
    share = CpuShare(cores)
    hog = stranger()
    try:
        time.sleep(1.0)
        share.adjust()  # the window that saw the busy process start
        time.sleep(1.0)
        share.adjust()
        assert 0.7 < share.others < 1.5, share.others
        assert share.threads == threads_left(cores, share.others) < cores
        assert torch.get_num_threads() == share.threads
    finally:
        os.kill(hog, signal.SIGKILL)
    time.sleep(1.0)
    share.adjust()
    assert share.others < 0.5 and share.threads == cores == torch.get_num_threads()


def test_a_child_process_is_the_runs_own_work(restore_threads):
    """Reward programs and local rollout workers are this run's: they never take a thread."""
    share = CpuShare(2)
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.2\nwhile time.time() < end: pass"])
    time.sleep(1.0)
    share.adjust()
    child.wait()
    assert share.others < 0.5, share.others


def test_not_adaptive_never_touches_the_threads(restore_threads):
    torch.set_num_threads(2)
    share = CpuShare(2, adaptive=False)
    time.sleep(0.6)
    assert share.adjust() == 2 and not share.active and torch.get_num_threads() == 2


def test_one_or_two_threads_give_the_same_numbers(smollm2, restore_threads):
    """The thread count may change between steps: the forward and the LoRA gradients of a
    scored micro-batch on one thread and on two differ at most by float32 summation order
    (a BLAS may split a reduction across threads; on the AMD EPYC of issue 24 they were
    bitwise equal). Bound: 1e-5 of each tensor's largest value, ~100 float32 roundings."""
    model = retrograd.load_model(smollm2, weights="auto")
    adapter = attach_lora(model.transformer, ["auto"], 8, 16.0, 0)
    generator = torch.Generator().manual_seed(1)
    for layer in adapter.layers.values():
        torch.nn.init.normal_(layer.lora_b, std=1e-3, generator=generator)
    rollouts = [Rollout(g, tuple(range(200, 240)), tuple(range(100 + i, 116 + i))) for g in range(2) for i in range(4)]
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for p in adapter.parameters():
            p.grad = None
        logps = []
        for _, logp, mask in scored_micro_batches(model.transformer, rollouts, plan_shared(rollouts, 48), LogprobOptions(), "cpu"):
            logp[mask].sum().backward()
            logps.append(logp.detach())
        results.append((torch.cat([x.flatten() for x in logps]), torch.cat([p.grad.flatten() for p in adapter.parameters()])))
    (logp1, grad1), (logp2, grad2) = results
    assert grad1.abs().max() > 0
    assert (logp1 - logp2).abs().max() <= 1e-5 * logp1.abs().max()
    assert (grad1 - grad2).abs().max() <= 1e-5 * grad1.abs().max()
