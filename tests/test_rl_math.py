"""The numbers of a rollout update mean what they say: log-probs at the sampling temperature
(kernel, sampler and torch scoring agree on a real run), the learning-rate schedule spans
the steps that happen, and rollouts.jsonl carries what an outside check needs."""

import json
import math
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from retrograd.kernels.chunked_logprobs import dense_gather_logprobs, gather_logprobs
from retrograd.kernels.frozen import FrozenWeight
from test_grpo import write_config

from retrograd.config import load_config
from retrograd.model.base import load_model
from retrograd.recipes import grpo
from retrograd.training.optim import Schedule, learning_rate
from retrograd.training.report import SilentReporter
from retrograd.training.rollout_step import logprob_mismatch

# ----------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_chunked_logprobs_at_a_temperature_match_the_dense_formula(softcap, temperature):
    """Float64 all through, so the only differences are summation order (~1e-15): values and
    gradients of log_softmax(softcap(h W^T) / T) at the ids, tiles smaller than the vocabulary."""
    g = torch.Generator().manual_seed(0)
    n, e, v = 7, 16, 53
    hidden = torch.randn(n, e, generator=g, dtype=torch.float64)
    weight = torch.randn(v, e, generator=g, dtype=torch.float64)
    ids = torch.randint(0, v, (n, 3), generator=g)
    head = FrozenWeight("output", weight, QT.F32, tuple(weight.shape))
    kw = dict(compute_dtype=torch.float64, softcap=softcap, temperature=temperature, vocab_tile=8, token_chunk=3)

    h1 = hidden.clone().requires_grad_(True)
    ours, _ = gather_logprobs(h1, head, ids, **kw)
    h2 = hidden.clone().requires_grad_(True)
    z = h2 @ weight.T
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    expected = torch.log_softmax(z / temperature, -1).gather(1, ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
    upstream = torch.randn(n, 3, generator=g, dtype=torch.float64)
    (ours * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-12)
    dense, _ = dense_gather_logprobs(hidden, head, ids, **kw)
    torch.testing.assert_close(dense, expected, rtol=0, atol=1e-12)
    if temperature != 1.0:  # the temperature really enters
        assert (ours - torch.log_softmax(z, -1).gather(1, ids)).abs().max() > 1e-2


# ----------------------------------------------------------------------------- the schedule


def test_replanned_schedule_ends_where_the_run_ends():
    """Planned 4 updates x 2 steps; update 2 is dead (0 steps), update 3 takes 1 (fewer
    samples than minibatches). The re-planned total at the last update is the real count,
    so its last step gets the schedule's last learning rate."""
    s = Schedule(lr=1.0, scheduler="linear", warmup_steps=0, total_steps=8, max_grad_norm=1.0, updates=4)
    step, rates = 0, []
    for update, steps_now in enumerate((2, 0, 1, 2)):
        total = s.total_from(update, step, steps_now)
        for _ in range(steps_now):
            rates.append(s.rate(step, total))
            step += 1
    assert step == 5 and total == 5
    assert rates[-1] == pytest.approx(learning_rate(4, lr=1.0, schedule="linear", warmup_steps=0, total_steps=5)) == pytest.approx(0.2)
    assert rates == sorted(rates, reverse=True)  # never rises


# ----------------------------------------------------------------------------- the mismatch metric


def test_logprob_mismatch_kl_is_unbiased_for_kl_from_the_sampler():
    """policy/logprob_mismatch_kl on an exact categorical (8 outcomes, float64): the tokens
    are llama.cpp's samples (q), torch scores them (p). Its expectation over q is
    KL(q || p) to rounding; the estimator with the ratio the other way round (e^d - 1 - d,
    d = log q - log p) has expectation chi^2(q || p) - KL(q || p) instead."""
    g = torch.Generator().manual_seed(7)
    llama = (torch.randn(8, generator=g, dtype=torch.float64) * 2).log_softmax(-1)  # q
    torch_ = (llama + 0.8 * torch.randn(8, generator=g, dtype=torch.float64)).log_softmax(-1)  # p
    kl = (llama.exp() * (llama - torch_)).sum().item()  # KL(q || p)
    chi2 = ((llama - torch_).exp() * llama.exp()).sum().item() - 1  # sum q^2 / p - 1
    per_token = [logprob_mismatch(llama[x].view(1), torch_[x].view(1)) for x in range(8)]  # one sampled token each
    expected = sum(q * m["policy/logprob_mismatch_kl"] for q, m in zip(llama.exp().tolist(), per_token))
    assert expected == pytest.approx(kl, rel=0, abs=1e-9)
    d = llama - torch_
    assert (llama.exp() * (d.exp() - 1 - d)).sum().item() == pytest.approx(chi2 - kl, abs=1e-12)
    assert kl == pytest.approx(0.171, abs=1e-3) and chi2 - kl == pytest.approx(0.329, abs=1e-3)  # tells them apart
    abs_mean = [m["policy/logprob_mismatch_abs_mean"] for m in per_token]
    assert abs_mean == pytest.approx(d.abs().tolist(), abs=1e-15)


# ----------------------------------------------------------------------------- a real run

DEAD_OR_LENGTH = '''
def dead_or_length(prompts, completions):
    """All equal (a dead group) for the prompts that say so, else the completion length."""
    return [0.0 if "dead" in p else float(len(c)) for p, c in zip(prompts, completions)]
'''


def prompts_file(path: Path, words: list[str]) -> None:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say something about {w}."}]}) + "\n" for w in words))


def test_grpo_at_temperature_scores_the_policy_that_sampled(tmp_path, tiny_model):
    """A GRPO run at T = 0.7 on an F32 model whose second update is all dead groups:
    - rollouts.jsonl's policy_logprobs are the base model's log_softmax(logits / 0.7) at the
      completion ids (recomputed here from scratch; the adapter is zero in update 1),
      far from the T = 1 values, and the sampler's agree with them;
    - the linear schedule ends on the run's real last step."""
    model = tiny_model("llama")
    prompts_file(tmp_path / "prompts.jsonl", ["cats", "dogs", "dead fish", "dead trees", "birds", "bees"])
    (tmp_path / "rewards_dead.py").write_text(DEAD_OR_LENGTH)
    cfg = write_config(
        tmp_path, model, updates=3, training='lr_scheduler = "linear"\ncompute_dtype = "f32"\nkv_dtype = "f32"',
        reward=f'reward_function = "{tmp_path / "rewards_dead.py"}:dead_or_length"',
    )
    cfg.write_text(cfg.read_text().replace("max_new_tokens = 12", "max_new_tokens = 12\ntemperature = 0.7"))
    result = grpo.run(load_config(cfg), SilentReporter())
    rows = [json.loads(line) for line in (tmp_path / "out/adapter.rollouts.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1] * 8 + [2] * 8 + [3] * 8
    assert all(not r["trained"] and r["policy_logprobs"] is None for r in rows if r["update"] == 2)

    base = load_model(model)
    gaps, t1_gaps = [], []
    for r in (r for r in rows if r["update"] == 1):
        assert len(r["completion_ids"]) == len(r["sampler_logprobs"]) == len(r["policy_logprobs"]) == r["tokens"]
        ids = r["prompt_ids"] + r["completion_ids"]
        logits = base.logits(ids)[len(r["prompt_ids"]) - 1 : -1].double()  # [n, V] predicting each completion token
        target = torch.tensor(r["completion_ids"])[:, None]
        tempered = torch.log_softmax(logits / 0.7, -1).gather(1, target)[:, 0]
        at_one = torch.log_softmax(logits, -1).gather(1, target)[:, 0]
        policy = torch.tensor(r["policy_logprobs"], dtype=torch.float64)
        torch.testing.assert_close(policy, tempered, rtol=0, atol=2e-4)  # float32 forward vs float64 softmax
        gaps.append((torch.tensor(r["sampler_logprobs"], dtype=torch.float64) - policy).abs())
        t1_gaps.append((at_one - policy).abs())
    assert torch.cat(gaps).mean() < 1e-3  # llama.cpp (F32 KV) and torch score the same policy
    assert torch.cat(t1_gaps).mean() > 0.05  # which is not the temperature-1 one

    metrics = [json.loads(line) for line in (tmp_path / "out/adapter.metrics.jsonl").read_text().splitlines()]
    lr_by_update = {m["train/update"]: m.get("optimizer/learning_rate") for m in metrics if "reward/mean" in m}
    assert result.steps == 2  # updates 1 and 3 trained once each; update 2 was dead
    assert lr_by_update[3] == pytest.approx(learning_rate(1, lr=1e-3, schedule="linear", warmup_steps=0, total_steps=2))
    assert not math.isclose(lr_by_update[3], learning_rate(1, lr=1e-3, schedule="linear", warmup_steps=0, total_steps=3))


def test_agent_rollouts_record_each_turn_with_its_ids_and_logprobs(tmp_path, tiny_model):
    """Agentic GRPO at T = 0.7 (judge only, no tools run): each assistant turn's record has
    the context before it, its own sampled ids, and the sampler's and torch's log-probs of
    them, which agree (F32 model and KV cache)."""
    from test_agent_grpo import JUDGED, write_run

    from retrograd.recipes import agent_grpo

    cfg = write_run(tmp_path, model=tiny_model("llama"), updates=1, scenarios_per_update=1, scenarios=(JUDGED,),
                    environment="", agent="temperature = 0.7")
    text = cfg.read_text().replace("[agent.environment]\n\n[agent.environment.tools]\ndefault = \"mini\"\n"
                                   "[agent.environment.tools.toolset.mini]\ntools = [\"write_file\", \"submit\"]\n", "")
    cfg.write_text(text.replace("threads = 2", 'threads = 2\ncompute_dtype = "f32"\nkv_dtype = "f32"'))
    agent_grpo.run(load_config(cfg), SilentReporter())
    records = [json.loads(line) for line in (tmp_path / "out/adapter.rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 4 and any(r["trained"] for r in records)
    gaps = []
    for r in records:
        context = None
        for turn in r["turns"]:
            assert len(turn["completion_ids"]) == len(turn["sampler_logprobs"]) == turn["tokens"] > 0
            if context is not None:  # a later turn's context extends the earlier turn and what followed it
                assert turn["prompt_ids"][: len(context)] == context
            context = turn["prompt_ids"] + turn["completion_ids"]
            if r["trained"]:
                assert len(turn["policy_logprobs"]) == turn["tokens"]
                gaps += [abs(a - b) for a, b in zip(turn["sampler_logprobs"], turn["policy_logprobs"])]
            else:
                assert turn["policy_logprobs"] is None
        assert sum(t["tokens"] for t in r["turns"]) == r["sampled_tokens"]
    assert gaps and sum(gaps) / len(gaps) < 1e-3
