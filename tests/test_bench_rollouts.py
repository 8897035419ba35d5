"""`retrograd bench` on grpo and agent_grpo configs, on the bundled SmolLM2 with the real
llama.cpp sampler, the smoke example's reward program and a real sandbox: rewards are the
program's (or verify's) on the completions, the seeds are paired (an adapter that adds
zero gets the base's answers, Δ = 0 exactly), and bad input stops on one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from retrograd.config import load_config
from retrograd.errors import ConfigError, DataError
from retrograd.evaluation import bench
from retrograd.gguf.adapter import LoRAWeights, write_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.training.report import SilentReporter

RETROGRAD = [sys.executable, "-m", "retrograd"]
REWARD_PROGRAM = Path(__file__).parents[1] / "examples" / "smoke_rl_reward.py"
QUESTIONS = ("Calculate 3 + 4.", "Calculate 6 * 7. Reply with exactly one number.", "What is 10 - 2?")
# held-out scenarios whose verify passes whatever the model does, and one it can never pass
PASSES = {"id": "passes", "user": "Say hello, then submit.",
          "metadata": {"env": {"verify": {"command": "test -d .", "reward_on_success": 2.0}}}}
FAILS = {"id": "fails", "user": "Name a colour, then submit.",
         "metadata": {"env": {"verify": {"command": "test -f /no/such/file"}}}}


def smoke_reward():
    """The reward function of examples/smoke_rl_reward.py, to recompute what the bench reports."""
    spec = importlib.util.spec_from_file_location("smoke_rl_reward", REWARD_PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward


def write_adapter_for(model: Path, path: Path, scale: float, rank: int = 4) -> Path:
    """A LoRA on every attention-query and FFN-down weight of `model`: B = scale * N(0, 1),
    so scale 0 adds exactly nothing and 0.05 changes the answers."""
    base = GGUFFile(model)
    shapes = {n: tuple(t.shape) for n, t in base.tensors.items() if len(t.shape) == 2}
    rng = np.random.default_rng(0)
    tensors = {
        name: LoRAWeights(rng.standard_normal((rank, n_in)).astype(np.float32) * 0.1,
                          rng.standard_normal((n_out, rank)).astype(np.float32) * scale)
        for name, (n_out, n_in) in shapes.items() if name.endswith(("attn_q.weight", "ffn_down.weight"))
    }
    return write_adapter(path, tensors, arch=str(base.require("general.architecture")), alpha=2.0 * rank, base_shapes=shapes)


def texts(side) -> list[list[str]]:
    """A pass's completions, prompt by prompt."""
    return [[s.text for s in prompt] for prompt in side.samples]


def write_grpo(folder: Path, *, evaluation: bool = True, output: str = "out/adapter.gguf") -> Path:
    for name in ("prompts.jsonl", "held_out.jsonl"):
        (folder / name).write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    cfg = folder / "grpo.toml"
    cfg.write_text(f"""
[run]
algorithm = "grpo"
[output]
path = "{output}"
[training]
ctx = 128
threads = 2
[grpo]
prompts = "prompts.jsonl"
reward_command = ["{sys.executable}", "{REWARD_PROGRAM}"]
updates = 1
prompts_per_update = 2
group_size = 2
grpo_epochs = 1
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = 0.0
[grpo.sampling]
max_new_tokens = 6
temperature = 0.9
seed = 7
""" + ('[evaluation]\ndata = "held_out.jsonl"\n' if evaluation else ""))
    return cfg


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, smollm2):
    """(config, zero adapter, changing adapter) for the bundled SmolLM2."""
    folder = tmp_path_factory.mktemp("bench_grpo")
    cfg = write_grpo(folder)
    return cfg, write_adapter_for(smollm2, folder / "zero.gguf", 0.0), write_adapter_for(smollm2, folder / "changed.gguf", 0.05)


def test_grpo_rewards_are_the_programs_on_paired_completions(grpo_run):
    cfg, zero, changed = grpo_run
    config = load_config(cfg)
    tuned = bench.run(config, SilentReporter(), bench.BenchOptions(adapter=changed, samples=3, success_at=0.5))
    reward = smoke_reward()
    assert tuned.adapter_path == changed and len(tuned.base.samples) == len(QUESTIONS)
    for side in (tuned.base, tuned.adapter):
        for question, samples in zip(QUESTIONS, side.samples):
            assert len(samples) == 3
            for s in samples:
                assert s.reward == reward(question, s.text) and s.success == (s.reward >= 0.5)
                assert 1 <= s.tokens <= 6 and (s.tokens == 6 or not s.truncated)
    flat = [s for p in tuned.adapter.samples for s in p]
    rows = {r.metric: r for r in tuned.rows()}
    assert rows["mean"].adapter == pytest.approx(np.mean([s.reward for s in flat]))
    assert rows["stddev"].adapter == pytest.approx(np.std([s.reward for s in flat]))
    assert rows["success rate (reward ≥ 0.5)"].adapter == pytest.approx(np.mean([s.success for s in flat]))
    assert rows["mean length (tokens)"].adapter == pytest.approx(np.mean([s.tokens for s in flat]))
    assert rows["truncated"].adapter == pytest.approx(np.mean([s.truncated for s in flat]))
    assert texts(tuned.adapter) != texts(tuned.base)  # the adapter reached llama.cpp
    verdict = tuned.verdict()
    deltas = [np.mean([s.reward for s in a]) - np.mean([s.reward for s in b]) for a, b in zip(tuned.adapter.samples, tuned.base.samples)]
    assert verdict.mean_delta == pytest.approx(np.mean(deltas)) and verdict.total == len(QUESTIONS)
    assert [i.delta for i in tuned.items()] == pytest.approx(deltas)

    # the seeds are fixed per prompt and sample: another run, or fewer prompts, draw the same answers
    again = bench.run(config, SilentReporter(), bench.BenchOptions(adapter=zero, samples=3, limit=2))
    assert texts(again.base) == texts(tuned.base)[:2]
    # an adapter that adds exactly zero samples exactly the base's answers: the passes are paired
    assert texts(again.adapter) == texts(again.base)
    v = again.verdict()
    assert (v.label, v.mean_delta, v.unchanged, v.total) == ("unchanged", 0.0, 2, 2)


class Messages(SilentReporter):
    def __init__(self):
        self.lines = []

    def message(self, text: str) -> None:
        self.lines.append(text)


def test_held_out_answers_reach_the_reward_program_as_reference(tmp_path, smollm2):
    """`bench --data` with records that end with the known answer: SmolLM2 answers the
    question, and the reward program gets the answer as "reference" with every sample."""
    cfg = write_grpo(tmp_path)
    log = tmp_path / "requests.jsonl"
    reference_program = Path(__file__).parent / "reward_programs" / "reference.py"
    cfg.write_text(cfg.read_text().replace(f'"{REWARD_PROGRAM}"', f'"{reference_program}", "{log}"'))
    answers = ("7", "42", "8")
    (tmp_path / "answered.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for q, a in zip(QUESTIONS, answers)))
    reporter = Messages()
    zero = write_adapter_for(smollm2, tmp_path / "zero.gguf", 0.0)
    result = bench.run(load_config(cfg), reporter, bench.BenchOptions(data=tmp_path / "answered.jsonl", adapter=zero, samples=2))
    assert ('data: answered.jsonl (chat messages, 3 records; 3 with a reference answer, which the reward receives '
            'as "reference")') in reporter.lines
    for side in (result.base, result.adapter):
        assert [[s.reward for s in samples] for samples in side.samples] == [[float(len(a))] * 2 for a in answers]
        assert all(s.tokens >= 1 for samples in side.samples for s in samples)
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(requests) == 2 * 2 * len(QUESTIONS)  # base and adapter, two samples each
    assert {(q["prompt"], q["reference"]) for q in requests} == set(zip(QUESTIONS, answers))


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*RETROGRAD, "bench", *map(str, args)], cwd=cwd, capture_output=True, text=True, check=False)


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("│ ").split("│")]


def test_cli_prints_rewards_verdict_and_per_prompt_table(grpo_run):
    cfg, zero, _ = grpo_run
    r = cli(cfg, "--adapter", zero, "--samples", "2", "--verbose", cwd=cfg.parent)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"bench: 3 prompt(s) from {cfg.parent / 'held_out.jsonl'}, 2 sample(s) each, temperature 0.9" in r.stdout
    per_prompt = next(i for i, line in enumerate(lines) if "prompt (mean reward)" in line)
    assert cells(lines[per_prompt]) == ["prompt (mean reward)", "base", "adapter", "Δ"]
    body = [cells(line) for line in lines[per_prompt + 2: per_prompt + 5]]
    assert [row[0] for row in body] == list(QUESTIONS) and all(row[1] == row[2] and row[3] == "+0.0000" for row in body)
    assert cells(next(line for line in lines if "metric" in line)) == ["metric", "base", "adapter", "Δ", "Δ%"]
    success = cells(next(line for line in lines if "success rate (reward ≥ 1)" in line))
    assert success[1] == success[2]
    assert cells(next(line for line in lines if line.startswith("│   prompts ")))[:3] == ["prompts", "3", "3"]
    assert "verdict    unchanged   mean reward Δ+0.0000" in r.stdout
    assert "prompts    ↑ 0/3 improved (0.0%)  ↓ 0 degraded  = 3 unchanged (|Δ| ≤ 1e-09)" in r.stdout


@pytest.mark.namespace  # the agent loop runs its tools in a real bubblewrap sandbox, as training does
def test_agent_bench_scores_held_out_scenarios_by_verify(tmp_path, smollm2):
    (tmp_path / "scenarios.jsonl").write_text(json.dumps(PASSES) + "\n")
    (tmp_path / "held_out.jsonl").write_text(json.dumps(PASSES) + "\n" + json.dumps(FAILS) + "\n")
    cfg = tmp_path / "agent.toml"
    cfg.write_text("""
[run]
algorithm = "agent_grpo"
[output]
path = "out/adapter.gguf"
[training]
ctx = 640
threads = 2
[agent]
scenarios = "scenarios.jsonl"
scenarios_per_update = 2
group_size = 2
max_turns = 1
max_new_tokens_per_turn = 12
temperature = 0.7
[agent.environment]
type = "sandbox"
[agent.environment.tools]
default = "mini"
[agent.environment.tools.toolset.mini]
tools = ["submit"]
[evaluation]
data = "held_out.jsonl"
""")
    zero = write_adapter_for(smollm2, tmp_path / "zero.gguf", 0.0)
    result = bench.run(load_config(cfg), SilentReporter(), bench.BenchOptions(adapter=zero, samples=2))
    assert result.prompts == ("passes", "fails")
    for side in (result.base, result.adapter):  # no step rewards here: the reward is verify's
        assert [[(s.reward, s.success, s.failed) for s in p] for p in side.samples] == [[(2.0, True, False)] * 2, [(0.0, False, False)] * 2]
        assert all(1 <= s.tokens <= 12 for p in side.samples for s in p)
    assert texts(result.adapter) == texts(result.base)
    assert result.verdict().label == "unchanged" and result.verdict().items == "scenarios"
    rows = {r.metric: r for r in result.rows()}
    assert (rows["mean"].base, rows["success rate (verify passed)"].base, rows["failed (sandbox or tool broke)"].base) == (1.0, 0.5, 0.0)

    r = cli(cfg, "--limit", "1", "--samples", "1", "--verbose", cwd=tmp_path)  # no adapter at out/: the base alone
    assert r.returncode == 0, r.stderr
    assert "no adapter at" in r.stdout and "bench: 1 scenario(s) from" in r.stdout and "environment sandbox" in r.stdout
    assert cells(next(line for line in r.stdout.splitlines() if "scenario (mean reward)" in line)) == ["scenario (mean reward)", "base"]
    assert "│ passes " in r.stdout and "verdict" not in r.stdout


@pytest.mark.parametrize("case, needle", [
    ("no held-out prompts", "no held-out prompts to bench on: the config has no [evaluation] data; pass --data FILE"),
    ("adapter of another model", "does not fit the base model SmolLM2"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_model, case, needle):
    cfg = write_grpo(tmp_path, evaluation=case != "no held-out prompts")
    extra = ["--adapter", write_adapter_for(tiny_model("llama"), tmp_path / "tiny.gguf", 0.0)] if case.startswith("adapter") else []
    r = cli(cfg, *extra, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "loading" not in r.stdout and "bench:" not in r.stdout


def test_options_that_do_not_apply_are_refused(tmp_path):
    cfg = write_grpo(tmp_path)
    with pytest.raises(DataError, match=r"--adapter .*nope.gguf: no such file"):
        bench.run(load_config(cfg), SilentReporter(), bench.BenchOptions(adapter=tmp_path / "nope.gguf"))
    (tmp_path / "sft.toml").write_text('[run]\nalgorithm = "sft"\n[output]\npath = "a.gguf"\n[sft]\ndata = "prompts.jsonl"\n')
    with pytest.raises(ConfigError, match="--samples: applies to ppo, grpo, agent_grpo configs, not sft"):
        bench.run(load_config(tmp_path / "sft.toml"), SilentReporter(), bench.BenchOptions(samples=2))
