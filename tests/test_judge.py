"""The LLM judge (`type = "ruler"`): verdicts from a real `retrograd serve` on loopback
(deterministic at temperature 0, all cache hits on a rerun), every strategy's bookkeeping
against a scripted endpoint in this process, failures that drop groups and then stop a GRPO
run, and its config errors."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from loopback import JsonEndpoint
from test_bench_rollouts import write_adapter_for, write_grpo
from test_grpo import metrics, write_config
from test_serve import running, without_key

from retrograd.config import (
    JudgeCompactionSection,
    JudgeContextSection,
    JudgeSection,
    JudgeStrategySection,
    load_config,
)
from retrograd.errors import ConfigError
from retrograd.evaluation import bench
from retrograd.recipes import grpo
from retrograd.rollouts.judge import JudgeError, RulerJudge, bradley_terry, elide
from retrograd.rollouts.rewards import _reward_in
from retrograd.training.report import SilentReporter

TASK = "What is 12 + 30? Answer with the number."
ANSWERS = ["42", "The answer is 41.", "I like trains."]


def ruler(base_url: str, **keys) -> JudgeSection:
    return JudgeSection(type="ruler", base_url=base_url, model=keys.pop("model", "base"), **keys)


# ---- a scripted endpoint


class Endpoint(JsonEndpoint):
    """An OpenAI-shaped /chat/completions on 127.0.0.1 that answers as `behaviour` says:
    "longer" (listwise: score by length; pairwise: the longer wins), "fail" (500),
    "garbage" (200 with prose), "no_schema" (400 for a JSON schema, else "longer")."""

    def __init__(self, behaviour: str):
        self.behaviour = behaviour
        super().__init__(self.answer)

    def answer(self, body: dict) -> tuple[int, dict]:
        if self.behaviour == "fail":
            return 500, {"error": {"message": "down"}}
        if self.behaviour == "no_schema" and body["response_format"]["type"] == "json_schema":
            return 400, {"error": {"message": "response_format json_schema is not supported", "param": "response_format"}}
        user = body["messages"][1]["content"]
        if body["messages"][0]["content"].startswith("You shorten an agent's transcript"):  # compaction
            earlier = user.split("Earlier turns:\n", 1)[1]
            content = json.dumps({"summary": f"it wrote {len(earlier)} characters"})
            return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
        if self.behaviour == "garbage":
            content = "I think the first one is better."
        elif "[response A]" in user:
            a = user.split("[response A]\n")[1].split("\n\n[response B]\n")[0]
            b = user.split("[response B]\n")[1]
            content = json.dumps({"explanation": "length", "winner": "A" if len(a) > len(b) else "B" if len(b) > len(a) else "tie"})
        else:
            blocks = user.split("[response ")[1:]
            scores = [{"id": block.split("]")[0], "explanation": "length",
                       "score": min(1.0, len(block.split("]\n", 1)[1].strip()) / 40)} for block in blocks]
            content = json.dumps({"scores": scores})
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}


@pytest.fixture
def endpoint(request):
    served = Endpoint(request.param)
    yield served
    served.close()


# ---- against retrograd serve


@pytest.fixture(scope="module")
def serve_url():
    with running("--ctx", "2048", env=without_key()) as url:
        yield url


def test_a_local_serve_judges_deterministically_and_a_rerun_is_all_cache_hits(serve_url, tmp_path):
    section = ruler(serve_url, temperature=0.0, cache_path=tmp_path / "verdicts.jsonl")
    with RulerJudge(section) as judge:
        first = judge.score_group(TASK, ANSWERS)
        assert judge.metrics() == {"judge/requests": 1.0, "judge/cache_hit_rate": 0.0}
    assert len(first) == 3 and all(0 <= v <= 1 for v in first)
    with RulerJudge(section) as again:  # a new run reading the cache
        assert again.score_group(TASK, ANSWERS) == first
        assert again.metrics() == {"judge/requests": 0.0, "judge/cache_hit_rate": 1.0}
    with RulerJudge(ruler(serve_url, temperature=0.0)) as uncached:  # the endpoint itself is deterministic
        assert uncached.score_group(TASK, ANSWERS) == first
    pairwise = ruler(serve_url, temperature=0.0, strategy=JudgeStrategySection(mode="pairwise"))
    with RulerJudge(pairwise) as judge:
        verdicts = judge.score_group(TASK, ANSWERS)
        m = judge.metrics()
    assert len(verdicts) == 3 and all(0 <= v <= 1 for v in verdicts) and sum(verdicts) == pytest.approx(1.5)
    assert m["judge/requests"] == 6 and 0 <= m["judge/position_disagreement"] <= 1  # a ring of 3, both orders


# ---- strategies, on the scripted endpoint


@pytest.mark.parametrize("endpoint", ["longer"], indirect=True)
def test_listwise_verdicts_follow_the_endpoint_whatever_order_it_saw(endpoint):
    answers = ["a" * 10, "b" * 30, "c" * 20, "d" * 40]
    with RulerJudge(ruler(endpoint.url)) as judge:
        assert judge.score_group(TASK, answers) == [0.25, 0.75, 0.5, 1.0]
    shown = endpoint.bodies[0]["messages"][1]["content"]
    order = [shown.index(a) for a in answers]
    assert order != sorted(order)  # members are shown in a drawn order, mapped back by id
    schema = endpoint.bodies[0]["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["scores"]["minItems"] == 4 == schema["properties"]["scores"]["maxItems"]


@pytest.mark.parametrize("endpoint", ["longer"], indirect=True)
def test_pairwise_win_rates_bradley_terry_and_chunks_with_an_anchor(endpoint):
    answers = ["a" * 10, "b" * 30, "c" * 20]
    with RulerJudge(ruler(endpoint.url, strategy=JudgeStrategySection(mode="pairwise"))) as judge:
        assert judge.score_group(TASK, answers) == [0.0, 1.0, 0.5]  # each pair both ways: 6 requests
        assert judge.metrics()["judge/position_disagreement"] == 0.0
    assert len(endpoint.bodies) == 6
    strengths = bradley_terry(np.array([[0, 0, 0], [1, 0, 1], [1, 0, 0.0]]))
    assert strengths[1] > strengths[2] > strengths[0] and all(0 < s < 1 for s in strengths)
    endpoint.bodies.clear()
    many = ["x" * (4 * k + 4) for k in range(8)]
    chunked = ruler(endpoint.url, strategy=JudgeStrategySection(mode="chunked"),
                    context=JudgeContextSection(max_request_chars=1000, max_trajectory_chars=200, max_message_chars=200))
    with RulerJudge(chunked) as judge:
        scores = judge.score_group(TASK, many)
    assert len(endpoint.bodies) > 1  # split to fit 1,000 characters, the anchor in every request
    assert all(many[0] in body["messages"][1]["content"] for body in endpoint.bodies)
    assert scores == pytest.approx([min(1.0, len(t) / 40) for t in many])  # the endpoint is consistent: no shift


@pytest.mark.parametrize("endpoint", ["no_schema"], indirect=True)
def test_an_endpoint_without_json_schemas_gets_plain_json_mode(endpoint):
    with RulerJudge(ruler(endpoint.url)) as judge:
        assert judge.score_group(TASK, ["a" * 20, "b" * 40]) == [0.5, 1.0]
    assert [b["response_format"]["type"] for b in endpoint.bodies] == ["json_schema", "json_object"]


@pytest.mark.parametrize("endpoint", ["fail", "garbage"], indirect=True)
def test_a_failing_endpoint_is_retried_then_a_judge_error(endpoint):
    with RulerJudge(ruler(endpoint.url, max_retries=2)) as judge, pytest.raises(JudgeError, match="3 tries"):
        judge.score_group(TASK, ANSWERS)
    assert len(endpoint.bodies) == 3


def test_long_texts_keep_head_and_tail():
    text = "".join(chr(65 + k % 26) for k in range(5000))
    cut = elide(text, 500, 0.4)
    assert len(cut) <= 500 and cut.startswith(text[:150]) and cut.endswith(text[-250:]) and "left out" in cut


# ---- GRPO with a judge


def judged_config(tmp_path: Path, url: str, *, extra: str = "") -> Path:
    judge = f'judge_weight = 2.0\n{extra}\n[grpo.judge]\ntype = "ruler"\nbase_url = "{url}"\nmodel = "judge"\nmax_retries = 0'
    return write_config(tmp_path, grpo_extra=judge, updates=2)


@pytest.mark.parametrize("endpoint", ["longer"], indirect=True)
def test_long_transcripts_are_compacted_once_per_group_at_temperature_0(endpoint, tmp_path):
    """The longest member is over trigger_chars, so every member with more parts than
    keep_last has its earlier parts summarised (asked at temperature 0 whatever the judge's,
    then cached); the verdict reads the summaries and the last parts as they were."""
    compaction = JudgeCompactionSection(trigger_chars=300, target_chars=100, keep_last=1)
    section = ruler(endpoint.url, temperature=0.5, compaction=compaction, cache_path=tmp_path / "verdicts.jsonl")
    group = [("x" * 200, "y" * 150, "final A"), ("short", "final B"), ("only part",)]
    with RulerJudge(section) as judge:
        verdicts = judge.score_group(TASK, group)
        assert judge.metrics() == {"judge/requests": 3.0, "judge/cache_hit_rate": 0.0, "judge/compacted_fraction": pytest.approx(2 / 3)}
    summaries, (verdict,) = endpoint.bodies[:2], endpoint.bodies[2:]
    assert [b["temperature"] for b in summaries] == [0.0, 0.0] and verdict["temperature"] == 0.5
    assert sorted(b["messages"][1]["content"].split("Earlier turns:\n")[1] for b in summaries) == ["short", "x" * 200 + "\n" + "y" * 150]
    shown = verdict["messages"][1]["content"]
    assert shown.count("[summary of the earlier turns]") == 2 and "it wrote 351 characters" in shown and "yyy" not in shown
    assert all(part in shown for part in ("final A", "final B", "only part"))
    assert len(verdicts) == 3
    with RulerJudge(section) as again:  # a rerun: summaries and verdict from the cache
        assert again.score_group(TASK, group) == verdicts
        assert again.metrics()["judge/requests"] == 0.0
    with RulerJudge(section) as short:  # under the trigger nothing is summarised
        short.score_group(TASK, [("a", "b"), ("c",)])
        assert short.metrics()["judge/compacted_fraction"] == 0.0
    assert not any(b["messages"][0]["content"].startswith("You shorten") for b in endpoint.bodies[3:])


@pytest.mark.parametrize("endpoint", ["longer"], indirect=True)
def test_grpo_adds_the_weighted_verdict_to_the_reward(endpoint, tmp_path):
    result = grpo.run(load_config(judged_config(tmp_path, endpoint.url)), SilentReporter())
    assert result.updates_done == 2
    rows = [r for r in metrics(tmp_path / "out/adapter.metrics.jsonl") if "reward/mean" in r]
    assert all("judge/score_mean" in r and r["judge/dropped_group_fraction"] == 0 for r in rows)
    assert rows[0]["judge/requests"] == 2 and "timing/judge_seconds" in rows[0]  # one listwise request per group
    for record in metrics(tmp_path / "out/adapter.rollouts.jsonl"):
        brevity = max(0.0, 1.0 - len(record["completion"]) / 40.0)  # the reward function; then the judge's term
        assert record["reward"] == pytest.approx(brevity + 2.0 * record["judge_verdict"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["fail"], indirect=True)
def test_a_failing_judge_drops_groups_and_then_stops_the_run(endpoint, tmp_path):
    cfg = judged_config(tmp_path, endpoint.url, extra="max_judge_dropped_fraction = 1.0")
    grpo.run(load_config(cfg), SilentReporter())  # every group dropped, none trained, the run goes on
    rows = [r for r in metrics(tmp_path / "out/adapter.metrics.jsonl") if "reward/mean" in r]
    assert rows and all(r["judge/dropped_group_fraction"] == 1.0 for r in rows)
    assert {r["skip_reason"] for r in metrics(tmp_path / "out/adapter.rollouts.jsonl")} == {"judge_dropped"}
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    with pytest.raises(JudgeError, match="max_judge_dropped_fraction = 0.5"):
        grpo.run(load_config(judged_config(stopped, endpoint.url)), SilentReporter())


BAD_JUDGES = [
    ('type = "ruler"\nmodel = "m"', "grpo.judge.base_url is required"),
    ('type = "ruler"\nbase_url = "127.0.0.1:8080"\nmodel = "m"', "is not an http(s):// URL"),
    ('type = "ruler"\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\ncommand = ["x"]', "grpo.judge.command applies to type = 'command', not 'ruler'"),
    ('command = ["x"]\nmodel = "m"', "grpo.judge.model applies to type = 'ruler'"),
    ('type = "ruler"\nbase_url = "http://h/v1"\nmodel = "m"\n[grpo.judge.context]\nmax_message_chars = 9000', "budgets must nest"),
    ('type = "ruler"\nbase_url = "http://h/v1"\nmodel = "m"\n[grpo.judge.compaction]\ntrigger_chars = 500\ntarget_chars = 500\n'
     'keep_last = 1', "grpo.judge.compaction: target_chars (500) must be below trigger_chars (500)"),
    ('type = "ruler"\nbase_url = "http://h/v1"\nmodel = "m"\n[grpo.judge.compaction]\ntrigger_chars = 500\ntarget_chars = 100',
     "grpo.judge.compaction.keep_last is required"),
    ('command = ["x"]\n[grpo.judge.compaction]\ntrigger_chars = 500\ntarget_chars = 100\nkeep_last = 1',
     "grpo.judge.compaction applies to type = 'ruler'"),
]


@pytest.mark.parametrize("table, message", BAD_JUDGES, ids=[b[1] for b in BAD_JUDGES])
def test_judge_config_errors_name_the_key(tmp_path, table, message):
    cfg = write_config(tmp_path, grpo_extra=f"judge_weight = 1.0\n[grpo.judge]\n{table}")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(cfg)
    with pytest.raises(ConfigError, match="grpo.judge_weight is required"):
        load_config(write_config(tmp_path, grpo_extra='[grpo.judge]\ncommand = ["x"]'))


WEIGHING_PROGRAM = """
import json, sys
for line in sys.stdin:
    request = json.loads(line)
    print(json.dumps({"reward": 0.5, "judge_weight": 0.0 if "2" in request["prompt"] else 3.0}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["longer"], indirect=True)
def test_a_reward_program_may_set_the_judge_weight_per_completion(endpoint, tmp_path):
    program = tmp_path / "weigh.py"
    program.write_text(WEIGHING_PROGRAM)
    reward = f'reward_command = ["{sys.executable}", "{program}"]\nreward_mode = "oneshot"'
    cfg = write_config(tmp_path, reward=reward, updates=2, grpo_extra=(
        f'judge_weight = 1.0\n[grpo.judge]\ntype = "ruler"\nbase_url = "{endpoint.url}"\nmodel = "judge"'))
    grpo.run(load_config(cfg), SilentReporter())
    records = metrics(tmp_path / "out/adapter.rollouts.jsonl")
    weighed_zero = [r for r in records if "2" in r["prompt"]]
    assert weighed_zero and all(r["judge_verdict"] is None and r["reward"] == 0.5 for r in weighed_zero)  # never sent
    judged = [r for r in records if "2" not in r["prompt"]]
    assert judged and all(r["reward"] == pytest.approx(0.5 + 3.0 * r["judge_verdict"]) for r in judged)
    assert len(endpoint.bodies) == len({(r["update"], r["group"]) for r in judged})  # one request per judged group


def test_judge_weight_in_a_reply_needs_a_judge_and_a_finite_weight():
    assert _reward_in(b'{"reward": 1, "judge_weight": 2}', {}, "request 1", True) == (1.0, 2.0)
    assert _reward_in(b'{"reward": 1}', {}, "request 1", True) == (1.0, None)
    for line, allowed, message in ((b'{"reward": 1, "judge_weight": 2}', False, "needs a [grpo.judge]"),
                                   (b'{"reward": 1, "judge_weight": -1}', True, "expected a finite number >= 0")):
        with pytest.raises(Exception, match=re.escape(message)):
            _reward_in(line, {}, "request 1", allowed)


@pytest.mark.parametrize("endpoint", ["longer"], indirect=True)
def test_bench_judges_base_and_adapter_samples_in_one_group(endpoint, tmp_path, smollm2):
    cfg = write_grpo(tmp_path)
    cfg.write_text(cfg.read_text().replace("[grpo.sampling]", (
        f'judge_weight = 1.0\n[grpo.judge]\ntype = "ruler"\nbase_url = "{endpoint.url}"\nmodel = "judge"\n[grpo.sampling]')))
    changed = write_adapter_for(smollm2, tmp_path / "changed.gguf", 0.05)
    result = bench.run(load_config(cfg), SilentReporter(), bench.BenchOptions(adapter=changed, samples=2))
    assert len(endpoint.bodies) == len(result.prompts)  # one request per prompt, holding both sides' samples
    assert all(body["messages"][1]["content"].count("[response ") == 4 for body in endpoint.bodies)
    for side in (result.base, result.adapter):
        for sample in (s for prompt in side.samples for s in prompt):
            assert sample.verdict == min(1.0, len(sample.text.strip()) / 40)  # what the scripted judge says
    judge_row = next(r for r in result.rows() if r.group == "judge")
    assert judge_row.adapter == pytest.approx(np.mean([s.verdict for p in result.adapter.samples for s in p]))


@pytest.mark.parametrize("endpoint", ["longer"], indirect=True)
def test_judge_eval_correlates_verdicts_with_labels_and_with_a_second_pass(endpoint, tmp_path):
    """The scripted judge scores by length: a group labelled by length agrees (tau +1), one
    labelled against it disagrees (-1), one with equal labels has no ranking; both passes ask
    the endpoint (the configured cache is not used) and agree with each other."""
    import subprocess

    cfg = judged_config(tmp_path, endpoint.url, extra=f'[grpo.judge.strategy]\nmode = "listwise"')
    cfg.write_text(cfg.read_text().replace('max_retries = 0', f'max_retries = 0\ncache_path = "{tmp_path / "cache.jsonl"}"'))
    fixtures = tmp_path / "labelled.jsonl"
    fixtures.write_text("".join(json.dumps(f) + "\n" for f in [
        {"prompt": TASK, "completions": ["42", "It is 42.", "The sum of 12 and 30 is 42."], "labels": [0, 1, 2]},
        {"prompt": TASK, "completions": ["42", "Forty-two, I believe."], "labels": [1, 0]},
        {"prompt": TASK, "completions": ["42", "It is 42."], "labels": [1, 1]},
    ]))
    out = tmp_path / "agreement.json"
    r = subprocess.run([sys.executable, "-m", "retrograd", "judge", "eval", str(cfg), "--fixtures", str(fixtures), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["vs_labels"] == {"kendall": 0.0, "spearman": pytest.approx(0.0), "groups": 2}  # (+1 - 1) / 2
    assert result["self_consistency"] == {"kendall": 1.0, "spearman": 1.0, "groups": 3}
    assert len(endpoint.bodies) == 6 and not (tmp_path / "cache.jsonl").exists()
    first = result["per_fixture"][0]["verdicts"][0]
    assert first == sorted(first) and result["per_fixture"][0]["verdicts"][1] == first
    assert "verdicts vs labels" in r.stdout and "1 group(s) left out of a row" in r.stdout
    fixtures.write_text(json.dumps({"prompt": TASK, "completions": ["42", "41"], "labels": [1]}) + "\n")
    r = subprocess.run([sys.executable, "-m", "retrograd", "judge", "eval", str(cfg), "--fixtures", str(fixtures)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {fixtures}:1: expected \"labels\": one finite number per " \
        "completion (higher is better)", r.stderr
    sft = Path(__file__).parents[1] / "examples/smoke_tiny_sft.toml"
    r = subprocess.run([sys.executable, "-m", "retrograd", "judge", "eval", str(sft), "--fixtures", str(fixtures)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {sft}: no [grpo.judge] or [agent.judge] to evaluate", r.stderr


def test_rank_correlations_with_ties():
    from retrograd.evaluation.judge_eval import kendall_tau, spearman_rho

    # tau-b by hand: of 6 pairs, x ties one (5 untied in x, 6 in y) and the other 5 are concordant;
    # Spearman's rho is Pearson's r of the average ranks (the tied pair shares rank 2.5)
    x, y = [1, 2, 2, 3], [1, 3, 2, 4]
    assert kendall_tau(x, y) == pytest.approx(5 / np.sqrt(5 * 6))
    assert spearman_rho(x, y) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4], [1, 3, 2, 4])[0, 1])
    assert kendall_tau([1, 1], [1, 2]) is None and spearman_rho([3, 3, 3], [1, 2, 3]) is None
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
