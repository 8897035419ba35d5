"""Checkpoints are hostile input and must survive a crash: nothing in one is ever unpickled,
a damaged one is passed over by `--resume` (with a note) and refused in one line when named,
`best` is never left missing, and leftovers of dead writers are cleaned up.

Most tests damage copies of a real tiny SFT run's checkpoints; the crash tests drive
save_checkpoint itself."""

import hashlib
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli_resume import one_line_error, train, write_run

from retrograd.config import load_config
from retrograd.kernels.optim import AdamW
from retrograd.recipes import sft
from retrograd.runtime.owner import process_tag
from retrograd.training.checkpoint import (
    FILES,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from retrograd.training.report import SilentReporter

STEPS = 6  # the finished run leaves step-1 … step-6


class Messages(SilentReporter):
    def __init__(self):
        self.lines = []

    def message(self, text: str) -> None:
        self.lines.append(text)


class Poison:
    """Unpickling it creates `marker`: proof that a file was unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model) -> Path:
    folder = tmp_path_factory.mktemp("run")
    result = sft.run(load_config(write_run(folder, tiny_model("llama"))), SilentReporter())
    assert result.steps == STEPS
    return folder


@pytest.fixture
def run_dir(finished_run, tmp_path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    (folder / "out/adapter.gguf").unlink()
    return folder


def step(folder: Path, n: int) -> Path:
    return folder / f"ckpt/step-{n:012d}.state"


def reseal(checkpoint: Path, name: str) -> None:
    """Record `name`'s current size and sha256 in the manifest, as a forger would."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def resume(folder: Path, resume) -> Messages:
    reporter = Messages()
    sft.run(load_config(folder / "run.toml"), reporter, resume=resume)
    return reporter


# ---------------------------------------------------------------- nothing is unpickled


def test_a_checkpoint_of_the_pickle_format_is_refused_without_unpickling(run_dir):
    newest = step(run_dir, STEPS)
    manifest = json.loads((newest / "manifest.json").read_text())
    (newest / "manifest.json").write_text(json.dumps({"format_version": 1, "name": newest.stem, "signature": manifest["signature"]}))
    for name in ("lora.pt", "optimizer.pt", "rng.pt"):
        (newest / name).write_bytes(pickle.dumps(Poison(run_dir / f"ran-{name}")))
    for args in (["--resume"], ["--resume-from", newest]):
        one_line_error(train("run.toml", *args, cwd=run_dir), f"{newest.relative_to(run_dir)}: written by an older retrograd",
                       "cannot be resumed safely")
    assert not list(run_dir.glob("ran-*")) and not (run_dir / "out/adapter.gguf").exists()


def test_pickles_dropped_into_a_checkpoint_are_never_read(run_dir):
    newest = step(run_dir, STEPS)
    for name in ("lora.pt", "optimizer.pt", "rng.pt", "data.pkl"):
        (newest / name).write_bytes(pickle.dumps(Poison(run_dir / f"ran-{name}")))
    reporter = resume(run_dir, True)
    assert f"resumed from {newest} at step {STEPS}" in reporter.lines
    assert not list(run_dir.glob("ran-*"))


def crafted_safetensors(kind: str, marker: Path) -> bytes:
    def header(fields: dict, data: bytes = b"") -> bytes:
        text = json.dumps(fields).encode()
        return struct.pack("<Q", len(text)) + text + data

    return {
        "pickle": pickle.dumps(Poison(marker)),
        "huge header length": struct.pack("<Q", 1 << 62) + b"{}",
        "offsets past the end": header({"x": {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 4 << 20]}}),
        "shape and size disagree": header({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4),
        "unknown dtype": header({"x": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
        "header not JSON": struct.pack("<Q", 5) + b"{{{{{",
    }[kind]


@pytest.mark.parametrize("name", ["lora.safetensors", "optimizer.safetensors"])
@pytest.mark.parametrize("kind", ["pickle", "huge header length", "offsets past the end", "shape and size disagree",
                                  "unknown dtype", "header not JSON"])
def test_a_forged_safetensors_file_is_one_line(run_dir, name, kind):
    """Even with a manifest that vouches for it, a crafted file is refused, never run."""
    newest, marker = step(run_dir, STEPS), run_dir / "ran"
    (newest / name).write_bytes(crafted_safetensors(kind, marker))
    reseal(newest, name)
    with pytest.raises(CheckpointError, match=f"{newest}: {name} is not a valid safetensors file") as e:
        resume(run_dir, newest)
    assert "\n" not in str(e.value) and not marker.exists()


@pytest.mark.parametrize("name,content", [
    ("rng.json", {"torch": "abc", "numpy": [], "python": 3}),
    ("optimizer.json", {"state": [], "param_groups": {}}),
    ("progress.json", {"global_step": "12"}),
])
def test_forged_json_state_is_one_line(run_dir, name, content):
    newest = step(run_dir, STEPS)
    (newest / name).write_text(json.dumps(content))
    reseal(newest, name)
    with pytest.raises(CheckpointError, match=str(newest)) as e:
        resume(run_dir, newest)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field,wrong", [("exp_avg", "leading"), ("exp_avg_sq", "scalar"), ("step", "vector")])
def test_optimizer_state_of_another_shape_is_one_line_exit_2(run_dir, field, wrong):
    """load_state_dict takes moments of any shape; resumed, the first step would die with a
    raw RuntimeError."""
    middle = step(run_dir, 3)
    tensors = load_file(middle / "optimizer.safetensors")
    param_shape = list(tensors["0.exp_avg"].shape)
    shape = {"leading": [4, *param_shape], "scalar": [], "vector": [2]}[wrong]
    tensors[f"0.{field}"] = torch.zeros(shape, dtype=tensors[f"0.{field}"].dtype)
    save_file(tensors, middle / "optimizer.safetensors")
    reseal(middle, "optimizer.safetensors")
    r = train("run.toml", "--resume-from", middle.relative_to(run_dir), cwd=run_dir)
    one_line_error(r, f"{middle.relative_to(run_dir)}: optimizer.safetensors holds 0.{field} of shape {shape}, "
                      f"expected {[] if field == 'step' else param_shape}")
    assert not (run_dir / "out/adapter.gguf").exists()


def test_optimizer_state_of_a_parameter_this_run_lacks_is_one_line_exit_2(run_dir):
    middle = step(run_dir, 3)
    tensors = load_file(middle / "optimizer.safetensors")
    tensors["99.exp_avg"] = tensors.pop("0.exp_avg")
    save_file(tensors, middle / "optimizer.safetensors")
    reseal(middle, "optimizer.safetensors")
    r = train("run.toml", "--resume-from", middle.relative_to(run_dir), cwd=run_dir)
    one_line_error(r, f"{middle.relative_to(run_dir)}: optimizer.safetensors holds 99.exp_avg, but this run has no parameter 99")


# ---------------------------------------------------------------- damaged checkpoints


def damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "zero":
        path.write_bytes(b"")
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # "flip": same size, other bytes
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["delete", "zero", "truncate", "flip"])
@pytest.mark.parametrize("name", [*FILES, "manifest.json"])
def test_resume_passes_over_a_damaged_newest_checkpoint(run_dir, name, how):
    newest = step(run_dir, STEPS)
    damage(newest / name, how)
    notes = []
    found = latest_checkpoint(run_dir / "ckpt", notes.append)
    assert found is not None and found.path == step(run_dir, STEPS - 1)
    assert len(notes) == 1 and notes[0].startswith(f"note: passed over {newest}: "), notes
    with pytest.raises(CheckpointError, match=str(newest)):
        load_checkpoint(newest)


def test_resume_says_which_checkpoint_it_passed_over(run_dir):
    newest = step(run_dir, STEPS)
    damage(newest / "lora.safetensors", "truncate")
    r = train("--resume", "run.toml", cwd=run_dir)
    assert r.returncode == 0, r.stderr
    note = next(line for line in r.stdout.splitlines() if line.startswith("note: passed over"))
    assert "step-000000000006.state: damaged checkpoint (lora.safetensors has" in note, note
    assert f"resumed from {step(run_dir, STEPS - 1)} at step {STEPS - 1}" in r.stdout, r.stdout
    assert (run_dir / "out/adapter.gguf").is_file()


def test_a_named_damaged_checkpoint_is_one_line(run_dir):
    damage(step(run_dir, STEPS) / "optimizer.safetensors", "zero")
    r = train("run.toml", "--resume-from", "ckpt/step-000000000006.state", cwd=run_dir)
    one_line_error(r, "--resume-from ckpt/step-000000000006.state: damaged checkpoint (optimizer.safetensors has 0 bytes")
    assert not (run_dir / "out/adapter.gguf").exists()


def test_a_file_replaced_by_a_link_is_damage(run_dir):
    newest = step(run_dir, STEPS)
    target = run_dir / "elsewhere.json"
    shutil.move(newest / "progress.json", target)
    (newest / "progress.json").symlink_to(target)
    with pytest.raises(CheckpointError, match=f"{newest}: damaged checkpoint \\(progress.json: "):
        load_checkpoint(newest)


MALFORMED_MANIFESTS = {
    "not json": "{not json",
    "not an object": "[1, 2]",
    "version a string": {"format_version": "2"},
    "signature a list": {"signature": []},
    "a file missing": {"files": {"adapter.gguf": None}},
    "a path outside": {"files": {"../../run.toml": {"size": 1, "sha256": "0" * 64}}},
    "size a string": {"files": {"lora.safetensors": {"size": "12", "sha256": "0" * 64}}},
    "sha256 short": {"files": {"rng.json": {"size": 12, "sha256": "abc"}}},
}


def write_malformed(checkpoint: Path, case: str) -> None:
    change = MALFORMED_MANIFESTS[case]
    if isinstance(change, str):
        (checkpoint / "manifest.json").write_text(change)
        return
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for key, value in change.items():
        if key == "files":
            files = {**manifest["files"], **value}
            if "../../run.toml" in value:
                del files["rng.json"]
            manifest["files"] = {k: v for k, v in files.items() if v is not None}
        else:
            manifest[key] = value
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("case", MALFORMED_MANIFESTS)
def test_a_malformed_manifest_is_one_line_or_passed_over(run_dir, case):
    newest = step(run_dir, STEPS)
    write_malformed(newest, case)
    with pytest.raises(CheckpointError, match=f"{newest}: not a readable checkpoint \\(manifest.json ") as e:
        load_checkpoint(newest)
    assert "\n" not in str(e.value)
    notes = []
    assert latest_checkpoint(run_dir / "ckpt", notes.append).path == step(run_dir, STEPS - 1)
    assert len(notes) == 1 and str(newest) in notes[0]


def test_a_malformed_manifest_named_on_the_command_line_exits_2(run_dir):
    write_malformed(step(run_dir, STEPS), "size a string")
    r = train("run.toml", "--resume-from", "ckpt/step-000000000006.state", cwd=run_dir)
    one_line_error(r, "--resume-from ckpt/step-000000000006.state: not a readable checkpoint (manifest.json has no size")


# ---------------------------------------------------------------- writing


def toy_state(seed: int) -> dict:
    """What save_checkpoint takes, from the loops' AdamW after two steps."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    optimizer = AdamW(params, lr=1e-3, weight_decay=0.1)
    for _ in range(2):
        sum((p**2).sum() for p in params).backward()
        optimizer.step()
    return {"lora": {"layer.0.a": params[0].detach(), "layer.0.b": params[1].detach()}, "optimizer": optimizer.state_dict(),
            "progress": {"global_step": seed}, "signature": {"seed": seed}, "params": params}


def save_toy(directory: Path, name: str, seed: int) -> Path:
    state = toy_state(seed)
    return save_checkpoint(directory, name, write_adapter=lambda p: p.write_bytes(b"GGUF" + bytes([seed]) * 64),
                           lora=state["lora"], optimizer=state["optimizer"], progress=state["progress"],
                           signature=state["signature"])


def test_optimizer_lora_and_rng_round_trip_exactly(tmp_path):
    state = toy_state(3)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    path = save_checkpoint(tmp_path, "step-000000000003", write_adapter=lambda p: p.write_bytes(b"GGUF"),
                           lora=state["lora"], optimizer=state["optimizer"], progress=state["progress"],
                           signature=state["signature"])
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    checkpoint = load_checkpoint(path)
    fresh = AdamW(state["params"], lr=1e-3, weight_decay=0.1)
    fresh.load_state_dict(checkpoint.optimizer_state(fresh))
    saved, restored = state["optimizer"], fresh.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    assert type(restored["param_groups"][0]["betas"]) is tuple
    for param, fields in saved["state"].items():
        for field, value in fields.items():
            again = restored["state"][param][field]
            assert again.dtype == value.dtype and again.shape == value.shape and torch.equal(again, value), (param, field)
    lora = checkpoint.tensors("lora.safetensors")
    assert all(torch.equal(lora[k], v) for k, v in state["lora"].items())
    restore_rng(checkpoint.document("rng.json"))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected


def test_a_failed_swap_keeps_the_old_best(tmp_path, monkeypatch):
    save_toy(tmp_path, "best", 1)
    calls, real = [], os.replace

    def failing(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # best.state already renamed aside, the new one not yet in
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError):
        save_toy(tmp_path, "best", 2)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "best.state").progress == {"global_step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.gguf", "best.state"]


CRASH_AT_RENAME = """
import os, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_checkpoint import save_toy
real, calls = os.replace, []
def crash(src, dst):
    calls.append(dst)
    if len(calls) == {n}:
        os._exit(9)
    real(src, dst)
os.replace = crash
save_toy(Path({folder!r}), "best", 2)
"""


@pytest.mark.parametrize("n,kept", [(1, 1), (2, 1), (3, 2)], ids=["before-aside", "between", "at-the-gguf"])
def test_a_crash_at_any_rename_of_best_leaves_a_loadable_best(tmp_path, n, kept):
    """The process dies (os._exit) at the n-th rename of a best swap: the next listing finds
    a sound best, the old or the new one, and nothing else."""
    save_toy(tmp_path, "best", 1)
    script = CRASH_AT_RENAME.format(tests=str(Path(__file__).parent), folder=str(tmp_path), n=n)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    if n == 2:  # the window the crash hit: best.state is aside, the new one not yet in
        assert not (tmp_path / "best.state").exists()
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.path == tmp_path / "best.state" and found.progress == {"global_step": kept}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.gguf", "best.state"]


def test_best_is_replaced(tmp_path):
    save_toy(tmp_path, "best", 1)
    save_toy(tmp_path, "best", 2)
    assert load_checkpoint(tmp_path / "best.state").progress == {"global_step": 2}
    assert (tmp_path / "best.gguf").read_bytes() == b"GGUF" + bytes([2]) * 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.gguf", "best.state"]


@pytest.fixture
def dead_owner() -> str:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    tag = process_tag(child.pid)
    child.communicate(b"")
    return tag


@pytest.mark.parametrize("when", ["listing", "writing"])
def test_leftovers_of_dead_writers_are_removed_and_live_ones_kept(tmp_path, dead_owner, when):
    save_toy(tmp_path, "step-000000000001", 1)
    live = process_tag()
    for owner in (dead_owner, live):
        (tmp_path / f".step-000000000002.state.tmp-{owner}").mkdir()
        (tmp_path / f".step-000000000002.state.tmp-{owner}/lora.safetensors").write_bytes(b"half")
        (tmp_path / f".step-000000000002.gguf.tmp-{owner}").write_bytes(b"half")
    if when == "listing":
        assert latest_checkpoint(tmp_path).path == tmp_path / "step-000000000001.state"
    else:
        save_toy(tmp_path, "step-000000000003", 3)
    left = {p.name for p in tmp_path.iterdir() if p.name.startswith(".")}
    assert left == {f".step-000000000002.state.tmp-{live}", f".step-000000000002.gguf.tmp-{live}"}
