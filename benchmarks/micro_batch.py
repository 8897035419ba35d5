"""Small micro-batches: seconds per GRPO update through `retrograd train` at micro_batch 8 and 1024.

    python benchmarks/micro_batch.py                          # every workload, both sizes (~5 min on 2 cores)
    python benchmarks/micro_batch.py --workloads smoke --weights quantized

Workloads (the bundled SmolLM2-135M-Instruct Q4_1, LoRA rank 8 / alpha 16 on all seven
families, the prompts of examples/data/smoke_rl_prompts.jsonl in order, rewarded by
examples/smoke_rl_reward.py over the reward protocol):
  smoke  the Rust retrograd's smoke_tiny_grpo.toml: 2 prompts x 8 completions, 4 new tokens,
         3 epochs, kl_coefficient 0.02, lr 5e-6, weight decay 0.01, ctx 64
  trl    benchmarks/grpo_vs_trl.py's shape: 2 prompts x 8, at most 16 new tokens, 1 epoch,
         kl_coefficient 0, lr 1e-5, ctx 128
Each (workload, micro_batch) pair is one `python -m retrograd train` subprocess on a generated
TOML, 2 threads (--threads), `[model] weights` from --weights (default: the config default, "auto").
s/update is the mean of timing/update_seconds over the run's updates (metrics.jsonl; the
recipe's warm-up step runs before the first), each phase the mean of its timing/*, and RSS
the largest system/rss_bytes logged at the end of an update.
  sft    benchmarks/sft_vs_trl.py's workload (8 rows of ~40 tokens per step, 20 steps, f32): one
         micro-batch per step against micro_batch 32 with gradient_accumulation 8 (a row each)
Goals (issue 11): smoke at micro_batch 8 <= 8 s per update on 2 cores; micro_batch 8 at most
1.3x the wall time of micro_batch 1024 on the same run; SFT at micro_batch 32 at most 1.3x of one
micro-batch per step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO_BATCHES = (8, 1024)
PHASES = ("generation", "reward", "behavior_scoring", "reference", "optimizer")
GOALS = {"smoke_seconds": 8.0, "ratio": 1.3}
WORKLOADS = {  # the GRPO ones; "sft" is run_sft's
    "smoke": {"new_tokens": 4, "epochs": 3, "kl": 0.02, "lr": 5e-6, "weight_decay": 0.01, "ctx": 64},
    "trl": {"new_tokens": 16, "epochs": 1, "kl": 0.0, "lr": 1e-5, "weight_decay": 0.0, "ctx": 128},
}


def config(workload: str, micro_batch: int, updates: int, weights: str | None, threads: int, out: Path) -> str:
    w = WORKLOADS[workload]
    weights_line = f'[model]\nweights = "{weights}"\n' if weights else ""
    return f"""
[run]
algorithm = "grpo"
{weights_line}
[output]
path = "{out / 'adapter.gguf'}"
[lora]
rank = 8
alpha = 16.0
[training]
ctx = {w['ctx']}
micro_batch = {micro_batch}
lr = {w['lr']}
weight_decay = {w['weight_decay']}
threads = {threads}
[grpo]
prompts = "{ROOT / 'examples/data/smoke_rl_prompts.jsonl'}"
reward_command = ["{sys.executable}", "{ROOT / 'examples/smoke_rl_reward.py'}"]
prompt_order = "sequential"
updates = {updates}
prompts_per_update = 2
group_size = 8
grpo_epochs = {w['epochs']}
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = {w['kl']}
[grpo.sampling]
max_new_tokens = {w['new_tokens']}
"""


def run(workload: str, micro_batch: int, updates: int, weights: str | None, threads: int) -> dict:
    """One `retrograd train` run -> mean seconds per update and per phase."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cfg = out / "grpo.toml"
        cfg.write_text(config(workload, micro_batch, updates, weights, threads, out))
        r = subprocess.run([sys.executable, "-m", "retrograd", "train", str(cfg)], cwd=ROOT, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            sys.exit(f"retrograd train failed ({workload}, micro_batch {micro_batch}):\n{r.stderr[-2000:]}")
        rows = [json.loads(line) for line in (out / "adapter.metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "timing/update_seconds" in row]
    weights_line = next((line for line in r.stdout.splitlines() if line.startswith("weights:")), "weights: ?")
    return {
        "update": statistics.mean(row["timing/update_seconds"] for row in rows),
        **{p: statistics.mean(row.get(f"timing/{p}_seconds", 0.0) for row in rows) for p in PHASES},
        "rss": max(row["system/rss_bytes"] for row in rows),
        "weights": weights_line.removeprefix("weights: "),
    }


def run_sft(micro_batch: int | None, threads: int) -> dict:
    """sft_vs_trl.py's workload through `retrograd train`: one micro-batch per step (None), or
    `micro_batch` tokens with the accumulation that keeps each step's 8 rows -> mean seconds per
    step after the first, and RSS."""
    from sft_vs_trl import WORK, step_budget, write_run

    from retrograd.config import load_config
    from retrograd.training.batches import epoch_plan

    with tempfile.TemporaryDirectory() as tmp:
        examples, budget = step_budget(write_run(Path(tmp), "f32"))
        cfg = write_run(Path(tmp), "f32", micro_batch=micro_batch or budget)
        lengths = [len(e.ids) for e in examples]
        accumulation = 1 if micro_batch is None else len(epoch_plan(lengths[: WORK.batch], 0, seed=0, shuffle=False, micro_batch=micro_batch, accumulation=1))
        cfg.write_text(cfg.read_text().replace("gradient_accumulation = 1", f"gradient_accumulation = {accumulation}")
                       .replace(f"threads = {WORK.threads}", f"threads = {threads}"))
        t = load_config(cfg).training
        plan = epoch_plan(lengths, 0, seed=0, shuffle=False, micro_batch=t.micro_batch, accumulation=t.gradient_accumulation)
        assert [sorted(i for mb in step for i in mb) for step in plan] == [list(range(k, k + WORK.batch)) for k in range(0, WORK.rows, WORK.batch)]
        r = subprocess.run([sys.executable, "-m", "retrograd", "train", str(cfg)], cwd=ROOT, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            sys.exit(f"retrograd train failed (sft, micro_batch {micro_batch}):\n{r.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "out" / "adapter.metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "timing/step_seconds" in row][1:]
    return {"step": statistics.mean(row["timing/step_seconds"] for row in rows), "rss": max(row["system/rss_bytes"] for row in rows),
            "micro_batch": micro_batch or budget, "accumulation": accumulation}


def cpu_model() -> str:
    """'AMD EPYC (family 25 model 1; avx2)': the model name alone does not tell a Zen 3 from a
    Zen 4, and the vector extensions decide the benchmark ratios."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return platform.processor() or "unknown"
    fields = {}
    for line in info.read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    vector = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}; {', '.join(vector) or 'no AVX2'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="smoke,trl,sft", help="comma-separated: " + ", ".join([*WORKLOADS, "sft"]))
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--weights", default=None, help="[model] weights for every run (default: the config default)")
    parser.add_argument("--threads", type=int, default=2, help="training.threads (the goals are for 2)")
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    print(f"CPU: {cpu_model()}; {args.threads} threads; {args.updates} updates per run")
    rollout_workloads = [w for w in workloads if w != "sft"]
    if rollout_workloads:
        print(f"{'workload':<9} {'micro_batch':>11} {'s/update':>9} " + " ".join(f"{p[:10]:>10}" for p in PHASES) + f" {'ratio':>6} {'RSS MiB':>8}  weights")
    for workload in rollout_workloads:
        results = {mb: run(workload, mb, args.updates, args.weights, args.threads) for mb in MICRO_BATCHES}
        for mb, res in results.items():
            ratio = res["update"] / results[max(MICRO_BATCHES)]["update"]
            print(f"{workload:<9} {mb:>11} {res['update']:>9.2f} " + " ".join(f"{res[p]:>10.2f}" for p in PHASES)
                  + f" {ratio:>5.2f}x {res['rss'] / 2**20:>8.0f}  {res['weights']}")
        small = results[min(MICRO_BATCHES)]
        ratio = small["update"] / results[max(MICRO_BATCHES)]["update"]
        verdicts = [f"micro_batch {min(MICRO_BATCHES)} / {max(MICRO_BATCHES)} = {ratio:.2f}x (goal <= {GOALS['ratio']}x)"]
        if workload == "smoke":
            verdicts.append(f"{small['update']:.2f} s per update at micro_batch {min(MICRO_BATCHES)} (goal <= {GOALS['smoke_seconds']:g} s)")
        print(f"  {workload}: " + "; ".join(verdicts))
    if "sft" in workloads:
        whole, small = run_sft(None, args.threads), run_sft(32, args.threads)
        print(f"{'sft':<9} {'micro_batch':>11} {'accumulation':>12} {'s/step':>7} {'ratio':>6} {'RSS MiB':>8}")
        for res in (small, whole):
            print(f"{'sft':<9} {res['micro_batch']:>11} {res['accumulation']:>12} {res['step']:>7.2f} {res['step'] / whole['step']:>5.2f}x {res['rss'] / 2**20:>8.0f}")
        print(f"  sft: micro_batch 32 / one micro-batch per step = {small['step'] / whole['step']:.2f}x (goal <= {GOALS['ratio']}x)")


if __name__ == "__main__":
    main()
