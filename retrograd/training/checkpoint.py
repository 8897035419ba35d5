"""Checkpoints: self-describing directories that make `--resume` exact.

    checkpoints/
      step-000000000012.gguf        the adapter at step 12, ready for llama.cpp --lora
      step-000000000012.state/      what resume needs
        adapter.gguf                the same adapter
        lora.pt                     the LoRA parameters in float32, bit for bit
        optimizer.pt                optimizer state (moments, step counts)
        rng.pt                      torch, numpy and Python RNG states
        progress.json               step, epoch, data cursor, evaluation bookkeeping
        manifest.json               written last: the completeness marker, plus the model
                                    fingerprint and the trajectory signature
      best.state/ + best.gguf       the best evaluation so far (best_eval modes)

A checkpoint is written under a temporary name and renamed into place, so a crash never
leaves a half-written one where resume would look.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrograd.errors import RetrogradError

FORMAT_VERSION = 1
STATE_SUFFIX = ".state"


class CheckpointError(RetrogradError):
    pass


def step_name(step: int) -> str:
    return f"step-{step:012d}"


def file_fingerprint(path: Path, chunk: int = 1 << 20, samples: int = 16) -> str:
    """Size plus a hash of the first and last MiB and `samples` MiB spread between: cheap
    on multi-GB models, and any re-download, re-quantization or truncation changes it."""
    size = path.stat().st_size
    span = max(size - chunk, 0)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for offset in sorted({span * i // (samples + 1) for i in range(samples + 2)}):
            f.seek(offset)
            h.update(f.read(chunk))
    return f"{size}:{h.hexdigest()[:32]}"


def content_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:32]


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: dict
    progress: dict

    def tensor_file(self, name: str) -> Any:
        return torch.load(self.path / name, weights_only=False)


def save_checkpoint(
    directory: Path,
    name: str,
    *,
    write_adapter,  # callable(path) that writes the adapter GGUF
    lora: dict[str, torch.Tensor],
    optimizer: dict,
    progress: dict,
    signature: dict,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{name}{STATE_SUFFIX}"
    tmp = directory / f".{name}{STATE_SUFFIX}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_adapter(tmp / "adapter.gguf")
        torch.save(lora, tmp / "lora.pt")
        torch.save(optimizer, tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "progress.json").write_text(json.dumps(progress, indent=1))
        manifest = {"format_version": FORMAT_VERSION, "name": name, "signature": signature}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if final.exists():  # best.state is rewritten in place
            shutil.rmtree(final)
        os.replace(tmp, final)
        gguf_copy = directory / f".{name}.gguf.tmp-{os.getpid()}"
        shutil.copyfile(final / "adapter.gguf", gguf_copy)
        os.replace(gguf_copy, directory / f"{name}.gguf")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete step checkpoint, else best.state, else None."""
    if not directory.is_dir():
        return None
    steps = sorted(p for p in directory.glob(f"step-*{STATE_SUFFIX}") if (p / "manifest.json").is_file())
    if steps:
        return steps[-1]
    best = directory / f"best{STATE_SUFFIX}"
    return best if (best / "manifest.json").is_file() else None


def load_checkpoint(path: Path) -> Checkpoint:
    path = Path(path)
    if path.suffix == ".gguf" and path.with_suffix(STATE_SUFFIX).is_dir():
        path = path.with_suffix(STATE_SUFFIX)  # the adapter beside a state directory
    manifest_file = path / "manifest.json"
    if not manifest_file.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no manifest.json)")
    manifest = json.loads(manifest_file.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format_version')} is not {FORMAT_VERSION}")
    return Checkpoint(path, manifest, json.loads((path / "progress.json").read_text()))


def check_signature(checkpoint: Checkpoint, expected: dict) -> None:
    """Refuse to resume when anything that shapes the trajectory differs, naming it."""
    difference = _first_difference(checkpoint.manifest["signature"], expected, "")
    if difference:
        name, before, now = difference
        raise CheckpointError(f"cannot resume from {checkpoint.path}: {name} differs (checkpoint: {_short(before)}, now: {_short(now)})")


def _first_difference(saved, expected, prefix: str):
    if isinstance(saved, dict) and isinstance(expected, dict):
        for k in sorted(set(saved) | set(expected)):
            found = _first_difference(saved.get(k), expected.get(k), f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
            if found:
                return found
        return None
    return None if saved == expected else (prefix, saved, expected)


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
