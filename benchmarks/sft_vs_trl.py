"""SFT speed and memory: `retrograd train` beside TRL's SFTTrainer on one identical CPU workload.

    python benchmarks/sft_vs_trl.py                      # TRL; ours f32, bf16, bf16 + checkpointing, f32 and bf16 on the quantized blocks (~7 min on 2 cores)
    python benchmarks/sft_vs_trl.py --sides ours-bf16    # a subset; TRL is not needed without "trl"
    python benchmarks/sft_vs_trl.py --profile bf16       # torch.profiler over our first 4 steps, in this process
    python benchmarks/sft_vs_trl.py --model M.gguf       # another base (benchmarks/sized_models.py writes 0.5B/1.5B ones)
    python benchmarks/sft_vs_trl.py --model 1.5b.gguf --steps 6   # fewer steps for a large model
    python benchmarks/sft_vs_trl.py --rank 64            # another LoRA rank on every side (alpha twice it)

Workload (both sides): the bundled SmolLM2-135M-Instruct Q4_1 (or --model); 160 chat rows, row i user
"What is A + B?" and assistant "A+B" with A, B drawn by random.Random(0); loss on the
assistant tokens only; LoRA rank 8, alpha 16 (--rank) on q, k, v, o, gate, up, down; step k trains
rows 8k..8k+7 in order, 20 steps (--steps); AdamW lr 1e-4 constant, no weight decay, gradient clip 1.0;
2 threads. TRL: transformers dequantizes the GGUF to float32, PEFT LoRA, SFTTrainer on
prompt/completion conversations with completion_only_loss, fp32, no gradient checkpointing.
Ours: what a user runs, `retrograd train` in its own process on a TOML this script writes
(the default [model] weights, or "quantized" for ours-*-quantized, f32 or bf16 compute, sft.shuffle = false, gradient_accumulation = 1 and a
micro_batch token budget that packs exactly rows 8k..8k+7 into step k, which is checked with
the recipe's own planner; no evaluation, no checkpoints); its numbers come from the run's own
metrics.jsonl, so they are the progress table's.

Each side runs in a fresh process, so its peak RSS (ru_maxrss: load included) is its own.
Definitions (the progress table's tok/s is "tok/s per step"; benchmarks/README.md):
  step s        one optimizer step's wall time, from packing its first micro-batch to the end of
                the optimizer step (ours: the denominator of metrics.jsonl's train/tokens_per_second;
                TRL: from one step's end to the next).
  tok/s         non-pad input tokens (prompt and answer: every token the model reads) per second
                of step time; "steady" is steps 2-20 (step 1 warms up), "all" is steps 1-20 (what
                the run's closing `done ... tok/s=` line reports).
  tok/s wall    steps 2-20's tokens over the wall-clock time from the end of step 1 to the end of
                step 20, so with whatever runs between steps (metrics, the progress table).
  start-up s    from launching the process to the start of step 1 (imports, model load, data).
  GFLOP/s       matmul FLOPs each side executes per step (2 per multiply-add), over steady time:
                frozen linears forward 2·P·T plus input gradients 2·P·T (no weight gradients);
                LoRA 6·r·(in+out)·T (forward, input and weight gradients); attention on R padded
                rows of L slots 6·R·L²·H·(D+Dv) per layer; LM head 4·E·V·N over the N positions
                it scores (ours: trained tokens only; TRL on CPU: every position of the padded batch).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sized_models import bench_model, use_model

TRL_PACKAGES = ("trl", "transformers", "peft", "accelerate", "datasets")
SIDES = ("trl", "ours-f32", "ours-bf16", "ours-bf16-gc", "ours-f32-quantized", "ours-bf16-quantized")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OUR_TARGETS = ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]
LOSS_STEPS = (1, 5, 10, 20)  # those the run has
STEPS_ENV = "RETROGRAD_BENCH_SFT_STEPS"  # --steps, for the children
RANK_ENV = "RETROGRAD_BENCH_SFT_RANK"  # --rank, for the children


@dataclass(frozen=True)
class Workload:
    batch: int = 8
    steps: int = 20
    max_len: int = 128
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    rank: int = 8
    alpha: float = 16.0
    seed: int = 0
    threads: int = 2

    @property
    def rows(self) -> int:
        return self.batch * self.steps

    def questions(self) -> list[tuple[str, str]]:
        """(user, assistant) per row: the sum written out, not computed."""
        rng = random.Random(self.seed)
        pairs = []
        for _ in range(self.rows):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            pairs.append((f"What is {a} + {b}?", f"{a}+{b}"))
        return pairs


_RANK = int(os.environ.get(RANK_ENV, "8"))
WORK = Workload(steps=int(os.environ.get(STEPS_ENV, "20")), rank=_RANK, alpha=2.0 * _RANK)


def peak_rss_bytes(who=resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


# ----------------------------------------------------------------------------- ours


def write_run(folder: Path, dtype: str, *, checkpointing: bool = False, micro_batch: int | None = None,
              weights: str = "auto") -> Path:
    """The workload as a `retrograd train` TOML (data file beside it), with the micro_batch
    budget that packs 8 rows per step (`step_budget`; found on a first version without it)."""
    data = folder / "sums.jsonl"
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in WORK.questions()]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = folder / "sft.toml"
    gc = '\ngradient_checkpointing = true\ncheckpoint_every_n_layers = 1\ncheckpoint_dtype = "bf16"' if checkpointing else ""
    config.write_text(f"""
[run]
algorithm = "sft"

[model]
path = "{bench_model()}"
weights = "{weights}"

[output]
path = "{folder / 'out' / 'adapter.gguf'}"

[lora]
rank = {WORK.rank}
alpha = {WORK.alpha}
seed = {WORK.seed}
targets = {json.dumps(OUR_TARGETS)}

[training]
ctx = {WORK.max_len}
micro_batch = {micro_batch or 1}
gradient_accumulation = 1
lr = {WORK.lr}
lr_scheduler = "constant"
weight_decay = 0.0
max_grad_norm = {WORK.max_grad_norm}
threads = {WORK.threads}
compute_dtype = "{dtype}"{gc}

[sft]
data = "{data}"
shuffle = false
""")
    return config


def step_budget(config: Path) -> tuple[list, int]:
    """Our examples (ids, mask) as the recipe tokenizes them, and the micro_batch budget that
    packs exactly rows 8k..8k+7 into step k (the recipe's own planner says so, or this fails)."""
    from retrograd.config import load_config
    from retrograd.data import load_sft
    from retrograd.recipes.common import open_chat
    from retrograd.training.batches import epoch_plan

    cfg = load_config(config)
    examples = load_sft(cfg.sft.data, open_chat(cfg), ctx=WORK.max_len).examples
    assert len(examples) == WORK.rows, "no row is longer than max_len"
    budget = max(sum(len(e.ids) for e in examples[k : k + WORK.batch]) for k in range(0, WORK.rows, WORK.batch))
    plan = epoch_plan([len(e.ids) for e in examples], 0, seed=WORK.seed, shuffle=False, micro_batch=budget, accumulation=1)
    expected = [[list(range(k, k + WORK.batch))] for k in range(0, WORK.rows, WORK.batch)]
    assert plan == expected, f"micro_batch {budget} does not pack rows 8k..8k+7 per step"
    return examples, budget


def run_ours(dtype: str, checkpointing: bool = False, weights: str = "auto") -> dict:
    """`retrograd train` on the workload's TOML, in a process of its own; its metrics.jsonl."""
    with tempfile.TemporaryDirectory() as tmp:
        examples, budget = step_budget(write_run(Path(tmp), dtype))
        config = write_run(Path(tmp), dtype, checkpointing=checkpointing, micro_batch=budget, weights=weights)
        launched = time.time()
        res = subprocess.run([sys.executable, "-m", "retrograd", "train", str(config)], check=False, capture_output=True, text=True)
        wall = time.time() - launched
        if res.returncode:
            sys.exit(f"retrograd train failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "out" / "adapter.metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/tokens_per_second" in r]
    tokens = [sum(len(e.ids) for e in examples[k : k + WORK.batch]) for k in range(0, WORK.rows, WORK.batch)]
    step_s = [n / r["train/tokens_per_second"] for n, r in zip(tokens, steps)]
    return {
        "ids": [list(e.ids) for e in examples],
        "mask": [list(e.mask) for e in examples],
        "step_s": step_s,
        "step_ends": [r["time"] for r in steps],
        "startup_s": steps[0]["time"] - step_s[0] - launched,
        "command_s": wall,
        "losses": [r["train/loss"] for r in steps],
        "rss_step_max": max(r["system/rss_bytes"] for r in steps),
        "rss_peak": peak_rss_bytes(resource.RUSAGE_CHILDREN),
        "micro_batch": budget,
        "loaded": next(line.strip() for line in res.stdout.splitlines() if line.startswith("model loaded")),
        "summary": res.stdout.strip().splitlines()[-1],
    }


def profile_ours(dtype: str) -> None:
    """The run's first 4 steps in this process under torch.profiler (model load and step 1's
    warm-up included; the profiler slows everything down)."""
    import torch.profiler

    from retrograd.config import load_config
    from retrograd.recipes import sft
    from retrograd.training.report import SilentReporter

    with tempfile.TemporaryDirectory() as tmp:
        budget = step_budget(write_run(Path(tmp), dtype))[1]
        cfg = load_config(write_run(Path(tmp), dtype, micro_batch=budget))
        rows = cfg.sft.data.read_text().splitlines(keepends=True)
        cfg.sft.data.write_text("".join(rows[: 4 * WORK.batch]))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            sft.run(cfg, SilentReporter())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr)


# ----------------------------------------------------------------------------- TRL


def run_trl() -> dict:
    """TRL's SFTTrainer with a callback that timestamps every optimizer step."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from retrograd.runtime.memory import rss_bytes

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks, self.losses, self.tokens, self.rss = [], [], [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(time.time())

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.time())
            self.rss.append(rss_bytes())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.tokens.append(int(logs["num_tokens"]))

    torch.set_num_threads(WORK.threads)
    path = bench_model()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # dequantize=True: a plain float32 model (transformers refuses to train one still marked GGUF-quantized)
    dequantized = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, quantization_config=dequantized)
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
        for q, a in WORK.questions()
    ])
    lora = LoraConfig(r=WORK.rank, lora_alpha=WORK.alpha, lora_dropout=0.0, target_modules=HF_TARGETS, task_type="CAUSAL_LM")
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(
            output_dir=tmp, per_device_train_batch_size=WORK.batch, gradient_accumulation_steps=1,
            max_steps=WORK.steps, learning_rate=WORK.lr, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=WORK.max_grad_norm, optim="adamw_torch", seed=WORK.seed,
            train_sampling_strategy="sequential", max_length=WORK.max_len, completion_only_loss=True,
            packing=False, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora, callbacks=[clock])
        trainer.train()
    rows = trainer.train_dataset.to_list()  # labels: the ids, with -100 where not trained
    marks = clock.marks
    return {
        "ids": [row["input_ids"] for row in rows],
        "mask": [[label != -100 for label in row["labels"]] for row in rows],
        "step_s": [b - a for a, b in itertools.pairwise(marks)],
        "step_ends": marks[1:],
        "started": marks[0],
        "losses": clock.losses,
        "logged_tokens": clock.tokens,  # TRL's own cumulative count of attention-mask tokens
        "rss_step_max": max(clock.rss),
        "rss_peak": peak_rss_bytes(),
        "versions": {p: importlib.import_module(p).__version__ for p in TRL_PACKAGES},
    }


CHILDREN = {
    "trl": run_trl,
    "ours-f32": lambda: run_ours("f32"),
    "ours-bf16": lambda: run_ours("bf16"),
    "ours-bf16-gc": lambda: run_ours("bf16", checkpointing=True),
    "ours-f32-quantized": lambda: run_ours("f32", weights="quantized"),  # the base in its GGUF blocks
    "ours-bf16-quantized": lambda: run_ours("bf16", weights="quantized"),
}


# ----------------------------------------------------------------------------- driver


def busy_cpu_seconds() -> float:
    """CPU seconds every process on the machine has spent so far (/proc/stat, all but idle and iowait)."""
    user, nice, system, idle, iowait, irq, softirq, *_ = map(int, Path("/proc/stat").read_text().split("\n")[0].split()[1:])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def spawn(side: str) -> dict:
    """Run one side in a fresh interpreter; also measure how busy the rest of the machine was.
    TRL gets OMP/MKL thread counts from the environment (it has no knob); ours only what its
    TOML says, as a user's run would."""
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false"}
    if side == "trl":
        env |= {"OMP_NUM_THREADS": str(WORK.threads), "MKL_NUM_THREADS": str(WORK.threads)}
    launched, busy0, own0 = time.time(), busy_cpu_seconds(), children_cpu_seconds()
    res = subprocess.run([sys.executable, __file__, "--_child", side], check=False, capture_output=True, text=True, env=env)
    if res.returncode:
        sys.exit(f"sft_vs_trl: the {side} run failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    others = (busy_cpu_seconds() - busy0) - (children_cpu_seconds() - own0)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["other_cores"] = max(others, 0.0) / (time.time() - launched)
    if side == "trl":
        out["startup_s"] = out["started"] - launched
        out["command_s"] = time.time() - launched
    return out


def matmul_probe() -> dict[str, float]:
    """Best GFLOP/s of square matmuls on the benchmark's thread count, per dtype."""
    import torch

    torch.set_num_threads(WORK.threads)
    best = {}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        for n in (1024, 2048):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            a @ b  # warm-up
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t0)
            best[name] = max(best.get(name, 0.0), 2 * n**3 / min(times) / 1e9)
    return best


def model_dims() -> dict[str, int]:
    from retrograd.gguf.file import GGUFFile
    from retrograd.gguf.spec import read_spec

    s = read_spec(GGUFFile(bench_model()))
    E, F, H, K, D, Dv = s.n_embd, s.n_ff, s.n_head, s.n_head_kv, s.head_dim, s.head_dim_v
    shapes = [(E, H * D), (E, K * D), (E, K * Dv), (H * Dv, E), (E, F), (E, F), (F, E)]  # (in, out): q k v o gate up down
    return {
        "linear": s.n_layer * sum(i * o for i, o in shapes),
        "lora_per_rank": s.n_layer * sum(i + o for i, o in shapes),
        "attention": s.n_layer * H * (D + Dv),
        "head": E * s.n_vocab,
    }


def step_flops(dims: dict[str, int], tokens: int, rows: int, width: int, head_rows: int) -> float:
    """Matmul FLOPs of one forward+backward (see the module docstring)."""
    return (
        4 * dims["linear"] * tokens
        + 6 * WORK.rank * dims["lora_per_rank"] * tokens
        + 6 * rows * width**2 * dims["attention"]
        + 4 * dims["head"] * head_rows
    )


def summarize(side: str, r: dict, dims: dict[str, int]) -> dict:
    step_s, lengths = r["step_s"], [len(ids) for ids in r["ids"]]
    assert len(step_s) == WORK.steps, f"{side}: timed {len(step_s)} steps"
    steps = [lengths[k * WORK.batch : (k + 1) * WORK.batch] for k in range(WORK.steps)]
    tokens = [sum(s) for s in steps]
    trained = [sum(map(sum, r["mask"][k * WORK.batch : (k + 1) * WORK.batch])) for k in range(WORK.steps)]
    if side == "trl":  # padded batch, every position scored by the head
        flops = [step_flops(dims, len(s) * max(s), len(s), max(s), len(s) * (max(s) - 1)) for s in steps]
    else:  # packed stream, rows padded to the longest, head on trained tokens only
        flops = [step_flops(dims, sum(s), len(s), max(s), n) for s, n in zip(steps, trained)]
    steady = sum(step_s[1:])
    return {
        "tok_s": sum(tokens[1:]) / steady,
        "tok_s_wall": sum(tokens[1:]) / (r["step_ends"][-1] - r["step_ends"][0]),
        "tok_s_all": sum(tokens) / sum(step_s),
        "first_step_s": step_s[0],
        "steady_step_s": steady / (WORK.steps - 1),
        "startup_s": r["startup_s"],
        "command_s": r["command_s"],
        "gflop_s": sum(flops[1:]) / steady / 1e9,
        "losses": r["losses"],
        "tokens": sum(tokens),
        "trained": sum(trained),
        "rss_peak": r["rss_peak"],
        "rss_step_max": r["rss_step_max"],
        "other_cores": r["other_cores"],
    }


def compare_masks(ours: dict, trl: dict) -> list[str]:
    """Lines saying whether both sides read the same ids and train the same positions."""
    from retrograd.model.tokenizer import Tokenizer

    lines = []
    same_ids = ours["ids"] == trl["ids"]
    lines.append(f"input ids identical on all {WORK.rows} rows: {'yes' if same_ids else 'NO'}")
    if not same_ids:
        first = next(i for i, (a, b) in enumerate(zip(ours["ids"], trl["ids"])) if a != b)
        lines.append(f"  first differing row {first}: ours {ours['ids'][first]}\n  TRL {trl['ids'][first]}")
        return lines
    n_ours, n_trl = sum(map(sum, ours["mask"])), sum(map(sum, trl["mask"]))
    lines.append(f"trained tokens, all rows: ours {n_ours}, TRL {n_trl}")
    only_trl, only_ours = {}, {}
    for ids, mo, mt in zip(ours["ids"], ours["mask"], trl["mask"]):
        for token, a, b in zip(ids, mo, mt):
            if b and not a:
                only_trl[token] = only_trl.get(token, 0) + 1
            if a and not b:
                only_ours[token] = only_ours.get(token, 0) + 1
    decode = Tokenizer(bench_model()).decode
    for who, extra in (("TRL", only_trl), ("ours", only_ours)):
        for token, count in sorted(extra.items()):
            lines.append(f"  only {who} trains token {token} ({decode([token])!r}) on {count} rows")
    return lines


def print_report(results: dict[str, dict], probe: dict[str, float] | None) -> None:
    gib = 2**30
    if probe:
        print(f"\nCPU matmul probe, {WORK.threads} threads: f32 {probe['f32']:.0f} GFLOP/s, bf16 {probe['bf16']:.0f} GFLOP/s")
    sides = list(results)
    ours = [s for s in sides if s != "trl"]
    n = WORK.steps
    rows = [  # label, cell, the key whose ratio to TRL is printed (or None)
        (f"tok/s steady (steps 2-{n})", lambda s: f"{s['tok_s']:.0f}", "tok_s"),
        ("tok/s steady, wall", lambda s: f"{s['tok_s_wall']:.0f}", "tok_s_wall"),
        (f"tok/s all {n} steps", lambda s: f"{s['tok_s_all']:.0f}", "tok_s_all"),
        ("step 1 (warm-up) s", lambda s: f"{s['first_step_s']:.2f}", None),
        ("steady step s", lambda s: f"{s['steady_step_s']:.3f}", None),
        ("start-up s", lambda s: f"{s['startup_s']:.1f}", "startup_s"),
        ("whole command s", lambda s: f"{s['command_s']:.1f}", "command_s"),
        ("GFLOP/s executed", lambda s: f"{s['gflop_s']:.1f}", "gflop_s"),
        ("peak RSS GiB (process)", lambda s: f"{s['rss_peak'] / gib:.2f}", "rss_peak"),
        ("RSS GiB at step ends, max", lambda s: f"{s['rss_step_max'] / gib:.2f}", "rss_step_max"),
        (f"input tokens ({n} steps)", lambda s: f"{s['tokens']}", None),
        (f"trained tokens ({n} steps)", lambda s: f"{s['trained']}", None),
        *((f"loss step {k}", lambda s, k=k: f"{s['losses'][k - 1]:.3f}", None) for k in (*(k for k in LOSS_STEPS if k < n), n)),
        ("other processes, cores", lambda s: f"{s['other_cores']:.2f}", None),
    ]
    ratios = ours if "trl" in results else []
    width = max(map(len, sides)) + 2
    print(f"{'':<27}" + "".join(f"{s:>{width}}" for s in sides) + "".join(f"{s + '/trl':>{width + 4}}" for s in ratios))
    for label, cell, key in rows:
        line = f"{label:<27}" + "".join(f"{cell(results[s]):>{width}}" for s in sides)
        if key:
            line += "".join(f"{results[s][key] / results['trl'][key]:>{width + 4}.2f}" for s in ratios)
        print(line)
    for s in ours if probe else ():
        dtype = s.split("-")[1]
        print(f"{s}: {results[s]['gflop_s'] / probe[dtype]:.0%} of the {dtype} matmul probe")
    print("\nloss per step")
    for s in sides:
        print(f"  {s:<{width}} " + " ".join(f"{x:.2f}" for x in results[s]["losses"]))


def main() -> None:
    global WORK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {', '.join(SIDES)}")
    ap.add_argument("--profile", choices=("f32", "bf16"), help="profile our first 4 steps in this process and stop")
    ap.add_argument("--model", type=Path, help="the base GGUF (default: the bundled SmolLM2-135M; benchmarks/sized_models.py writes 0.5B and 1.5B ones)")
    ap.add_argument("--steps", type=int, default=WORK.steps, help="optimizer steps per side, at least 2 (default 20)")
    ap.add_argument("--rank", type=int, default=WORK.rank, help="LoRA rank on every side, alpha twice it (default 8)")
    ap.add_argument("--_child", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    use_model(args.model, "sft_vs_trl")
    if args.steps < 2:
        sys.exit("sft_vs_trl: --steps must be at least 2 (step 1 warms up)")
    if args.rank < 1:
        sys.exit("sft_vs_trl: --rank must be at least 1")
    WORK = replace(WORK, steps=args.steps, rank=args.rank, alpha=2.0 * args.rank)
    os.environ[STEPS_ENV], os.environ[RANK_ENV] = str(args.steps), str(args.rank)
    if args._child:
        print(json.dumps(CHILDREN[args._child]()))
        return
    if args.profile:
        profile_ours(args.profile)
        return
    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        sys.exit(f"sft_vs_trl: --sides {args.sides}: unknown {', '.join(unknown)}; expected a subset of {', '.join(SIDES)}")
    missing = [p for p in TRL_PACKAGES if importlib.util.find_spec(p) is None]
    if "trl" in sides and missing:
        print(f"sft_vs_trl: missing {', '.join(missing)} (benchmark-only): pip install {' '.join(missing)}", file=sys.stderr)
        sys.exit(2)

    import torch

    from retrograd.runtime.allocator import preload_env
    from retrograd.runtime.device import cpu_name, describe, resolve_device

    print(f"workload: {asdict(WORK)}; model {bench_model().name}; load average at start {os.getloadavg()[0]:.2f}; "
          f"ours on {preload_env().get('LD_PRELOAD', 'system malloc')}, TRL on system malloc", file=sys.stderr)
    on_gpu = torch.cuda.is_available()  # then our runs train there (device auto) and a CPU probe says nothing
    probe = None if on_gpu else matmul_probe()
    raw = {}
    for side in sides:
        raw[side] = spawn(side)
        print(f"measured {side}", file=sys.stderr)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; our device: {describe(resolve_device())}")
    dims = model_dims()
    results = {side: summarize(side, r, dims) for side, r in raw.items()}
    for side in (s for s in sides if s != "trl"):
        print(f"{side}: retrograd train, micro_batch {raw[side]['micro_batch']}; {raw[side]['loaded']}\n  its last line: {raw[side]['summary']}")
    if "trl" in raw:
        print("TRL " + ", ".join(f"{p} {v}" for p, v in raw["trl"]["versions"].items()))
        logged = raw["trl"]["logged_tokens"]
        expected = [sum(len(ids) for ids in raw["trl"]["ids"][: (k + 1) * WORK.batch]) for k in range(WORK.steps)]
        print(f"TRL trained rows in order (its logged token counts match rows 8k..8k+7): {'yes' if logged == expected else 'NO'}")
        for side in (s for s in sides if s != "trl"):
            print("\n".join(f"{side} vs TRL: {line}" for line in compare_masks(raw[side], raw["trl"])))
    print_report(results, probe)


if __name__ == "__main__":
    main()
