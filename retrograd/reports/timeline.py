"""What a finished run's NAME.timeline.jsonl says, in a few lines: busy time per side, the
waits, and which side is the bottleneck. Reading a timeline needs no torch, so
`retrograd profile --timeline` answers in well under a second."""

from __future__ import annotations

from pathlib import Path

from retrograd.training.timeline import TIMELINE_COUNTERS, read_timeline

PRODUCTION_PHASES = ("environment", "generation", "tools", "reward", "judge", "teacher")  # the sampler's side
TRAINING_PHASES = ("behavior_scoring", "reference", "optimizer", "adapter_push")  # the trainer's side
SIGNIFICANT_WAIT = 0.10  # a side idle this share of the run's wall time is waiting on the other


def timeline_summary(path: Path) -> list[str]:
    """What a run's timeline.jsonl says: busy time per side, waits, counters, and which side
    is the bottleneck (the seed tuning guide's reading: the trainer waiting for batches means
    inference is the bottleneck; the sampler waiting for adapters, or rollouts piling up,
    means training is)."""
    spans, counters = read_timeline(path)
    if not spans:
        return [f"timeline {path}: no spans (the run did not finish an update)"]
    wall = max(max(s["end"] for s in spans) - min(s["start"] for s in spans), 1e-9)
    busy = {"sampler": 0.0, "trainer": 0.0}
    for s in spans:
        side = "sampler" if s["phase"] in PRODUCTION_PHASES or s["phase"] == "adapter_refresh" else "trainer"
        if s["phase"] in PRODUCTION_PHASES + TRAINING_PHASES + ("adapter_refresh",):
            busy[side] += s["end"] - s["start"]
    total = {k: sum(c.get(k, 0) for c in counters.values()) for k in TIMELINE_COUNTERS}
    overlapped = any(s["worker"] == "sampler" and s["phase"] == "waiting_for_adapter" for s in spans) or total["in_flight_rollouts"]
    out = [
        f"Timeline ({path.name}, {len(counters)} updates, {wall:.1f} s from first to last span)",
        f"  sampler busy {busy['sampler']:8.1f} s {busy['sampler'] / wall:6.1%}   (generation, rewards, tools, adapter refresh)",
        f"  trainer busy {busy['trainer']:8.1f} s {busy['trainer'] / wall:6.1%}   (scoring, optimizer, adapter push)",
        (f"  trainer waiting for batches {total['waiting_for_batch_seconds']:8.1f} s   sampler waiting for adapters "
         f"{total['waiting_for_adapter_seconds']:8.1f} s"),
        (f"  rollouts: discarded groups {total['discarded_groups']:.0f}, canceled {total['canceled_rollouts']:.0f}, "
         f"truncated {total['truncated_rollouts']:.0f}, queued (sum over updates) {total['queued_rollouts']:.0f}"),
    ]
    return out + ["  " + bottleneck(busy, total, wall, overlapped=bool(overlapped))]


def bottleneck(busy: dict, total: dict, wall: float, *, overlapped: bool) -> str:
    """One line: which side to grow, with the knob to turn first."""
    sampler, trainer = busy["sampler"], busy["trainer"]
    if not overlapped:
        side, knob = (("inference", "training.generation_threads, [rollout] workers, or a lower max_new_tokens")
                      if sampler > trainer else ("training", "training.threads, fewer grpo_epochs or minibatches"))
        return (f"bottleneck: {side} ({sampler:.1f} s sampling vs {trainer:.1f} s training, taking turns: max_async_rollout = 0). "
                f"max_async_rollout = 1 overlaps them and can save up to {min(sampler, trainer):.1f} s when "
                f"training.threads + training.generation_threads fit the cores; to speed up {side} itself: {knob}")
    if total["waiting_for_batch_seconds"] > SIGNIFICANT_WAIT * wall:
        return (f"bottleneck: inference (the trainer waited {total['waiting_for_batch_seconds']:.1f} s for rollouts): raise "
                "training.generation_threads, add [rollout] workers, or lower max_new_tokens")
    if total["waiting_for_adapter_seconds"] > SIGNIFICANT_WAIT * wall or total["queued_rollouts"]:
        return (f"bottleneck: training (the sampler waited {total['waiting_for_adapter_seconds']:.1f} s for adapters): raise "
                "max_async_rollout, give the trainer more of the cores (training.threads), or train fewer passes per update")
    return "balanced: neither side waited more than a tenth of the run for the other"
