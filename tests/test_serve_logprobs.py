"""Log-probabilities from `retrograd serve`: /v1/completions' `logprobs` and `echo` (OpenAI's
legacy shape; `echo` with `max_tokens: 0` scores a prompt alone, as lm-evaluation-harness
asks) and chat's `logprobs` / `top_logprobs`, per model name, at the request's temperature,
whole or streamed (the chunks' entries joined are the whole reply's).
The values are checked against llama.cpp's own logits for the same tokens, computed apart
(llama-cpp-python, one batch, the same f16 KV cache) on a random F32 model."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from llama_ref import llama_logits
from lora_files import random_adapter

from retrograd.serving.inference import MAX_TOP_LOGPROBS, Inference
from retrograd.serving.serve import create_app

PROMPT = [1, 17, 29, 5, 88, 41, 7, 63, 12, 90, 3]
TOLERANCE = 1e-4  # nats: the same model, weights and KV cache, a prompt scored in other batches
STEP_TOLERANCE = 5e-4  # a reply decoded one token at a time against one batch: up to 1.9e-4 seen


@pytest.fixture(scope="module")
def tiny(tiny_model, tmp_path_factory):
    path = tiny_model("llama")
    return path, random_adapter(path, tmp_path_factory.mktemp("logprobs") / "tuned.gguf")


@pytest.fixture(scope="module")
def client(tiny):
    path, adapter = tiny
    with Inference(path, {"tuned": adapter}, n_ctx=256, n_threads=2) as inference:
        app = create_app(inference, api_key=None, max_request_bytes=1 << 20, max_queue=4)
        with TestClient(app) as http:
            yield http


def reference(path, ids: list[int], temperature: float = 1.0, lora=None) -> torch.Tensor:
    """llama.cpp's log-probs [len(ids), V] at each position, at `temperature`."""
    return (llama_logits(path, ids, lora_path=lora, kv_f32=False, flash_attn=True).double() / temperature).log_softmax(-1)


def completion(client, **body) -> dict:
    response = client.post("/v1/completions", json={"model": "base", "prompt": PROMPT} | body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@pytest.mark.parametrize("model", ["base", "tuned"])
def test_an_echoed_prompt_is_scored_as_llama_cpp_scores_it(client, tiny, model):
    path, adapter = tiny
    choice = completion(client, model=model, echo=True, max_tokens=0, logprobs=5)
    lp = choice["logprobs"]
    expected = reference(path, PROMPT, lora=adapter if model == "tuned" else None)
    assert len(lp["tokens"]) == len(PROMPT) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i, token in enumerate(PROMPT[1:], 1):
        assert lp["token_logprobs"][i] == pytest.approx(float(expected[i - 1, token]), abs=TOLERANCE)
        best = expected[i - 1].topk(5)
        assert list(lp["top_logprobs"][i].values()) == pytest.approx(best.values.tolist(), abs=TOLERANCE)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"] == "".join(lp["tokens"]) and choice["finish_reason"] == "length"


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_reply_tokens_carry_their_log_probs_at_the_request_temperature(client, tiny, temperature):
    path, _ = tiny
    choice = completion(client, max_tokens=6, logprobs=3, temperature=temperature, seed=5)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 6
    # the reply's token ids: re-scored from the prompt plus what was sampled, one at a time
    ids = list(PROMPT)
    expected = None
    for i in range(6):
        expected = reference(path, ids, temperature or 1.0)
        top = lp["top_logprobs"][i]
        assert list(top.values()) == pytest.approx(expected[-1].topk(3).values.tolist(), abs=STEP_TOLERANCE)
        gaps = (expected[-1] - lp["token_logprobs"][i]).abs()
        sampled = int(gaps.argmin())  # the token whose reference log-prob this is
        assert gaps[sampled] < STEP_TOLERANCE
        if temperature == 0:
            assert lp["token_logprobs"][i] == pytest.approx(max(top.values()), abs=1e-12)  # greedy takes the best
        ids.append(sampled)
    assert lp["text_offset"][0] == len(client.post("/v1/completions", json={
        "model": "base", "prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 0}).json()["choices"][0]["text"])


def test_chat_logprobs_have_openai_shape(smollm2):
    with Inference(smollm2, n_ctx=256, n_threads=2) as inference, \
            TestClient(create_app(inference, api_key=None, max_request_bytes=1 << 20, max_queue=4)) as http:
        body = {"model": "base", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}
        reply = http.post("/v1/chat/completions", json=body).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    text = b"".join(bytes(entry["bytes"]) for entry in content).decode()
    assert text == reply["choices"][0]["message"]["content"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]


def streamed(http, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed reply (the data events before [DONE])."""
    response = http.post(path, json=body | {"stream": True})
    assert response.status_code == 200, response.text
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("echo, max_tokens", [(False, 6), (True, 4), (True, 0)])
def test_streamed_completion_chunks_carry_the_whole_replys_log_probs(client, echo, max_tokens):
    body = {"model": "tuned", "prompt": PROMPT, "max_tokens": max_tokens, "logprobs": 3, "temperature": 0.8, "seed": 11,
            "echo": echo}
    whole = completion(client, **body)
    chunks = [c["choices"][0] for c in streamed(client, "/v1/completions", body)]
    assert "".join(c["text"] for c in chunks) == whole["text"] and chunks[-1]["finish_reason"] == whole["finish_reason"]
    # the same tokens; the values within TOLERANCE: the second request reuses the first one's
    # prompt KV, so its last prompt token is computed in another batch
    for field in ("tokens", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][field]] == whole["logprobs"][field], field
    joined = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert joined == pytest.approx(whole["logprobs"]["token_logprobs"], abs=TOLERANCE)
    tops = [v for c in chunks for v in c["logprobs"]["top_logprobs"]]
    assert [t and list(t) for t in tops] == [t and list(t) for t in whole["logprobs"]["top_logprobs"]]
    assert [v for t in tops if t for v in t.values()] == pytest.approx(
        [v for t in whole["logprobs"]["top_logprobs"] if t for v in t.values()], abs=TOLERANCE)
    for c in chunks:  # each chunk's entries spell its own text (where no token splits a character)
        spelled = "".join(c["logprobs"]["tokens"])
        assert spelled == c["text"] or "\ufffd" in spelled


def test_streamed_chat_chunks_carry_the_whole_replys_log_probs(smollm2):
    body = {"model": "base", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12,
            "temperature": 0.7, "seed": 3, "logprobs": True, "top_logprobs": 2, "stop": ["blue"]}
    with Inference(smollm2, n_ctx=256, n_threads=2) as inference, \
            TestClient(create_app(inference, api_key=None, max_request_bytes=1 << 20, max_queue=4)) as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        chunks = [c["choices"][0] for c in streamed(http, "/v1/chat/completions", body)]
    assert "".join(c["delta"].get("content", "") for c in chunks) == whole["message"]["content"]
    joined = [e for c in chunks for e in c["logprobs"]["content"]]
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in joined] == \
        [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in whole["logprobs"]["content"]]
    assert [v for e in joined for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))] == pytest.approx(
        [v for e in whole["logprobs"]["content"] for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))],
        abs=TOLERANCE)
    assert len(whole["logprobs"]["content"]) > 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs"),
])
def test_logprob_requests_beyond_the_bounds_are_400s(client, path, body, param):
    response = client.post(path, json={"model": "base"} | body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_tokenizer_routes_are_the_models_tokenizer(client, tiny):
    from retrograd.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny[0])
    text = "Hello, world: ¿qué tal?"
    tokens = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert tokens == tokenizer.encode(text, add_bos=False)
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == text
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.piece(tokenizer.eos_id).decode()
    assert client.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
