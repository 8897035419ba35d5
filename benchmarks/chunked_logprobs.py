"""Dense vs chunked token log-probs: forward+backward transient peak memory and time.

    python benchmarks/chunked_logprobs.py [--heads f32,q8_0] [--cases smollm2,gemma3] [--repeats 2]
    python benchmarks/chunked_logprobs.py --sweep 1024x1024,2048x512,4096x512 --cases gemma3

The first form prints dense vs chunked (library default tile sizes); --sweep prints the chunked
path alone for each VOCAB_TILExTOKEN_CHUNK given, which is how the defaults were picked.

Each (case, head, path) runs in a fresh subprocess, so one measurement's freed-but-cached memory
cannot hide the next one's. In the child the inputs (head, hidden, ids) are allocated and a small
problem of the same kind is run once to load libraries and compile kernels; after malloc_trim
returns the memory it freed, the resident set size is the baseline. The peak is the larger of a
1 ms psutil sampling thread's maximum and ru_maxrss (when ru_maxrss grew during the run), minus
the baseline. Time is the best of the measured first run and `--repeats` more. On a machine shared
with other jobs, two torch threads make the chunked path's many small ops wait on each other;
`--threads 1` shows the work itself.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import subprocess
import sys
import threading
import time

import psutil
import torch
from gguf import GGMLQuantizationType as QT

from retrograd.kernels.chunked_logprobs import LOGPROB_PATHS, TOKEN_CHUNK, VOCAB_TILE
from retrograd.kernels.frozen import FrozenWeight

MIB = 1 << 20
CASES = {  # name -> (V, N, E)
    "smollm2": (49152, 1024, 576),
    "gemma3": (262144, 2048, 640),
}


def random_q8_0(n_rows: int, n_cols: int, gen: torch.Generator) -> torch.Tensor:
    """Valid Q8_0 rows without quantizing: per 32 values an f16 scale, then 32 int8 quants."""
    blocks = n_rows * n_cols // 32
    scales = (torch.rand(blocks, 1, generator=gen) * 0.002).to(torch.float16).view(torch.uint8)  # [B, 2]
    quants = torch.randint(-127, 128, (blocks, 32), dtype=torch.int8, generator=gen).view(torch.uint8)  # [B, 32]
    return torch.cat([scales, quants], dim=1).reshape(n_rows, -1)  # [V, E/32*34]


def make_head(kind: str, n_vocab: int, n_embd: int, gen: torch.Generator) -> FrozenWeight:
    if kind == "f32":
        data = torch.randn(n_vocab, n_embd, generator=gen) * 0.05
        return FrozenWeight("output.weight", data, QT.F32, (n_vocab, n_embd))
    return FrozenWeight("output.weight", random_q8_0(n_vocab, n_embd, gen), QT.Q8_0, (n_vocab, n_embd))


def step(path: str, head: FrozenWeight, hidden: torch.Tensor, ids: torch.Tensor, tile: int, chunk: int) -> None:
    hidden.grad = None
    logprobs, _ = LOGPROB_PATHS[path](hidden, head, ids, vocab_tile=tile, token_chunk=chunk)
    (-logprobs.sum()).backward()


class PeakSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.process = psutil.Process()
        self.peak = self.process.memory_info().rss
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(0.001):
            self.peak = max(self.peak, self.process.memory_info().rss)


def measure(case: str, head_kind: str, path: str, tile: int, chunk: int, repeats: int) -> dict:
    n_vocab, n_rows, n_embd = CASES[case]
    gen = torch.Generator().manual_seed(0)
    head = make_head(head_kind, n_vocab, n_embd, gen)
    hidden = torch.randn(n_rows, n_embd, generator=gen).requires_grad_()
    ids = torch.randint(0, n_vocab, (n_rows, 1), generator=gen)
    warm_head = make_head(head_kind, 2 * tile, n_embd, gen)
    step(path, warm_head, hidden[:64].detach().requires_grad_(), ids[:64] % (2 * tile), tile, chunk)
    del warm_head
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the warm-up's freed heap back, or the run reuses it unseen

    baseline = psutil.Process().memory_info().rss
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampler = PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    step(path, head, hidden, ids, tile, chunk)
    first = time.perf_counter() - t0
    sampler.done.set()
    sampler.join()
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = max(sampler.peak, maxrss_after if maxrss_after > maxrss_before else 0)

    times = [first]
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(path, head, hidden, ids, tile, chunk)
        times.append(time.perf_counter() - t0)
    return {"peak_mib": (peak - baseline) / MIB, "seconds": min(times)}


def run_child(case: str, head_kind: str, path: str, repeats: int, tile=VOCAB_TILE, chunk=TOKEN_CHUNK) -> dict:
    cmd = [sys.executable, __file__, "--child", case, head_kind, path, str(tile), str(chunk)]
    cmd += ["--repeats", str(repeats), "--threads", str(torch.get_num_threads())]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(cases: list[str], heads: list[str], repeats: int) -> None:
    print(f"threads={torch.get_num_threads()}  tile={VOCAB_TILE} chunk={TOKEN_CHUNK}  peak = RSS over baseline")
    header = f"{'case':8} {'V':>7} {'N':>5} {'E':>4} {'head':5} | {'dense MiB':>9} {'chunk MiB':>9} {'ratio':>6} |"
    print(header + f" {'dense s':>8} {'chunk s':>8} {'ratio':>6}")
    print("-" * (len(header) + 26))
    for case in cases:
        n_vocab, n_rows, n_embd = CASES[case]
        for head_kind in heads:
            dense = run_child(case, head_kind, "dense", repeats)
            chunked = run_child(case, head_kind, "chunked", repeats)
            mem_ratio = dense["peak_mib"] / chunked["peak_mib"]
            time_ratio = chunked["seconds"] / dense["seconds"]
            print(
                f"{case:8} {n_vocab:>7} {n_rows:>5} {n_embd:>4} {head_kind:5} | "
                f"{dense['peak_mib']:>9.0f} {chunked['peak_mib']:>9.1f} {mem_ratio:>5.0f}x | "
                f"{dense['seconds']:>8.2f} {chunked['seconds']:>8.2f} {time_ratio:>5.2f}x",
                flush=True,
            )


def sweep(cases: list[str], heads: list[str], sizes: list[str], repeats: int) -> None:
    print(f"threads={torch.get_num_threads()}  chunked path only  peak = RSS over baseline")
    print(f"{'case':8} {'head':5} {'tile':>6} {'chunk':>6} {'block MiB':>9} | {'peak MiB':>8} {'s':>7}")
    for case in cases:
        for head_kind in heads:
            for size in sizes:
                tile, chunk = (int(x) for x in size.split("x"))
                got = run_child(case, head_kind, "chunked", repeats, tile, chunk)
                block = tile * chunk * 4 / MIB
                print(
                    f"{case:8} {head_kind:5} {tile:>6} {chunk:>6} {block:>9.0f} | "
                    f"{got['peak_mib']:>8.1f} {got['seconds']:>7.2f}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--heads", default="f32", help="comma-separated: f32, q8_0")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs after the measured first one")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per run")
    parser.add_argument("--sweep", help="comma-separated VOCAB_TILExTOKEN_CHUNK sizes, chunked path only")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)  # CASE HEAD PATH TILE CHUNK
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases, heads = args.cases.split(","), args.heads.split(",")
    if args.child:
        case, head_kind, path, tile, chunk = args.child
        print(json.dumps(measure(case, head_kind, path, int(tile), int(chunk), args.repeats)))
    elif args.sweep:
        sweep(cases, heads, args.sweep.split(","), args.repeats)
    else:
        compare(cases, heads, args.repeats)


if __name__ == "__main__":
    main()
