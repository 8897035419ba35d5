"""The llama.cpp sampler on SmolLM2: batched generation with and without the live adapter,
the cost of an adapter refresh, and the prefill that group prompt sharing saves.

    python benchmarks/sampler.py               # 2 prompts x group 8 = 16 sequences, 16 new tokens
    python benchmarks/sampler.py --threads 1   # llama.cpp threads (default: every CPU)

The adapter is rank 8 on all seven projection families with non-zero B (as after training).
Throughput is sampled tokens over the wall time of `generate` (prefill, decode and the
numpy sampling together), median of --repeats runs alternating base and adapter. On a machine shared with other jobs,
OpenMP's default busy-waiting makes llama.cpp's threads fight the other processes; set
OMP_WAIT_POLICY=PASSIVE in the environment to see llama.cpp without that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import retrograd
from retrograd.bundled import default_model_path
from retrograd.lora import attach_lora
from retrograd.model.tokenizer import Tokenizer
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling

QUESTIONS = ("Write a short story about a lighthouse keeper.", "Explain how rain forms, step by step.")


def trained_adapter(path, rank: int):
    adapter = attach_lora(retrograd.load_model(path).transformer, ["auto"], rank=rank, alpha=2.0 * rank, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in adapter.layers.values():
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen) * 0.02)
    return adapter


def timed_run(sampler: Sampler, requests) -> tuple[float, int, int]:
    """(sampled tokens per second, sampled tokens, prompt tokens prefilled) of one generate."""
    sampled, prefilled = sampler.stats.sampled, sampler.stats.prefilled
    t0 = time.perf_counter()
    sampler.generate(requests)
    seconds = time.perf_counter() - t0
    return (
        (sampler.stats.sampled - sampled) / seconds,
        sampler.stats.sampled - sampled,
        sampler.stats.prefilled - prefilled,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--kv", default="f16", choices=("f16", "f32"))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    path = default_model_path()
    tok = Tokenizer(path)
    prompts = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS]
    sampling = Sampling(args.max_new_tokens, temperature=1.0)
    requests = [
        GroupRequest(p, list(range(i * args.group, (i + 1) * args.group)), sampling) for i, p in enumerate(prompts)
    ]
    n_seq = len(requests) * args.group
    adapter = trained_adapter(path, args.rank)
    options = SamplerOptions(n_ctx=256, n_seq_max=n_seq, kv_dtype=args.kv, n_threads=args.threads)

    runs: dict[str, list] = {"base": [], "adapter": []}
    with Sampler(path, options) as sampler:
        sampler.generate(requests)  # warm-up: first-use allocations
        refreshes = []
        for _ in range(args.repeats):  # alternate, so that load from other processes hits both alike
            sampler.set_adapter(None)  # every run starts from an empty cache
            runs["base"].append(timed_run(sampler, requests))
            refreshes.append(sampler.set_adapter(adapter))
            runs["adapter"].append(timed_run(sampler, requests))
        refreshes += [sampler.set_adapter(adapter) for _ in range(10 - len(refreshes))]
    base_rate, lora_rate = (statistics.median(r[0] for r in runs[k]) for k in ("base", "adapter"))
    base_tokens, lora_tokens = (sum(r[1] for r in runs[k]) for k in ("base", "adapter"))
    prefilled = runs["base"][0][2]

    threads = options.n_threads or len(os.sched_getaffinity(0))
    print(
        f"SmolLM2-135M Q4_1, {n_seq} sequences ({len(requests)} prompts x group {args.group}), "
        f"{args.max_new_tokens} new tokens, kv {args.kv}, {threads} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}"
    )
    print(f"{'generation':<34}{'tok/s':>10}{'tokens':>8}  (tokens summed over the runs)")
    print(f"{'base (no adapter)':<34}{base_rate:>10.1f}{base_tokens:>8}")
    print(f"{f'live adapter (rank {args.rank}, 7 families)':<34}{lora_rate:>10.1f}{lora_tokens:>8}")
    print(f"{'adapter / base':<34}{lora_rate / base_rate:>10.1%}")
    print(f"\n{'adapter refresh (median of 10)':<34}{'ms':>10}")
    for part in ("write_s", "init_s", "set_s", "total_s"):
        print(f"{part[:-2]:<34}{1000 * statistics.median(getattr(r, part) for r in refreshes):>10.1f}")
    unshared = sum(len(r.prompt) * len(r.seeds) for r in requests)
    print(f"\n{'prompt prefill':<34}{'tokens':>10}")
    print(f"{'without sharing':<34}{unshared:>10}")
    print(f"{'with group sharing':<34}{prefilled:>10}")
    print(f"{'saved':<34}{unshared - prefilled:>10}")


if __name__ == "__main__":
    main()
