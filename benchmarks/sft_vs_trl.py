"""SFT speed and memory: retrograd beside TRL's SFTTrainer on one identical CPU workload.

    python benchmarks/sft_vs_trl.py                      # TRL, ours f32, bf16, bf16 + checkpointing (~6 min on 2 cores)
    python benchmarks/sft_vs_trl.py --sides ours-bf16    # a subset; TRL is not needed without "trl"
    python benchmarks/sft_vs_trl.py --profile bf16       # torch.profiler over 3 of our steps

Workload (both sides): the bundled SmolLM2-135M-Instruct Q4_1; 256 chat rows, row i user
"What is A + B?" and assistant "A+B" with A, B drawn by random.Random(0); loss on the
assistant tokens only; LoRA rank 8, alpha 16 on q, k, v, o, gate, up, down; step k trains
rows 8k..8k+7 in order; rows of at most 128 tokens; AdamW lr 1e-4 constant, no weight decay,
gradient clip 1.0; 20 steps; 2 threads. TRL: transformers dequantizes the GGUF to float32,
PEFT LoRA, SFTTrainer on prompt/completion conversations with completion_only_loss, fp32,
no gradient checkpointing. Ours: load_model(weights="quantized"), attach_lora, load_sft,
pack, batch_logprobs, clip_gradients, build_optimizer, in f32 and in bf16 compute.

Each side runs in a fresh subprocess, so its peak RSS (ru_maxrss: load included) is its own.
Definitions:
  tok/s     non-pad input tokens (prompt and answer, every token the model reads) per
            wall-clock second of a whole optimizer step; "steady" excludes step 1 (warm-up).
  GFLOP/s   matmul FLOPs each side executes per step (2 per multiply-add), over steady time:
            frozen linears forward 2·P·T plus input gradients 2·P·T (no weight gradients);
            LoRA 6·r·(in+out)·T (forward, input and weight gradients); attention on R padded
            rows of L slots 6·R·L²·H·(D+Dv) per layer; LM head 4·E·V·N over the N positions
            it scores (ours: trained tokens only; TRL on CPU: every position of the padded batch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TRL_PACKAGES = ("trl", "transformers", "peft", "accelerate", "datasets")
SIDES = ("trl", "ours-f32", "ours-bf16", "ours-bf16-gc")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OUR_TARGETS = ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]
LOSS_STEPS = (1, 5, 10, 20)


@dataclass(frozen=True)
class Workload:
    rows: int = 256
    batch: int = 8
    steps: int = 20
    max_len: int = 128
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    rank: int = 8
    alpha: float = 16.0
    seed: int = 0
    threads: int = 2

    def questions(self) -> list[tuple[str, str]]:
        """(user, assistant) per row: the sum written out, not computed."""
        rng = random.Random(self.seed)
        pairs = []
        for _ in range(self.rows):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            pairs.append((f"What is {a} + {b}?", f"{a}+{b}"))
        return pairs


WORK = Workload()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_ours(dtype: str, profile: bool = False, checkpointing: bool = False) -> dict:
    """Our SFT step, written out as recipes/sft.py runs it, on the fixed batches; with
    `checkpointing`, as training.gradient_checkpointing = true with checkpoint_dtype = "bf16"."""
    import torch

    from retrograd.data import ChatFormat, load_sft, resolve_chat_template
    from retrograd.lora import attach_lora
    from retrograd.memory import PeakMemory, rss_bytes
    from retrograd.model.base import load_model
    from retrograd.training.batches import LogprobOptions, batch_logprobs, pack
    from retrograd.training.optim import build_optimizer, clip_gradients

    torch.set_num_threads(WORK.threads)
    model = load_model(weights="quantized", compute_dtype=dtype)
    transformer = model.transformer
    if checkpointing:
        transformer.checkpoint_every, transformer.checkpoint_dtype = 1, torch.bfloat16
    adapter = attach_lora(transformer, OUR_TARGETS, WORK.rank, WORK.alpha, WORK.seed)
    chat = ChatFormat(model.tokenizer, resolve_chat_template(model.spec.chat_template), origin=str(model.path))
    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / "sums.jsonl"
        records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in WORK.questions()]
        data_file.write_text("".join(json.dumps(r) + "\n" for r in records))
        examples = load_sft(data_file, chat, ctx=WORK.max_len).examples
    assert len(examples) == WORK.rows, "no row is longer than max_len"
    params = adapter.parameters()
    optimizer = build_optimizer(params, "adamw", WORK.lr, 0.0)
    options = LogprobOptions()
    rss_loaded = rss_bytes()

    def step(k: int) -> float:
        rows = examples[k * WORK.batch : (k + 1) * WORK.batch]
        batch = pack(rows)
        loss = -batch_logprobs(transformer, batch, options).sum() / sum(e.n_trained for e in rows)
        loss.backward()
        clip_gradients(params, WORK.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    if profile:
        return profile_steps(step)
    marks, losses = [time.perf_counter()], []
    with PeakMemory() as peak:
        for k in range(WORK.steps):
            losses.append(step(k))
            marks.append(time.perf_counter())
    return {
        "ids": [list(e.ids) for e in examples],
        "mask": [list(e.mask) for e in examples],
        "marks": marks,
        "losses": losses,
        "rss_loaded": rss_loaded,
        "rss_training_peak": peak.peak_rss,
        "rss_peak": peak_rss_bytes(),
    }


def profile_steps(step) -> dict:
    """Warm up on step 1, then profile steps 2-4 and print where the time goes."""
    import torch.profiler

    step(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for k in range(1, 4):
            step(k)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr)
    return {}


def run_trl() -> dict:
    """TRL's SFTTrainer with a callback that timestamps every optimizer step."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from retrograd.bundled import default_model_path
    from retrograd.memory import PeakMemory, rss_bytes

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks, self.losses, self.tokens = [], [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.tokens.append(int(logs["num_tokens"]))

    torch.set_num_threads(WORK.threads)
    path = default_model_path()
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
        rss_loaded = rss_bytes()
        with PeakMemory() as peak:
            trainer.train()
    rows = trainer.train_dataset.to_list()  # labels: the ids, with -100 where not trained
    return {
        "ids": [row["input_ids"] for row in rows],
        "mask": [[label != -100 for label in row["labels"]] for row in rows],
        "marks": clock.marks,
        "losses": clock.losses,
        "logged_tokens": clock.tokens,  # TRL's own cumulative count of attention-mask tokens
        "rss_loaded": rss_loaded,
        "rss_training_peak": peak.peak_rss,
        "rss_peak": peak_rss_bytes(),
        "versions": {p: importlib.import_module(p).__version__ for p in TRL_PACKAGES},
    }


CHILDREN = {
    "trl": run_trl,
    "ours-f32": lambda: run_ours("f32"),
    "ours-bf16": lambda: run_ours("bf16"),
    "ours-bf16-gc": lambda: run_ours("bf16", checkpointing=True),
}


def busy_cpu_seconds() -> float:
    """CPU seconds every process on the machine has spent so far (/proc/stat, all but idle and iowait)."""
    user, nice, system, idle, iowait, irq, softirq, *_ = map(int, Path("/proc/stat").read_text().split("\n")[0].split()[1:])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def spawn(side: str) -> dict:
    """Run one side in a fresh interpreter; also measure how busy the rest of the machine was."""
    env = os.environ | {"OMP_NUM_THREADS": str(WORK.threads), "MKL_NUM_THREADS": str(WORK.threads), "TOKENIZERS_PARALLELISM": "false"}
    t0, busy0, own0 = time.perf_counter(), busy_cpu_seconds(), children_cpu_seconds()
    res = subprocess.run([sys.executable, __file__, "--_child", side], capture_output=True, text=True, env=env)
    if res.returncode:
        sys.exit(f"sft_vs_trl: the {side} run failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    others = (busy_cpu_seconds() - busy0) - (children_cpu_seconds() - own0)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["other_cores"] = max(others, 0.0) / (time.perf_counter() - t0)
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
    from retrograd.bundled import default_model_path
    from retrograd.gguf.file import GGUFFile
    from retrograd.gguf.spec import read_spec

    s = read_spec(GGUFFile(default_model_path()))
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
    marks, lengths = r["marks"], [len(ids) for ids in r["ids"]]
    assert len(marks) == WORK.steps + 1, f"{side}: timed {len(marks) - 1} steps"
    steps = [lengths[k * WORK.batch : (k + 1) * WORK.batch] for k in range(WORK.steps)]
    tokens = [sum(s) for s in steps]
    trained = [sum(map(sum, r["mask"][k * WORK.batch : (k + 1) * WORK.batch])) for k in range(WORK.steps)]
    if side == "trl":  # padded batch, every position scored by the head
        flops = [step_flops(dims, len(s) * max(s), len(s), max(s), len(s) * (max(s) - 1)) for s in steps]
    else:  # packed stream, rows padded to the longest, head on trained tokens only
        flops = [step_flops(dims, sum(s), len(s), max(s), n) for s, n in zip(steps, trained)]
    steady = marks[-1] - marks[1]
    return {
        "tok_s": sum(tokens[1:]) / steady,
        "tok_s_all": sum(tokens) / (marks[-1] - marks[0]),
        "first_step_s": marks[1] - marks[0],
        "steady_step_s": steady / (WORK.steps - 1),
        "gflop_s": sum(flops[1:]) / steady / 1e9,
        "losses": r["losses"],
        "tokens": sum(tokens),
        "trained": sum(trained),
        "rss_peak": r["rss_peak"],
        "rss_training_peak": r["rss_training_peak"],
        "rss_loaded": r["rss_loaded"],
        "other_cores": r["other_cores"],
    }


def compare_masks(ours: dict, trl: dict) -> list[str]:
    """Lines saying whether both sides read the same ids and train the same positions."""
    from retrograd.bundled import default_model_path
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
    decode = Tokenizer(default_model_path()).decode
    for who, extra in (("TRL", only_trl), ("ours", only_ours)):
        for token, count in sorted(extra.items()):
            lines.append(f"  only {who} trains token {token} ({decode([token])!r}) on {count} rows")
    return lines


def print_report(results: dict[str, dict], probe: dict[str, float]) -> None:
    gib = 2**30
    print(f"\nmatmul probe, {WORK.threads} threads: f32 {probe['f32']:.0f} GFLOP/s, bf16 {probe['bf16']:.0f} GFLOP/s")
    sides = list(results)
    ours = [s for s in sides if s != "trl"]
    rows = [  # label, cell, the key whose ratio to TRL is printed (or None)
        ("tok/s steady (steps 2-20)", lambda s: f"{s['tok_s']:.0f}", "tok_s"),
        ("tok/s all 20 steps", lambda s: f"{s['tok_s_all']:.0f}", "tok_s_all"),
        ("step 1 (warm-up) s", lambda s: f"{s['first_step_s']:.2f}", None),
        ("steady step s", lambda s: f"{s['steady_step_s']:.3f}", None),
        ("GFLOP/s executed", lambda s: f"{s['gflop_s']:.1f}", "gflop_s"),
        ("peak RSS GiB (process)", lambda s: f"{s['rss_peak'] / gib:.2f}", "rss_peak"),
        ("peak RSS GiB (training)", lambda s: f"{s['rss_training_peak'] / gib:.2f}", "rss_training_peak"),
        ("RSS GiB before training", lambda s: f"{s['rss_loaded'] / gib:.2f}", None),
        ("input tokens (20 steps)", lambda s: f"{s['tokens']}", None),
        ("trained tokens (20 steps)", lambda s: f"{s['trained']}", None),
        *((f"loss step {k}", lambda s, k=k: f"{s['losses'][k - 1]:.3f}", None) for k in LOSS_STEPS),
        ("other processes, cores", lambda s: f"{s['other_cores']:.2f}", None),
    ]
    ratios = ours if "trl" in results else []
    print(f"{'':<27}" + "".join(f"{s:>11}" for s in sides) + "".join(f"{s + '/trl':>16}" for s in ratios))
    for label, cell, key in rows:
        line = f"{label:<27}" + "".join(f"{cell(results[s]):>11}" for s in sides)
        if key:
            line += "".join(f"{results[s][key] / results['trl'][key]:>16.2f}" for s in ratios)
        print(line)
    for s in ours:
        dtype = s.split("-")[1]
        print(f"{s}: {results[s]['gflop_s'] / probe[dtype]:.0%} of the {dtype} matmul probe")
    print("\nloss per step")
    for s in sides:
        print(f"  {s:<10} " + " ".join(f"{x:.2f}" for x in results[s]["losses"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {', '.join(SIDES)}")
    ap.add_argument("--profile", choices=("f32", "bf16"), help="profile our steps 2-4 in this process and stop")
    ap.add_argument("--_child", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print(json.dumps(CHILDREN[args._child]()))
        return
    if args.profile:
        run_ours(args.profile, profile=True)
        return
    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        sys.exit(f"sft_vs_trl: --sides {args.sides}: unknown {', '.join(unknown)}; expected a subset of {', '.join(SIDES)}")
    missing = [p for p in TRL_PACKAGES if importlib.util.find_spec(p) is None]
    if "trl" in sides and missing:
        print(f"sft_vs_trl: missing {', '.join(missing)} (benchmark-only): pip install {' '.join(missing)}", file=sys.stderr)
        sys.exit(2)

    print(f"workload: {asdict(WORK)}; load average at start {os.getloadavg()[0]:.2f}", file=sys.stderr)
    probe = matmul_probe()
    raw = {}
    for side in sides:
        raw[side] = spawn(side)
        print(f"measured {side}", file=sys.stderr)
    dims = model_dims()
    results = {side: summarize(side, r, dims) for side, r in raw.items()}
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
