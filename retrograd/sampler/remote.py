"""Sampling on rollout workers: `retrograd rollout-worker` processes (retrograd/serving/rollout_worker.py)
each serve one Sampler over HTTP, and `RemoteSamplers` stands in for a Sampler where GRPO and
on-policy distillation use one (generate, set_adapter, eog_ids, placement, close).

Why the numbers do not change: a completion's tokens and log-probs are a function of its seed
and context alone (sampler.py), so a group sampled by any worker holding the same model file,
adapter and sampler options is the group the in-process Sampler samples. `connect` checks the
model (file and tokenizer fingerprints) and the options that change numbers (kv_dtype,
generation_concurrency; a worker's ctx may be larger), then resets every worker to the base
model. Every adapter push carries a version, this client's random id and its push count,
that each generate answer repeats, so a batch sampled with another adapter (a stale one, a
worker restarted, or pushed to by another trainer) is refused instead of trained on.

Wire format: JSON for requests and completions (Python writes a float as its shortest repr,
which reads back as the same double); the adapter as one body (encode_adapter): a small JSON
header (alpha, version, each tensor's name and the shapes of its A and B), then every A and B
in header order as one float32 blob, which the worker reads as views without parsing an array
each. No tensors: the base.

A worker that cannot be reached mid-call (refused, reset, or silent for `timeout_s`), or that
answers what no rollout worker would (a body over its bound, token ids outside the vocabulary,
log-probs that are not finite numbers, lengths or keys that do not match the request) is
dropped with one `note:` line on stderr and its groups go to the remaining workers, once: a
group whose second worker fails too is an error (it may be what kills them), as is losing the
last worker. Nothing a worker answers reaches the tokenizer unchecked. A worker started with
an API key is sent it from the environment variable [rollout] api_key_env names.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd import errors
from retrograd.errors import ConfigError, DataError, RetrogradError
from retrograd.gguf.file import GGUFFile
from retrograd.runtime.bundled import default_model_path
from retrograd.runtime.http_guard import API_KEY_ENV
from retrograd.sampler.live_adapter import RefreshTiming, _tensors_and_alpha
from retrograd.sampler.sampler import Completion, GroupRequest, SamplerOptions

READY_PREFIX = "rollout-worker: listening on "  # the worker's one line on stdout once it serves
MAX_REPLY_BYTES = 1 << 20  # any answer but /generate's, whose bound grows with the request


# ---------------------------------------------------------------- what a worker must match


@dataclass(frozen=True)
class ModelIdentity:
    file: str  # retrograd.training.checkpoint.file_fingerprint
    tokenizer: str  # sha256 of the GGUF's tokenizer.ggml.* metadata
    n_vocab: int  # tokens in tokenizer.ggml.tokens: every id a worker answers is below it


def model_identity(path: Path) -> ModelIdentity:
    from retrograd.training.checkpoint import file_fingerprint  # imports torch: only once a worker is involved

    gguf = GGUFFile(path)
    keys = sorted(k for k in gguf.keys() if k.startswith("tokenizer.ggml."))  # noqa: SIM118 (not a dict)
    values = {key: gguf.get(key) for key in keys}
    text = json.dumps([[key, value] for key, value in values.items()], separators=(",", ":"))
    n_vocab = len(values.get("tokenizer.ggml.tokens") or ())
    return ModelIdentity(file_fingerprint(path), hashlib.sha256(text.encode()).hexdigest()[:32], n_vocab)


# ---------------------------------------------------------------- wire format, shared with the worker


ADAPTER_MAGIC = b"RGLORA01"  # the first bytes of a POST /adapter body
ADAPTER_HEADER_SIZE = struct.Struct("<I")  # after the magic: the JSON header's length in bytes


def encode_adapter(tensors: dict, alpha: float, version: str) -> bytearray:
    """{base weight name: LoRAWeights} -> the body of POST /adapter: ADAPTER_MAGIC, the header's
    length, the JSON header {"alpha", "version", "tensors": [{"name", "a": shape, "b": shape}]},
    then A and B of each listed tensor as little-endian float32, back to back. Built in one
    buffer (each tensor copied once, no joins); the header is padded so the blob starts 8-byte
    aligned."""
    pairs = [(name, np.asarray(w.a), np.asarray(w.b)) for name, w in tensors.items()]
    listed = [{"name": name, "a": list(a.shape), "b": list(b.shape)} for name, a, b in pairs]
    header = json.dumps({"alpha": float(alpha), "version": version, "tensors": listed}).encode()
    prefix = len(ADAPTER_MAGIC) + ADAPTER_HEADER_SIZE.size
    header += b" " * (-(prefix + len(header)) % 8)
    start = prefix + len(header)
    body = bytearray(start + 4 * sum(a.size + b.size for _, a, b in pairs))
    body[:start] = ADAPTER_MAGIC + ADAPTER_HEADER_SIZE.pack(len(header)) + header
    blob, at = np.frombuffer(body, "<f4", offset=start), 0
    for array in (x for _, a, b in pairs for x in (a, b)):
        blob[at : at + array.size].reshape(array.shape)[...] = array
        at += array.size
    return body


def request_json(request: GroupRequest) -> dict:
    s = request.sampling
    return {
        "prompt": [int(t) for t in request.prompt],
        "seeds": [int(seed) for seed in request.seeds],
        "max_new_tokens": int(s.max_new_tokens),
        "temperature": float(s.temperature),
        "top_p": float(s.top_p),
    }


def completion_json(c: Completion) -> dict:
    return {
        "tokens": c.tokens,
        "logprobs": c.logprobs,
        "finish": c.finish,
        "prefilled": c.prefilled,
        "reused": c.reused,
    }


def error_json(message: str, kind: str) -> dict:
    """A refusal: `kind` is the retrograd.errors class the client raises it as."""
    return {"error": {"message": message, "kind": kind}}


# ---------------------------------------------------------------- one worker


class WorkerLost(Exception):
    """The worker could not be reached, or went silent or away mid-answer."""


class BadReply(WorkerLost):
    """The worker answered what no rollout worker would: it is dropped as a lost one is."""


_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class Worker:
    """A worker's address, the API key it is sent, and its kept-alive connections (one per
    call in flight)."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
            raise ConfigError(f"rollout worker {url!r}: expected http://HOST:PORT")
        try:
            self.port = parts.port or 80
        except ValueError:
            raise ConfigError(f"rollout worker {url!r}: the port is not a number in [0, 65535]") from None
        self.url, self.host, self.timeout_s = f"http://{parts.netloc}", parts.hostname, timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self.info: dict = {}
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def call(
        self,
        method: str,
        path: str,
        body: bytes | bytearray | None = None,
        content_type: str = "application/json",
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ):
        """-> (HTTP status, parsed JSON answer); WorkerLost when the worker is not there,
        BadReply for an answer over `max_reply_bytes` or not JSON. A kept-alive connection the
        worker has closed meanwhile is retried once on a fresh one."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        reused = conn is not None
        headers = self._headers | ({"Content-Type": content_type} if body else {})
        while True:
            conn = conn or http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                too_long = response.length is not None and response.length > max_reply_bytes
                data = b"" if too_long else response.read(max_reply_bytes + 1)
                break
            except _STALE as e:
                conn.close()
                if not reused:
                    raise WorkerLost(_reason(e)) from None
                conn, reused = None, False
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise WorkerLost(_reason(e)) from None
        if too_long or len(data) > max_reply_bytes:
            conn.close()
            raise BadReply(f"HTTP {response.status} with a body over {max_reply_bytes} bytes")
        if response.will_close:
            conn.close()
        else:
            with self._lock:
                self._idle.append(conn)
        try:
            return response.status, json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            raise BadReply(f"HTTP {response.status} with a body that is not JSON") from None

    def answer(
        self,
        method: str,
        path: str,
        body: bytes | bytearray | None = None,
        content_type: str = "application/json",
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> dict:
        """The JSON object a successful call answers; a refusal raises the worker's error class."""
        status, answer = self.call(method, path, body, content_type, max_reply_bytes)
        if status == 200:
            if not isinstance(answer, dict):
                raise BadReply(f"answered {type(answer).__name__} where a JSON object belongs")
            return answer
        error = answer.get("error") if isinstance(answer, dict) else None
        error = error if isinstance(error, dict) else {}
        kind = getattr(errors, str(error.get("kind")), None)
        if not (isinstance(kind, type) and issubclass(kind, RetrogradError)):
            kind = DataError
        message = " ".join(str(error.get("message", answer)).split())[:1000]
        raise kind(f"rollout worker {self.url}: {message}" + (f" (HTTP {status})" if status >= 500 else ""))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _reason(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "no answer within the timeout"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


# ---------------------------------------------------------------- the client


@dataclass(frozen=True)
class PushTiming:
    """One adapter push to every worker; total_s as RefreshTiming's, plus each worker's part."""

    encode_s: float  # the tensors as one body (encode_adapter)
    push_s: float  # the concurrent pushes, until the last worker answered
    round_trip_s: dict[str, float]  # per worker URL: upload, refresh and answer
    refresh: dict[str, RefreshTiming]  # per worker URL: its Sampler's own refresh

    @property
    def total_s(self) -> float:
        return self.encode_s + self.push_s


@dataclass(frozen=True)
class WorkersPlacement:
    workers: tuple[tuple[str, str], ...]  # (URL, where its llama.cpp runs)

    def describe(self) -> str:
        n = len(self.workers)
        listed = ", ".join(f"{url} ({where})" for url, where in self.workers)
        return f"{n} rollout worker{'s' if n != 1 else ''}: {listed}"


def connect(
    urls: Sequence[str],
    model_path: str | Path | None,
    options: SamplerOptions,
    *,
    timeout_s: float = 600.0,
    api_key_env: str = API_KEY_ENV,
) -> RemoteSamplers:
    """Workers that sample exactly as Sampler(model_path, options) would, reset to the base
    model; one line naming the worker otherwise. `timeout_s`: how long a call may go without
    an answer before its worker counts as lost (a whole batch's generation must fit).
    `api_key_env` ([rollout] api_key_env): the environment variable whose key is sent."""
    if not urls:
        raise ConfigError("rollout workers: no worker URL given")
    api_key = worker_api_key(api_key_env)
    workers = [Worker(url, timeout_s, api_key) for url in urls]
    if len({w.url for w in workers}) != len(workers):
        raise ConfigError(f"rollout workers: a URL is listed twice ({', '.join(urls)})")
    path = Path(model_path) if model_path is not None else default_model_path()
    expected = model_identity(path)
    client = None
    try:
        with ThreadPoolExecutor(max_workers=len(workers)) as pool:
            infos = list(pool.map(_info, workers))
        for worker, info in zip(workers, infos):
            _check(worker, info, path, expected, options)
            worker.info = info
        client = RemoteSamplers(workers, expected.n_vocab)
        client.set_adapter(None)
    except BaseException:
        if client is not None:
            client.close()
        for worker in workers:
            worker.close()
        raise
    return client


def worker_api_key(env: str) -> str | None:
    """The key the workers are sent: the value of $`env`, which must be set unless `env` is
    the default RETROGRAD_API_KEY (then unset: no key)."""
    key = os.environ.get(env)
    if key is None and env != API_KEY_ENV:
        raise ConfigError(f"rollout.api_key_env: ${env} is not set (it should hold the rollout workers' API key)")
    if key is not None and not key.strip():
        raise ConfigError(f"rollout workers: ${env} is empty; give the workers' API key, or unset it to send none")
    if key is not None and not (key.isascii() and key.isprintable()):
        raise ConfigError(f"rollout workers: ${env} holds characters an HTTP header cannot carry (a newline?)")
    return key


def _info(worker: Worker) -> dict:
    try:
        return worker.answer("GET", "/info")
    except BadReply as e:
        raise ConfigError(f"rollout worker {worker.url}: its /info is not a rollout worker's ({e})") from None
    except WorkerLost as e:
        raise ConfigError(f"rollout worker {worker.url} cannot be reached ({e})") from None


INFO_TYPES = {
    "model": str, "model_fingerprint": str, "tokenizer_fingerprint": str, "n_ctx": int, "n_seq_max": int,
    "kv_dtype": str, "eog_ids": list, "placement": str,
}  # fmt: skip


def _check(worker: Worker, info: dict, path: Path, expected: ModelIdentity, options: SamplerOptions) -> None:
    if not (
        all(type(info.get(key)) is kind for key, kind in INFO_TYPES.items())
        and all(type(i) is int and 0 <= i < expected.n_vocab for i in info["eog_ids"])
    ):
        raise ConfigError(
            f"rollout worker {worker.url}: its /info is not a rollout worker's (is it `retrograd rollout-worker`?)"
        )
    theirs = f"{info['model']} (fingerprint {info['model_fingerprint']})"
    ours = f"{path} (fingerprint {expected.file})"
    if info["tokenizer_fingerprint"] != expected.tokenizer:
        raise ConfigError(f"rollout worker {worker.url} serves {theirs} whose tokenizer differs from {ours}'s")
    if info["model_fingerprint"] != expected.file:
        raise ConfigError(f"rollout worker {worker.url} serves {theirs}, not {ours}")
    if info["n_ctx"] < options.n_ctx:
        raise ConfigError(
            f"rollout worker {worker.url} has ctx {info['n_ctx']}, this run needs {options.n_ctx} "
            f"(start it with --ctx {options.n_ctx} or more)"
        )
    for key, ours_value, flag in (
        ("kv_dtype", options.kv_dtype, "--kv-dtype"),
        ("n_seq_max", options.n_seq_max, "--concurrency"),
    ):
        if info[key] != ours_value:
            raise ConfigError(
                f"rollout worker {worker.url} runs {flag} {info[key]}, this run samples with {ours_value} "
                f"(it changes the numbers: start the worker with {flag} {ours_value})"
            )


class RemoteSamplers:
    """A Sampler's generate / set_adapter / eog_ids / placement over rollout workers whose
    /info `connect` has checked, for a model of `n_vocab` tokens. `requeued_groups` and
    `lost_workers` count what worker failures cost."""

    def __init__(self, workers: list[Worker], n_vocab: int):
        self.workers = list(workers)  # the live ones
        self.n_vocab = n_vocab
        self.eog_ids = frozenset(workers[0].info["eog_ids"])
        self.client_id = secrets.token_hex(8)  # no other client's adapter versions start with it
        self.pushes = 0
        self.adapter_version: str | None = None  # the last one pushed to every worker: "CLIENT_ID.PUSHES"
        self.requeued_groups = 0
        self.lost_workers = 0
        self._pool = ThreadPoolExecutor(max_workers=2 * len(workers), thread_name_prefix="retrograd-remote")

    @property
    def placement(self) -> WorkersPlacement:
        return WorkersPlacement(tuple((w.url, w.info["placement"]) for w in self.workers))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections; the workers keep running (they are not this client's)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for worker in self.workers:
            worker.close()

    # ---- the adapter

    def set_adapter(self, adapter, *, alpha: float | None = None) -> PushTiming:
        """As Sampler.set_adapter, on every worker at once, under a new version that each
        generate answer must repeat."""
        t0 = time.perf_counter()
        version = f"{self.client_id}.{self.pushes}"
        self.pushes += 1
        tensors, alpha = _tensors_and_alpha(adapter, alpha) if adapter is not None else ({}, 1.0)
        body = encode_adapter(tensors, alpha, version)
        t1 = time.perf_counter()
        round_trips: dict[str, float] = {}

        def push(worker: Worker) -> RefreshTiming:
            start = time.perf_counter()
            answer = worker.answer("POST", "/adapter", body, "application/octet-stream")
            round_trips[worker.url] = time.perf_counter() - start
            if answer.get("adapter_version") != version:
                raise BadReply(f"answered adapter version {answer.get('adapter_version')!r:.100}, pushed {version}")
            timing = [answer.get(key) for key in ("write_s", "init_s", "set_s")]
            if not all(type(s) is float and 0 <= s < math.inf for s in timing):
                raise BadReply(f"answered the push's timing {timing!r:.200}, expected seconds")
            return RefreshTiming(*timing)

        pushed = {}
        for worker, outcome in zip(list(self.workers), self._each(push)):
            if isinstance(outcome, WorkerLost):
                self._drop(worker, outcome)
            else:
                pushed[worker.url] = outcome
        self.adapter_version = version
        return PushTiming(t1 - t0, time.perf_counter() - t1, round_trips, pushed)

    # ---- GRPO groups

    def generate(self, requests: Sequence[GroupRequest]) -> list[list[Completion]]:
        """Per request, its completions in seed order, as Sampler.generate; the groups are
        spread over the workers by completion count and sampled concurrently."""
        results: list[list[Completion] | None] = [None] * len(requests)
        load = {w: 0 for w in self.workers}  # completions in flight per worker
        calls: dict[Future, tuple[Worker, list[int]]] = {}
        requeued: set[int] = set()

        def submit(indices: list[int]) -> None:
            for worker, part in _spread(indices, requests, load).items():
                calls[self._pool.submit(self._generate_on, worker, [requests[i] for i in part])] = (worker, part)

        submit(list(range(len(requests))))
        while calls:
            done, _ = wait(calls, return_when=FIRST_COMPLETED)
            for call in done:
                worker, part = calls.pop(call)
                try:
                    groups = call.result()
                except WorkerLost as e:
                    self._drop(worker, e)
                    load.pop(worker, None)
                    twice = [i for i in part if i in requeued]
                    if twice:
                        raise DataError(
                            f"rollout workers: request {twice[0]} was lost with two workers in turn (the last {worker.url}: {e})"
                        ) from None
                    requeued.update(part)
                    self.requeued_groups += len(part)
                    submit(part)
                    continue
                load[worker] -= sum(len(requests[i].seeds) for i in part)
                for i, group in zip(part, groups):
                    results[i] = group
        return results

    def _generate_on(self, worker: Worker, requests: list[GroupRequest]) -> list[list[Completion]]:
        body = json.dumps({"requests": [request_json(r) for r in requests]}).encode()
        answer = worker.answer("POST", "/generate", body, max_reply_bytes=generate_reply_bound(requests))
        version = answer.get("adapter_version")
        if not isinstance(version, str):
            raise BadReply("answered no adapter version")
        if version != self.adapter_version:
            raise DataError(
                f"rollout worker {worker.url} sampled with adapter version {version!r:.100}, the last pushed is "
                f"{self.adapter_version!r} (was it restarted, or does another client push to it?)"
            )
        return checked_completions(answer.get("completions"), requests, self.n_vocab)

    # ---- workers

    def _each(self, work) -> list:
        """work(worker) on every live worker concurrently -> the results in worker order, a
        WorkerLost in place of the result of a worker that was not there; any other error is
        raised."""
        futures = [self._pool.submit(work, w) for w in self.workers]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except WorkerLost as e:
                results.append(e)
        return results

    def _drop(self, worker: Worker, why: WorkerLost) -> None:
        if worker in self.workers:
            self.workers.remove(worker)
            self.lost_workers += 1
            worker.close()
            print(f"note: rollout worker {worker.url} dropped: {why}", file=sys.stderr, flush=True)
        if not self.workers:
            raise DataError(f"rollout workers: none left (the last, {worker.url}, was lost: {why})")


def generate_reply_bound(requests: Sequence[GroupRequest]) -> int:
    """The bytes a /generate answer to `requests` may take: 64 per token asked (an id and its
    log-prob take at most 40 as Python writes them) and 256 per completion, plus 1 MiB."""
    return MAX_REPLY_BYTES + sum(len(r.seeds) * (256 + 64 * r.sampling.max_new_tokens) for r in requests)


COMPLETION_KEYS = frozenset(("tokens", "logprobs", "finish", "prefilled", "reused"))


def checked_completions(groups, requests: Sequence[GroupRequest], n_vocab: int) -> list[list[Completion]]:
    """A /generate answer's completions, each checked against its request, or BadReply naming
    the first thing that no worker sampling `requests` would answer."""
    if not (isinstance(groups, list) and len(groups) == len(requests)):
        raise BadReply(f"answered no list of {len(requests)} groups of completions")
    checked = []
    for i, (group, request) in enumerate(zip(groups, requests)):
        if not (isinstance(group, list) and len(group) == len(request.seeds)):
            raise BadReply(f"request {i}: answered no list of {len(request.seeds)} completions")
        checked.append([_checked_completion(c, request, n_vocab, f"request {i}.{j}") for j, c in enumerate(group)])
    return checked


def _checked_completion(c, request: GroupRequest, n_vocab: int, where: str) -> Completion:
    if not (isinstance(c, dict) and c.keys() == COMPLETION_KEYS):
        raise BadReply(f"{where}: not an object with exactly the keys {', '.join(sorted(COMPLETION_KEYS))}")
    tokens, logprobs = c["tokens"], c["logprobs"]
    if not (isinstance(tokens, list) and len(tokens) <= request.sampling.max_new_tokens):
        raise BadReply(f"{where}: tokens is no list of at most max_new_tokens {request.sampling.max_new_tokens}")
    bad = next((i for i, t in enumerate(tokens) if not (type(t) is int and 0 <= t < n_vocab)), None)
    if bad is not None:
        raise BadReply(f"{where}: token {tokens[bad]!r:.100} is not an id in the vocabulary [0, {n_vocab})")
    if not (isinstance(logprobs, list) and len(logprobs) == len(tokens)):
        raise BadReply(f"{where}: logprobs is no list of one per token ({len(tokens)})")
    if not all(type(x) is float and math.isfinite(x) for x in logprobs):
        raise BadReply(f"{where}: a log-prob is not a finite number")
    if c["finish"] not in ("eos", "length"):
        raise BadReply(f"{where}: finish {c['finish']!r:.100} is neither eos nor length")
    if not all(type(c[key]) is int and c[key] >= 0 for key in ("prefilled", "reused")):
        raise BadReply(f"{where}: prefilled / reused is not a count")
    return Completion(tokens, logprobs, c["finish"], c["prefilled"], c["reused"])


def _spread(indices: list[int], requests: Sequence[GroupRequest], load: dict[Worker, int]) -> dict[Worker, list[int]]:
    """Groups to workers, the largest first onto the least loaded (counting completions; ties
    to the first listed); each worker's share in request order. Updates `load`."""
    shares: dict[Worker, list[int]] = {}
    for i in sorted(indices, key=lambda i: -len(requests[i].seeds)):
        worker = min(load, key=load.__getitem__)
        shares.setdefault(worker, []).append(i)
        load[worker] += len(requests[i].seeds)
    return {worker: sorted(share) for worker, share in shares.items()}


# ---------------------------------------------------------------- workers on this machine


class LocalWorkers:
    """K `retrograd rollout-worker` subprocesses on 127.0.0.1 (start_local_workers); close()
    ends them, and so does garbage collection or interpreter exit if nobody did."""

    def __init__(self, processes: list[subprocess.Popen], urls: list[str], folder: Path):
        self.processes, self.urls = processes, urls
        self._finalizer = weakref.finalize(self, _stop_all, list(processes), folder)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._finalizer()


def start_local_workers(
    k: int,
    model_path: str | Path | None,
    options: SamplerOptions,
    threads: int | None = None,
    *,
    startup_timeout_s: float = 300.0,
) -> LocalWorkers:
    """K workers on free ports of 127.0.0.1 with `options`, each with `threads` llama.cpp
    threads (default: an equal share of this process's CPUs); returns once all serve."""
    if k < 1:
        raise ConfigError(f"rollout workers: {k} local workers asked, at least 1 expected")
    threads = max(1, len(os.sched_getaffinity(0)) // k) if threads is None else threads
    path = Path(model_path) if model_path is not None else default_model_path()
    command = [
        sys.executable, "-m", "retrograd", "rollout-worker", "--model", str(path), "--port", "0",
        "--ctx", str(options.n_ctx), "--concurrency", str(options.n_seq_max), "--kv-dtype", options.kv_dtype,
        "--threads", str(threads),
    ]  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="retrograd-workers-"))
    processes: list[subprocess.Popen] = []
    try:
        for i in range(k):  # all load their model at once
            with open(folder / f"{i}.out", "wb") as out, open(folder / f"{i}.err", "wb") as err:
                processes.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err))
        deadline = time.monotonic() + startup_timeout_s
        urls = [
            _ready_url(p, folder / f"{i}.out", folder / f"{i}.err", deadline, startup_timeout_s)
            for i, p in enumerate(processes)
        ]
    except BaseException:
        _stop_all(processes, folder)
        raise
    return LocalWorkers(processes, urls, folder)


def _ready_url(process: subprocess.Popen, out: Path, err: Path, deadline: float, timeout_s: float) -> str:
    """The URL of the worker's ready line, or one line with its stderr's tail."""
    while True:
        lines = out.read_text(errors="replace").split("\n")[:-1]  # complete lines only
        ready = next((line for line in lines if line.startswith(READY_PREFIX)), None)
        if ready is not None:
            return ready.removeprefix(READY_PREFIX).split()[0]
        exited = process.poll()
        if exited is not None or time.monotonic() > deadline:
            why = f"exited with status {exited}" if exited is not None else f"did not listen within {timeout_s:.0f} s"
            tail = " | ".join(err.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
            raise DataError(f"rollout worker (pid {process.pid}) {why}; stderr: {tail or '(empty)'}")
        time.sleep(0.05)


def _stop_all(processes: list[subprocess.Popen], folder: Path, grace_s: float = 30.0) -> None:
    """SIGTERM (the worker frees its model and adapter files), SIGKILL after grace_s."""
    for p in processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    shutil.rmtree(folder, ignore_errors=True)
