"""Rollout workers (issue 14, item 4): `retrograd rollout-worker` processes on 127.0.0.1 serving
the tiny llama, and the client in retrograd.sampler.remote. Their completions are the
in-process Sampler's, bit for bit, with and without a pushed adapter, and still are when a
worker is killed between or during calls (its groups re-queued on the others); connect
refuses, in one line, a worker it cannot reach, one serving another model and one with too
small a ctx; bad bodies are 4xx with a one-line message; a GRPO run on two local workers repeats the
in-process run. The push and generation speeds are measured in benchmarks/rollout_workers.py."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from lora_files import randomise_b
from test_grpo import write_config

import retrograd
from retrograd.config import load_config
from retrograd.errors import ConfigError, DataError, GGUFError
from retrograd.gguf.adapter import LoRAWeights
from retrograd.model.lora import attach_lora
from retrograd.recipes import grpo
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.sampler.remote import (
    ADAPTER_HEADER_SIZE,
    ADAPTER_MAGIC,
    connect,
    encode_adapter,
    start_local_workers,
)
from retrograd.serving.rollout_worker import read_adapter_body
from retrograd.training.report import SilentReporter

OPTIONS = SamplerOptions(n_ctx=256, n_seq_max=4, kv_dtype="f16", n_threads=1)


def outcome(groups):
    return [[(c.tokens, c.logprobs, c.finish) for c in g] for g in groups]


def groups(n: int, seeds: int, max_new_tokens: int, prompt_tokens: int = 70) -> list[GroupRequest]:
    """n groups of `seeds` completions; prompts cross a prefill piece and share their start."""
    return [
        GroupRequest(
            [300 + t for t in range(prompt_tokens - 3)] + [1000 + i, 2000 + i, 7],
            [50 * i + j for j in range(seeds)],
            Sampling(max_new_tokens),
        )
        for i in range(n)
    ]


def info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/info", timeout=30) as answer:
        return json.load(answer)


def post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def workers(tiny):
    with start_local_workers(2, tiny, OPTIONS, threads=1) as started:
        yield started
    assert all(p.returncode == 130 for p in started.processes)  # SIGTERM: the model and adapter files freed


@pytest.fixture(scope="module")
def local(tiny):
    with Sampler(tiny, OPTIONS) as sampler:
        yield sampler


@pytest.fixture(scope="module")
def adapter(tiny):
    adapter = attach_lora(retrograd.load_model(tiny).transformer, ["auto"], rank=4, alpha=8.0, seed=0)
    return randomise_b(adapter, 0.5)


def test_two_workers_sample_what_the_local_sampler_does_with_and_without_an_adapter(workers, local, adapter):
    requests = groups(5, 3, 12) + groups(2, 1, 30)
    with connect(workers.urls, local.engine.path, OPTIONS) as remote:
        assert remote.eog_ids == local.eog_ids
        assert remote.placement.describe().startswith(f"2 rollout workers: {workers.urls[0]} (cpu")
        before = [info(url)["sampled"] for url in workers.urls]
        base = remote.generate(requests)
        assert all(info(url)["sampled"] > n for url, n in zip(workers.urls, before))  # both sampled a share
        local.set_adapter(None)
        assert outcome(base) == outcome(local.generate(requests))

        timing = remote.set_adapter(adapter)
        pushed = f"{remote.client_id}.1"  # connect pushed the base as .0
        assert remote.adapter_version == pushed and [info(url)["adapter_version"] for url in workers.urls] == [pushed] * 2
        assert set(timing.refresh) == set(workers.urls) and timing.total_s > 0
        tuned = remote.generate(requests)
        local.set_adapter(adapter)
        assert outcome(tuned) == outcome(local.generate(requests))
        assert outcome(tuned) != outcome(base)
        assert remote.generate([]) == []
        assert (remote.requeued_groups, remote.lost_workers) == (0, 0)


def test_a_worker_killed_between_or_during_calls_loses_nothing(tiny, local):
    short, long = groups(6, 2, 8), groups(6, 2, 150, prompt_tokens=40)
    local.set_adapter(None)
    expected_short, expected_long = outcome(local.generate(short)), outcome(local.generate(long))
    with start_local_workers(3, tiny, OPTIONS, threads=1) as three, connect(three.urls, tiny, OPTIONS) as remote:
        folders = [info(url)["adapter_folder"] for url in three.urls]  # a SIGKILLed worker leaves its own
        try:
            assert outcome(remote.generate(short)) == expected_short
            three.processes[0].send_signal(signal.SIGKILL)  # between calls
            three.processes[0].wait()
            assert outcome(remote.generate(short)) == expected_short
            assert (remote.lost_workers, remote.requeued_groups) == (1, 2)  # 6 equal groups over 3 workers: 2 each

            victim = three.urls[1]

            def kill_once_busy():
                deadline = time.monotonic() + 60
                while not info(victim)["busy"] and time.monotonic() < deadline:
                    time.sleep(0.005)
                three.processes[1].send_signal(signal.SIGKILL)

            killer = threading.Thread(target=kill_once_busy)
            killer.start()
            assert outcome(remote.generate(long)) == expected_long  # during a call
            killer.join()
            assert (remote.lost_workers, remote.requeued_groups) == (2, 5)  # 3 of the 6 were the victim's
            assert [w.url for w in remote.workers] == [three.urls[2]]

            three.processes[2].send_signal(signal.SIGKILL)
            three.processes[2].wait()
            with pytest.raises(
                DataError, match=r"^rollout workers: none left \(the last, http://127\.0\.0\.1:\d+, was lost"
            ):
                remote.generate(short)
        finally:
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)
    assert all(p.poll() is not None for p in three.processes)


def test_connect_refuses_an_unreachable_worker_another_model_and_a_small_ctx(tiny, tiny_model, workers):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(ConfigError) as unreachable:
        connect([workers.urls[0], f"http://127.0.0.1:{port}"], tiny, OPTIONS)
    assert (
        str(unreachable.value)
        == f"rollout worker http://127.0.0.1:{port} cannot be reached (ConnectionRefusedError: [Errno 111] Connection refused)"
    )

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(
            ConfigError, match=rf"^rollout worker {url} cannot be reached \(no answer within the timeout\)$"
        ):
            connect([url], tiny, OPTIONS, timeout_s=0.5)

    with pytest.raises(ConfigError) as small:
        connect(workers.urls, tiny, SamplerOptions(n_ctx=OPTIONS.n_ctx + 1, n_seq_max=4, n_threads=1))
    assert str(small.value) == (
        f"rollout worker {workers.urls[0]} has ctx {OPTIONS.n_ctx}, this run needs {OPTIONS.n_ctx + 1} "
        f"(start it with --ctx {OPTIONS.n_ctx + 1} or more)"
    )
    with pytest.raises(ConfigError, match=r"runs --concurrency 4, this run samples with 8 "):
        connect(workers.urls, tiny, SamplerOptions(n_ctx=OPTIONS.n_ctx, n_seq_max=8, n_threads=1))

    qwen2 = tiny_model("qwen2")
    with pytest.raises(ConfigError) as other, start_local_workers(1, qwen2, OPTIONS, threads=1) as started:
        connect(started.urls, tiny, OPTIONS)  # raised inside the with: the worker is stopped too
    message = str(other.value)
    assert (
        message.startswith(f"rollout worker {started.urls[0]} serves {qwen2} (fingerprint ")
        and f", not {tiny} (" in message
    )
    assert "\n" not in message and started.processes[0].poll() is not None


def test_a_worker_that_cannot_start_is_one_line_with_its_stderr(tmp_path):
    not_a_model = tmp_path / "model.gguf"
    not_a_model.write_bytes(b"nope" * 100)
    with pytest.raises(
        DataError, match=r"^rollout worker \(pid \d+\) exited with status 2; stderr: error: .*model\.gguf"
    ):
        start_local_workers(1, not_a_model, OPTIONS, threads=1)


def test_a_port_in_use_is_one_line_and_exit_2(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "retrograd", "rollout-worker", "--model", str(tiny), "--port", str(port)],
            check=False, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == f"error: --port {port}: 127.0.0.1:{port} is in use\n"


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{", "the body is not valid JSON"),
        (b'{"requests": [{"prompt": [1], "seeds": [1]}]}', "requests.0.max_new_tokens: Field required"),
        (
            b'{"requests": [{"prompt": [1], "seeds": [1], "max_new_tokens": "3"}]}',
            "requests.0.max_new_tokens: Input should be a valid integer",
        ),
        (
            b'{"requests": [{"prompt": [1], "seeds": [-1], "max_new_tokens": 3}]}',
            "requests.0.seeds.0: Input should be greater than or equal to 0",
        ),
        (
            b'{"requests": [{"prompt": [1], "seeds": [1], "max_new_tokens": 3, "top_k": 5}]}',
            "requests.0.top_k: Extra inputs are not permitted",
        ),
        (
            b'{"requests": [{"prompt": [49152], "seeds": [1], "max_new_tokens": 3}]}',
            "sampler: request 0 has token id 49152, outside the vocabulary [0, 49152)",
        ),
        (
            b'{"requests": [{"prompt": [1, 2], "seeds": [1], "max_new_tokens": 255}]}',
            "sampler: request 0: 2 prompt tokens + max_new_tokens 255 = 257 exceed ctx 256",
        ),
    ],
)
def test_bad_generate_bodies_are_400_with_one_line(workers, body, message):
    assert post(workers.urls[0], "/generate", body) == (400, {"error": {"message": message, "kind": "DataError"}})


def adapter_body(header: dict | bytes, blob: bytes) -> bytes:
    """A POST /adapter body laid out as encode_adapter's, around any header and blob."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return ADAPTER_MAGIC + ADAPTER_HEADER_SIZE.pack(len(raw)) + raw + blob


def test_an_adapter_body_carries_every_tensor_bit_for_bit():
    rng = np.random.default_rng(0)
    tensors = {
        "blk.0.attn_q.weight": LoRAWeights(rng.standard_normal((4, 6), np.float32), rng.standard_normal((5, 4))),
        "blk.0.ffn_up_exps.weight": LoRAWeights(
            rng.standard_normal((3, 6, 4), np.float32).transpose(0, 2, 1),
            np.asfortranarray(rng.standard_normal((3, 7, 4), np.float32)),
        ),
    }  # float64 and non-contiguous inputs are sent as float32
    body = encode_adapter(tensors, 8, "v5")
    blob_bytes = 4 * sum(w.a.size + w.b.size for w in tensors.values())
    assert body.startswith(ADAPTER_MAGIC) and (len(body) - blob_bytes) % 8 == 0  # the blob starts aligned
    decoded, alpha, version = read_adapter_body(bytes(body))
    assert (alpha, version, list(decoded)) == (8.0, "v5", list(tensors))
    for name, sent in tensors.items():
        for got, want in ((decoded[name].a, sent.a), (decoded[name].b, sent.b)):
            assert got.dtype == np.float32 and got.tobytes() == np.asarray(want, np.float32).tobytes()
    assert read_adapter_body(bytes(encode_adapter({}, 1.0, "0"))) == ({}, 1.0, "0")


def test_bad_adapter_bodies_are_400_with_one_line_and_change_nothing(workers, tiny, adapter):
    url = workers.urls[0]
    version = info(url)["adapter_version"]
    a, b = np.zeros((4, 64), np.float32), np.zeros((64, 4), np.float32)
    name = "blk.0.attn_q.weight"
    entry = {"name": name, "a": [4, 64], "b": [64, 4]}
    good, blob = {"alpha": 8.0, "version": "3", "tensors": [entry]}, a.tobytes() + b.tobytes()
    changed = lambda **fields: {**good, **fields}
    cases = [
        (b"PK not ours", "the body is not an adapter as encode_adapter writes it (starting RGLORA01)", "DataError"),
        (ADAPTER_MAGIC + ADAPTER_HEADER_SIZE.pack(1 << 30) + b"{}",
         "the header's length 1073741824 exceeds the body or the limit of 1048576 bytes", "DataError"),
        (adapter_body(b'{"alpha": 8', blob), "the header is not valid JSON", "DataError"),
        (adapter_body({"version": 3, "tensors": [entry]}, blob), "alpha: Field required", "DataError"),
        (adapter_body(b'{"alpha": NaN, "version": "3", "tensors": []}', b""), "alpha: Input should be a finite number", "DataError"),
        (adapter_body(changed(version=""), blob), "version: String should have at least 1 character", "DataError"),
        (adapter_body(changed(version=3), blob), "version: Input should be a valid string", "DataError"),
        (adapter_body(changed(tensors=[{"name": name, "a": [4, 64]}]), blob), "tensors.0.b: Field required", "DataError"),
        (adapter_body(changed(tensors=[{**entry, "a": [4, -64]}]), blob),
         "tensors.0.a.1: Input should be greater than or equal to 0", "DataError"),
        (adapter_body(changed(tensors=[{**entry, "a": [0, 1 << 40]}]), b.tobytes()),
         "tensors.0.a.1: Input should be less than or equal to 1048576", "DataError"),
        (adapter_body(changed(tensors=[{**entry, "dtype": "float64"}]), blob),
         "tensors.0.dtype: Extra inputs are not permitted", "DataError"),
        (adapter_body(good, a.astype(np.float64).tobytes() + b.tobytes()),
         "the header's tensors take 2048 bytes, 3072 follow it", "DataError"),
        (adapter_body(good, blob[:-4]), "the header's tensors take 2048 bytes, 2044 follow it", "DataError"),
        (adapter_body(changed(tensors=[entry, entry]), blob + blob), f"tensor {name} is listed twice", "DataError"),
        (adapter_body(changed(tensors=[{**entry, "a": [4, 32]}]), a[:, :32].tobytes() + b.tobytes()),
         f"adapter weight {name}: lora_a [4, 32] / lora_b [64, 4] do not fit the base [64, 64] (expected [r, 64] and [64, r], r >= 1)", "GGUFError"),
    ]  # fmt: skip
    for body, message, kind in cases:
        assert post(url, "/adapter", body) == (400, {"error": {"message": message, "kind": kind}})
    assert info(url)["adapter_version"] == version

    with connect(workers.urls, tiny, OPTIONS) as remote:  # the client raises the worker's error class
        with pytest.raises(GGUFError, match=rf"^rollout worker {url}: adapter weight {name}: lora_a \[4, 32\]"):
            remote.set_adapter({name: LoRAWeights(a[:, :32], b)}, alpha=8.0)
        with pytest.raises(DataError, match=rf"^rollout worker {url}: sampler: request 0 has token id 49152"):
            remote.generate([GroupRequest([49152], [1], Sampling(3))])
        assert post(url, "/adapter", encode_adapter({}, 1.0, "7"))[0] == 200  # someone else pushes
        with pytest.raises(DataError, match=rf"sampled with adapter version '7', the last pushed is '{remote.client_id}\.0' "):
            remote.generate(groups(2, 1, 2))


# ---------------------------------------------------------------- a GRPO run on workers


def grpo_rollouts(folder: Path, model: Path, rollout: str = "", training: str = "") -> tuple[list[dict], list[dict]]:
    cfg = write_config(folder, model, updates=2, reward_name="length", training='compute_dtype = "f32"\n' + training,
                       extra=rollout)
    result = grpo.run(load_config(cfg), SilentReporter())
    assert result.updates_done == 2
    read = lambda name: [json.loads(line) for line in (folder / "out" / name).read_text().splitlines()]
    return read("adapter.rollouts.jsonl"), read("adapter.metrics.jsonl")


def test_grpo_on_two_local_workers_trains_what_the_in_process_sampler_does(tmp_path, tiny):
    """Workers sample every group exactly as the trainer's own sampler would (and get each
    new adapter), so the whole run repeats: rollouts, rewards and losses."""
    (tmp_path / "here").mkdir()
    (tmp_path / "workers").mkdir()
    here, here_metrics = grpo_rollouts(tmp_path / "here", tiny)
    there, there_metrics = grpo_rollouts(tmp_path / "workers", tiny, "[rollout]\nlocal_workers = 2", "generation_threads = 1")
    strip = lambda rows: [{k: v for k, v in r.items() if k != "source"} for r in rows]
    assert strip(here) == strip(there)
    assert [m["policy/total_loss"] for m in here_metrics] == [m["policy/total_loss"] for m in there_metrics]
    assert there_metrics[-1]["workers/lost"] == 0 and "workers/lost" not in here_metrics[-1]


@pytest.mark.parametrize("table,algorithm,needle", [
    ('[rollout]\nworkers = ["http://127.0.0.1:9"]', "grpo", "rollout worker http://127.0.0.1:9 cannot be reached"),
    ('[rollout]\nworkers = ["127.0.0.1:8101"]', "grpo", "rollout.workers: '127.0.0.1:8101' is not an http:// URL"),
    ('[rollout]\nworkers = ["http://127.0.0.1:9"]\nlocal_workers = 2', "grpo", "workers and local_workers both given"),
    ('[rollout]\nlocal_workers = 2', "agent_grpo", "[rollout] does not belong to algorithm 'agent_grpo'"),
])
def test_bad_worker_settings_are_one_line(tmp_path, tiny, table, algorithm, needle):
    cfg = write_config(tmp_path, tiny, extra=table)
    if algorithm == "agent_grpo":
        cfg.write_text('[run]\nalgorithm = "agent_grpo"\n[output]\npath = "out/a.gguf"\n[agent]\nscenarios = "s.jsonl"\n' + table)
    r = subprocess.run([sys.executable, "-m", "retrograd", "train", str(cfg)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
