"""`retrograd serve` as a user runs it: a subprocess on a free port of 127.0.0.1, spoken to
by the official `openai` client and by httpx for raw requests. Its answers are the chat
layer's (retrograd.serving.inference in this process) for the base and for the adapter. Where a test
must see inside (the generations a request made), the app runs in this process instead,
still over HTTP on loopback and on the real model."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from imports import run_noting_import
from lora_files import random_adapter

from retrograd.cli.serve import MAX_QUEUE, MAX_REQUEST_BYTES, bind, named_adapters
from retrograd.errors import ConfigError
from retrograd.runtime.http_guard import API_KEY_ENV
from retrograd.serving.inference import BASE, Generation, Inference, Settings
from retrograd.serving.serve import DEFAULT_MAX_TOKENS, INTERNAL_ERROR, MAX_STOP_CHARACTERS, create_app

N_CTX = 512
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # the base counts on to any budget
KEY = "key-of-issue-22"
SMALL_BODIES = 65536


@pytest.fixture(scope="module")
def adapter(smollm2, tmp_path_factory) -> Path:
    return random_adapter(smollm2, tmp_path_factory.mktemp("serve") / "tuned.gguf")


@pytest.fixture(scope="module")
def local(smollm2, adapter):
    with Inference(smollm2, {"tuned": adapter}, n_ctx=N_CTX, n_threads=2) as inf:
        yield inf


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "retrograd", "serve", "--ctx", str(N_CTX), "--threads", "2", *args]


def without_key(**extra: str) -> dict[str, str]:
    """This process's environment without $RETROGRAD_API_KEY, plus `extra`."""
    return {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | extra


@contextlib.contextmanager
def running(*args: str, env: dict[str, str]):
    """The base URL (…/v1) of `retrograd serve --port 0 ARGS` while it runs; Ctrl-C after."""
    process = subprocess.Popen(
        serve_command("--port", "0", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = process.stdout.readline()
        assert " at http://127.0.0.1:" in line, (line, process.stderr.read() if not line else "")
        yield line.split(" at ")[1].split()[0]
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=30) == 130 and "Traceback" not in process.stderr.read()


@pytest.fixture(scope="module")
def server(adapter):
    """The base URL of a running `retrograd serve --port 0 --adapter PATH`, with the defaults."""
    with running("--adapter", str(adapter), env=without_key()) as url:
        yield url


@pytest.fixture(scope="module")
def limited():
    """The base URL of a server that wants $RETROGRAD_API_KEY's key, takes bodies of at most
    SMALL_BODIES bytes and lets one request wait while one generates."""
    args = ("--max-request-bytes", str(SMALL_BODIES), "--max-queue", "1")
    with running(*args, env=without_key(**{API_KEY_ENV: KEY})) as url:
        yield url


@dataclass(frozen=True)
class InProcess:
    url: str
    inference: Inference


@pytest.fixture(scope="module")
def in_process(smollm2):
    """create_app over a real Inference (a context with room for DEFAULT_MAX_TOKENS), served
    by uvicorn on a loopback port from a thread of this process, so a test can see inside."""
    with Inference(smollm2, n_ctx=2 * DEFAULT_MAX_TOKENS, n_threads=2) as inference, bind("127.0.0.1", 0) as sock:
        app = create_app(inference, api_key=None, max_request_bytes=MAX_REQUEST_BYTES, max_queue=MAX_QUEUE)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            eventually(lambda: server.started, "the server started")
            yield InProcess(f"http://127.0.0.1:{sock.getsockname()[1]}/v1", inference)
        finally:
            server.should_exit = True
            thread.join(timeout=60)
            app.state.closing.set()
            with app.state.lock:  # a generation still running ends before the model is freed
                pass


@pytest.fixture
def made(in_process, monkeypatch) -> list[Generation]:
    """Every generation the in-process server makes during the test, in order."""
    made, generate = [], in_process.inference.generate

    def recorded(*args, **kwargs) -> Generation:
        made.append(generate(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(in_process.inference, "generate", recorded)
    return made


def eventually(condition, what: str) -> None:
    """Waits for `condition` (a guard against hanging, not a timing claim)."""
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


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
    ("unknown field", {"model": "base", "messages": QUESTION, "functions": []}, 400, "functions"),
    ("bad role", {"model": "base", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("prompt too long", {"model": "base", "messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ("stops too long", {"model": "base", "messages": QUESTION, "stop": ["x", "y" * MAX_STOP_CHARACTERS]}, 400, "stop"),
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


# ---- under abuse: stop strings, sizes, disconnects, the queue, the key, internal errors


def test_a_stop_string_cuts_the_reply_as_the_chat_layer_does(client, local):
    prompt = local.chat_prompt(QUESTION)
    whole = expected(local, BASE, prompt, 12).text
    stop = whole[len(whole) // 3 :][:6]  # from the middle of the reply: likely across a token boundary
    want = local.generate(BASE, prompt, Settings(max_tokens=12, stop=(stop,)))
    assert want.run() == whole[: whole.index(stop)] and want.finish_reason == "stop"
    reply = client.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=12, temperature=0, stop=[stop])
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (want.text, "stop")


def test_a_body_over_the_default_bound_gets_413_unread(server):
    body = b"{" + b" " * (MAX_REQUEST_BYTES - 1)  # one byte over, and not JSON: it is never parsed
    response = httpx.post(f"{server}/chat/completions", content=body + b" ", timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    assert str(MAX_REQUEST_BYTES) in response.json()["error"]["message"]
    assert httpx.get(f"{server}/models", timeout=60).status_code == 200


def test_bodies_over_the_bound_get_413_however_they_are_sent(limited):
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    declared = httpx.post(f"{limited}/completions", content=b" " * (SMALL_BODIES + 1), headers=headers, timeout=60)
    chunked = httpx.post(f"{limited}/completions", content=iter([b" " * 40000] * 2), headers=headers, timeout=60)
    for response in (declared, chunked):
        assert response.status_code == 413 and response.json()["error"]["message"], response.text
    fits = {"model": BASE, "prompt": "x" * (SMALL_BODIES // 2), "max_tokens": 1}
    response = httpx.post(f"{limited}/completions", json=fits, headers=headers, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"  # read, then too long


def test_without_the_key_every_route_answers_401(limited):
    chat = {"model": BASE, "messages": QUESTION, "max_tokens": 1}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}, {"x-api-key": KEY}):
        for response in (
            httpx.get(f"{limited}/models", headers=headers, timeout=60),
            httpx.post(f"{limited}/chat/completions", json=chat, headers=headers, timeout=60),
        ):
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=limited, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=limited, api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [BASE]
    assert client.chat.completions.create(**chat).usage.completion_tokens == 1


def test_a_full_queue_answers_429_and_the_places_come_back(limited):
    counting = {"model": BASE, "prompt": COUNTING, "max_tokens": 400, "temperature": 0, "stream": True}
    one_token = counting | {"max_tokens": 1, "stream": False}
    with httpx.Client(base_url=limited, headers={"authorization": f"Bearer {KEY}"}, timeout=120) as http:
        with http.stream("POST", "/completions", json=counting) as generating:
            lines = generating.iter_lines()  # kept: a dropped iterator hangs up
            assert next(line for line in lines if line.startswith("data: "))  # it holds the model
            with http.stream("POST", "/completions", json=counting) as waiting:
                assert waiting.status_code == 200  # the one place in the queue
                busy = http.post("/completions", json=one_token)
        assert busy.status_code == 429, busy.text
        assert busy.json()["error"]["code"] == "rate_limit_exceeded"
        # both clients went away: their places and the model come back
        eventually(lambda: http.post("/completions", json=one_token).status_code == 200, "a place in the queue")


def test_a_public_address_without_a_key_is_refused_in_one_line():
    run = subprocess.run(serve_command("--host", "0.0.0.0"), env=without_key(), capture_output=True, text=True,
                         check=False, timeout=120)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1
    assert run.stderr.startswith("error: --host 0.0.0.0: ") and "--api-key" in run.stderr
    run = subprocess.run(serve_command("--api-key", " "), env=without_key(), capture_output=True, text=True,
                         check=False, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "empty" in run.stderr


@pytest.mark.parametrize("args", [("--host", "0.0.0.0"), ("--api-key", " ")], ids=["public address", "empty key"])
def test_a_refused_key_is_answered_before_the_server_is_imported(monkeypatch, args):
    """uvicorn, fastapi and llama.cpp take about a second to import: a refusal needs none of them."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    run = run_noting_import("uvicorn", "serve", *args)
    assert run.stdout.strip() == "exit 2, uvicorn imported: False", (run.stdout, run.stderr)
    assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1


def test_prompts_are_tokenized_off_the_event_loop(in_process, monkeypatch):
    tokenizing, finish = threading.Event(), threading.Event()
    text_prompt = in_process.inference.text_prompt

    def slow(text: str) -> list[int]:  # a prompt that takes long to tokenize, for as long as the test likes
        tokenizing.set()
        finish.wait(timeout=120)
        return text_prompt(text)

    monkeypatch.setattr(in_process.inference, "text_prompt", slow)
    body = {"model": BASE, "prompt": COUNTING, "max_tokens": 1}
    with httpx.Client(base_url=in_process.url, timeout=120) as http:
        reply = threading.Thread(target=http.post, args=("/completions",), kwargs={"json": body})
        reply.start()
        try:
            assert tokenizing.wait(timeout=120)
            models = httpx.get(f"{in_process.url}/models", timeout=20)  # the event loop answers meanwhile
        finally:
            finish.set()
            reply.join()
    assert models.status_code == 200


def raw_post(url: str, body: dict) -> socket.socket:
    """A POST to the completions of the server at `url`, on a bare socket: the test can hang up."""
    address = httpx.URL(url)
    data = json.dumps(body).encode()
    head = (
        f"POST {address.path}/completions HTTP/1.1\r\nHost: {address.host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection((address.host, address.port))
    sock.sendall(head.encode() + data)
    return sock


def test_a_client_gone_mid_reply_stops_its_generation(in_process, made):
    budget = 1000
    with raw_post(in_process.url, {"model": BASE, "prompt": COUNTING, "max_tokens": budget, "temperature": 0}):
        eventually(lambda: made and made[0].completion_tokens > 0, "the reply started")
    # the client hung up: the next request gets the model as soon as the first stops
    after = httpx.post(f"{in_process.url}/completions", json={"model": BASE, "prompt": "1,", "max_tokens": 1},
                       timeout=300)
    assert after.status_code == 200
    gone = made[0]
    assert gone.finish_reason is None and gone.completion_tokens < budget  # cancelled, not run out


def test_a_chat_without_max_tokens_gets_the_default_budget(in_process, made):
    body = {"model": BASE, "messages": QUESTION, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{in_process.url}/chat/completions", json=body, timeout=120) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    assert made[0].budget == DEFAULT_MAX_TOKENS < in_process.inference.n_ctx - made[0].prompt_tokens


def test_an_internal_error_names_no_local_path(in_process, monkeypatch, caplog):
    secret = "/home/someone/models/private.gguf"

    def broken(*_):
        raise RuntimeError(f"llama_decode failed on {secret}")

    monkeypatch.setattr(in_process.inference, "_step", broken)
    log = logging.getLogger("uvicorn.error")  # where uvicorn writes to stderr
    log.addHandler(caplog.handler)
    try:
        body = {"model": BASE, "prompt": COUNTING, "max_tokens": 5}
        whole = httpx.post(f"{in_process.url}/completions", json=body, timeout=120)
        streamed = httpx.post(f"{in_process.url}/completions", json=body | {"stream": True}, timeout=120)
    finally:
        log.removeHandler(caplog.handler)
    assert whole.status_code == 500 and whole.json()["error"] == {
        "message": INTERNAL_ERROR, "type": "server_error", "param": None, "code": None
    }
    assert streamed.status_code == 200 and INTERNAL_ERROR in streamed.text
    assert secret not in whole.text + streamed.text
    assert caplog.text.count(f"llama_decode failed on {secret}") >= 2  # the details, for the server's owner
