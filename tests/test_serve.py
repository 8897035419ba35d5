"""`retrograd serve` as a user runs it: a subprocess on a free port of 127.0.0.1, spoken to
by the official `openai` client and by httpx for raw requests. Its answers are the chat
layer's (retrograd.inference in this process) for the base and for the adapter."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from lora_files import random_adapter

from retrograd.cli.serve import named_adapters
from retrograd.errors import ConfigError
from retrograd.inference import BASE, Inference, Settings

N_CTX = 512
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def adapter(smollm2, tmp_path_factory) -> Path:
    return random_adapter(smollm2, tmp_path_factory.mktemp("serve") / "tuned.gguf")


@pytest.fixture(scope="module")
def local(smollm2, adapter):
    with Inference(smollm2, {"tuned": adapter}, n_ctx=N_CTX, n_threads=2) as inf:
        yield inf


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "retrograd", "serve", "--ctx", str(N_CTX), "--threads", "2", *args]


@pytest.fixture(scope="module")
def server(adapter):
    """The base URL (…/v1) of a running `retrograd serve --port 0 --adapter PATH`."""
    process = subprocess.Popen(
        serve_command("--port", "0", "--adapter", str(adapter)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("serving base, tuned at http://127.0.0.1:"), (
            line,
            process.stderr.read() if not line else "",
        )
        yield line.split(" at ")[1].split()[0]
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=30) == 130 and "Traceback" not in process.stderr.read()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def expected(local: Inference, name: str, prompt: list[int], max_tokens: int):
    generation = local.generate(name, prompt, Settings(max_tokens=max_tokens))
    generation.run()
    return generation


def test_models_are_the_base_and_each_adapter_by_file_stem(client):
    assert [m.id for m in client.models.list()] == [BASE, "tuned"]


def test_chat_completions_answer_as_the_chat_layer_for_base_and_adapter(client, local):
    prompt = local.chat_prompt(QUESTION)
    answers = {}
    for name in (BASE, "tuned"):
        want = expected(local, name, prompt, 12)
        reply = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=12, temperature=0)
        choice = reply.choices[0]
        assert (choice.message.role, choice.message.content, choice.finish_reason) == (
            "assistant",
            want.text,
            want.finish_reason,
        )
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), want.completion_tokens)
        assert reply.model == name
        answers[name] = choice.message.content
    assert answers[BASE] != answers["tuned"]
    assert {want.finish_reason for want in (expected(local, n, prompt, 12) for n in (BASE, "tuned"))} == {
        "length",
        "stop",
    }


def test_streamed_chat_is_the_same_reply_in_pieces_with_usage(client, local):
    want = expected(local, "tuned", local.chat_prompt(QUESTION), 12)
    chunks = list(
        client.chat.completions.create(
            model="tuned",
            messages=QUESTION,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.completion_tokens


def test_text_completions_plain_and_streamed(client, local):
    text = "The capital of France is"
    want = expected(local, "tuned", local.text_prompt(text), 8)
    reply = client.completions.create(model="tuned", prompt=text, max_tokens=8, temperature=0)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (want.text, want.finish_reason)
    assert reply.usage.prompt_tokens == len(local.text_prompt(text))
    streamed = client.completions.create(model="tuned", prompt=text, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_raw_stream_ends_with_done_and_a_dropped_stream_frees_the_model(server, local):
    body = {"model": "tuned", "messages": QUESTION, "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/chat/completions", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[0])["object"] == "chat.completion.chunk"
    base = body | {"model": BASE}
    with httpx.stream("POST", f"{server}/chat/completions", json=base | {"max_tokens": 400}, timeout=120) as response:
        next(response.iter_lines())  # the client goes away after the first event; the base would talk on
    again = httpx.post(f"{server}/chat/completions", json=base | {"stream": False}, timeout=120)
    assert (
        again.json()["choices"][0]["message"]["content"] == expected(local, BASE, local.chat_prompt(QUESTION), 12).text
    )


BAD_REQUESTS = [
    ("not json", b"{bad", 400, None),
    ("no messages", {"model": "base"}, 400, "messages"),
    ("empty messages", {"model": "base", "messages": []}, 400, "messages"),
    ("unknown model", {"model": "gpt-4", "messages": QUESTION}, 404, "model"),
    ("string max_tokens", {"model": "base", "messages": QUESTION, "max_tokens": "5"}, 400, "max_tokens"),
    ("n > 1", {"model": "base", "messages": QUESTION, "n": 2}, 400, "n"),
    ("unknown field", {"model": "base", "messages": QUESTION, "tools": []}, 400, "tools"),
    ("bad role", {"model": "base", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("prompt too long", {"model": "base", "messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
]


@pytest.mark.parametrize(
    "body, status, param", [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS]
)
def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    response = httpx.post(f"{server}/chat/completions", timeout=60, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert httpx.get(f"{server}/models", timeout=60).status_code == 200


def test_a_body_that_is_not_json_names_the_content_type(server):
    response = httpx.post(f"{server}/chat/completions", content=b"model=base", timeout=60,
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 400 and "Content-Type: application/json" in response.json()["error"]["message"]


def test_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        client.chat.completions.create(model=BASE, messages=QUESTION, n=2)


def test_a_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            serve_command("--port", str(port)), check=False, capture_output=True, text=True, timeout=120
        )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == f"error: --port {port}: 127.0.0.1:{port} is in use\n"


def test_an_adapter_name_clash_is_refused(adapter):
    run = subprocess.run(
        serve_command("--adapter", f"base={adapter}"), check=False, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "the model name 'base' is the base" in run.stderr


def test_ctrl_c_mid_reply_stops_the_server_cleanly(adapter):
    process = subprocess.Popen(serve_command("--port", "0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().split(" at ")[1].split()[0]
        body = {"model": BASE, "messages": QUESTION, "max_tokens": 400, "temperature": 0, "stream": True}
        rest = []
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            next(lines)  # the reply has started
            process.send_signal(signal.SIGINT)  # Ctrl-C while the model is generating
            with contextlib.suppress(httpx.RemoteProtocolError):  # the server may cut the stream as it goes
                rest += lines
        assert "data: [DONE]" not in rest  # stopped, not finished
        assert process.wait(timeout=60) == 130  # the generation stopped and the model was freed: no crash
        assert "Traceback" not in process.stderr.read()
    finally:
        process.kill()


def test_adapters_are_named_by_stem_or_name_equals_path(tmp_path):
    first, second = tmp_path / "math.gguf", tmp_path / "a=b.gguf"
    second.touch()  # an existing path with "=" in it is a path, not NAME=PATH
    assert named_adapters([str(first), f"old={first}", str(second)]) == {"math": first, "old": first, "a=b": second}
    with pytest.raises(ConfigError, match="'math' is taken"):
        named_adapters([str(first), str(first)])
