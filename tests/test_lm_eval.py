"""lm-evaluation-harness against `retrograd serve`: its `local-completions` model on a loopback
server (the tokenizer through serve's /tokenize routes, `tokenizer_backend=remote`), with
tasks defined from local JSONL files: a loglikelihood (multiple-choice) task and a
generate_until task. The harness's per-choice log-likelihoods equal the torch forward's
(retrograd.load_model) within the f16 KV cache's noise, and its generations equal the chat
layer's greedy replies. Runs when lm_eval is importable (the test extra installs it)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import uvicorn

from retrograd import load_model
from retrograd.cli.serve import bind
from retrograd.serving.inference import Inference, Settings
from retrograd.serving.serve import create_app

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    {"question": "Is the sky blue?", "choices": ["yes", "no", "green"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin", "Madrid"], "answer": 0},
]
MC_TASK = """task: retrograd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: retrograd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def served(tiny_model):
    """(URL, model path) of a serve app on a loopback port, run by uvicorn in this process."""
    path = tiny_model("llama")
    with Inference(path, n_ctx=256, n_threads=2) as inference, bind("127.0.0.1", 0) as sock:
        app = create_app(inference, api_key=None, max_request_bytes=1 << 20, max_queue=16)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.time() + 60
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}", path
        finally:
            server.should_exit = True
            thread.join(timeout=60)


@pytest.mark.slow  # ~12 s on 2 cores: lm-eval's harness against a live serve
def test_the_harness_scores_local_tasks_through_serve(served, tmp_path, monkeypatch):
    url, path = served
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=data))
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=data))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{url}/v1/completions", "model": "base", "tokenizer_backend": "remote",
                    "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1},
        tasks=["retrograd_mc", "retrograd_gen"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
    )
    model = load_model(path, weights="f32")
    tokenizer = model.tokenizer

    def loglikelihood(context: str, continuation: str) -> float:
        """As the harness splits a request: the context's tokens, then the rest of the whole's."""
        whole = tokenizer.encode(context + continuation, add_bos=False)
        n = len(tokenizer.encode(context, add_bos=False))
        with torch.no_grad():
            logp = model.logits(whole).double().log_softmax(-1)
        return sum(float(logp[i - 1, whole[i]]) for i in range(n, len(whole)))

    samples = results["samples"]["retrograd_mc"]
    assert len(samples) == len(results["samples"]["retrograd_gen"]) == len(QUESTIONS)
    correct = []
    for sample in samples:
        doc = sample["doc"]
        harness = [float(r[0][0]) for r in sample["resps"]]
        ours = [loglikelihood(doc["question"], " " + choice) for choice in doc["choices"]]
        assert harness == pytest.approx(ours, abs=2e-2), (doc, harness, ours)
        correct.append(max(range(len(ours)), key=ours.__getitem__) == doc["answer"])
    assert results["results"]["retrograd_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))

    with Inference(path, n_ctx=256, n_threads=2) as chat_layer:
        for sample in results["samples"]["retrograd_gen"]:
            prompt = tokenizer.encode(sample["doc"]["question"], add_bos=False)
            expected = chat_layer.generate("base", prompt, Settings(max_tokens=6, stop=("\n",))).run()
            assert sample["resps"][0][0] == expected
