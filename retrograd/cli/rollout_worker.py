"""`retrograd rollout-worker`: one Sampler behind HTTP for trainers on other processes or
machines (retrograd/serving/rollout_worker.py, client in retrograd/sampler/remote.py). The port is
bound before the model loads, so a port in use costs one line; once serving, the worker
prints one line `rollout-worker: listening on http://HOST:PORT (MODEL)` (with --port 0, the
port it got). Off loopback it needs an API key (--api-key or $RETROGRAD_API_KEY), which
every request must then send as `Authorization: Bearer KEY`. SIGTERM, like Ctrl-C, stops it
after the call in progress, freeing the model and the adapter files in /dev/shm."""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from retrograd.cli.app import app
from retrograd.cli.chat import ThreadsOpt
from retrograd.cli.options import ApiKeyOpt, ModelOpt
from retrograd.cli.serve import bind
from retrograd.runtime.http_guard import require_key_off_loopback, resolve_api_key


@app.command(
    "rollout-worker",
    epilog="Example: retrograd rollout-worker --model base.gguf --port 8101 --ctx 1024 --concurrency 16 --threads 4",
)
def rollout_worker(
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port (0: any free one).")] = 8101,
    ctx: Annotated[
        int, typer.Option("--ctx", min=2, help="Positions per sequence: prompt + new tokens (\\[training] ctx).")
    ] = 512,
    concurrency: Annotated[
        int,
        typer.Option("--concurrency", min=1, help="Sequences decoding together (\\[training] generation_concurrency)."),
    ] = 8,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="f16 (fast) or f32 (\\[training] kv_dtype).")] = "f16",
    threads: ThreadsOpt = 0,
    api_key: ApiKeyOpt = None,
    max_adapter_rank: Annotated[
        int,
        typer.Option(
            "--max-adapter-rank", min=1, help="Largest LoRA rank a push may carry (bounds the bytes of POST /adapter)."
        ),
    ] = 256,
) -> None:
    """Serve GRPO / distillation rollouts of the model with a live LoRA (GET /info, POST /generate, POST /adapter)."""
    import uvicorn

    from retrograd.runtime.bundled import default_model_path
    from retrograd.sampler import Sampler, SamplerOptions
    from retrograd.serving.rollout_worker import create_app

    options = SamplerOptions(n_ctx=ctx, n_seq_max=concurrency, kv_dtype=kv_dtype, n_threads=threads)
    path = model or default_model_path()
    key = resolve_api_key(api_key)
    require_key_off_loopback(host, key)
    sock = bind(host, port)
    signal.signal(signal.SIGTERM, _interrupt)  # uvicorn re-raises it after its shutdown: unwind, then exit
    try:
        with sock, Sampler(path, options) as sampler:
            api = create_app(sampler, path, api_key=key, max_adapter_rank=max_adapter_rank)
            bound_host, bound_port = sock.getsockname()[:2]
            url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
            print(f"rollout-worker: listening on http://{url_host}:{bound_port} ({path})", flush=True)
            server = uvicorn.Server(
                uvicorn.Config(api, log_level="warning", timeout_graceful_shutdown=5, timeout_keep_alive=3600)
            )
            try:
                server.run(sockets=[sock])
            finally:
                with api.state.lock:  # a call still running in a worker thread ends before the model is freed
                    pass
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
