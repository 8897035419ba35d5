"""`retrograd serve` latency beside raw llama.cpp: time to first token and decode tokens/s of a
streamed, greedy chat reply, for the base and with an adapter.

    python benchmarks/serve.py                  # SmolLM2 Q4_1, 128 new tokens, best of 3
    python benchmarks/serve.py --threads 1 --repeats 5 --model other.gguf

Sides, on the same chat prompts (rendered by the GGUF's template, so every side reads the
same prompt tokens), the same token budget and thread count, alternated within each repeat so
that load from other processes hits all alike; every repeat asks a different question, so no
side can answer from a cached prompt:
- raw: llama-cpp-python's `Llama.generate` on the prompt tokens in this process, no HTTP
  (flash attention on and f16 KV, as `retrograd serve` runs it; the adapter by `lora_path`);
- llama_cpp.server: llama-cpp-python's own OpenAI server (one process per adapter choice:
  it serves one LoRA per model), streamed over HTTP, when its extra is installed;
- retrograd serve: `retrograd serve` in its own process, base and adapter as two model names
  of one server, streamed over HTTP.
Time to first token (TTFT) is from sending the request (raw: calling generate) to the first
token of text; decode tokens/s counts the tokens after the first over the time after the
first. HTTP sides read the streamed chunks with httpx, one chunk per token. The adapter is
rank 8 on all seven projection families with non-zero B (as after training). Ratios are
ours over raw for tokens/s and raw over ours for TTFT: the goal is >= 90% for both.
Structured outputs: the same prompts answered under a JSON schema (the story as one JSON
string) beside the unconstrained reply (goal: >= 80% of its decode tok/s), and `--judge-tries`
seeded pairwise-judge requests under a schema at temperature 1 (goal: every reply valid).
About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from retrograd.gguf.adapter import LoRAWeights, write_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.runtime.bundled import default_model_path
from retrograd.runtime.device import cpu_name
from retrograd.runtime.llamacpp import C, llama_cpp
from retrograd.serving.inference import Inference

QUESTIONS = (
    "Write a long story about a lighthouse keeper.",
    "Explain how rain forms, step by step, in detail.",
    "Describe a busy market in a port city.",
    "Tell me the history of the bicycle.",
    "Write a letter to a friend about a long journey.",
)
FAMILIES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
N_CTX = 2048
JUDGE_SCHEMA = {
    "type": "object",
    "properties": {"winner": {"enum": ["a", "b"]}, "reason": {"type": "string", "maxLength": 200}},
    "required": ["winner", "reason"],
}
STORY_SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


def trained_adapter(model: Path, path: Path, rank: int = 8) -> Path:
    base = GGUFFile(model)
    shapes = {name: t.shape for name, t in base.tensors.items()}
    rng = np.random.default_rng(1)
    tensors = {
        name: LoRAWeights(
            rng.standard_normal((rank, n_in), dtype=np.float32) / np.sqrt(n_in),
            rng.standard_normal((n_out, rank), dtype=np.float32) * 0.02,
        )
        for name, (n_out, n_in) in ((n, shape) for n, shape in shapes.items() if n.split(".")[-2] in FAMILIES)
    }
    return write_adapter(path, tensors, arch=base.get_str("general.architecture"), alpha=2.0 * rank, base_shapes=shapes)


def messages(repeat: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[repeat % len(QUESTIONS)]}]


def raw_side(model: Path, lora: Path | None, threads: int):
    llm = llama_cpp.Llama(
        model_path=str(model),
        n_ctx=N_CTX,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        verbose=False,
        lora_path=str(lora) if lora else None,
    )

    def run(prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
        llm.reset()
        start = time.perf_counter()
        stamps = []
        for token in llm.generate(prompt, temp=0.0):
            if C.llama_vocab_is_eog(llm._model.vocab, token) or len(stamps) == max_tokens:
                break
            stamps.append(time.perf_counter())
        return _timings(start, stamps)

    return run, llm.close


def http_side(url: str, model: str, **extra):
    def run(chat: list[dict], max_tokens: int) -> tuple[float, float, int]:
        body = {"model": model, "messages": chat, "max_tokens": max_tokens, "temperature": 0, "stream": True} | extra
        stamps = []
        start = time.perf_counter()
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
        return _timings(start, stamps)

    return run


def judge_tries(url: str, tries: int) -> tuple[int, float]:
    """How many of `tries` seeded pairwise-judge requests under a JSON schema answer JSON that
    validates, and the mean seconds per request."""
    import jsonschema

    valid, start = 0, time.perf_counter()
    for seed in range(tries):
        question = QUESTIONS[seed % len(QUESTIONS)]
        prompt = (f"Question: {question}\nAnswer a: I do not know.\nAnswer b: Here is a careful answer.\n"
                  "Which answer is better? Reply with JSON: the winner and a short reason.")
        body = {"model": "base", "messages": [{"role": "user", "content": prompt}], "temperature": 1.0, "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": JUDGE_SCHEMA}}}
        reply = httpx.post(f"{url}/chat/completions", json=body, timeout=600).json()
        try:
            jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), JUDGE_SCHEMA)
            valid += 1
        except (ValueError, KeyError, jsonschema.ValidationError):
            pass
    return valid, (time.perf_counter() - start) / tries


def _timings(start: float, stamps: list[float]) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s after the first token, tokens)."""
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return stamps[0] - start, decode, len(stamps)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], url: str) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{command[0:3]} exited with {process.returncode}: {process.stderr.read()[-500:]}")
        try:
            if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{' '.join(command[:3])} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--judge-tries", type=int, default=100, help="seeded pairwise-judge requests under a schema")
    args = parser.parse_args()
    model = args.model or default_model_path()
    folder = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    lora = trained_adapter(model, folder / "adapter.gguf")
    with Inference(model, n_ctx=N_CTX) as inference:  # the prompt tokens every side reads
        prompts = [inference.chat_prompt(messages(r)) for r in range(args.repeats)]

    threads = ["--threads", str(args.threads)]
    ours_url = f"http://127.0.0.1:{free_port()}/v1"
    ours_port = ours_url.rsplit(":", 1)[1].split("/")[0]
    servers = [
        start_server(
            [
                sys.executable,
                "-m",
                "retrograd",
                "serve",
                "--model",
                str(model),
                "--adapter",
                f"adapter={lora}",
                "--port",
                ours_port,
                "--ctx",
                str(N_CTX),
                *threads,
            ],
            ours_url,
        )
    ]
    sides: dict[str, tuple] = {}
    closers = []
    try:
        for label, adapter in (("", None), (" + adapter", lora)):
            run, close = raw_side(model, adapter, args.threads)
            sides["raw" + label] = ("tokens", run)
            closers.append(close)
        try:
            import llama_cpp.server.app  # noqa: F401  (the extra: llama-cpp-python[server])

            for label, adapter in (("", None), (" + adapter", lora)):
                url = f"http://127.0.0.1:{free_port()}/v1"
                port = url.rsplit(":", 1)[1].split("/")[0]
                command = [
                    sys.executable,
                    "-m",
                    "llama_cpp.server",
                    "--model",
                    str(model),
                    "--n_ctx",
                    str(N_CTX),
                    "--n_threads",
                    str(args.threads),
                    "--n_threads_batch",
                    str(args.threads),
                    "--flash_attn",
                    "true",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    port,
                ]
                servers.append(start_server(command + (["--lora_path", str(adapter)] if adapter else []), url))
                sides["llama_cpp.server" + label] = ("chat", http_side(url, "model"))
        except ImportError:
            print("llama_cpp.server is not installed (pip install 'llama-cpp-python[server]'): its sides are skipped")
        sides["retrograd serve"] = ("chat", http_side(ours_url, "base"))
        schema = {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY_SCHEMA}}
        sides["retrograd serve, JSON schema"] = ("chat", http_side(ours_url, "base", response_format=schema))
        sides["retrograd serve + adapter"] = ("chat", http_side(ours_url, "adapter"))  # after: switching costs

        results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in sides}
        http_side(ours_url, "base")(messages(0), 4)  # warm-up of both processes' first request
        for r in range(args.repeats):
            for name, (kind, run) in sides.items():
                results[name].append(run(prompts[r] if kind == "tokens" else messages(r), args.max_tokens))
        judged = judge_tries(ours_url, args.judge_tries) if args.judge_tries else None
    finally:
        for process in servers:
            process.terminate()
            process.wait(timeout=30)
        for close in closers:
            close()

    best = {
        name: (min(t[0] for t in runs), max(t[1] for t in runs), [t[2] for t in runs]) for name, runs in results.items()
    }
    print(
        f"serve latency: {model.name}, {cpu_name()}, {args.threads} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}"
    )
    print(
        f"prompts of {[len(p) for p in prompts]} tokens, up to {args.max_tokens} new tokens, greedy, best of {args.repeats}"
    )
    print(f"{'side':<30}{'TTFT ms':>10}{'decode tok/s':>14}  tokens per repeat")
    for name, (ttft, rate, tokens) in best.items():
        print(f"{name:<30}{ttft * 1e3:>10.1f}{rate:>14.1f}  {tokens}")
    print(f"\n{'ratio (goal >= 90%)':<44}{'TTFT':>8}{'tok/s':>8}")
    for ours, peer in (
        ("retrograd serve", "raw"),
        ("retrograd serve + adapter", "raw + adapter"),
        ("retrograd serve", "llama_cpp.server"),
        ("retrograd serve + adapter", "llama_cpp.server + adapter"),
        ("retrograd serve, JSON schema", "retrograd serve"),
    ):
        if peer in best:
            print(
                f"{ours + ' / ' + peer:<44}{best[peer][0] / best[ours][0]:>8.0%}{best[ours][1] / best[peer][1]:>8.0%}"
            )
    print("(JSON schema / unconstrained: the story as one JSON string, grammar-constrained; goal tok/s >= 80%)")
    if judged:
        print(f"\npairwise judge under a JSON schema, temperature 1, seeds 0..{args.judge_tries - 1}: "
              f"{judged[0]} of {args.judge_tries} replies valid, {judged[1]:.2f} s per request (goal: all valid)")


if __name__ == "__main__":
    main()
