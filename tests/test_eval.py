"""`retrograd eval`: task files (and their errors, file:line), each choice's and each text's
score against the transformer's own logits, the paired bootstrap's verdicts, and the command
end to end on a random model with an adapter."""

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

RETROGRAD = [sys.executable, "-m", "retrograd"]
MC = [{"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
      {"question": "Two plus two is", "choices": ["five", "four"], "answer": "four"}]
TEXTS = [{"text": "The quick brown fox jumps over the lazy dog."}, {"text": "Once upon a time there was a fisherman."}]


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_scores_are_the_transformers_log_probs(tmp_path, tiny_model):
    model = load_model(tiny_model("llama"), weights="f32")
    tok = model.tokenizer
    write(tmp_path / "mc.jsonl", MC)
    write(tmp_path / "text.jsonl", TEXTS)
    mc, text = load_tasks(tmp_path)
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
def test_malformed_records_name_their_line(tmp_path, record, needle):
    path = write(tmp_path / "t.jsonl", [MC[0], record])
    with pytest.raises(DataError, match=f"{path}:2: .*{needle}"):
        load_tasks(path)


def test_mixed_kinds_and_missing_files_are_refused(tmp_path):
    with pytest.raises(DataError, match="mixes multiple-choice and text records"):
        load_tasks(write(tmp_path / "t.jsonl", [MC[0], TEXTS[0]]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no \\*.jsonl files"):
        load_tasks(tmp_path / "empty")


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
        '{"question", "choices", "answer"} or a text record {"text"}', r.stderr


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

    write(tmp_path / "mc.jsonl", [MC[0], {"question": "q", "choices": ["a", "b"], "answer": 7}])
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and f"{tmp_path / 'mc.jsonl'}:2:" in r.stderr and "Traceback" not in r.stderr
