"""Rollout workers among peers that are not ours (issue 22, items 4, 7, 8 and 12): two trainers
on one worker refuse each other's adapters; hostile adapter pushes are refused before anything
is written and the worker takes the trainer's next push; hostile /generate and push answers
from a fake worker on loopback drop it with one note while the real worker samples its groups;
an API key and body bounds in front of a real worker process."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest.mock import Mock

import numpy as np
import pytest
from lora_files import randomise_b
from test_config_keys import GRPO, config, problem
from test_grpo import write_config
from test_rollout_workers import OPTIONS, groups, info, outcome, post

import retrograd
from retrograd.config import load_config
from retrograd.errors import ConfigError, DataError, GGUFError
from retrograd.gguf.adapter import LoRAWeights, adapter_tensors
from retrograd.gguf.file import GGUFFile
from retrograd.model.lora import attach_lora
from retrograd.recipes import grpo
from retrograd.sampler import Sampler, live_adapter
from retrograd.sampler.remote import (
    ADAPTER_HEADER_SIZE,
    ADAPTER_MAGIC,
    READY_PREFIX,
    connect,
    encode_adapter,
    start_local_workers,
)
from retrograd.serving.rollout_worker import MAX_GENERATE_BYTES, adapter_body_limit
from retrograd.training.report import SilentReporter

N_VOCAB = 49152  # the tiny llama's


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def worker(tiny):
    with start_local_workers(1, tiny, OPTIONS, threads=1) as started:
        yield started.urls[0]


@pytest.fixture(scope="module")
def local(tiny):
    with Sampler(tiny, OPTIONS) as sampler:
        yield sampler


def lora(tiny: Path, seed: int) -> dict[str, LoRAWeights]:
    """A rank-4 LoRA on every target, as a trainer pushes it."""
    adapter = attach_lora(retrograd.load_model(tiny).transformer, ["auto"], rank=4, alpha=8.0, seed=seed)
    return adapter_tensors(randomise_b(adapter, 0.5, seed=seed))


# ---------------------------------------------------------------- item 4: versions per client


def test_two_trainers_on_one_worker_refuse_each_others_adapters(tiny, worker):
    """Each client's versions carry its own random id: B's push (its first, as A's was) is
    not taken for A's, so A refuses the batch sampled with it instead of training on it."""
    with connect([worker], tiny, OPTIONS) as a:
        a.set_adapter(lora(tiny, 1), alpha=8.0)
        a.generate(groups(1, 1, 2))  # sampled with A's own adapter: accepted
        with connect([worker], tiny, OPTIONS) as b:
            b.set_adapter(lora(tiny, 2), alpha=8.0)
            assert a.client_id != b.client_id and a.pushes == b.pushes == 2
            with pytest.raises(
                DataError,
                match=rf"^rollout worker {worker} sampled with adapter version '{b.client_id}\.1', the last pushed "
                rf"is '{a.client_id}\.1' \(was it restarted, or does another client push to it\?\)$",
            ):
                a.generate(groups(1, 1, 2))
            b.generate(groups(1, 1, 2))  # B's own batch still goes through


# ---------------------------------------------------------------- item 7: hostile pushes


def test_hostile_pushes_are_400_and_the_worker_takes_the_next_valid_one(tiny, worker, local):
    """Each hostile push is refused in one line, and the trainer's next push of its layout and
    a /generate still work and sample what the in-process sampler does with that adapter.
    Rank 0 used to pass the shape check and be renamed over the live file; a LoRA on
    token_embd passes every check of ours and is refused by llama.cpp after being written; a
    1-D base weight was a 500."""
    trainer = lora(tiny, 3)
    shapes = {n: t.shape for n, t in GGUFFile(tiny).tensors.items()}
    name = next(iter(trainer))
    (n_out, n_in), embd = shapes[name], shapes["token_embd.weight"]
    rank_zero = {n: LoRAWeights(np.zeros((0, w.a.shape[1]), np.float32), np.zeros((w.b.shape[0], 0), np.float32))
                 for n, w in trainer.items()}  # fmt: skip
    hostile = [
        (rank_zero, f"adapter weight {name}: lora_a [0, {n_in}] / lora_b [{n_out}, 0] do not fit the base "
                    f"[{n_out}, {n_in}] (expected [r, {n_in}] and [{n_out}, r], r >= 1)"),
        ({"blk.0.attn_norm.weight": LoRAWeights(np.zeros((4, 64), np.float32), np.zeros((64, 4), np.float32))},
         "adapter weight blk.0.attn_norm.weight: the base's [64] is not a matrix or an expert stack"),
        ({"token_embd.weight": LoRAWeights(np.zeros((4, embd[1]), np.float32), np.zeros((embd[0], 4), np.float32))},
         "llama.cpp refuses this LoRA adapter for tiny-llama.gguf"),
    ]  # fmt: skip
    requests = groups(2, 2, 10)
    local.set_adapter(trainer, alpha=8.0)
    expected = outcome(local.generate(requests))
    with connect([worker], tiny, OPTIONS) as remote:
        for tensors, message in hostile:
            remote.set_adapter(trainer, alpha=8.0)  # the trainer's layout is live when the hostile push comes
            live = info(worker)["adapter_version"]
            status, answer = post(worker, "/adapter", bytes(encode_adapter(tensors, 8.0, "hostile")))
            assert (status, answer["error"]["kind"]) == (400, "GGUFError") and message in answer["error"]["message"]
            assert "\n" not in answer["error"]["message"] and info(worker)["adapter_version"] == live
            remote.set_adapter(trainer, alpha=8.0)
            assert outcome(remote.generate(requests)) == expected


def test_a_push_failing_after_its_file_is_replaced_leaves_the_next_one_working(tiny, local, monkeypatch):
    """Whatever fails once a new layout's file is in place (here: reading it back), the next
    push of the layout before it is written whole, not into the replaced file's old mapping
    (which used to leave the failed push's adapter live, silently)."""
    first, second = lora(tiny, 5), lora(tiny, 6)
    fewer = dict(list(first.items())[1:])  # another layout
    requests = groups(2, 2, 10)
    local.set_adapter(second, alpha=8.0)
    expected = outcome(local.generate(requests))
    with Sampler(tiny, OPTIONS) as sampler:
        sampler.set_adapter(first, alpha=8.0)
        with monkeypatch.context() as patch:
            patch.setattr(live_adapter, "GGUFFile", Mock(side_effect=GGUFError("read back: failed")))
            with pytest.raises(GGUFError, match="^read back: failed$"):
                sampler.set_adapter(fewer, alpha=8.0)
        sampler.set_adapter(second, alpha=8.0)
        assert outcome(sampler.generate(requests)) == expected


# ---------------------------------------------------------------- item 8: hostile answers


def plausible(requests: list[dict]) -> list[list[dict]]:
    """Completions shaped as a worker's: three in-vocabulary tokens per seed."""
    return [[{"tokens": [1, 2, 3], "logprobs": [-1.0, -2.0, -0.5], "finish": "length", "prefilled": 0, "reused": 0}
             for _ in r["seeds"]] for r in requests]  # fmt: skip


def spoiled(change: Callable[[dict], None]) -> Callable:
    """A /generate answer whose first completion `change` spoils."""

    def answer(requests: list[dict], version) -> bytes:
        completions = plausible(requests)
        change(completions[0][0])
        return json.dumps({"completions": completions, "adapter_version": version}).encode()

    return answer


def answered(body: bytes, length: int | str | None = "auto") -> Callable:
    return lambda requests, version: (body, length)


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # the client hung up on a body over its bound


class FakeWorker:
    """A loopback HTTP server that passes for the rollout worker at `real` (its /info, every
    push acknowledged with its version) but answers /generate with `generate(requests,
    version)`: a body, or (body, Content-Length: "auto", a number, or None for none and the
    connection closed after it). `push(version)` may replace the push's answer, `lie` change
    the /info."""

    def __init__(self, real: str, generate: Callable, push: Callable | None = None, lie: dict | None = None):
        real_info, state = info(real) | (lie or {}), {"version": None}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.reply(json.dumps(real_info).encode())

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/adapter":
                    start = len(ADAPTER_MAGIC) + ADAPTER_HEADER_SIZE.size
                    (size,) = ADAPTER_HEADER_SIZE.unpack_from(body, len(ADAPTER_MAGIC))
                    state["version"] = version = json.loads(body[start : start + size])["version"]
                    timing = {"write_s": 0.0, "init_s": 0.0, "set_s": 0.0, "total_s": 0.0}
                    answer = push(version) if push else {"adapter_version": version, **timing}
                    self.reply(json.dumps(answer).encode())
                else:
                    answer = generate(json.loads(body)["requests"], state["version"])
                    self.reply(*(answer if isinstance(answer, tuple) else (answer,)))

            def reply(self, body: bytes, length: int | str | None = "auto") -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if length is None or length != "auto":
                    self.close_connection = True
                    self.send_header("Connection", "close")
                if length is not None:
                    self.send_header("Content-Length", str(len(body) if length == "auto" else length))
                self.end_headers()
                self.wfile.write(body)

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


HOSTILE_ANSWERS = {
    "token id = n_vocab": (spoiled(lambda c: c["tokens"].__setitem__(0, N_VOCAB)), f"token {N_VOCAB} is not an id"),
    "negative token id": (spoiled(lambda c: c["tokens"].__setitem__(0, -1)), "token -1 is not an id"),
    "huge token id": (spoiled(lambda c: c["tokens"].__setitem__(0, 1 << 70)), "is not an id in the vocabulary"),
    "true as a token": (spoiled(lambda c: c["tokens"].__setitem__(0, True)), "token True is not an id"),
    "a token as text": (spoiled(lambda c: c["tokens"].__setitem__(0, "1")), "token '1' is not an id"),
    "NaN log-prob": (spoiled(lambda c: c["logprobs"].__setitem__(1, float("nan"))), "a log-prob is not a finite"),
    "infinite log-prob": (spoiled(lambda c: c["logprobs"].__setitem__(1, -float("inf"))), "not a finite number"),
    "a log-prob short": (spoiled(lambda c: c["logprobs"].pop()), "logprobs is no list of one per token (3)"),
    "more tokens than asked": (spoiled(lambda c: c.update(tokens=[1] * 9, logprobs=[-1.0] * 9)), "at most max_new"),
    "no finish": (spoiled(lambda c: c.pop("finish")), "not an object with exactly the keys finish, logprobs"),
    "an extra key": (spoiled(lambda c: c.update(text="hi")), "not an object with exactly the keys"),
    "unknown finish": (spoiled(lambda c: c.update(finish="stop")), "finish 'stop' is neither eos nor length"),
    "negative count": (spoiled(lambda c: c.update(prefilled=-5)), "prefilled / reused is not a count"),
    "a completion missing": (lambda rs, v: json.dumps({"completions": [g[:-1] for g in plausible(rs)],
                                                        "adapter_version": v}).encode(),
                             "request 0: answered no list of 2 completions"),
    "no version": (answered(b'{"completions": []}'), "answered no adapter version"),
    "no completions": (lambda rs, v: json.dumps({"adapter_version": v}).encode(),
                       "answered no list of 2 groups of completions"),
    "an array": (answered(b"[]"), "answered list where a JSON object belongs"),
    "not JSON": (answered(b"<html>oops</html>"), "HTTP 200 with a body that is not JSON"),
    "nested 100,000 deep": (answered(b"[" * 100_000), "HTTP 200 with a body that is not JSON"),
    "declares a terabyte": (answered(b"", 1 << 40), "HTTP 200 with a body over"),
    "streams 4 MiB": (answered(b" " * (4 << 20) + b"{}", None), "HTTP 200 with a body over"),
}  # fmt: skip


@pytest.mark.parametrize("hostile", HOSTILE_ANSWERS, ids=list(HOSTILE_ANSWERS))
def test_a_hostile_generate_answer_drops_its_worker_and_requeues_its_groups(hostile, tiny, worker, local, capfd):
    generate, reason = HOSTILE_ANSWERS[hostile]
    requests = groups(4, 2, 8)
    local.set_adapter(None)
    expected = outcome(local.generate(requests))
    with FakeWorker(worker, generate) as fake, connect([fake.url, worker], tiny, OPTIONS) as remote:
        capfd.readouterr()
        assert outcome(remote.generate(requests)) == expected  # the fake's two groups sampled by the real one
        assert (remote.lost_workers, remote.requeued_groups) == (1, 2) and [w.url for w in remote.workers] == [worker]
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"note: rollout worker {fake.url} dropped: ") and reason in lines[0]


@pytest.mark.parametrize("answer, reason", [
    (lambda version: {"adapter_version": "someone else's"}, "answered adapter version \"someone else's\", pushed "),
    (lambda version: {"adapter_version": version, "write_s": "fast", "init_s": 0.0, "set_s": 0.0},
     "answered the push's timing ['fast', 0.0, 0.0], expected seconds"),
    (lambda version: {"adapter_version": version, "write_s": float("nan"), "init_s": 0.0, "set_s": 0.0},
     "expected seconds"),
])  # fmt: skip
def test_a_hostile_push_answer_drops_its_worker(answer, reason, tiny, worker, capfd):
    capfd.readouterr()
    with FakeWorker(worker, answered(b"{}"), push=answer) as fake, connect([fake.url, worker], tiny, OPTIONS) as remote:
        assert [w.url for w in remote.workers] == [worker] and remote.lost_workers == 1
        assert len(remote.generate(groups(2, 1, 2))) == 2
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"note: rollout worker {fake.url} dropped: ") and reason in lines[0]


@pytest.mark.parametrize("lie", [{"eog_ids": [N_VOCAB]}, {"eog_ids": [-1]}, {"n_ctx": "256"}, {"placement": None}])
def test_connect_refuses_an_info_that_is_not_a_workers(lie, tiny, worker):
    with FakeWorker(worker, answered(b"{}"), lie=lie) as fake:
        with pytest.raises(ConfigError, match=rf"^rollout worker {fake.url}: its /info is not a rollout worker's"):
            connect([fake.url], tiny, OPTIONS)


def test_a_run_whose_worker_answers_token_ids_outside_the_vocabulary_completes(tmp_path, tiny):
    """The trainer used to hand such ids to tokenizer.decode: std::out_of_range, SIGABRT (exit
    134). Now the worker is dropped with one note and its group is sampled by the other."""
    cfg = write_config(tmp_path, tiny, updates=2, reward_name="length", training="generation_threads = 1")
    options = grpo.sampler_options(load_config(cfg))
    with start_local_workers(1, tiny, options, threads=1) as real:
        hostile = spoiled(lambda c: c["tokens"].__setitem__(0, N_VOCAB))
        with FakeWorker(real.urls[0], hostile) as fake:
            with cfg.open("a") as f:
                f.write(f'[rollout]\nworkers = ["{fake.url}", "{real.urls[0]}"]\n')
            run = subprocess.run([sys.executable, "-m", "retrograd", "train", str(cfg)], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    notes = [line for line in run.stderr.splitlines() if line.startswith("note: rollout worker")]
    assert notes == [
        f"note: rollout worker {fake.url} dropped: request 0.0: token {N_VOCAB} is not an id in the vocabulary "
        f"[0, {N_VOCAB})"
    ]
    (records,) = (tmp_path / "out").glob("*metrics.jsonl")
    metrics = [json.loads(line) for line in records.read_text().splitlines()]
    assert (metrics[-1]["workers/lost"], metrics[-1]["workers/requeued_groups"]) == (1, 1)


# ---------------------------------------------------------------- item 12: the API key and body bounds


@pytest.mark.parametrize("name", ["sk-abc123", "", "1KEY", "MY KEY"])
def test_api_key_env_must_name_a_variable_not_hold_a_key(name):
    message = problem(config("grpo", GRPO, rollout={"workers": ["http://127.0.0.1:8101"], "api_key_env": name}))
    assert message.endswith("rollout.api_key_env: not the name of an environment variable (letters, digits and _): "
                            "it names the variable holding the workers' API key, never the key itself")
    assert not name or name not in message  # a key put there by mistake is not echoed


@contextmanager
def serve_worker(model: Path, *flags: str, env: dict | None = None):
    """`retrograd rollout-worker` on a free loopback port with `flags` -> its URL."""
    command = [sys.executable, "-m", "retrograd", "rollout-worker", "--model", str(model), "--port", "0",
               "--ctx", str(OPTIONS.n_ctx), "--concurrency", str(OPTIONS.n_seq_max), "--threads", "1", *flags]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})})  # fmt: skip
    try:
        line = process.stdout.readline()
        assert line.startswith(READY_PREFIX), process.stderr.read()
        yield line.removeprefix(READY_PREFIX).split()[0]
    finally:
        process.terminate()
        process.wait(timeout=60)


def request(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_a_worker_with_an_api_key_answers_only_requests_that_send_it(tiny, monkeypatch):
    key = "k3y-for-the-test"
    with serve_worker(tiny, "--api-key", key, "--max-adapter-rank", "1") as url:
        unauthorized = {"error": {"message": "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                  "kind": "ConfigError"}}  # fmt: skip
        generate = json.dumps({"requests": [{"prompt": [1], "seeds": [1], "max_new_tokens": 2}]}).encode()
        assert request(url, "GET", "/info") == (401, unauthorized)
        assert request(url, "GET", "/info", headers={"Authorization": "Bearer wrong"}) == (401, unauthorized)
        assert request(url, "POST", "/generate", generate, {"Authorization": f"Basic {key}"}) == (401, unauthorized)
        assert request(url, "POST", "/generate", generate, {"Authorization": f"Bearer {key}"})[0] == 200

        limit = adapter_body_limit({n: t.shape for n, t in GGUFFile(tiny).tensors.items()}, 1)
        for path, bound in (("/generate", MAX_GENERATE_BYTES), ("/adapter", limit)):  # refused on the declared length
            declared = {"Authorization": f"Bearer {key}", "Content-Length": str(bound + 1)}
            assert request(url, "POST", path, None, declared) == (413, {"error": {
                "message": f"request body of {bound + 1} bytes is over this server's {bound}", "kind": "DataError"}})

        monkeypatch.delenv("RETROGRAD_API_KEY", raising=False)
        with pytest.raises(ConfigError, match=rf"^rollout worker {url}: missing or wrong API key"):
            connect([url], tiny, OPTIONS)
        monkeypatch.setenv("WORKER_KEY", key)
        with connect([url], tiny, OPTIONS, api_key_env="WORKER_KEY") as remote:
            remote.set_adapter(lora(tiny, 4), alpha=8.0)  # rank 4 on the blocks: within the rank-1 bound of the model
            assert len(remote.generate(groups(2, 2, 4))) == 2
        monkeypatch.setenv("RETROGRAD_API_KEY", key)  # the default variable, as local workers inherit it
        with connect([url], tiny, OPTIONS) as remote:
            assert len(remote.generate(groups(1, 1, 2))) == 1
        with pytest.raises(ConfigError, match=r"^rollout.api_key_env: \$UNSET_KEY_VARIABLE is not set"):
            connect([url], tiny, OPTIONS, api_key_env="UNSET_KEY_VARIABLE")
        monkeypatch.setenv("WORKER_KEY", f"{key}\n")
        with pytest.raises(ConfigError, match=r"^rollout workers: \$WORKER_KEY holds characters an HTTP header"):
            connect([url], tiny, OPTIONS, api_key_env="WORKER_KEY")


def test_a_run_sends_the_key_from_the_variable_its_config_names(tmp_path, tiny, monkeypatch):
    """[rollout] api_key_env reaches the trainer's connection: the worker holds the key as
    $RETROGRAD_API_KEY, the trainer only as $WORKER_KEY."""
    key = "run-k3y"
    cfg = write_config(tmp_path, tiny, updates=1, reward_name="length", training="generation_threads = 1")
    monkeypatch.setenv("RETROGRAD_API_KEY", key)  # inherited by the worker process started next
    with start_local_workers(1, tiny, grpo.sampler_options(load_config(cfg)), threads=1) as keyed:
        monkeypatch.delenv("RETROGRAD_API_KEY")
        monkeypatch.setenv("WORKER_KEY", key)
        with cfg.open("a") as f:
            f.write(f'[rollout]\nworkers = ["{keyed.urls[0]}"]\napi_key_env = "WORKER_KEY"\n')
        result = grpo.run(load_config(cfg), SilentReporter())
    assert result.updates_done == 1


@pytest.mark.parametrize("flags, env, message", [
    (["--host", "0.0.0.0"], {}, "error: --host 0.0.0.0: other machines could reach this server, so it needs a key: "
                                "pass --api-key KEY (or set $RETROGRAD_API_KEY); clients then send 'Authorization: "
                                "Bearer KEY'"),
    (["--api-key", " "], {}, "error: --api-key / $RETROGRAD_API_KEY is empty: give a key, or unset it to serve "
                             "loopback without one"),
    ([], {"RETROGRAD_API_KEY": ""}, "error: --api-key / $RETROGRAD_API_KEY is empty"),
])  # fmt: skip
def test_a_worker_off_loopback_without_a_key_is_refused_in_one_line(tiny, flags, env, message):
    environment = {k: v for k, v in os.environ.items() if k != "RETROGRAD_API_KEY"} | env
    run = subprocess.run([sys.executable, "-m", "retrograd", "rollout-worker", "--model", str(tiny), "--port", "0",
                          *flags], capture_output=True, text=True, timeout=120, env=environment, check=False)  # fmt: skip
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(message), run.stderr
