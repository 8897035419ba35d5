"""PPO with a critic: GAE and the value head against direct computations, the features the
head reads against the transformer's own hidden states, runs on real llama.cpp sampling
(per-token advantages, KL toward the sampling policy, the critic-off REINFORCE mode, exact
resume with the head's state), a reward that rises on SmolLM2, and bad input."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from retrograd import load_model
from retrograd.config import load_config
from retrograd.errors import ConfigError
from retrograd.objectives.critic import ValueHead, explained_variance, gae, whiten
from retrograd.recipes import ppo
from retrograd.training.report import SilentReporter
from retrograd.training.scoring import Rollout, rollout_features

RETROGRAD = [sys.executable, "-m", "retrograd"]
EXAMPLES = Path(__file__).parents[1] / "examples"
REWARDS = '''
def brevity(prompts, completions):
    """1 for an empty answer, falling to 0 at 40 characters."""
    return [max(0.0, 1.0 - len(c) / 40.0) for c in completions]


def length(prompts, completions):
    """Distinct rewards even for the random tokens of a tiny untrained model."""
    return [float(len(c)) for c in completions]
'''


def write_config(tmp: Path, model: Path | None = None, *, updates: int = 2, critic: str = "",
                 training: str = "", extra: str = "", reward_name: str = "length") -> Path:
    (tmp / "rewards.py").write_text(REWARDS)
    (tmp / "prompts.jsonl").write_text((EXAMPLES / "data/smoke_rl_prompts.jsonl").read_text())
    model_line = f'[model]\npath = "{model}"\n' if model else ""
    cfg = tmp / "ppo.toml"
    cfg.write_text(f"""
[run]
algorithm = "ppo"
{model_line}
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
[training]
ctx = 96
micro_batch = 256
lr = 1e-3
threads = 2
threads_follow_load = false
{training}
[ppo]
prompts = "prompts.jsonl"
reward_function = "{tmp / "rewards.py"}:{reward_name}"
updates = {updates}
rollout_batch_size = 4
ppo_epochs = 1
clip_range = 0.2
kl_coefficient = 0.02
[ppo.critic]
{critic}
[ppo.sampling]
max_new_tokens = 8
{extra}
""")
    return cfg


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def updates_of(path: Path) -> list[dict]:
    return [r for r in lines(path) if "reward/mean" in r]


# ---------------------------------------------------------------- the math


def test_gae_is_the_discounted_sum_of_td_errors():
    torch.manual_seed(0)
    values = torch.randn(7, dtype=torch.float64)
    reward, gamma, lam = 1.7, 0.9, 0.8
    rewards = [0.0] * 6 + [reward]
    following = [*values[1:].tolist(), 0.0]
    deltas = [r + gamma * v1 - v0 for r, v1, v0 in zip(rewards, following, values.tolist())]
    direct = [sum((gamma * lam) ** k * deltas[t + k] for k in range(7 - t)) for t in range(7)]
    assert gae(values, reward, gamma, lam).tolist() == pytest.approx(direct, abs=1e-12)
    # lambda = gamma = 1: the advantage is the return (the final reward) minus the value
    assert gae(values, reward, 1.0, 1.0).tolist() == pytest.approx((reward - values).tolist(), abs=1e-12)
    # lambda = 0: one-step TD errors
    assert gae(values, reward, gamma, 0.0).tolist() == pytest.approx(deltas, abs=1e-12)


def test_whitening_and_explained_variance():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    w = whiten(x)
    assert float(w.mean()) == pytest.approx(0, abs=1e-12) and float(w.std(unbiased=False)) == pytest.approx(1, abs=1e-6)
    assert whiten(torch.full((5,), 0.3)).tolist() == [0.0] * 5
    target = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert explained_variance(target, target) == 1.0
    assert explained_variance(torch.full((4,), 1.5), target) == pytest.approx(0.0)
    assert explained_variance(-target, target) < 0


def test_value_head_fits_a_linear_target_and_resumes_exactly_from_its_json_state():
    torch.manual_seed(0)
    features = torch.randn(64, 16) * 3
    targets = features @ torch.randn(16) / 4 + 0.5
    head = ValueHead(16, lr=0.05)
    assert head(features).abs().max() == 0  # zero at the start
    head.fit(features, targets, 3)
    saved = json.loads(json.dumps(head.state()))
    resumed = ValueHead.from_state(saved, lr=0.05)
    assert torch.equal(resumed(features), head(features))
    head.fit(features, targets, 200)
    resumed.fit(features, targets, 200)
    assert torch.equal(resumed.linear.weight, head.linear.weight) and torch.equal(resumed.linear.bias, head.linear.bias)
    assert explained_variance(head(features), targets) > 0.95


def test_features_are_the_hidden_states_before_each_completion_token(tiny_model):
    """What the critic reads: the final hidden state that predicts each completion token,
    the same whether a prompt is packed with its completion or computed once and shared
    by a split group (a micro-batch too small for it)."""
    model = load_model(tiny_model("llama"), device="cpu", compute_dtype="f32").transformer
    prompt, tokens = (5, 9, 17, 33, 2, 41), (7, 8, 11, 60)
    rollouts = [Rollout(0, prompt, tokens), Rollout(0, prompt, tokens[:3]), Rollout(1, prompt[:4], tokens)]
    with torch.no_grad():
        direct = [model(torch.tensor(r.prompt + r.tokens))[len(r.prompt) - 1 : -1] for r in rollouts]  # [n, E] each
    for budget in (256, 8):  # everything in one micro-batch; prompts shared across split micro-batches
        got = rollout_features(model, rollouts, budget, "cpu")
        for g, d in zip(got, direct):
            assert g.shape == d.shape
            torch.testing.assert_close(g, d, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- runs


def test_a_run_trains_per_token_advantages_with_kl_toward_the_sampling_policy(tmp_path, tiny_model):
    cfg = write_config(tmp_path, tiny_model("llama"), updates=2, training='compute_dtype = "f32"')
    cfg.write_text(cfg.read_text().replace("ppo_epochs = 1", "ppo_epochs = 2"))
    result = ppo.run(load_config(cfg), SilentReporter())
    assert result.updates_done == 2 and result.steps == 4 and result.output.is_file()
    first, second = result.records
    # the head starts at zero: nothing explained on the first batch; it is fit toward A + V afterwards
    assert first.metrics["critic/explained_variance"] == 0.0
    assert first.metrics["critic/value_loss"] < first.metrics["critic/value_loss_before"]
    assert first.metrics["critic/feature_mib"] > 0
    # the advantages are whitened over the batch's completion tokens
    assert first.metrics["advantages/mean"] == pytest.approx(0, abs=1e-9)
    assert first.metrics["advantages/std"] == pytest.approx(1, abs=1e-6)
    # KL toward the policy that sampled: exactly 0 in each update's first step (nothing has moved
    # since sampling, though the adapter is no longer the base in the second update), not after it
    for record in result.records:
        step1, step2 = record.step_diagnostics
        assert step1["policy/kl"] == 0.0 and step1["policy/ratio_min"] == step1["policy/ratio_max"] == 1.0
        assert step2["policy/kl"] > 0.0
    records = lines(tmp_path / "out/adapter.rollouts.jsonl")
    assert len(records) == 2 * 4 and [r["update"] for r in records] == [1] * 4 + [2] * 4
    assert {r["group"] for r in records} == set(range(8))  # one completion per prompt, the stream's positions
    assert all(r["reward"] == len(r["completion"]) for r in records)
    logged = updates_of(tmp_path / "out/adapter.metrics.jsonl")
    assert "timing/critic_seconds" in logged[0] and logged[0]["timing/critic_seconds"] > 0


def test_without_the_critic_every_token_carries_the_whitened_reward(tmp_path, tiny_model):
    cfg = write_config(tmp_path, tiny_model("llama"), updates=1, critic="enabled = false",
                       extra='[evaluation]\ndata = "prompts.jsonl"\nmax_examples = 3')
    result = ppo.run(load_config(cfg), SilentReporter())
    assert not any(k.startswith("critic/") for k in result.records[0].metrics)
    held_out = [r for r in lines(tmp_path / "out/adapter.metrics.jsonl") if "eval/mean_reward" in r]
    assert len(held_out) == 1 and held_out[0]["eval/reward_min"] <= held_out[0]["eval/mean_reward"]
    records = lines(tmp_path / "out/adapter.rollouts.jsonl")
    rewards = torch.tensor([r["reward"] for r in records], dtype=torch.float64)
    expected = ((rewards - rewards.mean()) / rewards.std(unbiased=False)).tolist() if rewards.std() > 0 else [0.0] * 4
    assert [r["advantage"] for r in records] == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow  # ~17 s on 2 cores: three runs; test_sft.py kills and resumes in the default suite
def test_killed_run_resumes_at_update_boundaries_exactly_with_the_critic(tmp_path, tiny_model):
    """The head's weights and Adam moments travel in the checkpoint: after a kill and
    --resume, every update (value loss and explained variance included) is the one an
    uninterrupted run made."""
    base = tiny_model("qwen2")
    runs = {}
    keys = ("reward/mean", "policy/total_loss", "critic/value_loss", "critic/explained_variance")
    for name in ("straight", "killed"):
        d = tmp_path / name
        d.mkdir()
        write_config(d, base, updates=5, training='compute_dtype = "f32"\nfast_sampling_context = false',
                     extra='[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 1')
        runs[name] = d
    subprocess.run([*RETROGRAD, "train", "ppo.toml"], cwd=runs["straight"], check=True, capture_output=True)
    reference = {r["train/update"]: [r[k] for k in keys] for r in updates_of(runs["straight"] / "out/adapter.metrics.jsonl")}
    assert len(reference) == 5 and reference[5][3] != 0.0

    d = runs["killed"]
    proc = subprocess.Popen([*RETROGRAD, "train", "ppo.toml"], cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    log = d / "out/adapter.metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(updates_of(log)) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert proc.wait() == -signal.SIGKILL
    r = subprocess.run([*RETROGRAD, "train", "ppo.toml", "--resume"], cwd=d, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    seen: dict[int, list] = {}
    for row in updates_of(log):
        seen.setdefault(row["train/update"], []).append([row[k] for k in keys])
    assert set(seen) == set(reference)
    for update, values in seen.items():
        assert all(v == reference[update] for v in values), (update, values, reference[update])


def test_bench_compares_base_and_adapter_on_held_out_prompts_with_the_runs_reward(tmp_path, tiny_model):
    cfg = write_config(tmp_path, tiny_model("llama"), updates=1, extra='[evaluation]\ndata = "prompts.jsonl"')
    assert subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, cwd=tmp_path).returncode == 0
    r = subprocess.run([*RETROGRAD, "bench", str(cfg), "--limit", "3", "--samples", "2"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "bench: 3 prompt(s)" in r.stdout and "2 sample(s) each" in r.stdout
    assert "mean length (tokens)" in r.stdout and "verdict" in r.stdout


@pytest.mark.slow
def test_reward_rises_and_the_critic_explains_variance_on_smollm2(tmp_path):
    cfg = write_config(tmp_path, updates=8, reward_name="brevity")
    cfg.write_text(cfg.read_text().replace("rollout_batch_size = 4", "rollout_batch_size = 16")
                   .replace("max_new_tokens = 8", "max_new_tokens = 16").replace("lr = 1e-3", "lr = 5e-4"))
    result = ppo.run(load_config(cfg), SilentReporter())
    rewards = [r.metrics["reward/mean"] for r in result.records]
    explained = [r.metrics["critic/explained_variance"] for r in result.records]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards
    assert max(explained[2:]) > 0.1, explained


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change,needle",
    [
        (('reward_function = ', 'reward_mode = "oneshot"\nreward_function = '), "ppo.reward_mode applies to reward_command"),
        (("[ppo.sampling]", "[ppo.sampling]\ntop_p = 0.9"), "ppo.sampling.top_p = 0.9"),
        (("[ppo.critic]", "[ppo.critic]\nenabled = false\nfeature_dtype = \"bf16\""), "ppo.critic.feature_dtype applies to an enabled critic"),
        (("clip_range = 0.2", "clip_range = 1.5"), "ppo.clip_range = 1.5"),
        (("rollout_batch_size = 4", "rollout_batch_size = 4\nminibatches = 5"), "ppo.minibatches = 5 is more than the 4"),
        (("[ppo.critic]", "[ppo.critic]\ngae_lamda = 0.9"), "did you mean"),
        (("threads = 2", "threads = 2\nmax_async_rollout = 1"), "training.max_async_rollout applies to grpo"),
        (("[ppo.sampling]", "[grpo]\n[ppo.sampling]"), "[grpo] does not belong to algorithm 'ppo'"),
    ],
)
def test_bad_input_is_one_line(tmp_path, change, needle):
    cfg = write_config(tmp_path)
    cfg.write_text(cfg.read_text().replace(*change, 1))
    with pytest.raises(ConfigError) as caught:
        load_config(cfg)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_the_cli_refuses_a_bad_config_with_exit_2_and_writes_nothing(tmp_path):
    cfg = write_config(tmp_path)
    cfg.write_text(cfg.read_text().replace("[ppo.sampling]", "[ppo.sampling]\ntop_p = 0.9"))
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines_ = r.stderr.strip().splitlines()
    assert len(lines_) == 1 and lines_[0].startswith("error: ") and "ppo.sampling.top_p = 0.9" in lines_[0], r.stderr
    assert not (tmp_path / "out").exists()
