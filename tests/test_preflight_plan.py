"""`retrograd preflight RUN.toml`: the probe's predictions against real `retrograd train` runs
of the same files (peak memory within 15%, time per step within 30%), the ladder when a
budget is too small, and bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from retrograd.config import load_config
from retrograd.evaluation import plan as planner

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from preflight_accuracy import measure_train  # noqa: E402  (the same measurement as the benchmark's)

RETROGRAD = [sys.executable, "-m", "retrograd"]
EXAMPLES = Path(__file__).parents[1] / "examples"
GiB = 2**30
# The probe and the run it predicts use the same threads: with threads_follow_load, each would
# pick its own count from the load it happens to see (the probe's watcher, the test before).
FIXED_THREADS = "threads = 2\nthreads_follow_load = false"


def sft_config(tmp: Path, *, rows: int = 64, micro_batch: int = 256, training: str = "", lora: str = "") -> Path:
    data = tmp / "train.jsonl"
    data.write_text("".join((EXAMPLES / "data/arithmetic_train.jsonl").read_text().splitlines(keepends=True)[:rows]))
    cfg = tmp / "sft.toml"
    cfg.write_text(f"""
[run]
algorithm = "sft"
[output]
path = "out/sft.gguf"
[lora]
rank = 8
alpha = 16.0
{lora}
[training]
ctx = 128
micro_batch = {micro_batch}
epochs = 1
lr = 1e-3
{FIXED_THREADS}
{training}
[sft]
data = "train.jsonl"
""")
    return cfg


def grpo_config(tmp: Path) -> Path:
    (tmp / "prompts.jsonl").write_text((EXAMPLES / "data/smoke_rl_prompts.jsonl").read_text())
    cfg = tmp / "grpo.toml"
    cfg.write_text(f"""
[run]
algorithm = "grpo"
[output]
path = "out/grpo.gguf"
[lora]
rank = 8
alpha = 16.0
[training]
ctx = 128
micro_batch = 512
lr = 2e-4
{FIXED_THREADS}
[grpo]
prompts = "prompts.jsonl"
reward_command = ["{sys.executable}", "{EXAMPLES / 'smoke_rl_reward.py'}"]
updates = 4
prompts_per_update = 2
group_size = 8
grpo_epochs = 2
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = 0.02
[grpo.sampling]
max_new_tokens = 8
""")
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["sft-dense", "sft-quantized-checkpointed", "grpo"])
def test_predictions_match_a_real_run(tmp_path, shape):
    """Three runs of different shape: dense f32 SFT; quantized weights with bf16 gradient
    checkpoints, rank 8 on q and v; GRPO with a reward program."""
    cfg = {
        "sft-dense": lambda: sft_config(tmp_path),
        "sft-quantized-checkpointed": lambda: sft_config(
            tmp_path, micro_batch=128, training='gradient_checkpointing = true\ncheckpoint_dtype = "bf16"\n[model]\nweights = "quantized"',
            lora='targets = ["q", "v"]'),
        "grpo": lambda: grpo_config(tmp_path),
    }[shape]()
    memory_misses, timing_misses = [], []
    for _ in range(2):  # a second probe and run only when the first pair missed
        predicted = planner.plan(load_config(cfg), planner.default_budget())
        assert predicted.configured.fits and predicted.remedy is None
        peak, per_step, steps = measure_train(cfg)
        probe = predicted.configured
        print(f"{shape}: peak predicted {probe.peak_bytes / GiB:.3f} GiB, measured {peak / GiB:.3f}; "
              f"s/{probe.unit[:-1]} predicted {probe.seconds_per_unit:.2f}, measured {per_step:.2f}")
        assert probe.total_units == steps
        memory_misses.append(abs(probe.peak_bytes / peak - 1))
        timing_misses.append(abs(probe.seconds_per_unit / per_step - 1))
        if memory_misses[-1] <= 0.15 and timing_misses[-1] <= 0.30:
            break
    # Neither measurement repeats exactly on these shared VMs. The host's own speed drifts: an
    # idle 2-thread f32 matmul measured 207, then 316, then 260 GFLOP/s within 40 s, and whole
    # probes of one config 0.65 and 1.02 s/step a minute apart. The heap's high-water mark
    # depends on the order its blocks were freed in: six identical runs of the quantized config
    # peaked between 0.627 and 0.738 GiB. One miss can be the machine; two in a row are the planner.
    assert min(memory_misses) <= 0.15, memory_misses
    assert min(timing_misses) <= 0.30, timing_misses


@pytest.mark.slow  # ~36 s, two probes; the default suite keeps the ladder's and the planner's own tests
def test_a_run_over_budget_gets_the_first_rung_that_fits(tmp_path):
    """Under a budget below the run's peak the probe is stopped, and the planner names a
    smaller micro-batch (with the accumulation that keeps the step's size) that fits."""
    cfg = sft_config(tmp_path, rows=24, micro_batch=512)
    measured = planner.run_probe(load_config(cfg), planner.default_budget(), units=2)
    # Three quarters of the way from setup to peak: a step's memory has a part that does not
    # shrink with the micro-batch (about 0.15 GiB here), so at half of it even micro_batch 128
    # fitted with 1% to spare, and the rung picked was up to the RSS sampling's luck.
    budget = measured.setup_bytes + 3 * (measured.peak_bytes - measured.setup_bytes) // 4
    run = subprocess.run([*RETROGRAD, "preflight", str(cfg), "--memory", f"{budget / 2**20:.0f}MiB", "--probe-steps", "2"],
                         capture_output=True, text=True, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "as configured  does not fit" in out
    fix = [line for line in out.splitlines() if line.startswith("rung 1") and "peak" in line]
    assert fix, out
    mb = int(fix[0].split("micro_batch = ")[1].split(",")[0])
    accumulation = int(fix[0].split("gradient_accumulation = ")[1].split(":")[0])
    assert mb < 512 and mb * accumulation == 512
    assert f"  micro_batch = {mb}\n  gradient_accumulation = {accumulation}" in out
    assert "warn" not in out.lower()


def test_the_ladder_follows_the_tuning_guide(tmp_path):
    sft = load_config(sft_config(tmp_path, micro_batch=512, training="gradient_accumulation = 3"))
    names = [name for name, _ in planner.rungs(sft)]
    assert names == ["a smaller micro_batch", "gradient checkpointing in bf16", "all of these together"]
    assert planner.rungs(sft)[0][1] == [  # down to ctx (128): every example still fits a micro-batch
        (("training.micro_batch", 256), ("training.gradient_accumulation", 6)),
        (("training.micro_batch", 128), ("training.gradient_accumulation", 12)),
    ]
    grpo = load_config(grpo_config(tmp_path))
    ladder = dict(planner.rungs(grpo))
    assert planner.generation_concurrency(grpo) == 16  # 2 prompts × 8 completions
    assert ladder["a lower generation_concurrency"][0] == (("training.generation_concurrency", 8),)
    assert [c[0][1] for c in ladder["a smaller micro_batch"]] == [256, 128, 64, 32, 16]
    assert all(len(c) == 1 for c in ladder["a smaller micro_batch"])  # no accumulation in GRPO
    together = ladder["all of these together"]  # from mild to drastic
    checkpointing = (("training.gradient_checkpointing", True), ("training.checkpoint_dtype", "bf16"))
    assert together[0] == (("training.micro_batch", 256), ("training.generation_concurrency", 8), *checkpointing)
    assert together[-1] == (("training.micro_batch", 16), ("training.generation_concurrency", 1), *checkpointing)
    changed = planner.with_changes(grpo, together[-1])
    assert (changed.training.micro_batch, changed.training.generation_concurrency, changed.training.checkpoint_dtype) == (16, 1, "bf16")


@pytest.mark.parametrize("text,expected", [("3GiB", 3 * GiB), ("512MiB", 512 * 2**20), ("2.5G", int(2.5 * GiB)), ("800m", 800 * 2**20)])
def test_memory_sizes(text, expected):
    assert planner.parse_size(text) == expected


@pytest.mark.parametrize("text", ["6", "inf GiB", "nanG", "-1G", "0M", "3 apples"])
def test_memory_sizes_need_a_unit_and_a_positive_number(text):
    with pytest.raises(ValueError, match="expected a size above zero with its unit"):
        planner.parse_size(text)


@pytest.mark.parametrize("args,expected", [
    (["--memory", "lots"], "--memory 'lots': expected a size above zero with its unit, such as 3GiB or 512MiB"),
    (["--ctx", "64"], "--ctx apply to --model probes; the run's file sets them"),
])
def test_bad_input_is_one_line(tmp_path, args, expected):
    cfg = sft_config(tmp_path, rows=8)
    run = subprocess.run([*RETROGRAD, "preflight", str(cfg), *args], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and expected in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "Traceback" not in run.stderr


def test_a_probe_that_fails_says_why(tmp_path):
    """A run whose recipe stops with an error of its own (here: data longer than ctx leaves no
    example) is a one-line error naming the cause, not a plan."""
    cfg = sft_config(tmp_path, rows=8, training="")
    cfg.write_text(cfg.read_text().replace("ctx = 128", "ctx = 8"))
    run = subprocess.run([*RETROGRAD, "preflight", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and "the probe run failed" in run.stderr, run.stdout + run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
