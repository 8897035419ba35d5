"""`retrograd eval`: task files (and their errors, file:line), each choice's and each text's
score against the transformer's own logits, the paired bootstrap's verdicts, generation tasks
answered by llama.cpp and scored by a reward program, and the command end to end on a random
model with an adapter."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from lora_files import random_adapter

from retrograd import load_model
from retrograd.errors import DataError
from retrograd.evaluation.tasks import load_tasks, paired_difference, score_task
from retrograd.recipes.common import model_chat
from retrograd.runtime.bundled import default_model_path

RETROGRAD = [sys.executable, "-m", "retrograd"]
MC = [{"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
      {"question": "Two plus two is", "choices": ["five", "four"], "answer": "four"}]
TEXTS = [{"text": "The quick brown fox jumps over the lazy dog."}, {"text": "Once upon a time there was a fisherman."}]
PROMPTS = [{"messages": [{"role": "user", "content": "Count to three."}]},
           {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "blue"}]},
           {"messages": [{"role": "user", "content": "Say something short."}]}]
REWARDS = '''
def length(prompts, completions, **_):
    """Each answer's length in characters: differs for any change in what was sampled."""
    return [float(len(c)) for c in completions]
'''


@pytest.fixture(scope="module")
def chat():
    return model_chat(default_model_path())


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_scores_are_the_transformers_log_probs(tmp_path, tiny_model, chat):
    model = load_model(tiny_model("llama"), weights="f32")
    tok = model.tokenizer
    write(tmp_path / "mc.jsonl", MC)
    write(tmp_path / "text.jsonl", TEXTS)
    mc, text = load_tasks(tmp_path, chat)
    assert (mc.name, mc.kind, text.kind) == ("mc", "multiple_choice", "perplexity") and mc.items[1].answer == 1
    for budget in (4096, 16):  # one micro-batch; prompts shared across split ones
        scores = score_task(model, mc, budget, "cpu", lambda n: None)
        for item, sums in zip(mc.items, scores.detail):
            context = tok.encode(item.question)
            for choice, got in zip(item.choices, sums):
                whole = tok.encode(item.question + " " + choice)
                with torch.no_grad():
                    logp = model.logits(whole).double().log_softmax(-1)
                expected = sum(float(logp[i - 1, whole[i]]) for i in range(len(context), len(whole)))
                assert got == pytest.approx(expected, abs=1e-3)
        assert scores.metrics["accuracy"] == np.mean([int(np.argmax(s)) == i.answer for s, i in zip(scores.detail, mc.items)])
    scores = score_task(model, text, 4096, "cpu", lambda n: None)
    ids = tok.encode(TEXTS[0]["text"])
    with torch.no_grad():
        logp = model.logits(ids).double().log_softmax(-1)
    nll = -sum(float(logp[i - 1, ids[i]]) for i in range(1, len(ids)))
    assert scores.detail[0] == (pytest.approx(nll, abs=1e-3), len(ids) - 1)
    total_nll = sum(d[0] for d in scores.detail)
    assert scores.metrics["perplexity"] == pytest.approx(np.exp(total_nll / sum(d[1] for d in scores.detail)))


def test_paired_bootstrap_verdicts():
    base = np.zeros(40)
    assert paired_difference(base, np.ones(40)).verdict == "better"
    assert paired_difference(base, -np.ones(40)).verdict == "worse"
    noise = np.random.default_rng(0).normal(size=40)
    d = paired_difference(base, noise - noise.mean())
    assert d.verdict == "no detectable change" and d.low < 0 < d.high and d.mean == pytest.approx(0, abs=1e-12)
    flipped = np.array([1.0] * 20 + [0.0] * 20)  # 3 of 40 answers change, all for the better: too few to tell
    assert paired_difference(flipped, np.where(np.arange(40) < 23, 1.0, 0.0)).verdict == "no detectable change"


@pytest.mark.parametrize("record, needle", [
    ({"question": "q", "choices": ["a"], "answer": 0}, "two or more non-empty strings"),
    ({"question": "q", "choices": ["a", "b"], "answer": 2}, "expected an index into choices"),
    ({"question": "q", "choices": ["a", "b"], "answer": "c"}, "expected an index into choices"),
    ({"text": ""}, "\"text\" must be a non-empty string"),
    ({"prompt": "x"}, "expected a multiple-choice record"),
])
def test_malformed_records_name_their_line(tmp_path, record, needle, chat):
    path = write(tmp_path / "t.jsonl", [MC[0], record])
    with pytest.raises(DataError, match=f"{path}:2: .*{needle}"):
        load_tasks(path, chat)


def test_mixed_kinds_and_missing_files_are_refused(tmp_path, chat):
    with pytest.raises(DataError, match="mixes multiple-choice and text records"):
        load_tasks(write(tmp_path / "t.jsonl", [MC[0], TEXTS[0]]), chat)
    with pytest.raises(DataError, match="t.jsonl:2: "):  # a prompts file is read as training reads one
        load_tasks(write(tmp_path / "t.jsonl", [PROMPTS[0], {"messages": "hi"}]), chat)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no \\*.jsonl files"):
        load_tasks(tmp_path / "empty", chat)


def test_the_command_compares_base_and_adapters(tmp_path, tiny_model):
    base = tiny_model("llama")
    adapter = random_adapter(base, tmp_path / "tuned.gguf", scale=0.5)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write(tasks / "mc.jsonl", MC)
    write(tasks / "text.jsonl", TEXTS)
    out = tmp_path / "eval.json"
    r = subprocess.run([*RETROGRAD, "eval", "--model", str(base), "--adapter", str(adapter), "--tasks", str(tasks),
                        "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "perplexity" in r.stdout and "accuracy" in r.stdout and "95% CI" in r.stdout
    results = json.loads(out.read_text())
    assert set(results) == {"mc", "text"} and set(results["mc"]["metrics"]) == {"base", "tuned"}
    d = results["text"]["differences"]["tuned"]
    assert d["low"] <= d["mean"] <= d["high"] and d["verdict"] in ("better", "worse", "no detectable change")
    assert len(results["mc"]["per_item"]) == 2 and results["mc"]["per_item"][0]["source"].endswith("mc.jsonl:1")
    bad = write(tmp_path / "bad.jsonl", [{"question": "q"}])
    r = subprocess.run([*RETROGRAD, "eval", "--model", str(base), "--tasks", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {bad}:1: expected a multiple-choice record " \
        '{"question", "choices", "answer"}, a text record {"text"} or a generation record {"prompt"} / {"messages"}', r.stderr


def evaluation_table(page: str) -> list[list[str]]:
    """The cells of the report's evaluation table, row by row, as text."""
    import html
    import re

    table = page.split('<table id="evaluation">')[1].split("</table>")[0]
    return [[" ".join(html.unescape(re.sub(r"<[^>]+>", "", cell)).split()) for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)]


def eval_generation(tmp_path, base, *args) -> subprocess.CompletedProcess:
    (tmp_path / "rewards.py").write_text(REWARDS)
    return subprocess.run([*RETROGRAD, "eval", "--model", str(base), "--tasks", str(write(tmp_path / "gen.jsonl", PROMPTS)),
                           "--reward-function", f"{tmp_path / 'rewards.py'}:length", "--max-new-tokens", "6",
                           "--samples", "2", *args], capture_output=True, text=True)


def test_generation_tasks_are_answered_with_paired_seeds_and_scored_by_the_reward(tmp_path, tiny_model):
    """An adapter that changes nothing (B = 0) gets the same answers, so Δ is 0 exactly; a real
    one gets its own; each recorded reward is the reward of the recorded answer."""
    base = tiny_model("llama")
    silent = random_adapter(base, tmp_path / "silent.gguf", scale=0.0)
    tuned = random_adapter(base, tmp_path / "tuned.gguf", scale=2.0)
    out = tmp_path / "eval.json"
    r = eval_generation(tmp_path, base, "--adapter", str(silent), "--adapter", str(tuned), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "mean reward" in r.stdout and "reward), 95% CI" in r.stdout
    result = json.loads(out.read_text())["gen"]
    assert result["kind"] == "generation" and result["items"] == 3
    assert result["differences"]["silent"] == {"mean": 0.0, "low": 0.0, "high": 0.0, "verdict": "no detectable change"}
    items = result["per_item"]
    for item in items:
        for name in ("base", "silent", "tuned"):
            assert len(item[name]["answers"]) == 2 and item[name]["rewards"] == [float(len(a)) for a in item[name]["answers"]]
        assert item["silent"] == item["base"]
    assert any(item["tuned"]["answers"] != item["base"]["answers"] for item in items)
    means = [np.mean(item["base"]["rewards"]) for item in items]
    assert result["metrics"]["base"]["mean reward"] == pytest.approx(np.mean(means))
    assert eval_generation(tmp_path, base, "--out", str(tmp_path / "again.json")).returncode == 0
    again = json.loads((tmp_path / "again.json").read_text())["gen"]["per_item"]
    assert [i["base"] for i in again] == [i["base"] for i in items]  # the same seeds give the same answers


def test_a_generation_task_without_a_reward_is_one_line(tmp_path, tiny_model):
    r = subprocess.run([*RETROGRAD, "eval", "--model", str(tiny_model("llama")),
                        "--tasks", str(write(tmp_path / "gen.jsonl", PROMPTS))], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: gen: a generation task needs a reward program to score its answers "
        "(retrograd eval --reward-function module:function or --reward-command CMD)"), r.stderr


def test_evaluation_tasks_run_after_training_and_a_bad_one_stops_it_first(tmp_path, tiny_model):
    examples = __import__("pathlib").Path(__file__).parents[1] / "examples"
    (tmp_path / "train.jsonl").write_text("".join((examples / "data/arithmetic_train.jsonl").read_text().splitlines(True)[:8]))
    write(tmp_path / "mc.jsonl", MC)
    cfg = tmp_path / "sft.toml"
    cfg.write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{tiny_model("llama")}"
[output]
path = "out/run.gguf"
[training]
ctx = 96
micro_batch = 256
epochs = 1
threads = 2
[sft]
data = "train.jsonl"
[evaluation]
data = "train.jsonl"
tasks = ["mc.jsonl"]
""")
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "evaluation tasks: mc, base and adapter" in r.stdout and "95% CI" in r.stdout
    results = json.loads((tmp_path / "out/run.eval.json").read_text())
    assert set(results["mc"]["metrics"]) == {"base", "adapter"}
    d = results["mc"]["differences"]["adapter"]
    table = evaluation_table((tmp_path / "out/run.report.html").read_text())  # the report shows the paired table
    assert table[0] == ["task", "metric", "base", "adapter"]
    first = next(iter(results["mc"]["metrics"]["base"]))
    assert table[1] == ["mc (multiple_choice, 2 items)", first, *(f"{results['mc']['metrics'][m][first]:.4f}" for m in ("base", "adapter"))]
    assert table[-1] == ["", "Δ, 95% interval", "", f"{d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}] {d['verdict']}"]

    # retrograd eval --run adds other tasks to the run's report (the adapter named by its file)
    write(tmp_path / "text.jsonl", TEXTS)
    r = subprocess.run([*RETROGRAD, "eval", "--model", str(tiny_model("llama")), "--adapter", str(tmp_path / "out/run.gguf"),
                        "--tasks", str(tmp_path / "text.jsonl"), "--run", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"report: {tmp_path / 'out/run.report.html'}" in r.stdout
    table = evaluation_table((tmp_path / "out/run.report.html").read_text())
    assert table[0] == ["task", "metric", "base", "run"] and table[1][0] == "text (perplexity, 2 items)"
    r = subprocess.run([*RETROGRAD, "eval", "--model", str(tiny_model("llama")), "--tasks", str(tmp_path / "text.jsonl"),
                        "--run", str(tmp_path / "nowhere")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {tmp_path / 'nowhere'}: no such file or folder") \
        and len(r.stderr.strip().splitlines()) == 1, r.stderr

    write(tmp_path / "mc.jsonl", [MC[0], {"question": "q", "choices": ["a", "b"], "answer": 7}])
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and f"{tmp_path / 'mc.jsonl'}:2:" in r.stderr and "Traceback" not in r.stderr

    write(tmp_path / "mc.jsonl", MC)
    write(tmp_path / "gen.jsonl", PROMPTS)
    cfg.write_text(cfg.read_text().replace('tasks = ["mc.jsonl"]', 'tasks = ["gen.jsonl"]'))
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "evaluation.tasks: gen is a generation task, scored by a reward program, and a sft run " \
        "has none" in r.stderr and "Traceback" not in r.stderr


def test_a_grpo_run_scores_generation_tasks_with_its_own_reward(tmp_path, tiny_model):
    examples = __import__("pathlib").Path(__file__).parents[1] / "examples"
    (tmp_path / "prompts.jsonl").write_text((examples / "data/smoke_rl_prompts.jsonl").read_text())
    (tmp_path / "rewards.py").write_text(REWARDS)
    write(tmp_path / "gen.jsonl", PROMPTS)
    cfg = tmp_path / "grpo.toml"
    cfg.write_text(f"""
[run]
algorithm = "grpo"
[model]
path = "{tiny_model("llama")}"
[output]
path = "out/run.gguf"
[training]
ctx = 96
micro_batch = 256
lr = 1e-3
threads = 2
[grpo]
prompts = "prompts.jsonl"
reward_function = "{tmp_path / "rewards.py"}:length"
updates = 1
prompts_per_update = 2
group_size = 2
grpo_epochs = 1
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = 0.0
[grpo.sampling]
max_new_tokens = 6
[evaluation]
data = "prompts.jsonl"
tasks = ["gen.jsonl"]
""")
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out/run.eval.json").read_text())["gen"]
    assert set(result["metrics"]) == {"base", "adapter"} and "mean reward" in result["metrics"]["adapter"]
    for item in result["per_item"]:
        assert len(item["adapter"]["answers"]) == 1
        assert item["adapter"]["rewards"] == [float(len(a)) for a in item["adapter"]["answers"]]


def test_the_reports_evaluation_table_leaves_out_what_eval_does_not_write(tmp_path):
    from retrograd.reports.run_report import evaluation_rows

    good = {"kind": "perplexity", "items": 2, "metrics": {"base": {"perplexity": 9.5}, "run": {"perplexity": 8.25}},
            "differences": {"run": {"mean": 0.1, "low": -0.2, "high": 0.4, "verdict": "no detectable change"}}}
    path = tmp_path / "run.eval.json"
    path.write_text(json.dumps({"text": good, "nan": good | {"metrics": {"base": {"perplexity": "9"}, "run": {"perplexity": 1}}},
                                "other models": good | {"metrics": {"base": {"perplexity": 9}, "x": {"perplexity": 1}}, "differences": {}},
                                "unknown adapter": good | {"differences": {"y": good["differences"]["run"]}}}))
    rows, skipped = evaluation_rows(path)
    assert [r["task"] for r in rows] == ["text"] and skipped == 3
    assert rows[0]["models"] == ["base", "run"] and rows[0]["metrics"] == [{"name": "perplexity", "values": [9.5, 8.25]}]
    path.write_text('{"text": ')  # cut short
    assert evaluation_rows(path) == ([], 1)
    assert evaluation_rows(tmp_path / "none.json") == ([], 0)
