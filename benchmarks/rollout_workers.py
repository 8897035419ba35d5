"""Rollout workers beside the in-process sampler, at the same total llama.cpp threads.

    python benchmarks/rollout_workers.py            # ~2 min on 2 cores
    python benchmarks/rollout_workers.py --threads 4 --groups 16

Workload: the bundled SmolLM2-135M-Instruct Q4_1 with a rank-8 adapter on all seven target
families (random A and B, so llama.cpp applies it on every projection); --groups groups of 8
completions (prompts of 70 tokens sharing their start), --new-tokens new tokens each,
temperature 1. Sides: the in-process Sampler with --threads threads, and 2 local
`retrograd rollout-worker` processes with --threads / 2 each, the groups spread across them.
Figures: sampled tokens per second over 3 repeats (the median), whether the completions are
bit-identical, and the adapter push: the median of 5 pushes, the whole push (encoding the tensors
as one body, a JSON header and one float32 blob, and the concurrent uploads) and each worker's
round trip, beside the in-process refresh. The issue's goal: a push of at most 50 ms per worker.
State the CPU with any figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from retrograd.gguf.adapter import read_adapter
from retrograd.runtime.bundled import default_model_path
from retrograd.runtime.device import cpu_name
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.sampler.remote import connect, start_local_workers

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from lora_files import random_adapter


def requests(groups: int, new_tokens: int) -> list[GroupRequest]:
    return [GroupRequest([300 + t for t in range(67)] + [1000 + i, 2000 + i, 7], [50 * i + j for j in range(8)],
                         Sampling(new_tokens)) for i in range(groups)]


def timed_generation(sampler, work: list[GroupRequest], repeats: int = 3) -> tuple[float, list]:
    rates, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = sampler.generate(work)
        seconds = time.perf_counter() - start
        rates.append(sum(len(c.tokens) for group in out for c in group) / seconds)
    return statistics.median(rates), [[(c.tokens, c.logprobs) for c in group] for group in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    model = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        adapter = read_adapter(random_adapter(model, Path(tmp) / "rank8.gguf", rank=8))
    work = requests(args.groups, args.new_tokens)
    whole = SamplerOptions(n_ctx=256, n_seq_max=min(64, 8 * args.groups), n_threads=args.threads)
    with Sampler(model, whole) as sampler:
        local_pushes = [sampler.set_adapter(adapter.tensors, alpha=adapter.alpha).total_s for _ in range(5)]
        local_rate, local_out = timed_generation(sampler, work)
    split = max(args.threads // 2, 1)
    with start_local_workers(2, model, whole, threads=split) as two, connect(two.urls, model, whole) as remote:
        pushes = [remote.set_adapter(adapter.tensors, alpha=adapter.alpha) for _ in range(5)]
        remote_rate, remote_out = timed_generation(remote, work)
    per_worker = {url: statistics.median(p.round_trip_s[url] for p in pushes) for url in pushes[0].round_trip_s}
    refresh = {url: statistics.median(p.refresh[url].total_s for p in pushes) for url in pushes[0].refresh}
    print(f"\nrollout workers vs in-process, {args.threads} llama.cpp threads in all; CPU: {cpu_name()}")
    print(f"workload: {args.groups} groups x 8 completions x {args.new_tokens} new tokens, rank-8 adapter on 7 families\n")
    print(f"{'side':28} {'tokens/s':>9} {'ratio':>6}")
    print(f"{'in-process, ' + str(args.threads) + ' threads':28} {local_rate:9.1f} {1.0:6.2f}")
    print(f"{'2 workers, ' + str(split) + ' thread(s) each':28} {remote_rate:9.1f} {remote_rate / local_rate:6.2f}")
    print(f"completions bit-identical: {local_out == remote_out}\n")
    print(f"adapter push (median of 5): whole push {statistics.median(p.total_s for p in pushes) * 1e3:.0f} ms "
          f"(encoding {statistics.median(p.encode_s for p in pushes) * 1e3:.0f} ms); in-process refresh "
          f"{statistics.median(local_pushes) * 1e3:.0f} ms")
    for url, round_trip in per_worker.items():
        print(f"  {url}: round trip {round_trip * 1e3:.0f} ms, of which its refresh {refresh[url] * 1e3:.0f} ms "
              f"(goal <= 50 ms per worker)")


if __name__ == "__main__":
    main()
