"""A shared machine: `retrograd train` idle and beside one CPU-bound process, in one run.

    python benchmarks/shared_machine.py                      # SFT and GRPO, three policies (~12 min on 2 cores)
    python benchmarks/shared_machine.py --workloads sft --policies follow-load,passive

Workloads: `sft` is benchmarks/sft_vs_trl.py's (20 steps of 8 rows, f32 compute, tok/s per
step, steps 2-20); `grpo` is benchmarks/micro_batch.py's `smoke` shape at micro_batch 8 (the
Rust retrograd's smoke GRPO run: many small passes, 2 updates, s/update). Each run is one
`retrograd train` process with `training.threads = 2`, first on the otherwise idle machine,
then beside `python -c "while True: pass"` (one busy core, started 2 s before and stopped
after). Policies:
  follow-load  the default: libgomp's own spin-then-sleep waiting, torch's threads follow the
               load (training.threads_follow_load = true, retrograd/runtime/cpu_share.py)
  fixed        the same waiting, always 2 threads (threads_follow_load = false)
  passive      what retrograd did before: OMP_WAIT_POLICY=PASSIVE, always 2 threads
Goal (issue 24): beside the busy process at most 1.6x slower than idle (a fair share of 2
cores would be 1.33x), without losing idle speed. Run it on an otherwise idle machine
(`uptime`); the script prints the cores other processes used during each idle run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import micro_batch  # noqa: E402
import sft_vs_trl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {
    "follow-load": ({}, True),
    "fixed": ({}, False),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, False),
}
GOAL = 1.6


def sft_config(folder: Path) -> Path:
    _, budget = sft_vs_trl.step_budget(sft_vs_trl.write_run(folder, "f32"))
    return sft_vs_trl.write_run(folder, "f32", micro_batch=budget)


def grpo_config(folder: Path) -> Path:
    path = folder / "grpo.toml"
    path.write_text(micro_batch.config("smoke", 8, 2, None, 2, folder))
    return path


WORKLOADS = {"sft": sft_config, "grpo": grpo_config}


def run(workload: str, policy: str, busy: bool) -> dict:
    env_extra, follow = POLICIES[policy]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = WORKLOADS[workload](folder)
        text = config.read_text().replace("[training]\n", f"[training]\nthreads_follow_load = {str(follow).lower()}\n", 1)
        config.write_text(text)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            if hog:
                time.sleep(2)
            busy0, own0, t0 = sft_vs_trl.busy_cpu_seconds(), sft_vs_trl.children_cpu_seconds(), time.time()
            res = subprocess.run([sys.executable, "-m", "retrograd", "train", str(config)], cwd=ROOT, capture_output=True,
                                 text=True, env=os.environ | env_extra, check=False)
            others = ((sft_vs_trl.busy_cpu_seconds() - busy0) - (sft_vs_trl.children_cpu_seconds() - own0)) / (time.time() - t0)
        finally:
            if hog:
                hog.kill()
                hog.wait()
        if res.returncode:
            sys.exit(f"retrograd train failed ({workload}, {policy}):\n{res.stderr[-3000:]}")
        metrics = folder / ("out" if workload == "sft" else "") / "adapter.metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if workload == "sft":
        steps = [r for r in rows if "train/tokens_per_second" in r][1:]  # step 1 warms up
        value = statistics.mean(r["train/tokens_per_second"] for r in steps)
    else:
        steps = [r for r in rows if "timing/update_seconds" in r]
        value = statistics.mean(r["timing/update_seconds"] for r in steps)
    threads = statistics.mean(r.get("system/threads", 2) for r in steps)
    return {"value": value, "threads": threads, "others": max(others, 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="sft,grpo", help="comma-separated: " + ", ".join(WORKLOADS))
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated: " + ", ".join(POLICIES))
    args = parser.parse_args()
    print(f"CPU: {micro_batch.cpu_model()}; {os.cpu_count()} cores; training.threads = 2; load before start: {os.getloadavg()[0]:.2f}")
    print(f"{'workload':<9} {'policy':<12} {'idle':>10} {'beside busy':>12} {'slowdown':>9} {'threads idle/busy':>18} {'others idle/busy':>17}")
    for workload in args.workloads.split(","):
        unit = "tok/s" if workload == "sft" else "s/update"
        for policy in args.policies.split(","):
            idle, busy = run(workload, policy, False), run(workload, policy, True)
            slowdown = idle["value"] / busy["value"] if workload == "sft" else busy["value"] / idle["value"]
            print(f"{workload:<9} {policy:<12} {idle['value']:>7.2f} {unit:<2} {busy['value']:>9.2f} {'':<2} {slowdown:>8.2f}x "
                  f"{idle['threads']:>9.2f} / {busy['threads']:<6.2f} {idle['others']:>8.2f} / {busy['others']:<6.2f}", flush=True)
    print(f"goal: slowdown <= {GOAL}x beside one busy process, idle speed kept (compare follow-load's idle with fixed's)")


if __name__ == "__main__":
    main()
