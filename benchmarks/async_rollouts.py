"""Asynchronous vs synchronous GRPO at the same total CPU threads.

    python benchmarks/async_rollouts.py                  # sync, async N=1 (and N=2), ~6 min on 2 cores
    python benchmarks/async_rollouts.py --updates 12 --sides sync,async1

Workload: benchmarks/grpo_vs_trl.py's (bundled SmolLM2-135M-Instruct Q4_1, 2 arithmetic prompts
x 8 completions per update, at most 16 new tokens, one optimizer step per update, LoRA rank 8
on every projection), run for --updates updates by `retrograd train` in a process of its own.
Sides (same total threads, `--threads`, default 2):
  sync      max_async_rollout = 0, training.threads = T (llama.cpp uses the same T, in turns)
  async1    max_async_rollout = 1, training.threads = T/2, generation_threads = T/2
  async2    max_async_rollout = 2, same split
Figures: updates per minute over the training span (first update's start to the last one's
end, from metrics.jsonl: start-up excluded), the mean reward of the last third of the updates,
and the timeline's busy / waiting seconds per side (retrograd/reports/profile.py's reading). State the
CPU with any figure: the split costs each side half the cores, so a run whose two sides are
both compute-bound on the same cores cannot gain much.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from retrograd.reports.timeline import timeline_summary
from retrograd.runtime.device import cpu_name


def sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


GRPO_VS_TRL = sibling("grpo_vs_trl")
SIDES = {"sync": 0, "async1": 1, "async2": 2}


def write_side(folder: Path, ahead: int, threads: int, updates: int) -> Path:
    config = GRPO_VS_TRL.write_config(folder, "auto")
    split = max(threads // 2, 1)
    text = config.read_text()
    text = text.replace(f"updates = {GRPO_VS_TRL.WORK.updates}\n", f"updates = {updates}\n")
    text = text.replace(f"threads = {GRPO_VS_TRL.WORK.threads}\n", (
        f"threads = {threads}\n" if ahead == 0 else
        f"threads = {split}\ngeneration_threads = {split}\nmax_async_rollout = {ahead}\n"))
    config.write_text(text)
    return config


def run_side(name: str, threads: int, updates: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = write_side(Path(tmp), SIDES[name], threads, updates)
        res = subprocess.run([sys.executable, "-m", "retrograd", "train", str(config)], capture_output=True, text=True, check=False)
        if res.returncode:
            sys.exit(f"{name}: retrograd train failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "out/adapter.metrics.jsonl").read_text().splitlines()]
        timeline = timeline_summary(Path(tmp) / "out/adapter.timeline.jsonl")
    span = rows[-1]["time"] - (rows[0]["time"] - rows[0]["timing/update_seconds"])
    tail = rows[-max(len(rows) // 3, 1):]
    return {
        "updates": len(rows),
        "updates_per_min": 60 * len(rows) / span,
        "span_s": span,
        "reward_tail": sum(r["reward/mean"] for r in tail) / len(tail),
        "reward_first": rows[0]["reward/mean"],
        "waiting_for_batch_s": sum(r["timing/waiting_for_batch_seconds"] for r in rows),
        "waiting_for_adapter_s": sum(r["timing/waiting_for_adapter_seconds"] for r in rows),
        "staleness_max": max(r["rollouts/staleness"] for r in rows),
        "timeline": timeline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="sync,async1,async2")
    parser.add_argument("--updates", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        sys.exit(f"--sides: unknown {sorted(unknown)} (expected {', '.join(SIDES)})")
    results = {}
    for name in sides:
        print(f"running {name} ({args.updates} updates)…", file=sys.stderr, flush=True)
        results[name] = run_side(name, args.threads, args.updates)
    base = results.get("sync")
    print(f"\nasync vs sync GRPO, {args.updates} updates, {args.threads} threads in all; CPU: {cpu_name()}\n")
    print(f"{'side':8} {'upd/min':>8} {'× sync':>7} {'span s':>7} {'reward last third':>18} {'wait batch s':>13} "
          f"{'wait adapter s':>15} {'max stale':>10}")
    for name, r in results.items():
        ratio = f"{r['updates_per_min'] / base['updates_per_min']:.2f}" if base else "-"
        print(f"{name:8} {r['updates_per_min']:8.2f} {ratio:>7} {r['span_s']:7.1f} {r['reward_tail']:18.4f} "
              f"{r['waiting_for_batch_s']:13.1f} {r['waiting_for_adapter_s']:15.1f} {r['staleness_max']:10d}")
    for name, r in results.items():
        print(f"\n{name}:")
        print("\n".join(r["timeline"]))


if __name__ == "__main__":
    main()
