"""What `NAME.report.html` costs on a long rollout run: the first build (`retrograd report`, or the
first checkpoint of a resumed `train`, which read all of NAME.rollouts.jsonl) and the refresh at a
later checkpoint (`train` reads only what was appended since the last one).

    python benchmarks/run_report.py [--updates 500] [--rollouts 64] [--tokens 256] [--repeats 3]

Workload: a GRPO run's files in the shapes retrograd writes them, --updates updates of
--rollouts completions of --tokens tokens each (token ids and both log-prob lists, as in
rollouts.jsonl), an evaluation every 10 updates. The refresh is timed after appending 10
more updates (a checkpoint every 10 updates).

Columns:
  rollouts.jsonl   size of the run's rollout file
  first build s    RunReport(...).write() on the whole run (median of --repeats)
  refresh s        write() again after 10 more updates, same RunReport (median)
  report MB        size of report.html (plotly.js is about 4.6 MB of it)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from retrograd.reports.run_report import RunFiles, RunReport

PHASES = ("generation", "reward", "behavior_scoring", "reference", "optimizer", "adapter_refresh")


def append_updates(folder: Path, first: int, count: int, args, rng: random.Random) -> None:
    with open(folder / "run.metrics.jsonl", "a") as metrics, open(folder / "run.rollouts.jsonl", "a") as rollouts:
        for update in range(first, first + count):
            timing = {f"timing/{p}_seconds": rng.uniform(0.1, 5.0) for p in PHASES}
            record = {"step": 2 * update, "time": 1.7e9 + 30 * update, "policy/total_loss": rng.gauss(0, 1e-3),
                      "reward/mean": rng.random(), "policy/kl": rng.random() / 100, "optimizer/learning_rate": 2e-4,
                      "batch/dead_group_fraction": 0.25, "completions/truncation_fraction": 0.5,
                      "train/tokens_per_second": 15.0, "timing/update_seconds": sum(timing.values()) + 0.5,
                      "timing/waiting_for_batch_seconds": 0.0, "rollouts/canceled": 0, "train/update": update} | timing
            metrics.write(json.dumps(record) + "\n")
            if update % 10 == 0:
                metrics.write(json.dumps({"step": 2 * update, "time": record["time"] + 3, "eval/mean_reward": rng.random(),
                                          "train/update": update}) + "\n")
            rollouts.writelines(json.dumps({
                    "update": update, "group": k // 8, "prompt": "Calculate 12 * 6. Reply with exactly one number.",
                    "source": "prompts.jsonl:3", "completion": "12 * 6 = 72. " * 20, "tokens": args.tokens,
                    "truncated": rng.random() < 0.5, "reward": rng.random(), "advantage": rng.gauss(0, 1), "trained": True,
                    "skip_reason": None, "prompt_ids": list(range(48)), "completion_ids": list(range(args.tokens)),
                    "sampler_logprobs": [rng.uniform(-5, 0) for _ in range(args.tokens)],
                    "policy_logprobs": [rng.uniform(-5, 0) for _ in range(args.tokens)],
                }) + "\n" for k in range(args.rollouts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=500)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    firsts, refreshes = [], []
    with tempfile.TemporaryDirectory(prefix="retrograd-report-bench-") as scratch:
        folder = Path(scratch)
        rng = random.Random(0)
        append_updates(folder, 1, args.updates, args, rng)
        files = RunFiles(folder / "run.metrics.jsonl", folder / "run.rollouts.jsonl", None, "grpo")
        RunReport(files).write()  # warm: imports, plotly.js read once per process
        size = files.rollouts.stat().st_size
        for repeat in range(args.repeats):
            report = RunReport(files)
            t0 = time.perf_counter()
            report.write()
            firsts.append(time.perf_counter() - t0)
            append_updates(folder, args.updates + 10 * repeat + 1, 10, args, rng)
            t0 = time.perf_counter()
            out = report.write()
            refreshes.append(time.perf_counter() - t0)
        page = out.stat().st_size
    print(f"{'updates':>8} {'rollouts.jsonl':>15} {'first build s':>14} {'refresh s':>10} {'report MB':>10}")
    print(f"{args.updates:>8} {size / 2**20:>12.0f} MB {statistics.median(firsts):>14.2f} "
          f"{statistics.median(refreshes):>10.2f} {page / 2**20:>10.1f}")


if __name__ == "__main__":
    main()
