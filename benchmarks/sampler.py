"""The llama.cpp sampler on SmolLM2 beside raw llama.cpp batched decode, with and without the
live adapter; the cost of an adapter refresh; the prefill that group prompt sharing saves.

    python benchmarks/sampler.py               # 2 prompts x group 8 = 16 sequences, 16 new tokens
    python benchmarks/sampler.py --threads 1   # llama.cpp threads (default: every CPU)

Four sides, on the same prompts, seeds count and token budget, alternated within each repeat
so that load from other processes hits all alike; throughput is sampled tokens over the wall
time of the whole generation (prefill, decode and sampling), best of --repeats:
- raw: llama.cpp's own batched decode through the low-level API, the way its `batched`
  example runs: one context of n_seq_max = the number of sequences with llama.cpp's default
  context parameters (split KV, flash attention auto, f16 KV), each prompt prefilled once in
  one llama_decode and copied to the other members of its group, then one llama_decode per
  step over the sequences still running (a finished one leaves the batch), each token drawn
  by a llama.cpp sampler chain (temperature, top-p, dist) of its own;
- raw + adapter: the same with the adapter file loaded by llama_adapter_lora_init and set on
  the context (llama.cpp's own LoRA cost);
- ours, ours + adapter: retrograd's Sampler.generate (reproducible batch shapes, our own
  sampling and log-probs), the adapter set by Sampler.set_adapter (the live refresh).
The adapter is rank 8 on all seven projection families with non-zero B (as after training).
On a machine shared with other jobs, OpenMP's default busy-waiting makes llama.cpp's threads
fight the other processes; set OMP_WAIT_POLICY=PASSIVE in the environment to see llama.cpp
without that.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import retrograd
from retrograd.gguf.adapter import adapter_tensors, write_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.model.lora import attach_lora
from retrograd.model.tokenizer import Tokenizer
from retrograd.runtime.bundled import default_model_path
from retrograd.runtime.device import cpu_name
from retrograd.runtime.llamacpp import C, load_llama_model
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling

QUESTIONS = ("Write a short story about a lighthouse keeper.", "Explain how rain forms, step by step.")
SIDES = ("raw", "raw + adapter", "ours", "ours + adapter")
REFRESH_PARTS = ("write_s", "init_s", "set_s", "total_s")


def trained_adapter(path, rank: int):
    adapter = attach_lora(retrograd.load_model(path).transformer, ["auto"], rank=rank, alpha=2.0 * rank, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in adapter.layers.values():
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen) * 0.02)
    return adapter


class RawLlama:
    """llama.cpp batched decode with nothing of ours in the loop: the baseline. Its weights are
    placed as the sampler's are (load_llama_model: AMX or CPU_REPACK), so a ratio
    measures the sampler, not the placement."""

    def __init__(self, path: Path, *, n_seq: int, n_ctx: int, n_threads: int):
        self.n_seq = n_seq
        self.model = load_llama_model(path, lambda: GGUFFile(path).tensors)
        self.vocab = C.llama_model_get_vocab(self.model)
        params = C.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx * n_seq, n_seq
        params.n_batch = params.n_ubatch = n_ctx
        params.n_threads = params.n_threads_batch = n_threads
        self.ctx = C.llama_init_from_model(self.model, params)
        self.memory = C.llama_get_memory(self.ctx)
        self.batch = C.llama_batch_init(n_ctx, 0, 1)
        self.adapter = None
        self.decode_s = 0.0  # running total of the time spent in llama_decode

    def set_adapter(self, file: Path | None) -> None:
        if file is None:
            C.llama_set_adapters_lora(self.ctx, None, 0, None)
            return
        if self.adapter is None:
            self.adapter = C.llama_adapter_lora_init(self.model, str(file).encode())
        adapters = (C.llama_adapter_lora_p_ctypes * 1)(self.adapter)
        C.llama_set_adapters_lora(self.ctx, adapters, 1, (ctypes.c_float * 1)(1.0))

    def generate(self, requests) -> int:
        """Every request's completions, each group in consecutive sequences -> tokens sampled."""
        C.llama_memory_clear(self.memory, False)
        seq, live, chains, sampled = 0, [], [], 0
        for r in requests:
            first = seq
            self._decode([(first, pos, token) for pos, token in enumerate(r.prompt)])
            for member, seed in enumerate(r.seeds):
                if member:
                    C.llama_memory_seq_cp(self.memory, first, seq, -1, -1)
                chains.append(_chain(r.sampling, seed))
                live.append([seq, len(r.prompt), C.llama_sampler_sample(chains[-1], self.ctx, -1), 1, r.sampling])
                seq += 1
        assert seq <= self.n_seq, (seq, self.n_seq)
        sampled = len(live)
        live = [s for s in live if not self._done(s)]
        while live:
            self._decode([(s[0], s[1], s[2]) for s in live])
            for row, s in enumerate(live):
                s[1], s[2], s[3] = s[1] + 1, C.llama_sampler_sample(chains[s[0]], self.ctx, row), s[3] + 1
            sampled += len(live)
            live = [s for s in live if not self._done(s)]
        for chain in chains:
            C.llama_sampler_free(chain)
        return sampled

    def _done(self, s) -> bool:
        return C.llama_vocab_is_eog(self.vocab, s[2]) or s[3] >= s[4].max_new_tokens

    def _decode(self, rows: list[tuple[int, int, int]]) -> None:
        """rows: (sequence, position, token); logits for the last row, or for every row of a step."""
        b = self.batch
        step = len({seq for seq, _, _ in rows}) == len(rows)
        for i, (seq, pos, token) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = token, pos, 1, seq
            b.logits[i] = step or i == len(rows) - 1
        b.n_tokens = len(rows)
        t0 = time.perf_counter()
        assert C.llama_decode(self.ctx, b) == 0
        self.decode_s += time.perf_counter() - t0

    def close(self) -> None:
        C.llama_batch_free(self.batch)
        C.llama_free(self.ctx)
        C.llama_model_free(self.model)


def _chain(sampling: Sampling, seed: int):
    chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(sampling.temperature))
    if sampling.top_p < 1:
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_p(sampling.top_p, 1))
    C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(seed))
    return chain


def compare(path: Path | None, requests, options: SamplerOptions, adapter, repeats: int) -> dict:
    """Raw llama.cpp and our sampler on the same requests, with and without `adapter` (a
    retrograd.model.lora.Adapter), alternated. Per side the best run's tok/s and the share of its
    wall time spent in llama_decode, the best tokens per CPU second, and the tokens summed
    over the repeats; the median
    refresh time per part (ms); the prompt tokens our sampler prefilled."""
    path = Path(path) if path is not None else default_model_path()
    threads = options.n_threads or len(os.sched_getaffinity(0))
    n_seq = sum(len(r.seeds) for r in requests)
    runs: dict[str, list[tuple[float, int, float, float]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp, Sampler(path, options) as ours:
        file = Path(tmp) / "adapter.gguf"
        shapes = {name: t.shape for name, t in GGUFFile(path).tensors.items()}
        write_adapter(file, adapter_tensors(adapter), arch=ours.adapter.arch, alpha=adapter.alpha, base_shapes=shapes)
        raw = RawLlama(path, n_seq=n_seq, n_ctx=options.n_ctx, n_threads=threads)
        raw_run = _timed(lambda: raw.generate(requests), lambda: raw.decode_s)
        ours_run = _timed(lambda: _sampled(ours, requests), lambda: ours.stats.decode_s)
        try:
            raw_run()  # warm-up: first-use allocations
            ours_run()
            refreshes, prefilled = [], 0
            for _ in range(repeats):
                raw.set_adapter(None)
                runs["raw"].append(raw_run())
                ours.set_adapter(None)  # also empties the cache: every run starts from nothing
                before = ours.stats.prefilled
                runs["ours"].append(ours_run())
                prefilled = ours.stats.prefilled - before
                raw.set_adapter(file)
                runs["raw + adapter"].append(raw_run())
                refreshes.append(ours.set_adapter(adapter))
                runs["ours + adapter"].append(ours_run())
            refreshes += [ours.set_adapter(adapter) for _ in range(10 - len(refreshes))]
        finally:
            raw.close()
    best = {side: max(r) for side, r in runs.items()}
    return {
        "threads": threads,
        "tok_s": {side: b[0] for side, b in best.items()},
        "decode_share": {side: b[2] for side, b in best.items()},
        "tok_per_cpu_s": {side: max(x[3] for x in r) for side, r in runs.items()},
        "tokens": {side: sum(x[1] for x in r) for side, r in runs.items()},
        "refresh_ms": {part: 1000 * statistics.median(getattr(t, part) for t in refreshes) for part in REFRESH_PARTS},
        "prefilled": prefilled,
    }


def _sampled(sampler: Sampler, requests) -> int:
    return sum(len(c.tokens) for group in sampler.generate(requests) for c in group)


def _timed(generate, decode_seconds):
    """A function that runs `generate` (-> tokens sampled) once -> (tok/s, tokens, share of
    the wall time in llama_decode (from the running total `decode_seconds()`), tokens per
    CPU second of this process (all its threads: less sensitive to other processes' load))."""

    def run() -> tuple[float, int, float, float]:
        d0, t0, c0 = decode_seconds(), time.perf_counter(), time.process_time()
        n = generate()
        seconds = time.perf_counter() - t0
        return n / seconds, n, (decode_seconds() - d0) / seconds, n / (time.process_time() - c0)

    return run


def print_comparison(result: dict, title: str) -> None:
    rate, cpu = result["tok_s"], result["tok_per_cpu_s"]
    print(f"{title}\n{result['threads']} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}, "
          f"CPU {cpu_name()}, load average {os.getloadavg()[0]:.1f}; best of the repeats, tokens summed over them")
    print(f"{'generation':<32}{'tok/s':>9}{'tok/CPU-s':>11}{'tokens':>8}{'in llama_decode':>17}")
    for side in SIDES:
        print(f"{side:<32}{rate[side]:>9.1f}{cpu[side]:>11.1f}{result['tokens'][side]:>8}{result['decode_share'][side]:>17.0%}")
    for label, (a, b), note in (
        ("ours / raw", ("ours", "raw"), ""),
        ("ours + adapter / raw", ("ours + adapter", "raw"), "   (goal >= 90%)"),
        ("ours + adapter / raw + adapter", ("ours + adapter", "raw + adapter"), ""),
        ("raw + adapter / raw", ("raw + adapter", "raw"), "   (llama.cpp's own LoRA cost)"),
    ):
        print(f"{label:<32}{rate[a] / rate[b]:>9.1%}{cpu[a] / cpu[b]:>11.1%}{note}")
    ms = result["refresh_ms"]
    print(f"adapter refresh, median of 10: {ms['total_s']:.1f} ms (write {ms['write_s']:.1f}, init {ms['init_s']:.1f}, "
          f"set {ms['set_s']:.1f}; goal <= 30 ms)")


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
    options = SamplerOptions(n_ctx=256, n_seq_max=n_seq, kv_dtype=args.kv, n_threads=args.threads)
    result = compare(path, requests, options, trained_adapter(path, args.rank), args.repeats)
    print_comparison(
        result,
        f"SmolLM2-135M Q4_1, {n_seq} sequences ({len(requests)} prompts x group {args.group}), "
        f"{args.max_new_tokens} new tokens, kv {args.kv} (ours), adapter rank {args.rank} on 7 families",
    )
    unshared = sum(len(r.prompt) * len(r.seeds) for r in requests)
    print(f"\nprompt prefill (ours): {unshared} tokens without sharing, {result['prefilled']} with group sharing")


if __name__ == "__main__":
    main()
