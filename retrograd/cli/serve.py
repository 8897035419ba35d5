"""`retrograd serve`: the base and its adapters behind an OpenAI-compatible HTTP API
(retrograd/serving/serve.py). The port is bound before the model loads, so a port in use (or an
address other machines reach, without a key) costs nothing but one line."""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import Annotated

import typer

from retrograd.cli.app import app
from retrograd.cli.chat import ChatTemplateOpt, CtxOpt, ThreadsOpt
from retrograd.cli.options import ApiKeyOpt, ModelOpt
from retrograd.errors import ConfigError
from retrograd.runtime.http_guard import require_key_off_loopback, resolve_api_key

MAX_REQUEST_BYTES = 4 * 2**20  # a prompt must fit the context anyway: 4 MiB is ~1M tokens of text
MAX_QUEUE = 16  # requests waiting for the model while one generates


@app.command(
    epilog="Examples: retrograd serve --adapter out/adapter.gguf | "
    "retrograd serve --model base.gguf --adapter tuned=out/adapter.gguf --adapter old=v1.gguf --port 8000"
)
def serve(
    model: ModelOpt = None,
    adapter: Annotated[
        list[str] | None,
        typer.Option(
            "--adapter",
            "-a",
            metavar="[NAME=]PATH",
            help="LoRA GGUF served as model NAME (default: the file's stem); repeatable.",
        ),
    ] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port (0: any free one).")] = 8080,
    chat_template: ChatTemplateOpt = None,
    ctx: CtxOpt = 4096,
    threads: ThreadsOpt = 0,
    api_key: ApiKeyOpt = None,
    max_request_bytes: Annotated[
        int, typer.Option("--max-request-bytes", min=1, help="Larger request bodies get 413.")
    ] = MAX_REQUEST_BYTES,
    max_queue: Annotated[
        int, typer.Option("--max-queue", min=0, help="Requests that may wait while one generates; more get 429.")
    ] = MAX_QUEUE,
) -> None:
    """Serve the model as `base` and each adapter by name at /v1 (chat/completions, completions, models)."""
    key = resolve_api_key(api_key)
    require_key_off_loopback(host, key)  # before the server's imports (uvicorn, fastapi, llama.cpp: about 1 s)
    import uvicorn

    from retrograd.runtime.bundled import default_model_path
    from retrograd.serving.inference import Inference
    from retrograd.serving.serve import create_app

    adapters = named_adapters(adapter or [])
    sock = bind(host, port)
    with (
        sock,
        Inference(
            model or default_model_path(), adapters, n_ctx=ctx, n_threads=threads, chat_template=chat_template
        ) as inference,
    ):
        bound_host, bound_port = sock.getsockname()[:2]
        url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
        print(f"serving {', '.join(inference.names)} at http://{url_host}:{bound_port}/v1 (Ctrl-C stops)", flush=True)
        api = create_app(inference, api_key=key, max_request_bytes=max_request_bytes, max_queue=max_queue)
        server = uvicorn.Server(uvicorn.Config(api, log_level="warning", timeout_graceful_shutdown=5))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for, or not, as asyncio's timing goes
            pass
        finally:
            api.state.closing.set()
            with api.state.lock:  # a generation still running in a worker thread ends before the model is freed
                pass
    if server.should_exit:  # stopped by Ctrl-C (SIGTERM ends the process inside uvicorn): always status 130
        raise typer.Exit(130)


def named_adapters(args: list[str]) -> dict[str, Path]:
    """NAME=PATH or PATH (named by its stem) -> {name: path}; names are unique."""
    from retrograd.serving.inference import BASE

    named: dict[str, Path] = {}
    for arg in args:
        name, sep, rest = arg.partition("=")
        if not (sep and name and rest) or Path(arg).exists():
            name, path = Path(arg).stem, Path(arg)
        else:
            path = Path(rest)
        if name == BASE or name in named:
            raise ConfigError(
                f"--adapter {arg}: the model name {name!r} is {'the base' if name == BASE else 'taken'}; name it with NAME=PATH"
            )
        named[name] = path
    return named


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or one line saying why not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: not an address this machine can listen on ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise ConfigError(f"--port {port}: {host}:{port} {why}") from None
    sock.listen(2048)  # connections wait in the backlog while the model loads, not refused
    return sock
