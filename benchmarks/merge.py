"""`retrograd merge`: wall time and peak resident memory of the merge process against the
goal (peak RSS <= 1.5x the larger of the base and merged files), for SmolLM2-135M (Q4_1)
and Gemma-3-270M (Q4_K_M) with merged weights in f16 and `same`; and how much of the
adapter's effect each merged model keeps in llama.cpp.

    python benchmarks/merge.py                                   # random rank-8 adapters
    python benchmarks/merge.py --adapter smollm2=out/smoke_sft/smoke_sft.gguf --adapter gemma3=out/g.gguf

The random adapters cover every default target at rank 8, alpha 16, with A ~ N(0, 1/n_in)
and B ~ N(0, 0.004^2): about the size of the change a short SFT run makes (the smoke SFT
adapter's mean |scale*B*A| is 7e-4). Peak RSS is the merge process's own (wait4's
ru_maxrss), the interpreter and `import retrograd.cli` included; the `startup` row is that
floor (`retrograd merge --help`). "kept" is 1 - KL(base+adapter || merged) / KL(base+adapter
|| base) over the first 16 arithmetic eval conversations, teacher-forced in llama.cpp with
an F32 KV cache: 100% is the adapter's effect intact, 0% or below is none of it left. It
means something only where the adapter's effect is well above the noise floor printed
beside it (what storing the base's weights in f16 changes by itself): a random adapter's
effect is not, so measure "kept" with trained adapters (`retrograd train
examples/smoke_tiny_sft.toml`, and the same with [model] path = Gemma-3 and chat_template =
"gemma").
llama.cpp's own export-lora is timed beside ours when `llama-export-lora` is on PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

GOAL = 1.5
TYPES = ("f16", "same")
EVAL = Path(__file__).resolve().parent.parent / "examples/data/arithmetic_eval.jsonl"


def random_adapter(model: Path, dst: Path, b_std: float = 0.004) -> Path:
    from retrograd.gguf.adapter import LoRAWeights, write_adapter
    from retrograd.gguf.file import GGUFFile
    from retrograd.model.lora import resolve_targets

    f = GGUFFile(model)
    shapes = {n: t.shape for n, t in f.tensors.items() if len(t.shape) == 2}
    rng = np.random.default_rng(0)
    tensors = {
        n: LoRAWeights(
            (rng.standard_normal((8, shapes[n][1])) / np.sqrt(shapes[n][1])).astype(np.float32),
            (rng.standard_normal((shapes[n][0], 8)) * b_std).astype(np.float32),
        )
        for n in resolve_targets(["auto"], list(shapes))
    }
    return write_adapter(dst, tensors, arch=f.get_str("general.architecture"), alpha=16.0, base_shapes=shapes, dtype="f16")


# A child's ru_maxrss includes the memory it shared with its parent before exec (Linux
# keeps the larger high-water mark across exec), and this process grows to hold llama.cpp
# models; so each command starts from a small launcher that reports its child's peak.
LAUNCHER = """
import os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawnp(sys.argv[1], sys.argv[1:], os.environ)
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - t0, usage.ru_maxrss * 1024, status)
"""


def f16_copy(model: Path, adapter: Path, folder: Path) -> Path:
    """The base with its adapted weights stored in f16 and nothing added: the merge of the
    adapter with B = 0. Against the base, the noise that storing weights in f16 (and
    llama.cpp's f16 matmul instead of its quantized one) makes by itself."""
    from retrograd.gguf.adapter import LoRAWeights, read_adapter, write_adapter
    from retrograd.gguf.file import GGUFFile
    from retrograd.gguf.merge import merge

    loaded = read_adapter(adapter)
    zero = {n: LoRAWeights(w.a, np.zeros_like(w.b)) for n, w in loaded.tensors.items()}
    shapes = {n: t.shape for n, t in GGUFFile(model).tensors.items()}
    write_adapter(folder / "zero.gguf", zero, arch=loaded.arch, alpha=loaded.alpha, base_shapes=shapes)
    return merge(model, folder / "zero.gguf", folder / "f16-copy.gguf", "f16").out


def timed(cmd: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one command."""
    r = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, text=True, check=False)
    seconds, rss, status = r.stdout.split()[-3:]
    if r.returncode or int(status):
        sys.exit(f"{' '.join(cmd)} failed: {r.stderr}")
    return float(seconds), int(rss)


def conversations(model: Path, template: str | None, n: int = 16) -> list[list[int]]:
    from retrograd.data import ChatFormat, resolve_chat_template
    from retrograd.gguf.file import GGUFFile
    from retrograd.model.tokenizer import Tokenizer

    chat = ChatFormat(Tokenizer(model), resolve_chat_template(GGUFFile(model).get_str("tokenizer.chat_template"), template))
    rows = [json.loads(line)["messages"] for line in EVAL.read_text().splitlines()[:n]]
    return [chat.tokenize(chat.render(m, where="eval"), "eval")[0] for m in rows]


def log_probs(model: Path, sequences: list[list[int]], lora: Path | None = None) -> list[np.ndarray]:
    from retrograd.runtime.llamacpp import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, logits_all=True, verbose=False, n_threads=2,
                          type_k=0, type_v=0, lora_path=str(lora) if lora else None)
    out = []
    try:
        for ids in sequences:
            llm.reset()
            llm.eval(ids)
            z = np.array(llm.scores[: len(ids)], dtype=np.float64)
            out.append(z - np.logaddexp.reduce(z, axis=-1, keepdims=True))
    finally:
        llm.close()
    return out


def kl(reference: list[np.ndarray], other: list[np.ndarray]) -> float:
    return float(np.mean(np.concatenate([(np.exp(p) * (p - q)).sum(-1) for p, q in zip(reference, other)])))


def main() -> None:
    from retrograd.runtime.bundled import default_model_path, gemma3_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", action="append", default=[], metavar="MODEL=PATH", help="a trained adapter for smollm2 or gemma3")
    args = ap.parse_args()
    given = dict(a.split("=", 1) for a in args.adapter)
    retrograd = [sys.executable, "-m", "retrograd"]
    peer = shutil.which("llama-export-lora")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores")
    _, startup_rss = timed([*retrograd, "merge", "--help"])
    print(f"startup (retrograd merge --help): peak RSS {startup_rss / 2**20:.0f} MiB")
    print(f"{'model':<9}{'type':<6}{'tool':<12}{'s':>7}{'peak RSS':>10}{'base':>8}{'merged':>8}{'RSS/max':>9}{'goal':>6}{'kept':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        # Gemma-3's GGUF has no chat template: the built-in gemma one, as training with it needs
        for name, model, template in (("smollm2", default_model_path(), None), ("gemma3", gemma3_path(), "gemma")):
            adapter = Path(given[name]) if name in given else random_adapter(model, Path(tmp) / f"{name}-adapter.gguf")
            sequences = conversations(model, template)
            reference = log_probs(model, sequences, adapter)
            base = log_probs(model, sequences)
            effect = kl(reference, base)
            runs = [(t, "retrograd", [*retrograd, "merge", "-m", str(model), "--adapter", str(adapter), "--type", t, "--out"]) for t in TYPES]
            if peer:
                runs.append(("f16", "export-lora", [peer, "-m", str(model), "--lora", str(adapter), "-o"]))
            for merge_type, tool, cmd in runs:
                out = Path(tmp) / f"{name}-{tool}-{merge_type}.gguf"
                seconds, rss = timed([*cmd, str(out)])
                biggest = max(model.stat().st_size, out.stat().st_size)
                kept = 1 - kl(reference, log_probs(out, sequences)) / effect
                print(f"{name:<9}{merge_type:<6}{tool:<12}{seconds:>7.1f}{rss / 2**20:>9.0f}M{model.stat().st_size / 2**20:>7.0f}M"
                      f"{out.stat().st_size / 2**20:>7.0f}M{rss / biggest:>9.2f}{'ok' if rss <= GOAL * biggest else 'MISS':>6}{kept:>7.1%}")
                out.unlink()
            floor = kl(base, log_probs(f16_copy(model, adapter, Path(tmp)), sequences))
            print(f"{name:<9}KL(base+adapter || base) {effect:.3g} nats/token; f16 noise floor KL(base || base in f16) {floor:.3g}")
    if not peer:
        print("llama.cpp's export-lora: not on this machine (llama-cpp-python ships no tools), so no peer rows")


if __name__ == "__main__":
    main()
