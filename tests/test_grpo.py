"""GRPO end to end on real llama.cpp sampling: the pipeline on SmolLM2, a reward that
rises, exact resume at update boundaries, ratio 1 before the first step, and bad input."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrograd.config import load_config
from retrograd.recipes import grpo
from retrograd.training.report import SilentReporter

RETROGRAD = [sys.executable, "-m", "retrograd"]
EXAMPLES = Path(__file__).parents[1] / "examples"
BREVITY = '''
def brevity(prompts, completions):
    """1 for an empty answer, falling to 0 at 40 characters: a 135M model learns it in a few updates."""
    return [max(0.0, 1.0 - len(c) / 40.0) for c in completions]


def length(prompts, completions):
    """Distinct rewards even for the random tokens of a tiny untrained model."""
    return [float(len(c)) for c in completions]
'''


def write_config(tmp: Path, model: Path | None = None, *, grpo_extra: str = "", training: str = "", extra: str = "",
                 reward: str | None = None, updates: int = 2, reward_name: str = "brevity") -> Path:
    (tmp / "rewards.py").write_text(BREVITY)
    prompts = tmp / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text((EXAMPLES / "data/smoke_rl_prompts.jsonl").read_text())
    reward = reward or f'reward_function = "{tmp / "rewards.py"}:{reward_name}"'
    model_line = f'[model]\npath = "{model}"\n' if model else ""
    cfg = tmp / "grpo.toml"
    cfg.write_text(f"""
[run]
algorithm = "grpo"
{model_line}
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
dtype = "f32"
[training]
ctx = 96
micro_batch = 256
lr = 1e-3
threads = 2
{training}
[grpo]
prompts = "prompts.jsonl"
{reward}
updates = {updates}
prompts_per_update = 2
group_size = 4
grpo_epochs = 1
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = 0.0
{grpo_extra}
[grpo.sampling]
max_new_tokens = 12
{extra}
""")
    return cfg


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_pipeline_on_smollm2_with_the_example_reward_program(tmp_path):
    """The example config's pieces: a reward program over the protocol, KL to the base
    with the adapter off, two epochs, evaluation; every output a user looks at exists."""
    reward = f'reward_command = ["{sys.executable}", "{EXAMPLES / "smoke_rl_reward.py"}"]'
    cfg = write_config(
        tmp_path, reward=reward,
        extra='[evaluation]\ndata = "prompts.jsonl"\nmax_examples = 4\n[checkpoint]\ndirectory = "ckpt"\nmode = "best_eval"',
    )
    cfg.write_text(cfg.read_text().replace("grpo_epochs = 1", "grpo_epochs = 2").replace("kl_coefficient = 0.0", "kl_coefficient = 0.05"))
    result = grpo.run(load_config(cfg), SilentReporter())
    assert result.updates_done == 2 and result.steps == 4 and result.output.is_file()
    rows = metrics(tmp_path / "out/adapter.metrics.jsonl")
    update_rows = [r for r in rows if "reward/mean" in r]
    for key in ("reward/mean", "reward/std", "completions/length_mean", "completions/truncation_fraction",
                "batch/zero_std_group_fraction", "policy/kl", "policy/clip_fraction", "policy/logprob_mismatch_abs_mean",
                "timing/generation_seconds", "timing/reward_seconds", "timing/behavior_scoring_seconds",
                "timing/reference_seconds", "timing/optimizer_seconds", "sampler/adapter_refresh_seconds"):
        assert key in update_rows[0], key
    assert update_rows[0]["policy/beta"] == 0.05
    assert any("eval/mean_reward" in r for r in rows)
    assert (tmp_path / "ckpt/best.gguf").is_file()
    rollouts = metrics(tmp_path / "out/adapter.rollouts.jsonl")
    assert len(rollouts) == 2 * 2 * 4
    assert {"prompt", "completion", "reward", "advantage", "trained", "skip_reason"} <= set(rollouts[0])
    # llama.cpp's and torch's log-probs of the sampled tokens stay close (f16 KV, quantized model)
    assert update_rows[0]["policy/logprob_mismatch_abs_mean"] < 0.2


@pytest.mark.slow
def test_mean_reward_of_an_easy_task_rises(tmp_path):
    cfg = write_config(tmp_path, updates=6, training='compute_dtype = "bf16"')
    cfg.write_text(cfg.read_text().replace("group_size = 4", "group_size = 8").replace("max_new_tokens = 12", "max_new_tokens = 16"))
    result = grpo.run(load_config(cfg), SilentReporter())
    rewards = [r.metrics["reward/mean"] for r in result.records]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.25, rewards


def test_first_ratios_are_exactly_one_with_several_epochs(tmp_path, tiny_model):
    """The behaviour pass and the first training pass compute the same thing the same way,
    so the first step's ratios are exactly 1; the second epoch's are not."""
    cfg = write_config(tmp_path, tiny_model("llama"), updates=1, training='compute_dtype = "f32"', reward_name="length")
    cfg.write_text(cfg.read_text().replace("grpo_epochs = 1", "grpo_epochs = 2").replace("group_size = 4", "group_size = 6"))
    result = grpo.run(load_config(cfg), SilentReporter())
    first, second = result.records[0].step_diagnostics
    assert first["policy/ratio_min"] == first["policy/ratio_max"] == 1.0
    assert second["policy/ratio_min"] != 1.0 or second["policy/ratio_max"] != 1.0


def test_held_out_records_that_end_with_their_answer_give_it_to_the_reward(tmp_path, tiny_model):
    """Evaluation data written as question and known answer: the prompt stops at the user
    turn, the reward program gets the answer as "reference" (training prompts get none), the
    start-up says so, and the evaluation's mean reward is the reward program's."""
    log = tmp_path / "requests.jsonl"
    reward = f'reward_command = ["{sys.executable}", "{Path(__file__).parent / "reward_programs/reference.py"}", "{log}"]'
    answers = {"Calculate 2 + 3.": "5", "Calculate 12 * 6.": "72", "Calculate 10 * 9.": "90"}
    (tmp_path / "held_out.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for q, a in answers.items()))
    cfg = write_config(tmp_path, tiny_model("llama"), updates=1, reward=reward, extra='[evaluation]\ndata = "held_out.jsonl"')
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert ('evaluation: held_out.jsonl (chat messages, 3 records; 3 with a reference answer, which the reward '
            'receives as "reference")') in r.stdout
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    held_out = [q for q in requests if q["prompt"] in answers]
    assert {q["prompt"]: q["reference"] for q in held_out} == answers and len(held_out) == len(answers)
    assert all("reference" not in q for q in requests if q["prompt"] not in answers)
    evaluation = next(row for row in metrics(next(tmp_path.glob("out/*metrics.jsonl"))) if "eval/mean_reward" in row)
    assert evaluation["eval/mean_reward"] == pytest.approx(sum(map(len, answers.values())) / len(answers))


def per_update(path: Path) -> dict[int, tuple]:
    out = {}
    for r in metrics(path):
        if "reward/mean" in r:
            out.setdefault(r["train/update"], []).append((r["reward/mean"], r.get("policy/total_loss")))
    return out


@pytest.mark.slow  # ~19 s on 2 cores: three runs; test_sft.py kills and resumes in the default suite
def test_killed_run_resumes_at_update_boundaries_exactly(tmp_path, tiny_model):
    base = tiny_model("qwen2")
    runs = {}
    for name in ("straight", "killed"):
        d = tmp_path / name
        d.mkdir()
        write_config(d, base, updates=6, training='compute_dtype = "f32"\nfast_sampling_context = false', reward_name="length",
                     extra='[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 1')
        runs[name] = d
    subprocess.run([*RETROGRAD, "train", "grpo.toml"], cwd=runs["straight"], check=True, capture_output=True)
    reference = per_update(runs["straight"] / "out/adapter.metrics.jsonl")
    assert len(reference) == 6

    d = runs["killed"]
    proc = subprocess.Popen([*RETROGRAD, "train", "grpo.toml"], cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        log = d / "out/adapter.metrics.jsonl"
        if log.exists() and len(per_update(log)) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert proc.wait() == -signal.SIGKILL
    r = subprocess.run([*RETROGRAD, "train", "grpo.toml", "--resume"], cwd=d, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    seen = per_update(d / "out/adapter.metrics.jsonl")
    assert set(seen) == set(reference)
    for update, values in seen.items():
        assert all(v == reference[update][0] for v in values), (update, values, reference[update])


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize(
    "case,needle",
    [
        ("prompt not ending with user", "does not end with a user message"),
        ("prompt too long", "more than the"),
        ("group of one", "grpo.group_size = 1: expected an integer >= 2"),
        ("missing reward program", "no-such-reward"),
        ("reward program not executable", "not executable"),
        ("temperature", "grpo.sampling.temperature = 0.0"),
        ("top_p", "grpo.sampling.top_p = 1.5"),
        ("reward program crashes", "crash.py' exited before sending the echo"),
    ],
)
def test_bad_input_is_one_line(tmp_path, case, needle):
    cfg = write_config(tmp_path)
    text = cfg.read_text()
    prompts = tmp_path / "prompts.jsonl"
    if case == "prompt not ending with user":
        rows = prompts.read_text().splitlines()
        rows[3] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
        prompts.write_text("\n".join(rows))
    elif case == "prompt too long":
        rows = prompts.read_text().splitlines()
        rows[2] = json.dumps({"messages": [{"role": "user", "content": "word " * 200}]})
        prompts.write_text("\n".join(rows))
    elif case == "group of one":
        text = text.replace("group_size = 4", "group_size = 1")
    elif case == "missing reward program":
        text = text.replace(f'reward_function = "{tmp_path / "rewards.py"}:brevity"', 'reward_command = ["./no-such-reward"]')
    elif case == "reward program not executable":
        (tmp_path / "reward.sh").write_text("#!/bin/sh\n")
        text = text.replace(f'reward_function = "{tmp_path / "rewards.py"}:brevity"', f'reward_command = ["{tmp_path / "reward.sh"}"]')
    elif case == "temperature":
        text = text.replace("max_new_tokens = 12", "max_new_tokens = 12\ntemperature = 0.0")
    elif case == "top_p":
        text = text.replace("max_new_tokens = 12", "max_new_tokens = 12\ntop_p = 1.5")
    elif case == "reward program crashes":
        (tmp_path / "crash.py").write_text("import sys\nsys.stdin.readline()\nsys.exit(3)\n")
        text = text.replace(f'reward_function = "{tmp_path / "rewards.py"}:brevity"', f'reward_command = ["{sys.executable}", "{tmp_path / "crash.py"}"]')
    cfg.write_text(text)
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    one_line_error(r, needle)
    assert not (tmp_path / "out/adapter.gguf").exists()


def test_profile_reports_phases_memory_and_duty_cycle(tmp_path, tiny_model):
    cfg = write_config(tmp_path, tiny_model("llama"), reward_name="length", training="max_gpu_duty_cycle = 0.5")
    r = subprocess.run([*RETROGRAD, "profile", str(cfg), "--group-size", "3", "--prompts", "2"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for expected in ("retrograd training profiler", "workload  updates=1 prompts/upd=2 group=3 epochs/upd=1",
                     "Initialization", "model load", "llama.cpp sampler", "Phase (all updates)", "generation (llama.cpp decode)",
                     "optimizer (fwd + bwd + step)", "adapter refresh", "TOTAL training", "Per update",
                     "Memory (host RSS)", "peak (updates)", "duty cycle requested=0.50: inactive on the CPU", "Summary  loss="):
        assert expected in out, expected
    assert not (tmp_path / "out").exists()  # the profile writes only to a scratch folder


def test_profile_refuses_other_algorithms(tmp_path):
    cfg = tmp_path / "sft.toml"
    cfg.write_text('[run]\nalgorithm = "sft"\n[output]\npath = "a.gguf"\n[sft]\ndata = "d.txt"\n')
    r = subprocess.run([*RETROGRAD, "profile", str(cfg)], capture_output=True, text=True)
    one_line_error(r, "profile runs grpo configs")
