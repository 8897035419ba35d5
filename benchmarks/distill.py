"""Distillation costs on the bundled SmolLM2 (teacher) and a 15-block cut of it (student,
examples/distill/make_student.py):

- scoring: teacher tokens per second through llama.cpp (the GGUF as it is) and through torch
  (quantized weights dequantized per matmul, or bf16 weights dequantized once), with and
  without the top-k that the sidecar and the JSD loss need;
- sidecar: bytes per position and positions written per second by `distill-teacher`, and the
  raw write speed of the format;
- memory: peak RSS of on-policy distillation (llama.cpp or torch teacher), offline top-k
  distillation and SFT on the same student and data, each in a fresh process.

    python benchmarks/distill.py                       # everything
    python benchmarks/distill.py --part scoring --examples 128 --threads 2

Tokens per second count every token the teacher reads (prompt and answer), timed after one
warm-up call (kernel compilation, first allocations).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples/data"


def _make_student():
    spec = importlib.util.spec_from_file_location("make_student", REPO / "examples/distill/make_student.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_config(folder: Path, student: Path, teacher: Path, body: str, threads: int) -> Path:
    cfg = folder / f"run-{abs(hash(body)) % 10**8}.toml"
    cfg.write_text(f"""
[run]
algorithm = "{"sft" if "[sft]" in body else "distill"}"
[model]
path = "{student}"
[output]
path = "out/adapter.gguf"
[lora]
rank = 8
alpha = 16.0
[training]
ctx = 96
micro_batch = 512
lr = 1e-3
{f"threads = {threads}" if threads else ""}
{body.replace("TEACHER", str(teacher))}
""")
    return cfg


def corpus(folder: Path, n: int) -> Path:
    lines = (DATA / "arithmetic_train.jsonl").read_text().splitlines()
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines[i % len(lines)] for i in range(n)) + "\n")
    return path


# ----------------------------------------------------------------------------- scoring


def bench_scoring(folder: Path, student: Path, teacher: Path, n: int, threads: int) -> None:
    from retrograd.config import load_config
    from retrograd.data import load_sft
    from retrograd.recipes.common import open_chat
    from retrograd.teacher import TeacherOptions, open_teacher
    from retrograd.training.scoring import Rollout

    corpus(folder, n)
    cfg = load_config(write_config(folder, student, teacher, RUNS["offline top-k"], threads))
    examples = load_sft(folder / "train.jsonl", open_chat(cfg), ctx=96).examples
    rollouts = [Rollout(i, e.ids[:1], e.ids[1:], e.mask[1:]) for i, e in enumerate(examples)]
    tokens = sum(len(e.ids) for e in examples)
    print(
        f"\nteacher scoring: {len(examples)} chats, {tokens} tokens, {sum(e.n_trained for e in examples)} scored; threads={threads or 'all'}"
    )
    print(f"{'backend':<26}{'open s':>8}{'tok/s':>9}{'tok/s top-16':>14}")
    variants = [
        ("llama.cpp", "quantized", "llama.cpp (Q4_1)"),
        ("torch", "quantized", "torch (Q4_1 per matmul)"),
        ("torch", "bf16", "torch (bf16 weights)"),
    ]
    for backend, weights, label in variants:
        t0 = time.perf_counter()
        teacher_model = open_teacher(
            teacher,
            backend,
            TeacherOptions(n_ctx=96, group=8, threads=threads, weights=weights, compute_dtype="bf16", micro_batch=1024),
        )
        opened = time.perf_counter() - t0
        teacher_model.score(rollouts[:4], topk=16)  # warm-up
        rates = []
        for k in (0, 16):
            t0 = time.perf_counter()
            teacher_model.score(rollouts, topk=k)
            rates.append(tokens / (time.perf_counter() - t0))
        teacher_model.close()
        print(f"{label:<26}{opened:>8.1f}{rates[0]:>9.0f}{rates[1]:>14.0f}")


# ----------------------------------------------------------------------------- sidecar


def bench_sidecar(folder: Path, student: Path, teacher: Path, n: int, threads: int) -> None:
    from retrograd.config import load_config
    from retrograd.recipes.distill import TopkOptions, write_teacher_topk
    from retrograd.teacher import SidecarHeader, read_sidecar, write_sidecar
    from retrograd.training.report import SilentReporter

    corpus(folder, n)
    cfg = load_config(write_config(folder, student, teacher, RUNS["offline top-k"], threads))
    print(f"\nsidecar: {n} chats through distill-teacher")
    print(f"{'backend':<12}{'k':>4}{'positions':>11}{'bytes':>10}{'B/position':>12}{'positions/s':>13}")
    for backend in ("llama.cpp", "torch"):
        write_teacher_topk(
            cfg, SilentReporter(), TopkOptions(k=4, backend=backend, out=folder / "warm.topk")
        )  # warm-up
        for k in (8, 32):
            report = write_teacher_topk(
                cfg, SilentReporter(), TopkOptions(k=k, backend=backend, out=folder / f"t{k}.topk")
            )
            rows = report.header.rows
            print(
                f"{backend:<12}{k:>4}{rows:>11}{report.bytes:>10}{report.bytes / rows:>12.1f}{rows / report.seconds:>13.0f}"
            )
    rows, k = 1_000_000, 32
    rng = np.random.default_rng(0)
    ids, logprobs = (
        rng.integers(0, 49152, (rows, k)).astype(np.int32),
        rng.standard_normal((rows, k)).astype(np.float32),
    )
    header = SidecarHeader(
        k=k,
        rows=rows,
        vocab_size=49152,
        tokenizer_fingerprint="-",
        corpus_fingerprint="-",
        teacher="-",
        teacher_fingerprint="-",
        backend="-",
    )
    t0 = time.perf_counter()
    path = write_sidecar(
        folder / "raw.topk", header, ((ids[i : i + 65536], logprobs[i : i + 65536]) for i in range(0, rows, 65536))
    )
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sidecar = read_sidecar(path)
    checksum = int(np.asarray(sidecar.ids[::1000]).sum())
    read_s = time.perf_counter() - t0
    mib = path.stat().st_size / 2**20
    print(
        f"format alone: {rows} rows x k={k} = {mib:.0f} MiB written in {write_s:.2f} s ({mib / write_s:.0f} MiB/s), "
        f"opened + sampled in {read_s * 1000:.1f} ms (memory-mapped; checksum {checksum})"
    )


# ----------------------------------------------------------------------------- memory

RUNS = {
    "sft": '[sft]\ndata = "train.jsonl"',
    "offline top-k": '[distill]\nmode = "topk_offline"\nteacher_path = "TEACHER"\ndata = "train.jsonl"\nsidecar = "m.topk"',
    "on-policy (llama.cpp teacher)": (
        '[distill]\nteacher_path = "TEACHER"\nprompts = "prompts.jsonl"\nupdates = 2\nprompts_per_update = 4\n'
        "samples_per_prompt = 4\n[distill.sampling]\nmax_new_tokens = 24"
    ),
    "on-policy (torch teacher)": (
        '[distill]\nteacher_path = "TEACHER"\nteacher_backend = "torch"\nprompts = "prompts.jsonl"\nupdates = 2\n'
        "prompts_per_update = 4\nsamples_per_prompt = 4\n[distill.sampling]\nmax_new_tokens = 24"
    ),
}


def child(config: str) -> None:
    """Run one config in this fresh process and print its peak RSS as JSON."""
    from retrograd.config import load_config
    from retrograd.recipes import distill, sft
    from retrograd.training.report import SilentReporter

    cfg = load_config(config)
    t0 = time.perf_counter()
    (sft if cfg.run.algorithm == "sft" else distill).run(cfg, SilentReporter())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss": peak, "seconds": time.perf_counter() - t0}))


def bench_memory(folder: Path, student: Path, teacher: Path, n: int, threads: int) -> None:
    from retrograd.config import load_config
    from retrograd.recipes.distill import TopkOptions, write_teacher_topk
    from retrograd.training.report import SilentReporter

    corpus(folder, n)
    (folder / "prompts.jsonl").write_text((DATA / "smoke_rl_prompts.jsonl").read_text())
    offline = write_config(folder, student, teacher, RUNS["offline top-k"], threads)
    write_teacher_topk(load_config(offline), SilentReporter(), TopkOptions(backend="torch"))
    print(
        f"\npeak RSS, one fresh process per run (student {student.name}, teacher {teacher.name}; ctx 96, micro_batch 512)"
    )
    print(f"{'run':<32}{'peak RSS MiB':>14}{'seconds':>10}")
    for name, body in RUNS.items():
        cfg = write_config(folder, student, teacher, body, threads)
        out = subprocess.run(
            [sys.executable, __file__, "--_child", str(cfg)], cwd=folder, capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-2000:]}")
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:<32}{measured['peak_rss'] / 2**20:>14.0f}{measured['seconds']:>10.1f}")


PARTS = {"scoring": bench_scoring, "sidecar": bench_sidecar, "memory": bench_memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--examples", type=int, default=64, help="arithmetic chats scored / trained on")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default: all)")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        return child(args._child)

    from retrograd.runtime.bundled import default_model_path

    with tempfile.TemporaryDirectory(prefix="distill-bench-") as tmp:
        folder = Path(tmp)
        teacher = default_model_path()
        make = _make_student()
        student = make.write_truncated(teacher, folder / "student.gguf", make.parse_layers(make.DEFAULT_KEEP))
        for name in PARTS if args.part == "all" else [args.part]:
            PARTS[name](folder, student, teacher, args.examples, args.threads)


if __name__ == "__main__":
    main()
