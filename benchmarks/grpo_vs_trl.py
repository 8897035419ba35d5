"""GRPO speed and memory: retrograd beside TRL's GRPOTrainer on one identical CPU workload.

    python benchmarks/grpo_vs_trl.py                        # every side (~4 min on 2 cores)
    python benchmarks/grpo_vs_trl.py --sides ours-auto,decode   # a subset; TRL is needed only for trl*
    python benchmarks/grpo_vs_trl.py --write-config DIR [--duty-cycle 0.5]   # only write our TOML (benchmarks/gpu_check.sh)
    python benchmarks/grpo_vs_trl.py --model M.gguf --sides trl,ours-auto   # another base (benchmarks/sized_models.py)

Workload (both sides): the bundled SmolLM2-135M-Instruct Q4_1 (or --model, when the reward also
adds the share of ASCII letters in the completion: random weights never answer); 16 prompts, row i user
"Calculate A + B. Reply with exactly one number." with A, B drawn by random.Random(0); update k
samples 8 completions for each of prompts 2k and 2k+1 (temperature 1, top_p 1, at most 16 new
tokens), rewards them with 1/(1+|first integer - (A+B)|) (0 without one, the function `reward`
below, shared by both sides), and takes one optimizer step (AdamW lr 1e-5 constant, gradient
clip 1.0, clip range 0.2/0.28, beta 0, Dr. GRPO normalization, unscaled advantages); LoRA rank
8, alpha 16 on q, k, v, o, gate, up, down; 3 updates; 2 threads.
TRL: transformers dequantizes the GGUF to float32, PEFT LoRA, GRPOTrainer with num_generations 8,
generation batch 16, max_completion_length 16, fp32, no vLLM, sampling by transformers'
generate; side "trl" keeps GRPOConfig's default gradient checkpointing, "trl-nogc" turns it off.
Ours: what a user runs, `retrograd train` in its own process on a [run] algorithm = "grpo" TOML
this script writes, compute dtype "auto" (bf16 on a CPU with native bf16) and "f32", and "ours-quantized"
(`[model] weights = "quantized"`: the base kept in its GGUF blocks, dequantized per use), and
"ours-lean" (quantized, plus gradient checkpointing, as TRL's default side checkpoints: the
least memory); rollouts from llama.cpp with the live adapter; its numbers come
from the run's own metrics.jsonl.
Side "decode": our sampler beside raw llama.cpp batched decode on the first two prompts (16
sequences), with a trained-looking rank-8 adapter and without (benchmarks/sampler.py's
`compare`), and the adapter refresh time.

Each side runs in a fresh subprocess, so its peak RSS (ru_maxrss: model load included) is its own.
Definitions:
  update s      wall time of one whole update: sampling, rewards, scoring, the optimizer step and
                (ours) the adapter refresh; ours: metrics.jsonl's timing/update_seconds (the
                denominator of the progress table's tok/s), TRL: from one optimizer step's end to
                the next. "wall" adds what runs between updates (ours: metrics, rollouts.jsonl,
                the progress table), from the run's time stamps; update 1 counts from its start.
  start-up s    from launching the process to the start of update 1 (imports, model load, sampler).
  phases        TRL: generate (transformers' generate), reward, forward (compute_loss), backward
                (accelerator.backward), optimizer (clip + step); ours: the recipe's own timers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # also when retrograd imports this file for its reward function
from sized_models import MODEL_ENV, bench_model, use_model  # noqa: E402

TRL_PACKAGES = ("trl", "transformers", "peft", "accelerate", "datasets")
SIDES = ("trl", "trl-nogc", "ours-auto", "ours-f32", "ours-quantized", "ours-lean", "decode")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUESTION = re.compile(r"Calculate (\d+) \+ (\d+)\.")
INTEGER = re.compile(r"-?\d+")
GOALS = {"speedup": 6.0, "rss_fraction": 0.3, "decode_fraction": 0.9, "refresh_ms": 30.0}


@dataclass(frozen=True)
class Workload:
    prompts: int = 16
    prompts_per_update: int = 2
    group_size: int = 8
    updates: int = 3
    max_new_tokens: int = 16
    lr: float = 1e-5
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    rank: int = 8
    alpha: float = 16.0
    seed: int = 0
    threads: int = 2

    def questions(self) -> list[str]:
        rng = random.Random(self.seed)
        rows = []
        for _ in range(self.prompts):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            rows.append(f"Calculate {a} + {b}. Reply with exactly one number.")
        return rows


WORK = Workload()


def reward(prompts: list[str], completions: list[str]) -> list[float]:
    """1/(1+|first integer - (A+B)|), 0 without an integer: ours loads it as
    reward_function = "<this file>:reward", TRL calls it through trl_reward. With --model
    (random weights, which hardly ever write an integer) the share of ASCII letters among the
    completion's characters is added, so that a group's rewards differ and both sides train."""
    out = []
    dense = bool(os.environ.get(MODEL_ENV))
    for prompt, completion in zip(prompts, completions):
        a, b = map(int, QUESTION.search(prompt).groups())
        answer = INTEGER.search(completion)
        value = 0.0 if answer is None else 1.0 / (1.0 + abs(int(answer.group()) - (a + b)))
        if dense:
            value += sum(ch.isascii() and ch.isalpha() for ch in completion) / max(1, len(completion))
        out.append(value)
    return out


def trl_reward(prompts, completions, **_) -> list[float]:
    """TRL passes conversations: the last user message and the assistant reply."""
    return reward([p[-1]["content"] for p in prompts], [c[0]["content"] for c in completions])


def peak_rss_bytes(who=resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


# ----------------------------------------------------------------------------- ours


def write_config(folder: Path, compute_dtype: str, duty_cycle: float = 1.0, weights: str = "auto", lean: bool = False) -> Path:
    """Our TOML for the workload; `lean`: gradient checkpointing too (at every layer, float32), as TRL's default side checkpoints."""
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in WORK.questions()))
    config = folder / "grpo.toml"
    config.write_text(f"""
[run]
algorithm = "grpo"

[model]
path = "{bench_model()}"
weights = "{weights}"

[output]
path = "{folder / 'out' / 'adapter.gguf'}"

[lora]
rank = {WORK.rank}
alpha = {WORK.alpha}

[training]
ctx = 128
micro_batch = 512   # tokens: one micro-batch holds an update's 16 completions and 2 prompts
lr = {WORK.lr}
max_grad_norm = {WORK.max_grad_norm}
threads = {WORK.threads}
compute_dtype = "{compute_dtype}"
max_gpu_duty_cycle = {duty_cycle}
{'gradient_checkpointing = true' if lean else ''}

[grpo]
prompts = "{prompts}"
reward_function = "{Path(__file__).resolve()}:reward"
updates = {WORK.updates}
prompts_per_update = {WORK.prompts_per_update}
group_size = {WORK.group_size}
grpo_epochs = 1
clip_range_low = {WORK.clip_low}
clip_range_high = {WORK.clip_high}
kl_coefficient = 0.0
prompt_order = "sequential"

[grpo.sampling]
max_new_tokens = {WORK.max_new_tokens}
temperature = 1.0
top_p = 1.0
""")
    return config


def run_ours(dtype: str, duty_cycle: float = 1.0, weights: str = "auto", lean: bool = False) -> dict:
    """`retrograd train` on the workload's TOML, in a process of its own; its metrics.jsonl."""
    from retrograd.config import load_config
    from retrograd.data import load_prompts
    from retrograd.recipes.common import open_chat

    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp), dtype, duty_cycle, weights, lean)
        launched = time.time()
        res = subprocess.run([sys.executable, "-m", "retrograd", "train", str(config)], check=False, capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"retrograd train failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "out" / "adapter.metrics.jsonl").read_text().splitlines()]
        prompts = load_prompts(config.parent / "prompts.jsonl", open_chat(load_config(config)))
    updates, previous_end = [], None
    for m in records:
        seconds = m["timing/update_seconds"]
        updates.append({
            "seconds": seconds,
            "wall": seconds if previous_end is None else m["time"] - previous_end,
            "phases": {
                "generation": m["timing/generation_seconds"], "reward": m["timing/reward_seconds"],
                "no-grad scoring": m["timing/behavior_scoring_seconds"] + m["timing/reference_seconds"],
                "train total": m["timing/optimizer_seconds"], "adapter refresh": m["timing/adapter_refresh_seconds"],
            },
            "tokens": m["completions/length_mean"] * WORK.prompts_per_update * WORK.group_size,
            "reward": m["reward/mean"],
            "refresh_s": m.get("sampler/adapter_refresh_seconds"),
        })
        previous_end = m["time"]
    loaded = next(line.strip() for line in res.stdout.splitlines() if line.startswith("model loaded"))
    return {
        "loaded": loaded,  # "model loaded in … s: FILE (arch, weights, DTYPE compute)"
        "prompt_ids": [list(p.ids) for p in prompts],
        "updates": updates,
        "startup_s": records[0]["time"] - records[0]["timing/update_seconds"] - launched,
        "rss_step_max": max(m["system/rss_bytes"] for m in records),
        "rss_peak": peak_rss_bytes(resource.RUSAGE_CHILDREN),
    }


def sibling(name: str):
    """A module beside this file (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_decode(repeats: int = 5) -> dict:
    """Our sampler beside raw llama.cpp batched decode on the first update's requests, with
    the run's options, with and without a trained-looking adapter (benchmarks/sampler.py)."""
    from retrograd.config import load_config
    from retrograd.data import load_prompts
    from retrograd.recipes.common import open_chat
    from retrograd.recipes.grpo import sampler_options
    from retrograd.sampler import GroupRequest, Sampling

    bench = sibling("sampler")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(write_config(Path(tmp), "auto"))
        prompts = load_prompts(cfg.grpo.prompts, open_chat(cfg))[: WORK.prompts_per_update]
    options = sampler_options(cfg)
    sampling = Sampling(WORK.max_new_tokens, temperature=1.0, top_p=1.0)
    g = WORK.group_size
    requests = [GroupRequest(p.ids, list(range(i * g, (i + 1) * g)), sampling) for i, p in enumerate(prompts)]
    model = bench_model()
    result = bench.compare(model, requests, options, bench.trained_adapter(model, WORK.rank), repeats)
    return result | {"options": asdict(options), "repeats": repeats}


# ----------------------------------------------------------------------------- TRL


def run_trl(gradient_checkpointing: bool) -> dict:
    """TRL's GRPOTrainer, its phases timed by wrapping the trainer's own methods."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from retrograd.runtime.memory import rss_bytes

    spent: dict[str, float] = {}

    def timed(phase: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - t0
        return wrapper

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks, self.phases, self.logs, self.rss = [], [], [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(time.time())

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_t0 = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            spent["optimizer"] = spent.get("optimizer", 0.0) + time.perf_counter() - self.optimizer_t0

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.time())
            self.rss.append(rss_bytes())
            self.phases.append(dict(spent))
            spent.clear()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    torch.set_num_threads(WORK.threads)
    path = bench_model()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    dequantized = GgufConfig(dequantize=True)  # a plain float32 model: transformers trains no GGUF-quantized one
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, quantization_config=dequantized)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in WORK.questions()])
    lora = LoraConfig(r=WORK.rank, lora_alpha=WORK.alpha, lora_dropout=0.0, target_modules=HF_TARGETS, task_type="CAUSAL_LM")
    batch = WORK.prompts_per_update * WORK.group_size
    clock = Clock()
    prompt_ids: list[list[int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=batch, gradient_accumulation_steps=1, generation_batch_size=batch,
            num_generations=WORK.group_size, max_completion_length=WORK.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
            beta=0.0, num_iterations=1, epsilon=WORK.clip_low, epsilon_high=WORK.clip_high, loss_type="dr_grpo",
            scale_rewards="none", learning_rate=WORK.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=WORK.max_grad_norm, optim="adamw_torch", max_steps=WORK.updates, seed=WORK.seed,
            shuffle_dataset=False, use_vllm=False, bf16=False, fp16=False, use_cpu=True,
            gradient_checkpointing=gradient_checkpointing, logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward], args=args, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=lora, callbacks=[clock])
        generate = trainer._generate_single_turn

        def generate_and_record(ids, *args, **kwargs):
            prompt_ids.extend(list(p) for p in ids)
            return generate(ids, *args, **kwargs)

        trainer._generate_single_turn = timed("generation", generate_and_record)
        trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
        trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
        trainer.compute_loss = timed("train forward", trainer.compute_loss)
        trainer.accelerator.backward = timed("train backward", trainer.accelerator.backward)
        trainer.train()
    marks = clock.marks
    assert len(marks) == WORK.updates + 1 and len(clock.logs) == WORK.updates, "one optimizer step and one log per update"
    updates = []
    for k, (phases, logs) in enumerate(zip(clock.phases, clock.logs)):
        train = phases["train forward"] + phases["train backward"] + phases["optimizer"]
        updates.append({
            "seconds": marks[k + 1] - marks[k],
            "wall": marks[k + 1] - marks[k],
            "phases": {
                "generation": phases["generation"], "reward": phases["reward"],
                "rollout other": phases["rollout"] - phases["generation"] - phases["reward"],
                "train forward": phases["train forward"], "train backward": phases["train backward"],
                "optimizer step": phases["optimizer"], "train total": train,
            },
            "tokens": logs["completions/mean_length"] * batch,
            "reward": logs["reward"],
        })
    return {
        "gradient_checkpointing": gradient_checkpointing,
        "torch_threads": torch.get_num_threads(),
        "prompt_ids": prompt_ids[:: WORK.group_size],  # one row per group, in sampling order
        "updates": updates,
        "started": marks[0],
        "rss_step_max": max(clock.rss),
        "rss_peak": peak_rss_bytes(),
        "versions": {p: importlib.import_module(p).__version__ for p in TRL_PACKAGES},
    }


CHILDREN = {  # side -> run(duty_cycle), which only our runs use
    "trl": lambda _: run_trl(gradient_checkpointing=True),
    "trl-nogc": lambda _: run_trl(gradient_checkpointing=False),
    "ours-auto": lambda duty: run_ours("auto", duty),
    "ours-f32": lambda duty: run_ours("f32", duty),
    "ours-quantized": lambda duty: run_ours("auto", duty, weights="quantized"),
    "ours-lean": lambda duty: run_ours("auto", duty, weights="quantized", lean=True),
    "decode": lambda _: run_decode(),
}


def spawn(side: str, duty_cycle: float) -> dict:
    """One side in a fresh interpreter. TRL and the decode side get OMP/MKL thread counts from
    the environment (no knob of their own); ours only what its TOML says, as a user's run would."""
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false"}
    if not side.startswith("ours"):
        env |= {"OMP_NUM_THREADS": str(WORK.threads), "MKL_NUM_THREADS": str(WORK.threads)}
    load_before = os.getloadavg()[0]
    launched = time.time()
    command = [sys.executable, __file__, "--_child", side, "--duty-cycle", str(duty_cycle)]
    res = subprocess.run(command, check=False, capture_output=True, text=True, env=env)
    if res.returncode:
        sys.exit(f"grpo_vs_trl: the {side} run failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["load"] = (load_before, os.getloadavg()[0])
    out["wall"] = time.time() - launched
    if "started" in out:  # TRL: its start-up counts from here
        out["startup_s"] = out["started"] - launched
    return out


# ----------------------------------------------------------------------------- report

PHASE_ROWS = ("generation", "reward", "rollout other", "no-grad scoring", "train forward", "train backward",
              "optimizer step", "train total", "adapter refresh")


def summarize(r: dict) -> dict:
    updates = r["updates"]
    seconds = [u["seconds"] for u in updates]
    phases = {p: statistics.mean(u["phases"][p] for u in updates) for p in PHASE_ROWS if p in updates[0]["phases"]}
    parts = sum(v for p, v in phases.items() if p not in ("train forward", "train backward", "optimizer step"))
    phases["other"] = statistics.mean(seconds) - parts
    return {
        "median_s": statistics.median(seconds),
        "median_wall_s": statistics.median(u["wall"] for u in updates),
        "seconds": seconds,
        "phases": phases,
        "tokens": statistics.mean(u["tokens"] for u in updates),
        "gen_tok_s": [u["tokens"] / u["phases"]["generation"] for u in updates],
        "reward": [u["reward"] for u in updates],
        "startup_s": r["startup_s"],
        "rss_peak": r["rss_peak"],
        "rss_step_max": r["rss_step_max"],
        "load": r["load"],
    }


def print_table(results: dict[str, dict]) -> None:
    gib = 2**30
    sides = list(results)
    trl = [s for s in sides if s.startswith("trl")]
    ours = [s for s in sides if s.startswith("ours")]
    pairs = [(o, t) for t in trl for o in ours]
    fmt_s = lambda v: f"{v:.2f}"
    rows = [  # label, value of a summary, format, ratio ("speedup": TRL/ours, "fraction": ours/TRL, None)
        ("update s, median of 3", lambda s: s["median_s"], fmt_s, "speedup"),
        ("update s, wall, median", lambda s: s["median_wall_s"], fmt_s, "speedup"),
        *((f"update {k + 1} s", lambda s, k=k: s["seconds"][k], fmt_s, "speedup") for k in range(WORK.updates)),
        *((f"  {p} s/update", lambda s, p=p: s["phases"].get(p), fmt_s, "speedup" if p in ("generation", "train total") else None)
          for p in (*PHASE_ROWS, "other")),
        ("generated tokens/update", lambda s: s["tokens"], lambda v: f"{v:.0f}", None),
        ("generation tok/s (median)", lambda s: statistics.median(s["gen_tok_s"]), lambda v: f"{v:.0f}", None),
        ("mean reward per update", lambda s: s["reward"], lambda v: "/".join(f"{x:.2f}" for x in v), None),
        ("start-up s", lambda s: s["startup_s"], lambda v: f"{v:.1f}", "speedup"),
        ("peak RSS GiB (process)", lambda s: s["rss_peak"] / gib, fmt_s, "fraction"),
        ("RSS GiB at update ends, max", lambda s: s["rss_step_max"] / gib, fmt_s, "fraction"),
        ("load avg before/after", lambda s: s["load"], lambda v: "{:.2f}/{:.2f}".format(*v), None),
    ]
    width = 15
    print(f"{'':<28}" + "".join(f"{s:>{width}}" for s in sides) + "".join(f"{o + '/' + t:>{width + 4}}" for o, t in pairs))
    for label, value, fmt, ratio in rows:
        cells = [value(results[s]) for s in sides]
        line = f"{label:<28}" + "".join(f"{'-' if v is None else fmt(v):>{width}}" for v in cells)
        for o, t in pairs:
            a, b = value(results[o]), value(results[t])
            cell = "" if ratio is None or not a or b is None else f"{b / a:.1f}x faster" if ratio == "speedup" else f"{a / b:.2f}x"
            line += f"{cell:>{width + 4}}"
        print(line)
    print("(ours: 'train total' = forward + backward + step under the optimizer timer; update 1 samples without "
          "the adapter, whose B is still zero)")


def print_decode(d: dict, ours: dict[str, dict]) -> None:
    o = d["options"]
    print()
    sibling("sampler").print_comparison(
        d,
        f"rollout generation, our sampler beside raw llama.cpp: {WORK.prompts_per_update} prompts x group "
        f"{WORK.group_size}, {WORK.max_new_tokens} new tokens, ctx {o['n_ctx']}, kv {o['kv_dtype']} (ours), "
        f"best of {d['repeats']} (prefill + decode + sampling)",
    )
    for side, r in ours.items():
        in_run = [1000 * u["refresh_s"] for u in r["updates"] if u["refresh_s"] is not None]
        print(f"  {side} refresh in the run     " + ", ".join(f"{x:.1f}" for x in in_run) + " ms")


def print_goals(results: dict[str, dict], decode: dict | None) -> None:
    trl = [s for s in results if s.startswith("trl")]
    ours = [s for s in results if s.startswith("ours")]
    print("\ngoals")
    for o in ours:
        for t in trl:
            speedup = results[t]["median_s"] / results[o]["median_s"]
            rss = results[o]["rss_peak"] / results[t]["rss_peak"]
            print(f"  {o} vs {t}: {speedup:.1f}x faster per update (goal >= {GOALS['speedup']:.0f}x: "
                  f"{'met' if speedup >= GOALS['speedup'] else 'MISSED'}), peak RSS {rss:.2f}x "
                  f"(goal <= {GOALS['rss_fraction']}x: {'met' if rss <= GOALS['rss_fraction'] else 'MISSED'})")
    if decode:
        share = decode["tok_s"]["ours + adapter"] / decode["tok_s"]["raw"]
        refresh = decode["refresh_ms"]["total_s"]
        print(f"  generation with the live adapter {share:.0%} of raw llama.cpp batched decode (goal >= "
              f"{GOALS['decode_fraction']:.0%}: {'met' if share >= GOALS['decode_fraction'] else 'MISSED'}); refresh {refresh:.1f} ms "
              f"(goal <= {GOALS['refresh_ms']:.0f} ms: {'met' if refresh <= GOALS['refresh_ms'] else 'MISSED'})")


def check_prompts(raw: dict[str, dict]) -> None:
    """Both sides feed the model the same prompt ids, in the workload's order."""
    trl = [s for s in raw if s.startswith("trl")]
    ours = [s for s in raw if s.startswith("ours")]
    for t in trl:
        sampled = raw[t]["prompt_ids"]
        for o in ours:
            expected = raw[o]["prompt_ids"][: len(sampled)]
            same = sampled == expected
            print(f"{t} sampled prompts 0..{len(sampled) - 1} in order with the same ids as {o}: {'yes' if same else 'NO'}")
            if not same:
                print(f"  TRL {sampled[0]}\n  ours {expected[0]}")


def main() -> None:
    from retrograd.runtime.device import cpu_name, describe, resolve_device

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {', '.join(SIDES)}")
    ap.add_argument("--duty-cycle", type=float, default=1.0, help="training.max_gpu_duty_cycle of our TOML (a GPU knob)")
    ap.add_argument("--write-config", type=Path, metavar="DIR", help="write our TOML (auto dtype) and its prompts into DIR, and stop")
    ap.add_argument("--model", type=Path, help="the base GGUF (default: the bundled SmolLM2-135M; benchmarks/sized_models.py writes 0.5B and 1.5B ones)")
    ap.add_argument("--_child", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    use_model(args.model, "grpo_vs_trl")
    if args._child:
        print(json.dumps(CHILDREN[args._child](args.duty_cycle)))
        return
    if args.write_config:
        args.write_config.mkdir(parents=True, exist_ok=True)
        print(write_config(args.write_config, "auto", args.duty_cycle))
        return
    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        sys.exit(f"grpo_vs_trl: --sides {args.sides}: unknown {', '.join(unknown)}; expected a subset of {', '.join(SIDES)}")
    missing = [p for p in TRL_PACKAGES if importlib.util.find_spec(p) is None]
    if any(s.startswith("trl") for s in sides) and missing:
        print(f"grpo_vs_trl: missing {', '.join(missing)} (benchmark-only): pip install {' '.join(missing)}", file=sys.stderr)
        sys.exit(2)

    from retrograd.runtime.allocator import preload_env

    print(f"workload: {asdict(WORK)}; load average at start {os.getloadavg()[0]:.2f}; "
          f"ours on {preload_env().get('LD_PRELOAD', 'system malloc')}, TRL on system malloc", file=sys.stderr)
    raw = {}
    for side in sides:
        raw[side] = spawn(side, args.duty_cycle)
        print(f"measured {side} in {raw[side]['wall']:.0f} s, load {raw[side]['load'][0]:.2f} -> {raw[side]['load'][1]:.2f}", file=sys.stderr)
    decode = raw.pop("decode", None)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; torch device {describe(resolve_device())}")
    for side, r in raw.items():
        if side.startswith("ours"):
            print(f"{side}: retrograd train, training.threads {WORK.threads}, max_gpu_duty_cycle {args.duty_cycle}; {r['loaded']}")
        else:
            print(f"{side}: gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}, {r['torch_threads']} torch threads")
    trl = [r for s, r in raw.items() if s.startswith("trl")]
    if trl:
        print("TRL " + ", ".join(f"{p} {v}" for p, v in trl[0]["versions"].items()))
        check_prompts(raw)
    summaries = {s: summarize(r) for s, r in raw.items()}
    if summaries:
        print()
        print_table(summaries)
    if decode:
        print_decode(decode, {s: r for s, r in raw.items() if s.startswith("ours")})
    print_goals(summaries, decode)

if __name__ == "__main__":
    main()
