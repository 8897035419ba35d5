"""How close `retrograd preflight RUN.toml` comes to the run it predicts, in one run.

    python benchmarks/preflight_accuracy.py                                  # the two smoke examples
    python benchmarks/preflight_accuracy.py my_sft.toml my_grpo.toml --model base.gguf

For each config: the planner's prediction (a few steps of the run's own recipe in a child
process), then the real `retrograd train` of the same file, whose process tree's RSS is sampled
every 20 ms as the probe's is and whose mean seconds per step (update) come from its
NAME.metrics.jsonl. The real run writes its outputs where the file says. Goal (issue 24): peak
within 15%, time per step within 30%. Run it on an otherwise idle machine (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from micro_batch import cpu_model

from retrograd.config import load_config
from retrograd.evaluation import plan as planner
from retrograd.runtime.memory import tree_rss_bytes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GiB = 2**30


def measure_train(config: Path, model: Path | None = None) -> tuple[int, float, int]:
    """A real `retrograd train CONFIG` run: the peak RSS of its process
    tree, its mean seconds per step (update) and its number of steps."""
    command = [sys.executable, "-m", "retrograd", "train", str(config)] + (["--model", str(model)] if model else [])
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = peak_while_running(run)
    if run.returncode != 0:
        raise RuntimeError(f"retrograd train {config} failed: {run.stderr.read().decode()[-2000:]}")
    output = load_config(config).output.path
    rows = [json.loads(line) for line in output.with_suffix(".metrics.jsonl").read_text().splitlines()]
    seconds = [s for r in rows if (s := r.get("timing/step_seconds", r.get("timing/update_seconds"))) is not None]
    return peak, statistics.fmean(seconds), len(seconds)


def peak_while_running(process: subprocess.Popen) -> int:
    """The largest RSS of the process and its descendants, sampled as preflight's probe is, until it exits."""
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss_bytes(process.pid))
        time.sleep(planner.WATCH_INTERVAL)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", type=Path,
                        default=[EXAMPLES / "smoke_tiny_sft.toml", EXAMPLES / "smoke_tiny_grpo.toml"])
    parser.add_argument("--model", type=Path, help="Base GGUF for every config (default: each file's own).")
    args = parser.parse_args()
    model = args.model.resolve() if args.model else None
    print(f"CPU: {cpu_model()}")
    print("| config | peak predicted | peak measured | ratio | s/step predicted | s/step measured | ratio | steps |")
    print("|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        cfg = load_config(config).with_overrides(model=model)
        probe = planner.plan(cfg, planner.default_budget()).configured
        peak, per_step, steps = measure_train(config.resolve(), model)
        print(f"| {config.name} | {probe.peak_bytes / GiB:.3f} GiB | {peak / GiB:.3f} GiB | {probe.peak_bytes / peak:.2f} | "
              f"{probe.seconds_per_unit:.2f} | {per_step:.2f} | {probe.seconds_per_unit / per_step:.2f} | {steps} |", flush=True)


if __name__ == "__main__":
    main()
