"""A rollout worker: one Sampler behind HTTP (FastAPI), for retrograd.sampler.remote's client.

GET /info          the model (path, file and tokenizer fingerprints), the sampler options,
                   end-of-generation ids, placement, the adapter version last pushed, whether
                   a call is running, the tokens sampled so far (answered while busy) and the
                   adapter's folder in memory-backed storage
POST /generate     {"requests": [{"prompt", "seeds", "max_new_tokens", "temperature", "top_p"}]}
                   -> {"completions": [[{"tokens", "logprobs", "finish", "prefilled", "reused"}]],
                       "adapter_version"}: every request of the call in one Sampler.generate
                   (its continuous batching), the version the whole batch was sampled with
POST /adapter      remote.encode_adapter's body: a JSON header (alpha, version, each tensor's name
                   and shapes) and one float32 blob of the tensors (none: the base model)
                   -> the refresh timing and the version now live; a refused push leaves the
                   adapter and version live before it in place

Calls take turns on the one Sampler (a lock). A refusal is 4xx with
{"error": {"message": one line, "kind": the retrograd.errors class}}, never a traceback.
In front of every route (retrograd.runtime.http_guard.Guard): with an API key, 401 without
`Authorization: Bearer KEY`; 413 for a /generate body over 16 MiB or an /adapter body over
what a LoRA of `max_adapter_rank` on every matrix of the model would take.
"""

from __future__ import annotations

import os
import threading
from math import prod
from pathlib import Path
from typing import Annotated

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from retrograd.errors import RetrogradError
from retrograd.gguf.adapter import LoRAWeights
from retrograd.runtime.http_guard import Guard
from retrograd.sampler import GroupRequest, Sampler, Sampling
from retrograd.sampler.remote import ADAPTER_HEADER_SIZE, ADAPTER_MAGIC, completion_json, error_json, model_identity

MAX_ADAPTER_HEADER_BYTES = 1 << 20  # some 10,000 tensors' names and shapes
MAX_GENERATE_BYTES = 16 << 20  # some 2.4 million prompt tokens per call


class GroupBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Annotated[list[int], Field(min_length=1)]
    seeds: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_new_tokens: Annotated[int, Field(ge=1)]
    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0

    def group(self) -> GroupRequest:
        return GroupRequest(self.prompt, self.seeds, Sampling(self.max_new_tokens, self.temperature, self.top_p))


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    requests: list[GroupBody]


# A LoRA matrix, or an expert stack of them; dims bounded so that numpy can hold any shape of zero size.
Shape = Annotated[list[Annotated[int, Field(ge=0, le=1 << 20)]], Field(min_length=2, max_length=3)]


class AdapterTensor(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, Field(min_length=1)]
    a: Shape
    b: Shape


class AdapterHeader(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    alpha: Annotated[float, Field(allow_inf_nan=False)]
    version: Annotated[str, Field(min_length=1, max_length=100)]  # the client's id and push count (remote.py)
    tensors: list[AdapterTensor]


class Refusal(Exception):
    def __init__(self, status: int, message: str, kind: str = "DataError"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def create_app(sampler: Sampler, model_path: Path, *, api_key: str | None, max_adapter_rank: int) -> FastAPI:
    """The app over `sampler`, behind a Guard with `api_key` (None: no key asked);
    `app.state.lock` is held while the sampler works (the CLI takes it before closing the
    sampler)."""
    app = FastAPI(title="retrograd rollout worker", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=MAX_GENERATE_BYTES,
        refusal=lambda status, message: error_json(message, "ConfigError" if status == 401 else "DataError"),
        path_limits={"/adapter": adapter_body_limit(sampler.adapter.base_shapes, max_adapter_rank)},
    )
    app.state.lock = lock = threading.Lock()
    identity = model_identity(model_path)
    options = sampler.options
    threads = options.n_threads or len(os.sched_getaffinity(0))  # as the Sampler counts them
    state = {"adapter_version": None}  # None: nothing pushed, the base model

    @app.get("/info")
    def info() -> dict:
        return {
            "model": str(model_path),
            "model_fingerprint": identity.file,
            "tokenizer_fingerprint": identity.tokenizer,
            "n_ctx": options.n_ctx,
            "n_seq_max": options.n_seq_max,
            "kv_dtype": options.kv_dtype,
            "threads": threads,
            "eog_ids": sorted(sampler.eog_ids),
            "placement": sampler.placement.describe(),
            "adapter_version": state["adapter_version"],
            "busy": lock.locked(),  # a call is using the sampler now
            "sampled": sampler.stats.sampled,  # tokens sampled since the worker started
            "adapter_folder": str(sampler.adapter.folder),  # left behind if the worker is SIGKILLed
        }

    @app.post("/generate")
    async def generate(request: Request) -> dict:
        try:
            body = GenerateBody.model_validate_json(await request.body())
        except ValidationError as e:
            raise Refusal(400, first_problem(e)) from None

        def run():
            with lock:
                return sampler.generate([r.group() for r in body.requests]), state["adapter_version"]

        try:
            groups, version = await anyio.to_thread.run_sync(run)
        except RetrogradError as e:
            raise Refusal(400, str(e), type(e).__name__) from None
        return {"completions": [[completion_json(c) for c in g] for g in groups], "adapter_version": version}

    @app.post("/adapter")
    async def adapter(request: Request) -> dict:
        tensors, alpha, version = read_adapter_body(await request.body())

        def refresh():
            with lock:
                timing = sampler.set_adapter(tensors or None, alpha=alpha)
                state["adapter_version"] = version
                return timing

        try:
            timing = await anyio.to_thread.run_sync(refresh)
        except RetrogradError as e:
            raise Refusal(400, str(e), type(e).__name__) from None
        return {
            "adapter_version": version,
            "write_s": timing.write_s,
            "init_s": timing.init_s,
            "set_s": timing.set_s,
            "total_s": timing.total_s,
        }

    @app.exception_handler(Refusal)
    async def _refused(_: Request, e: Refusal) -> JSONResponse:
        return JSONResponse(error_json(one_line(e.message), e.kind), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(error_json(one_line(str(e.detail)), "DataError"), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_json(one_line(f"internal error: {type(e).__name__}: {e}"), "RetrogradError"), 500)

    return app


def adapter_body_limit(base_shapes: dict[str, tuple[int, ...]], max_rank: int) -> int:
    """The bytes of the largest POST /adapter body worth reading: a float32 LoRA of `max_rank`
    on every matrix and expert stack of the model, behind the largest header."""
    matrices = [shape for shape in base_shapes.values() if len(shape) in (2, 3)]
    per_rank = sum(prod(shape[:-2]) * (shape[-2] + shape[-1]) for shape in matrices)
    return len(ADAPTER_MAGIC) + ADAPTER_HEADER_SIZE.size + MAX_ADAPTER_HEADER_BYTES + 4 * max_rank * per_rank


def read_adapter_body(body: bytes) -> tuple[dict[str, LoRAWeights], float, str]:
    """The body of POST /adapter (remote.encode_adapter) -> (tensors by base weight name, alpha,
    version). The tensors are read-only views of `body`, so nothing is parsed per array; their
    shapes are the Sampler's to check against the model."""
    prefix = len(ADAPTER_MAGIC) + ADAPTER_HEADER_SIZE.size
    if len(body) < prefix or not body.startswith(ADAPTER_MAGIC):
        raise Refusal(
            400, f"the body is not an adapter as encode_adapter writes it (starting {ADAPTER_MAGIC.decode()})"
        )
    (header_size,) = ADAPTER_HEADER_SIZE.unpack_from(body, len(ADAPTER_MAGIC))
    if header_size > min(MAX_ADAPTER_HEADER_BYTES, len(body) - prefix):
        raise Refusal(
            400, f"the header's length {header_size} exceeds the body or the limit of {MAX_ADAPTER_HEADER_BYTES} bytes"
        )
    try:
        header = AdapterHeader.model_validate_json(body[prefix : prefix + header_size])
    except ValidationError as e:
        raise Refusal(400, first_problem(e, "the header")) from None
    start = prefix + header_size
    sizes = [(prod(t.a), prod(t.b)) for t in header.tensors]
    described, held = 4 * sum(a + b for a, b in sizes), len(body) - start
    if described != held:
        raise Refusal(400, f"the header's tensors take {described} bytes, {held} follow it")
    tensors = {}
    for t, (a_size, b_size) in zip(header.tensors, sizes):
        if t.name in tensors:
            raise Refusal(400, f"tensor {t.name} is listed twice")
        a = np.frombuffer(body, "<f4", a_size, start).reshape(t.a)
        b = np.frombuffer(body, "<f4", b_size, start + 4 * a_size).reshape(t.b)
        tensors[t.name] = LoRAWeights(a, b)
        start += 4 * (a_size + b_size)
    return tensors, header.alpha, header.version


def first_problem(e: ValidationError, what: str = "the body") -> str:
    """A pydantic error as one line: where in `what`, and what."""
    first = e.errors()[0]
    if first["type"] == "json_invalid":
        return f"{what} is not valid JSON"
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def one_line(text: str) -> str:
    return " ".join(text.split())[:1000] or "error"
