"""`retrograd train` resume options through the real command: `--resume` is a flag (the
newest checkpoint) wherever it stands, `--resume-from CKPT` names one (any folder name,
`latest` included), and bad combinations stop with one line naming the option, exit 2."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from chats import write_chat

from retrograd.config import load_config
from retrograd.recipes import sft
from retrograd.training.report import SilentReporter

RETROGRAD = [sys.executable, "-m", "retrograd"]
STEP_1 = "ckpt/step-000000000001.state"


def train(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*RETROGRAD, "train", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300)


def one_line_error(result, *needles):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def write_run(folder: Path, model: Path) -> Path:
    """A tiny SFT run: 6 steps of one example, a checkpoint after each."""
    write_chat(folder / "train.jsonl", 6)
    cfg = folder / "run.toml"
    cfg.write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
[output]
path = "out/adapter.gguf"
[lora]
rank = 2
alpha = 4.0
dtype = "f32"
[training]
ctx = 64
micro_batch = 64
lr = 5e-3
compute_dtype = "f32"
threads = 2
[sft]
data = "train.jsonl"
[checkpoint]
directory = "ckpt"
mode = "steps"
every_steps = 1
""")
    return cfg


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model) -> Path:
    """A folder with run.toml whose run has finished, leaving a checkpoint per step."""
    folder = tmp_path_factory.mktemp("run")
    result = sft.run(load_config(write_run(folder, tiny_model("llama"))), SilentReporter())
    assert result.steps >= 3, result.steps
    return folder


@pytest.fixture
def run_dir(finished_run, tmp_path) -> Path:
    """A private copy of the finished run (the tests write outputs and rename checkpoints)."""
    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    return folder


def steps(folder: Path) -> list[Path]:
    return sorted((folder / "ckpt").glob("step-*.state"))


def test_resume_flag_before_the_config_is_not_a_checkpoint(run_dir):
    r = train("--resume", "run.toml", cwd=run_dir)
    assert r.returncode == 0, r.stderr
    newest = steps(run_dir)[-1]
    assert f"resumed from {newest} at step {len(steps(run_dir))}" in r.stdout, r.stdout
    assert (run_dir / "out/adapter.gguf").is_file()


def test_resume_from_a_checkpoint_folder_named_latest(run_dir):
    """A checkpoint folder may be called `latest`: --resume-from takes the path as given (here
    an early step), never "the newest"."""
    first = steps(run_dir)[0]
    latest = first.with_name("latest")
    first.rename(latest)
    (run_dir / "out/adapter.gguf").unlink()
    r = train("run.toml", "--resume-from", "ckpt/latest", cwd=run_dir)
    assert r.returncode == 0, r.stderr
    assert "resumed from ckpt/latest at step 1" in r.stdout, r.stdout
    assert (run_dir / "out/adapter.gguf").is_file()


def test_resume_from_the_adapter_beside_a_checkpoint(run_dir):
    """The step-N.gguf that every checkpoint leaves beside its .state directory names it too."""
    (run_dir / "out/adapter.gguf").unlink()
    r = train("run.toml", "--resume-from", "ckpt/step-000000000002.gguf", cwd=run_dir)
    assert r.returncode == 0, r.stderr
    assert "resumed from ckpt/step-000000000002.state at step 2" in r.stdout, r.stdout


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--resume", "--resume-from", STEP_1], ["--resume and --resume-from exclude each other"]),
        (["--resume", STEP_1], ["--resume takes no value", f"use --resume-from {STEP_1}"]),
        (["--resume-from", "ckpt/step-99.state"], ["--resume-from ckpt/step-99.state: no such file or directory"]),
        (["--resume-from", "train.jsonl"], ["--resume-from train.jsonl: not a complete checkpoint"]),
        (["--resume-from", "ckpt"], ["--resume-from ckpt: not a complete checkpoint"]),
        (["--resume-from", "broken.state"], ["--resume-from broken.state: not a readable checkpoint"]),
        (["--resume-from"], ["--resume-from"]),
    ],
    ids=["both", "resume-with-value", "missing", "a-file", "the-directory", "unreadable-manifest", "no-path"],
)
def test_bad_resume_options_are_one_line(run_dir, args, needles):
    (run_dir / "broken.state").mkdir()
    (run_dir / "broken.state/manifest.json").write_text("{not json")
    (run_dir / "out/adapter.gguf").unlink()
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    r = train("run.toml", *args, cwd=run_dir)
    one_line_error(r, *needles)
    assert not (run_dir / "out/adapter.gguf").exists()
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_resume_with_nothing_to_resume_names_the_option(tmp_path, tiny_model):
    write_run(tmp_path, tiny_model("llama"))
    one_line_error(train("--resume", "run.toml", cwd=tmp_path), "--resume: no checkpoint to resume in")
    assert not (tmp_path / "out/adapter.gguf").exists()
