"""Checkpoints: self-describing directories that make `--resume` exact.

    checkpoints/
      step-000000000012.gguf        the adapter at step 12, ready for llama.cpp --lora
      step-000000000012.state/      what resume needs
        adapter.gguf                the same adapter
        lora.safetensors            the LoRA parameters in float32, bit for bit
        optimizer.safetensors       optimizer state tensors (moments, step counts)
        optimizer.json              the rest of the optimizer state (param_groups)
        rng.json                    torch, numpy and Python RNG states
        progress.json               step, epoch, data cursor, evaluation bookkeeping
        manifest.json               written last: every other file's size and sha256, plus the
                                    model fingerprint and the trajectory signature
      best.state/ + best.gguf       the best evaluation so far (best_eval modes)

Checkpoints come from the internet as often as from our own runs, so nothing in one is ever
unpickled: tensors are safetensors, everything else JSON, and every file is checked against
the manifest before it is parsed.

A checkpoint is written under a temporary name (`.NAME.tmp-OWNER`), every file and the
folder fsynced, then renamed into place; an existing one (best.state) is first renamed
aside (`.NAME.old-OWNER`) and deleted only once the new one is in place. Leftovers of a
process that died are cleaned up whenever checkpoints are written or listed: an aside whose
checkpoint never got replaced is put back, anything else is deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors, save_file as save_tensors

from retrograd.errors import DataError, RetrogradError
from retrograd.kernels.optim import Optimizer
from retrograd.runtime.owner import is_dead, process_tag
from retrograd.training.optim import state_shape

FORMAT_VERSION = 2  # 1 held pickles (lora.pt, optimizer.pt, rng.pt)
STATE_SUFFIX = ".state"
FILES = ("adapter.gguf", "lora.safetensors", "optimizer.safetensors", "optimizer.json", "rng.json", "progress.json")
LEFTOVER = re.compile(r"\.(?P<target>.+)\.(?P<kind>tmp|old)-(?P<owner>\d+-\d+)")


class CheckpointError(RetrogradError):
    pass


class DamagedCheckpoint(CheckpointError):
    """Incomplete, truncated or not what its manifest says: `--resume` passes over it."""


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
    """torch, numpy and Python RNG states as JSON values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "python": [version, list(internal), gauss_next],
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: dict
    progress: dict

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        try:
            return load_tensors(self.read(name))
        except SafetensorError as e:
            raise CheckpointError(f"{self.path}: {name} is not a valid safetensors file ({e})") from None

    def document(self, name: str) -> Any:
        try:
            return json.loads(self.read(name))
        except ValueError as e:
            raise CheckpointError(f"{self.path}: {name} is not JSON ({e})") from None

    def read(self, name: str) -> bytes:
        """The file's bytes, checked against the manifest: what is parsed is what was checked."""
        record = self.manifest["files"][name]
        with _open_regular(self.path, name) as f:
            data = f.read(record["size"] + 1)
        _check(self.path, name, len(data), hashlib.sha256(data), record)
        return data

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        """The saved optimizer.state_dict(), shaped like `optimizer`'s own (tuples stay tuples)."""
        saved = self.document("optimizer.json")
        state = {int(k): dict(v) for k, v in saved["state"].items()}
        for key, tensor in self.tensors("optimizer.safetensors").items():
            param, _, field = key.partition(".")
            state.setdefault(int(param), {})[field] = tensor
        live = optimizer.state_dict()["param_groups"]
        if len(saved["param_groups"]) != len(live):
            raise CheckpointError(
                f"{self.path}: optimizer.json has {len(saved['param_groups'])} parameter groups, this run {len(live)}"
            )
        self._check_state_shapes(state, saved["param_groups"], optimizer)
        groups = [{k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in group.items()}
                  for group, now in zip(saved["param_groups"], live)]
        return {"state": state, "param_groups": groups}

    def _check_state_shapes(self, state: dict, saved_groups: list, optimizer: Optimizer) -> None:
        """Every saved tensor has the shape torch keeps for its parameter: load_state_dict takes
        any shape, and the first step would fail far from the file."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        saved_ids = [number for group in saved_groups for number in group["params"]]
        owner = dict(zip(saved_ids, params))
        for number, fields in state.items():
            for field, value in fields.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if number not in owner:
                    raise CheckpointError(f"{self.path}: optimizer.safetensors holds {number}.{field}, "
                                          f"but this run has no parameter {number}")
                expected = state_shape(field, owner[number])
                if value.shape != expected:
                    raise CheckpointError(f"{self.path}: optimizer.safetensors holds {number}.{field} of shape "
                                          f"{list(value.shape)}, expected {list(expected)}")


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
    _reap_leftovers(directory)
    owner = process_tag()
    final = directory / f"{name}{STATE_SUFFIX}"
    tmp = directory / f".{final.name}.tmp-{owner}"
    gguf, gguf_tmp = directory / f"{name}.gguf", directory / f".{name}.gguf.tmp-{owner}"
    tmp.mkdir()
    try:
        write_adapter(tmp / "adapter.gguf")
        save_tensors({k: v.detach().cpu().contiguous() for k, v in lora.items()}, tmp / "lora.safetensors")
        tensors, rest = _split_optimizer(optimizer)
        save_tensors(tensors, tmp / "optimizer.safetensors")
        (tmp / "optimizer.json").write_text(json.dumps(rest))
        (tmp / "rng.json").write_text(json.dumps(rng_state()))
        (tmp / "progress.json").write_text(json.dumps(progress, indent=1))
        files = {file: _seal(tmp / file) for file in FILES}
        manifest = {"format_version": FORMAT_VERSION, "name": name, "signature": signature, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _seal(tmp / "manifest.json")
        _fsync(tmp)
        _publish(tmp, final, directory / f".{final.name}.old-{owner}")
        shutil.copyfile(final / "adapter.gguf", gguf_tmp)
        _seal(gguf_tmp)
        os.replace(gguf_tmp, gguf)
        _fsync(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        gguf_tmp.unlink(missing_ok=True)
        raise
    return final


def _reap_leftovers(directory: Path) -> None:
    """Delete the temporary files and folders of checkpoint writers that died; put back a
    checkpoint one of them had renamed aside and not yet replaced."""
    dead = [(entry, found) for entry in directory.iterdir()
            if (found := LEFTOVER.fullmatch(entry.name)) and is_dead(found["owner"])]
    for entry, found in dead:
        with contextlib.suppress(OSError):
            target = directory / found["target"]
            if found["kind"] == "old" and not os.path.lexists(target):
                os.replace(entry, target)
            elif stat.S_ISDIR(entry.lstat().st_mode):
                shutil.rmtree(entry)
            else:
                entry.unlink()
    if dead:
        _fsync(directory)


def latest_checkpoint(directory: Path, note: Callable[[str], None] = lambda text: None) -> Checkpoint | None:
    """The newest sound step checkpoint, else a sound best.state, else None. A damaged one is
    passed over with a `note`; one written by an older retrograd stops the search."""
    if not directory.is_dir():
        return None
    _reap_leftovers(directory)
    steps = sorted(directory.glob(f"step-*{STATE_SUFFIX}"), reverse=True)
    for path in [*steps, directory / f"best{STATE_SUFFIX}"]:
        if not path.is_dir():
            continue
        try:
            return load_checkpoint(path)
        except DamagedCheckpoint as e:
            note(f"note: passed over {e}")
    return None


def load_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at `path`, once every file matches the size and sha256 in its manifest."""
    path = Path(path)
    if path.suffix == ".gguf" and path.with_suffix(STATE_SUFFIX).is_dir():
        path = path.with_suffix(STATE_SUFFIX)  # the adapter beside a state directory
    if not (path / "manifest.json").is_file():
        raise DamagedCheckpoint(f"{path}: not a complete checkpoint (no manifest.json)")
    manifest = _read_manifest(path)
    for name, record in manifest["files"].items():
        with _open_regular(path, name) as f:
            h = hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            _check(path, name, f.tell(), h, record)
    checkpoint = Checkpoint(path, manifest, {})
    progress = checkpoint.document("progress.json")
    step = progress.get("global_step") if isinstance(progress, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: progress.json holds no step count (global_step)")
    return Checkpoint(path, manifest, progress)


def resume_point(cfg, resume: Path | bool | None, message: Callable[[str], None]) -> Checkpoint | None:
    """The checkpoint to resume from: --resume-from PATH, --resume (True: the newest sound one
    in [checkpoint].directory, saying which damaged ones it passed over), or
    [checkpoint].resume_from; None for a fresh run."""
    if resume is None and cfg.checkpoint and cfg.checkpoint.resume_from:
        resume = cfg.checkpoint.resume_from
    if resume is None or resume is False:
        return None
    if resume is True:
        if cfg.checkpoint is None:
            raise DataError("--resume: the config has no [checkpoint] section, so there is nothing to resume")
        found = latest_checkpoint(cfg.checkpoint.directory, message)
        if found is None:
            raise DataError(f"--resume: no checkpoint to resume in {cfg.checkpoint.directory}")
        return found
    return load_checkpoint(Path(resume))


def check_signature(checkpoint: Checkpoint, expected: dict) -> None:
    """Refuse to resume when anything that shapes the trajectory differs, naming it."""
    difference = _first_difference(checkpoint.manifest["signature"], expected, "")
    if difference:
        name, before, now = difference
        raise CheckpointError(f"cannot resume from {checkpoint.path}: {name} differs (checkpoint: {_short(before)}, now: {_short(now)})")


def _read_manifest(path: Path) -> dict:
    """manifest.json, refused unless every field has the type this version writes."""
    def bad(problem: str) -> DamagedCheckpoint:
        return DamagedCheckpoint(f"{path}: not a readable checkpoint (manifest.json {problem})")

    try:
        with _open_regular(path, "manifest.json") as f:
            manifest = json.loads(f.read(1 << 24))
    except ValueError as e:
        raise bad(f"is not JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise bad("is not a JSON object")
    version = manifest.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version != FORMAT_VERSION:
        if version < FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: written by an older retrograd (checkpoint format {version}, which held pickled files) "
                "and cannot be resumed safely; start a fresh run"
            )
        raise CheckpointError(
            f"{path}: checkpoint format {version} is newer than this retrograd reads ({FORMAT_VERSION}); upgrade retrograd"
        )
    if version != FORMAT_VERSION:
        raise bad("has no format_version")
    if not isinstance(manifest.get("signature"), dict):
        raise bad("has no signature object")
    files = manifest.get("files")
    if not isinstance(files, dict) or sorted(files) != sorted(FILES):
        raise bad(f"does not list exactly the files {', '.join(FILES)}")
    for name, record in files.items():
        size, digest = (record.get("size"), record.get("sha256")) if isinstance(record, dict) else (None, None)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str) \
                or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise bad(f"has no size and sha256 for {name}")
    return manifest


@contextlib.contextmanager
def _open_regular(folder: Path, name: str):
    """`folder/name` opened for reading when it is a regular file, never through a link."""
    try:
        fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise DamagedCheckpoint(f"{folder}: damaged checkpoint ({name}: {e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DamagedCheckpoint(f"{folder}: damaged checkpoint ({name} is not a regular file)")
        yield f


def _check(folder: Path, name: str, size: int, digest, record: dict) -> None:
    if size != record["size"]:
        raise DamagedCheckpoint(
            f"{folder}: damaged checkpoint ({name} has {size} bytes, the manifest says {record['size']})"
        )
    if digest.hexdigest() != record["sha256"]:
        raise DamagedCheckpoint(f"{folder}: damaged checkpoint ({name} does not match its sha256 in the manifest)")


def _seal(path: Path) -> dict:
    """fsync `path` and return its manifest record."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        os.fsync(f.fileno())
        return {"size": f.tell(), "sha256": h.hexdigest()}


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path, aside: Path) -> None:
    """Rename `tmp` to `final`. An existing `final` is renamed aside first and deleted only
    once the new one is in place, so a crash leaves one of them (_reap_leftovers puts it back)."""
    replacing = final.exists()
    if replacing:
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        if replacing and not os.path.lexists(final):
            os.replace(aside, final)
        raise
    _fsync(final.parent)
    if replacing:
        shutil.rmtree(aside)


def _split_optimizer(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """optimizer.state_dict() as safetensors ("PARAM.FIELD") and the JSON-able rest."""
    tensors, rest = {}, {}
    for param, fields in state_dict["state"].items():
        for field, value in fields.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param}.{field}"] = value.detach().cpu().contiguous().clone()
            else:
                rest.setdefault(str(param), {})[field] = value
    return tensors, {"state": rest, "param_groups": state_dict["param_groups"]}


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
