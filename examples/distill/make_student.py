"""Write the example's student: the bundled SmolLM2-135M-Instruct cut down to 15 of its 30
blocks, everything else (vocabulary, chat template, quantized tensors) copied byte for byte;
and link the full model beside it as the teacher. The two share the tokenizer by
construction, and the cut model starts far from the full one (KL 9 nats/token on held-out
sums): a clear target for distillation.

    python examples/distill/make_student.py       # -> out/distill/student.gguf, out/distill/teacher.gguf
    python examples/distill/make_student.py --keep 0-14,25-29 --out other.gguf

The files are generated (the student is 62 MB), never committed.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

import gguf

from retrograd.runtime.bundled import default_model_path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "out" / "distill" / "student.gguf"
DEFAULT_KEEP = "0-9,25-29"  # the first ten blocks and the last five, which read out to the head
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def parse_layers(text: str) -> list[int]:
    """'0-3,29' -> [0, 1, 2, 3, 29]."""
    layers: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        layers += range(int(first), int(last or first) + 1)
    return layers


def write_truncated(src: Path, dst: Path, keep: Sequence[int]) -> Path:
    """A copy of the GGUF `src` holding only the blocks in `keep`, renumbered from 0."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layer = reader.fields[f"{arch}.block_count"].contents()
    if not keep or min(keep) < 0 or max(keep) >= n_layer or len(set(keep)) != len(keep):
        raise SystemExit(f"--keep {list(keep)}: expected distinct blocks in 0..{n_layer - 1}")
    renumber = {old: new for new, old in enumerate(keep)}
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = len(keep) if key == f"{arch}.block_count" else field.contents()
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, value_type, sub_type=sub_type)
    for t in reader.tensors:
        name = t.name
        block = _BLOCK.match(name)
        if block:
            if int(block[1]) not in renumber:
                continue
            name = f"blk.{renumber[int(block[1])]}.{block[2]}"
        writer.add_tensor(name, t.data, raw_dtype=t.tensor_type)  # quantized blocks keep their bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=None, help="GGUF to cut (default: the bundled SmolLM2)")
    parser.add_argument("--keep", default=DEFAULT_KEEP, help=f"blocks to keep, e.g. {DEFAULT_KEEP}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    src = args.src or default_model_path()
    out = write_truncated(src, args.out, parse_layers(args.keep))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    teacher = out.with_name("teacher.gguf")
    teacher.unlink(missing_ok=True)
    teacher.symlink_to(src.resolve())
    print(f"linked {teacher} -> {src}")


if __name__ == "__main__":
    main()
