"""`retrograd eval`'s scoring throughput beside the plain torch forward on the same tokens.

    python benchmarks/eval_scoring.py                    # bundled SmolLM2 Q4_1, examples/eval/, best of 3
    python benchmarks/eval_scoring.py --model other.gguf --copies 16 --micro-batch 1024

Sides, on the same model object (the base, weights as `retrograd eval` loads them), the same
threads and the same tokens, alternated within each repeat:
- eval: evaluation.tasks.score_task on each task of examples/eval/ (each file's items repeated
  `--copies` times): multiple-choice questions packed once for all their choices, texts scored
  token by token, `--micro-batch` tokens per pass; what `retrograd eval` runs per model;
- forward: the transformer over exactly the tokens eval computes (each question once, each
  choice's and each text's tokens), cut into plain sequences of `--micro-batch` tokens, then
  the output head and a log-softmax over the rows that predict a scored token, 256 at a time:
  the work any scorer must do, with no packing, layout or bookkeeping.
Tokens per second count the computed tokens; the ratio is eval over forward (the issue's goal:
>= 80%). Both run under torch.no_grad. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from retrograd.evaluation.tasks import choice_rollouts, load_tasks, loader, score_task, text_rollouts
from retrograd.recipes.common import model_chat
from retrograd.runtime.bundled import default_model_path

sys.path.insert(0, str(Path(__file__).parent))
from micro_batch import cpu_model  # noqa: E402

TASKS = Path(__file__).parents[1] / "examples/eval"


def computed_tokens(rollouts) -> tuple[list[int], int]:
    """The tokens a scorer computes (each group's prompt once, then its members' tokens) as
    one stream, and how many of them are scored."""
    stream, seen = [], set()
    for r in rollouts:
        if r.group not in seen:
            seen.add(r.group)
            stream += r.prompt
        stream += r.tokens
    return stream, sum(len(r.tokens) for r in rollouts)


def plain_forward(transformer, stream: list[int], n_scored: int, micro_batch: int) -> float:
    """The forward over `stream` in plain sequences, and log-probs for n_scored rows."""
    total = 0.0
    ids = torch.tensor(stream)
    hidden = torch.cat([transformer(ids[i : i + micro_batch]) for i in range(0, len(stream), micro_batch)])
    rows = hidden[:n_scored]
    targets = ids[1 : n_scored + 1]
    for i in range(0, n_scored, 256):
        logp = transformer.head(rows[i : i + 256]).log_softmax(-1)
        total += float(logp.gather(1, targets[i : i + 256, None]).sum())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="base GGUF (default: the bundled SmolLM2 Q4_1)")
    parser.add_argument("--copies", type=int, default=8, help="each task file's items repeated this many times")
    parser.add_argument("--micro-batch", type=int, default=2048, help="tokens per pass (retrograd eval's default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = args.model or default_model_path()
    chat = model_chat(base)
    tasks = [t for t in load_tasks(TASKS, chat) if t.kind != "generation"]
    model, device = loader(base, weights="auto", device=torch.device("cpu"))(None)
    print(f"CPU: {cpu_model()}; {args.threads} threads; load before start {os.getloadavg()[0]:.2f}; model {base.name}; "
          f"micro_batch {args.micro_batch}; best of {args.repeats}")
    print(f"{'task':<20} {'tokens':>7} {'eval tok/s':>11} {'forward tok/s':>14} {'ratio':>6}")
    for task in tasks:
        task = type(task)(task.name, task.kind, task.items * args.copies)
        make = choice_rollouts if task.kind == "multiple_choice" else text_rollouts
        stream, n_scored = computed_tokens(make(model.tokenizer, task.items))
        best = {"eval": float("inf"), "forward": float("inf")}
        with torch.no_grad():
            for repeat in range(args.repeats + 1):  # round 0 warms both and is not counted
                for side in best:
                    t0 = time.perf_counter()
                    if side == "eval":
                        score_task(model, task, args.micro_batch, device, lambda n: None)
                    else:
                        plain_forward(model.transformer, stream, n_scored, args.micro_batch)
                    if repeat:
                        best[side] = min(best[side], time.perf_counter() - t0)
        ours, ref = len(stream) / best["eval"], len(stream) / best["forward"]
        print(f"{task.name:<20} {len(stream):>7} {ours:>11.0f} {ref:>14.0f} {ours / ref:>6.2f}")


if __name__ == "__main__":
    main()
