"""The frozen base in torch: resident memory per `weights` mode against the GGUF file size,
forward / forward+backward speed per weights mode and compute dtype, and forward+backward
speed per architecture relative to llama at the same width and depth.

    python benchmarks/base_model.py            # SmolLM2 and Gemma-3, all modes, then the architectures (~11 min on 2 cores)
    python benchmarks/base_model.py --quick    # SmolLM2 only, 128 and 1024 tokens, then the architectures
    python benchmarks/base_model.py --archs    # the architecture rows alone (~1 min; --tokens 1024 for longer rows)

The architecture rows (their list, ARCHS, and how they are measured) are benchmarks/dense_variants.py's.

Each measurement runs in a fresh subprocess so resident memory and compile caches do not
leak between rows. Forward+backward trains a rank-8 LoRA on all seven projection families
with the chunked log-prob kernel, i.e. one SFT micro-step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

MODES = ("quantized", "bf16", "f32")
DTYPES = ("f32", "bf16")


def measure(model: str, mode: str, dtype: str, tokens: list[int]) -> dict:
    import torch

    from retrograd.gguf.file import GGUFFile
    from retrograd.kernels.chunked_logprobs import token_logprobs
    from retrograd.kernels.dequant import CODECS, dequantize
    from retrograd.model.base import load_model
    from retrograd.model.lora import attach_lora
    from retrograd.model.tokenizer import Tokenizer
    from retrograd.runtime.bundled import default_model_path, gemma3_path
    from retrograd.runtime.memory import rss_bytes

    torch.set_num_threads(2)
    path = default_model_path() if model == "smollm2" else gemma3_path()
    for qtype in {t.qtype for t in GGUFFile(path).tensors.values()} & set(CODECS):  # build the C loops first:
        codec = CODECS[qtype]  # the baseline then holds torch, them and llama.cpp, not the model
        dequantize(torch.zeros(4 * codec.type_size, dtype=torch.uint8), qtype, (4 * codec.block_size,))
    start = rss_bytes()
    tokenizer = Tokenizer(path)  # llama.cpp's vocabulary, reported on its own line
    before = rss_bytes()
    m = load_model(path, weights=mode, compute_dtype=dtype, tokenizer=tokenizer)
    t = m.transformer
    with torch.no_grad():
        t(torch.zeros(8, dtype=torch.long))  # touch every weight page once
    out = {"file": m.file_size, "rss": rss_bytes() - before, "held": m.weight_bytes, "tokenizer": before - start}
    attach_lora(t, ["auto"], rank=8, alpha=16.0, seed=0)
    gen = torch.Generator().manual_seed(0)
    for n in tokens:
        ids = torch.randint(0, m.spec.n_vocab, (n + 1,), generator=gen)
        x, y = ids[:-1], ids[1:]

        def forward():
            with torch.no_grad():
                t(x)

        def train_step():
            lp, _ = token_logprobs(t(x), t.output, y, compute_dtype=t.compute_dtype)
            (-lp.mean()).backward()

        for name, fn in (("fwd", forward), ("fwdbwd", train_step)):
            fn()  # warm-up
            times = []
            for _ in range(5 if n <= 256 else 3):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[f"{name}{n}"] = n / sorted(times)[len(times) // 2]  # median
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--archs", action="store_true", help="only the per-architecture rows")
    ap.add_argument("--tokens", type=int, default=512, help="sequence length of the per-architecture rows")
    ap.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        model, mode, dtype, tokens = args._child
        print(json.dumps(measure(model, mode, dtype, [int(n) for n in tokens.split(",")])))
        return
    from retrograd.runtime.device import cpu_name

    print(f"CPU: {cpu_name()}")
    if not args.archs:
        weight_modes(args.quick)
    from dense_variants import architecture_rows  # benchmarks/, this script's folder

    print("", *architecture_rows(args.tokens), sep="\n")


def weight_modes(quick: bool) -> None:
    """Memory and speed of SmolLM2 (and Gemma-3 unless `quick`) per weights mode and compute dtype."""
    models = ("smollm2",) if quick else ("smollm2", "gemma3")
    tokens = (128, 1024)
    rows = {}
    for model in models:
        for mode in MODES:
            for dtype in DTYPES:
                cmd = [sys.executable, __file__, "--_child", model, mode, dtype, ",".join(map(str, tokens))]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode:
                    sys.exit(f"{model} {mode} {dtype} failed:\n{res.stderr}")
                rows[model, mode, dtype] = json.loads(res.stdout.strip().splitlines()[-1])
                print(f"measured {model} {mode} {dtype}", file=sys.stderr)

    mib = 2**20
    print("\nResident memory of the loaded base weights (RSS increase from load + one forward, over a baseline with")
    print("dequantizers loaded and llama.cpp's tokenizer open; the tokenizer's own RSS is the last column)")
    print(f"{'model':<8} {'weights':<10} {'file MiB':>9} {'held MiB':>9} {'RSS MiB':>9} {'RSS/file':>9} {'tokenizer MiB':>14}")
    for model in models:
        for mode in MODES:
            r = rows[model, mode, "f32"]
            print(f"{model:<8} {mode:<10} {r['file'] / mib:9.1f} {r['held'] / mib:9.1f} {r['rss'] / mib:9.1f} "
                  f"{r['rss'] / r['file']:9.2f} {r['tokenizer'] / mib:14.1f}")

    print("\nTokens per second, median of 3-5 (1 sequence; fwd+bwd = rank-8 LoRA on all projections, chunked CE)")
    head = f"{'model':<8} {'weights':<10} {'compute':<7}" + "".join(f" {k + str(n):>11}" for n in tokens for k in ("fwd", "fwdbwd"))
    print(head + f" {'fwdbwd1024 vs bf16':>19}")
    for model in models:
        for dtype in DTYPES:
            ref = rows[model, "bf16", dtype]["fwdbwd1024"]
            for mode in MODES:
                r = rows[model, mode, dtype]
                cells = "".join(f" {r[k + str(n)]:11.0f}" for n in tokens for k in ("fwd", "fwdbwd"))
                print(f"{model:<8} {mode:<10} {dtype:<7}{cells} {r['fwdbwd1024'] / ref:19.2f}")


if __name__ == "__main__":
    main()
