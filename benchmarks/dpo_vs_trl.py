"""DPO speed and memory: `retrograd train` beside TRL's DPOTrainer on one identical CPU workload.

    python benchmarks/dpo_vs_trl.py                       # TRL, ours (auto and quantized weights), our SFT (~4 min on 2 cores)
    python benchmarks/dpo_vs_trl.py --model M.gguf        # another base (benchmarks/sized_models.py writes 0.5B/1.5B ones)

Workload (both sides): the bundled SmolLM2-135M-Instruct Q4_1 (or --model); 48 pairs, pair i
the user turn "Shout: <three words>" (words drawn by random.Random(0)) with the words in
capitals chosen and as given rejected; DPO (sigmoid loss), beta 0.1; LoRA rank 8, alpha 16
on q, k, v, o, gate, up, down; 4 pairs per optimizer step in file order, 12 steps; AdamW lr
5e-4 constant, no weight decay, gradient clip 1.0; 2 threads. TRL: transformers
dequantizes the GGUF to float32, PEFT LoRA, DPOTrainer with its defaults otherwise (the
reference is the same model with the adapter disabled, scored at every step). Ours: `retrograd
train` on a TOML this script writes (default weights and compute dtype, pairs_per_step 4,
shuffle false, micro_batch 512; the reference is scored once before step 1 and its time is
start-up), with the default weights (dense when they fit) and with quantized weights.

Each side is one process whose process tree's RSS is sampled every 20 ms (peak, load
included). pairs/s is 4 over the mean optimizer step time of steps 2-12 (step 1 warms up):
ours from its metrics.jsonl, TRL from a callback timestamping every step. Goal (issue 25): at
least 2x TRL's pairs/s at no more than 0.5x its peak RSS, and at most 1.1x the peak of our
SFT on the chosen and rejected conversations (same ctx and micro_batch). Run it on an idle machine (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from micro_batch import cpu_model
from preflight_accuracy import peak_while_running
from sized_models import bench_model, use_model

PAIRS, PER_STEP, BETA, LR, RANK, ALPHA, THREADS, MAX_LEN, MICRO_BATCH = 48, 4, 0.1, 5e-4, 8, 16.0, 2, 128, 512
WORDS = ("red blue green fast slow happy quiet loud river stone cloud bread apple window garden morning night "
         "summer winter music paper light dark warm cold open close early late bright small large").split()


def records() -> list[dict]:
    rng = random.Random(0)
    out = []
    for _ in range(PAIRS):
        phrase = " ".join(rng.choice(WORDS) for _ in range(3))
        out.append({"prompt": [{"role": "user", "content": f"Shout: {phrase}"}],
                    "chosen": [{"role": "assistant", "content": phrase.upper()}],
                    "rejected": [{"role": "assistant", "content": phrase}]})
    return out


def run_ours(folder: Path, weights: str = "auto", sft: bool = False) -> dict:
    """`retrograd train` on the workload; with `sft`, SFT on the chosen and the rejected
    conversations at the same ctx and micro_batch instead (the memory a preference run should
    stay near: passes of at most micro_batch tokens either way)."""
    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records()))
    chosen = folder / "conversations.jsonl"
    chosen.write_text("".join(json.dumps({"messages": r["prompt"] + r[k]}) + "\n" for r in records() for k in ("chosen", "rejected")))
    config = folder / "dpo.toml"
    algorithm = f"""[sft]
data = "{chosen}"
shuffle = false""" if sft else f"""[preference]
data = "{data}"
loss = "dpo"
beta = {BETA}
pairs_per_step = {PER_STEP}
shuffle = false"""
    config.write_text(f"""
[run]
algorithm = "{'sft' if sft else 'preference'}"
[model]
path = "{bench_model()}"
weights = "{weights}"
[output]
path = "{folder / 'out/adapter.gguf'}"
[lora]
rank = {RANK}
alpha = {ALPHA}
targets = ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]
[training]
ctx = {MAX_LEN}
micro_batch = {MICRO_BATCH}
lr = {LR}
lr_scheduler = "constant"
max_grad_norm = 1.0
threads = {THREADS}
{algorithm}
""")
    process = subprocess.Popen([sys.executable, "-m", "retrograd", "train", str(config)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    peak = peak_while_running(process)
    out, err = process.communicate()
    if process.returncode:
        sys.exit(f"dpo_vs_trl: our run failed:\n{err[-3000:]}")
    rows = [json.loads(line) for line in (folder / "out/adapter.metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing/step_seconds" in r]
    weights = next((line for line in out.splitlines() if line.startswith("weights:")), "weights: ?")
    return {"step_s": [r["timing/step_seconds"] for r in steps], "losses": [r["train/loss"] for r in steps],
            "accuracy": [r.get("rewards/accuracies", math.nan) for r in steps], "peak": peak, "weights": weights.removeprefix("weights: ")}


def trl_child() -> None:
    """TRL's DPOTrainer in this process; prints one JSON line."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks, self.losses, self.accuracy = [], [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(time.time())

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.accuracy.append(float(logs.get("rewards/accuracies", float("nan"))))

    torch.set_num_threads(THREADS)
    path = bench_model()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(
            output_dir=tmp, per_device_train_batch_size=PER_STEP, gradient_accumulation_steps=1, max_steps=PAIRS // PER_STEP,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            optim="adamw_torch", seed=0, beta=BETA, max_length=MAX_LEN, bf16=False, fp16=False, use_cpu=True,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
            gradient_checkpointing=False, train_sampling_strategy="sequential",
        )
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records()), processing_class=tokenizer,
                             peft_config=lora, callbacks=[clock])
        trainer.train()
    print(json.dumps({"step_s": [b - a for a, b in zip(clock.marks, clock.marks[1:])], "losses": clock.losses,
                      "accuracy": clock.accuracy}))


def run_trl() -> dict:
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    process = subprocess.Popen([sys.executable, __file__, "--_trl"],  # the model travels in use_model's environment variable
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())
    peak = peak_while_running(process)
    out, err = process.communicate()
    if process.returncode:
        sys.exit(f"dpo_vs_trl: the TRL run failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]) | {"peak": peak}


def pairs_per_second(step_s: list[float]) -> float:
    return PER_STEP / statistics.fmean(step_s[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="base GGUF (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--_trl", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_model(args.model, "dpo_vs_trl")
    if args._trl:
        trl_child()
        return
    print(f"CPU: {cpu_model()}; {THREADS} threads; load before start {os.getloadavg()[0]:.2f}; model {bench_model().name}")
    sides = {}
    for name, weights, sft in (("ours", "auto", False), ("ours, quantized weights", "quantized", False),
                               ("our SFT on both answers", "auto", True)):
        with tempfile.TemporaryDirectory() as tmp:
            sides[name] = run_ours(Path(tmp), weights, sft)
        print(f"{name}: weights {sides[name]['weights']}", flush=True)
    trl = run_trl()
    ours, sft = sides["ours"], sides["our SFT on both answers"]
    gib = 2**30
    print("| DPO, 4 pairs per step | TRL DPOTrainer | ours | ours, quantized weights | ours / TRL | quantized / TRL |")
    print("|---|---|---|---|---|---|")
    quantized = sides["ours, quantized weights"]
    speed = {k: pairs_per_second(v["step_s"]) for k, v in (("trl", trl), ("ours", ours), ("q", quantized))}
    print(f"| pairs/s (steps 2-12) | {speed['trl']:.2f} | {speed['ours']:.2f} | {speed['q']:.2f} | "
          f"{speed['ours'] / speed['trl']:.2f}x | {speed['q'] / speed['trl']:.2f}x |")
    print(f"| step 1 s | {trl['step_s'][0]:.2f} | {ours['step_s'][0]:.2f} | {quantized['step_s'][0]:.2f} | | |")
    print(f"| peak RSS | {trl['peak'] / gib:.2f} GiB | {ours['peak'] / gib:.2f} GiB | {quantized['peak'] / gib:.2f} GiB | "
          f"{ours['peak'] / trl['peak']:.2f}x | {quantized['peak'] / trl['peak']:.2f}x |")
    for k in (0, 5, 11):
        print(f"| loss / accuracy at step {k + 1} | {trl['losses'][k]:.4f} / {trl['accuracy'][k]:.2f} | "
              f"{ours['losses'][k]:.4f} / {ours['accuracy'][k]:.2f} | {quantized['losses'][k]:.4f} / {quantized['accuracy'][k]:.2f} | | |")
    print(f"peak RSS of our DPO run / our SFT on the chosen and rejected conversations (same ctx, micro_batch {MICRO_BATCH}, weights): "
          f"{ours['peak'] / gib:.2f} / {sft['peak'] / gib:.2f} GiB = {ours['peak'] / sft['peak']:.2f}x (goal <= 1.1x)")


if __name__ == "__main__":
    main()
