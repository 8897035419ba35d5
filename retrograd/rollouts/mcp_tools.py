"""MCP servers as tools: `[[agent.mcp_servers]]` and the `mcp.json` files of
`agent.mcp_config` (`{"mcpServers": {NAME: {"command": ..., "args": [...], "env": {...}}}}`
or `{NAME: {"url": ..., "headers": {...}}}`, `${VAR}` expanded when read; a variable that is
not set is an error).

A server is a program we start that speaks MCP on its stdin and stdout (`command`), or one
already listening over streamable HTTP (`url`, with `headers`). Each is connected once per run
and shared by all trajectories, so with an environment declared (whose sandboxes hold each
trajectory's own state) a server must say it keeps none (`stateless = true`). Its tools that
`allowed_tools` and `denied_tools` keep (`*` wildcards, deny wins) join every toolset and are
rendered into the chat template like our own. A server that cannot be reached at start-up
stops the run, unless `required = false`: then its tools are left out and the run says so.
The client is async, the rollout engine is threads: the servers live on an event loop of
their own thread, to which a trajectory's thread hands its call and waits. A call that times
out (`tool_timeout_secs`), gets a protocol error back or finds the server gone breaks that
trajectory only (stop `tool_broken`, the cause recorded) and the run goes on; a server that
went away is connected again (a stdio one started again) for the next call. A tool's own
failure (`isError`) is an error observation: the episode goes on. (`mcp` is imported when a
server starts: it takes a second.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import os
import re
import threading
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from retrograd.errors import ConfigError, RetrogradError
from retrograd.rollouts.sandbox.options import checked_kwargs
from retrograd.rollouts.tools import Tool, ToolResult, clip, make_tool

WHERE = "agent.mcp_servers"
BROKEN = "tool_broken"  # the stop reason of a trajectory whose mcp server failed it
START_TIMEOUT_SECS = 60.0  # to spawn a server and have its tool list
STOP_TIMEOUT_SECS = 10.0  # the mcp client closes stdin, then terminates, then kills
NAME = re.compile(r"[A-Za-z0-9_-]+")
VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
TRANSPORTS = ("stdio", "streamable_http")  # [[agent.mcp_servers]] transport.type
# what an mcp.json server may say besides its transport: our keys, as [[agent.mcp_servers]] has them
SERVER_KEYS = ("allowed_tools", "denied_tools", "required", "stateless", "tool_timeout_secs", "max_tool_result_bytes")
ALWAYS_PASSED = ("PATH", "HOME")  # reach a stdio server whatever env_passthrough says


class McpServerError(RetrogradError):
    """A server cannot be started or listed at start-up: the run stops before the model loads."""


@dataclass(frozen=True)
class McpServerOptions:
    name: str
    command: tuple[str, ...] = ()  # stdio: argv; the server speaks MCP on its stdin and stdout
    url: str | None = None  # streamable HTTP: the endpoint of a server that is already listening
    headers: tuple[tuple[str, str], ...] = ()  # sent with every HTTP request
    env: tuple[tuple[str, str], ...] = ()  # stdio: over the variables passed on
    env_passthrough: tuple[str, ...] | None = None  # stdio: this process's variables passed on (None: all)
    cwd: str | None = None  # relative to the TOML's folder (an mcp.json's own folder)
    allowed_tools: tuple[str, ...] = ("*",)
    denied_tools: tuple[str, ...] = ()
    required: bool = True  # false: a server that cannot be reached at start-up is left out
    stateless: bool = False  # its tools keep no state between calls (needed beside an environment)
    tool_timeout_secs: float = 30.0
    max_tool_result_bytes: int = 65536

    def keeps(self, tool: str) -> bool:
        return (any(fnmatchcase(tool, p) for p in self.allowed_tools)
                and not any(fnmatchcase(tool, p) for p in self.denied_tools))

    def environment(self) -> dict[str, str]:
        """A stdio server's variables: this process's that pass, then `env`."""
        passed = os.environ if self.env_passthrough is None else {
            k: v for k, v in os.environ.items() if k in self.env_passthrough or k in ALWAYS_PASSED}
        return dict(passed) | dict(self.env)

    def describe(self) -> str:
        return self.url or " ".join(self.command)


def server_options(servers, mcp_config, base_dir: Path, *, environment: bool = False) -> tuple[McpServerOptions, ...]:
    """`agent.mcp_servers` and the servers of the `agent.mcp_config` files, every problem at
    once. `environment`: the run declares [agent.environment] (each server must be stateless)."""
    problems: list[str] = []
    tables: list[tuple[str, dict]] = []
    if isinstance(servers, (list, tuple)) and all(isinstance(table, dict) for table in servers):
        tables += [(f"{WHERE}[{i}]", table) for i, table in enumerate(servers)]
    else:
        problems.append(f"{WHERE}: expected an array of tables [[{WHERE}]]")
    paths = [mcp_config] if isinstance(mcp_config, str) else mcp_config if mcp_config is not None else []
    if isinstance(paths, (list, tuple)) and all(isinstance(path, str) and path for path in paths):
        for path in paths:
            tables += _mcp_json(base_dir / path, problems)
    else:
        problems.append(f"agent.mcp_config = {mcp_config!r}: expected the path of an mcp.json file or a list of them")
    options = [_server(table, where, base_dir, problems) for where, table in tables]
    names = [o.name for o in options if o is not None]
    problems += [f"{WHERE}: two servers are named {name!r}" for name in sorted({n for n in names if names.count(n) > 1})]
    if environment:
        problems += [f"{where}.stateless: [agent.environment] is declared, and this server is shared by every trajectory; "
                     f"set stateless = true if its tools keep no state between calls, or leave it out"
                     for (where, _), o in zip(tables, options) if o is not None and not o.stateless]
    if problems:
        raise ConfigError("; ".join(problems))
    return tuple(options)


def _server(table: dict, where: str, base_dir: Path, problems: list[str]) -> McpServerOptions | None:
    before = len(problems)
    table = _flattened(table, where, problems)
    maps = {}
    for key in ("env", "headers"):
        value = _expanded(table.get(key, {}), f"{where}.{key}", problems)
        if isinstance(value, dict) and all(isinstance(item, str) for item in value.values()):
            maps[key] = tuple(sorted(value.items()))
        else:
            problems.append(f"{where}.{key} = {table.get(key)!r}: expected a table of strings")
    passthrough = table.get("env_passthrough")
    if passthrough is not None and not (isinstance(passthrough, list) and all(isinstance(v, str) for v in passthrough)):
        problems.append(f"{where}.env_passthrough = {passthrough!r}: expected a list of variable names")
    kwargs = checked_kwargs(McpServerOptions, {k: v for k, v in table.items() if k not in ("env", "headers", "env_passthrough")},
                            where, problems)
    checks = [("name", lambda v: NAME.fullmatch(v), "a name of letters, digits, '_' or '-'"),
              ("command", lambda v: len(v) > 0, "a non-empty argv list"),
              ("url", lambda v: v.startswith(("http://", "https://")), "an http:// or https:// address"),
              ("tool_timeout_secs", lambda v: v > 0, "a number > 0"),
              ("max_tool_result_bytes", lambda v: v >= 256, "an integer >= 256")]
    problems += [f"{where}.{key} = {kwargs[key]!r}: expected {want}" for key, ok, want in checks
                 if key in kwargs and not ok(kwargs[key])]
    if "name" not in table:
        problems.append(f"{where}.name is required")
    if ("command" in table) == ("url" in table):
        problems.append(f"{where}: give exactly one of command = [...] (a stdio server) and url = \"http://...\" "
                        "(a streamable HTTP server)")
    elif "url" in table:
        stdio_only = [key for key in ("env", "env_passthrough", "cwd") if key in table]
        problems += [f"{where}.{key}: only for a stdio server (command = [...])" for key in stdio_only[:1]]
    elif "headers" in table:
        problems.append(f"{where}.headers: only for a streamable HTTP server (url = ...)")
    if "cwd" in kwargs:
        kwargs["cwd"] = str((base_dir / kwargs["cwd"]).resolve())
        if not os.path.isdir(kwargs["cwd"]):
            problems.append(f"{where}.cwd = {table['cwd']!r}: {kwargs['cwd']} is not a folder")
    if len(problems) > before:
        return None
    return McpServerOptions(**kwargs, **maps, env_passthrough=None if passthrough is None else tuple(passthrough))


def _flattened(table: dict, where: str, problems: list[str]) -> dict:
    """The Rust retrograd's nested `transport = {type = "stdio" | "streamable_http", ...}`
    as the server's own keys."""
    transport = table.get("transport")
    if transport is None:
        return table
    kind = transport.get("type") if isinstance(transport, dict) else None
    if kind not in TRANSPORTS:
        problems.append(f"{where}.transport = {transport!r}: expected a table with type = \"stdio\" or \"streamable_http\"")
        return {k: v for k, v in table.items() if k != "transport"}
    inner = {k: v for k, v in transport.items() if k != "type"}
    both = sorted(set(inner) & set(table))
    if both:
        problems.append(f"{where}.transport.{both[0]}: also given outside transport; give it once")
    return {k: v for k, v in table.items() if k != "transport"} | inner


def _mcp_json(path: Path, problems: list[str]) -> list[tuple[str, dict]]:
    """An mcp.json file's servers as [[agent.mcp_servers]] tables."""
    where = f"agent.mcp_config {path}"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        problems.append(f"{where}: cannot read it: {error}")
        return []
    servers = doc.get("mcpServers") if isinstance(doc, dict) else None
    if not isinstance(servers, dict):
        problems.append(f"{where}: expected {{\"mcpServers\": {{NAME: {{\"command\": ..., \"args\": [...]}}}}}}")
        return []
    tables = []
    for name, entry in servers.items():
        at = f"{where} mcpServers.{name}"
        if not isinstance(entry, dict):
            problems.append(f"{at}: expected an object with command, args, env")
            continue
        # env and headers are expanded by _server, as a TOML table's are: once
        entry = {key: value if key in ("env", "headers") else _expanded(value, f"{at}.{key}", problems)
                 for key, value in entry.items()}
        kind = entry.get("type", "streamable_http" if "url" in entry else "stdio")
        if "url" in entry or kind in ("http", "streamable_http", "streamable-http"):
            unknown = [key for key in entry if key not in ("url", "headers", "type", *SERVER_KEYS)]
            if unknown or kind not in ("http", "streamable_http", "streamable-http"):
                problems.append(f"{at}.{unknown[0] if unknown else 'type'}: expected a streamable HTTP server "
                                "(known: url, headers, type = \"http\")")
                continue
            tables.append((at, {"name": name} | {key: value for key, value in entry.items() if key != "type"}))
            continue
        unknown = [key for key in entry if key not in ("command", "args", "env", "cwd", "type", "env_passthrough", *SERVER_KEYS)]
        if unknown or kind != "stdio":
            problems.append(f"{at}.{unknown[0] if unknown else 'type'}: expected a stdio server "
                            "(known: command, args, env, cwd, type = \"stdio\") or a streamable HTTP one (url, headers)")
            continue
        args = entry.get("args", [])
        table = {key: value for key, value in entry.items() if key not in ("command", "args", "type")}
        command = entry.get("command")
        if not (isinstance(command, str) and isinstance(args, list)):
            problems.append(f"{at}: expected \"command\": a string and \"args\": a list of strings")
            continue
        if "cwd" in table and isinstance(table["cwd"], str):
            table["cwd"] = str(path.parent / table["cwd"])
        tables.append((at, {"name": name, "command": [command, *args]} | table))
    return tables


def _expanded(value, where: str, problems: list[str]):
    """`${VAR}` replaced in every string; a variable that is not set fails closed."""
    if isinstance(value, dict):
        return {key: _expanded(item, where, problems) for key, item in value.items()}
    if isinstance(value, list):
        return [_expanded(item, where, problems) for item in value]
    if not isinstance(value, str):
        return value

    def variable(match: re.Match) -> str:
        if match.group(1) not in os.environ:
            problems.append(f"{where}: ${{{match.group(1)}}} is not set")
            return ""
        return os.environ[match.group(1)]
    return VARIABLE.sub(variable, value)


class McpServers:
    """The run's servers, started at once, on one event-loop thread; `tools` are theirs."""

    def __init__(self, options: tuple[McpServerOptions, ...]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="retrograd-mcp", daemon=True)
        self.thread.start()
        self.servers: list[_Server] = []
        self.left_out: list[str] = []  # why each server that is not required was left out
        try:
            tools: list[Tool] = []
            for o in options:
                server = _Server(o, self.loop)
                try:
                    tools += server.start()
                except McpServerError as error:
                    server.stop()
                    if o.required:
                        raise
                    self.left_out.append(f"{error}; required = false, so its tools are left out")
                    continue
                self.servers.append(server)
            names = [tool.name for tool in tools]
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:
                raise McpServerError(f"{WHERE}: two servers offer a tool named {twice[0]!r}; deny it on one of them")
            self.tools = tuple(tools)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class _Server:
    """One server: its session while it lives, restarted by the first call after it died."""

    def __init__(self, options: McpServerOptions, loop: asyncio.AbstractEventLoop):
        self.options, self.loop = options, loop
        self.lock = threading.Lock()
        self.session = None  # mcp.ClientSession
        self.stopping: asyncio.Event | None = None
        self.serving: concurrent.futures.Future | None = None
        self.dead = False

    def start(self) -> list[Tool]:
        o = self.options
        where = f"{WHERE} {o.name!r}"
        return [make_tool(f"mcp.{o.name}.{t.name}", 1, t.name, t.description or "", t.input_schema,
                          functools.partial(self.call, t.name), f"{where} tool {t.name!r}")
                for t in self._connect() if o.keeps(t.name)]

    def _connect(self) -> list:
        """Spawns the server and waits for its tool list."""
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self.serving = asyncio.run_coroutine_threadsafe(self._serve(ready), self.loop)
        where = f"{WHERE} {self.options.name!r} ({self.options.describe()})"
        try:
            self.session, self.stopping, tools = ready.result(timeout=START_TIMEOUT_SECS)
        except concurrent.futures.TimeoutError:
            self.serving.cancel()
            raise McpServerError(f"{where}: no tool list within {START_TIMEOUT_SECS:g} s") from None
        except Exception as error:
            error = _innermost(error)
            fails = "cannot be started" if self.options.url is None else "cannot be reached"
            raise McpServerError(f"{where}: {fails}: {type(error).__name__}: {error}") from None
        return tools

    async def _serve(self, ready: concurrent.futures.Future) -> None:
        """Holds the session open (its context must end in the task that began it) until stop()."""
        from mcp import ClientSession
        from mcp.types import PaginatedRequestParams

        stopping = asyncio.Event()
        try:
            async with self._transport() as streams, ClientSession(*streams[:2]) as session:
                await session.initialize()
                tools, cursor = [], None
                while True:
                    listing = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
                    tools += listing.tools
                    cursor = listing.next_cursor
                    if not cursor:
                        break
                ready.set_result((session, stopping, tools))
                await stopping.wait()
        except Exception as error:
            if not ready.done():
                ready.set_exception(error)

    @contextlib.asynccontextmanager
    async def _transport(self):
        """The (read, write) streams of a stdio process we start, or of a streamable HTTP session."""
        o = self.options
        if o.url is None:
            from mcp import StdioServerParameters, stdio_client

            params = StdioServerParameters(command=o.command[0], args=list(o.command[1:]), env=o.environment(), cwd=o.cwd)
            async with stdio_client(params) as streams:
                yield streams
            return
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        async with create_mcp_http_client(headers=dict(o.headers)) as client, \
                streamable_http_client(o.url, http_client=client) as streams:
            yield streams

    def stop(self) -> None:
        if self.serving is None:
            return
        if self.stopping is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)
        try:
            self.serving.result(timeout=STOP_TIMEOUT_SECS)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            self.serving.cancel()
        self.serving = self.session = self.stopping = None

    def call(self, tool: str, sandbox, arguments: dict) -> ToolResult:
        """One call (Tool.run; `sandbox` is not the server's concern)."""
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED

        o = self.options
        where = f"mcp server {o.name!r}, tool {tool!r}"
        try:
            with self.lock:
                if self.dead:
                    self.stop()
                    self._connect()
                    self.dead = False
                session = self.session
        except McpServerError as error:
            return ToolResult(f"{where}: restart failed: {error}", is_error=True, broken=BROKEN)
        future = asyncio.run_coroutine_threadsafe(
            session.call_tool(tool, arguments, read_timeout_seconds=o.tool_timeout_secs), self.loop)
        try:
            result = future.result(timeout=o.tool_timeout_secs + STOP_TIMEOUT_SECS)
        except MCPError as error:
            if error.code == CONNECTION_CLOSED:
                with self.lock:
                    self.dead = self.dead or self.session is session
            return ToolResult(f"{where}: {error}", is_error=True, broken=BROKEN)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return ToolResult(f"{where}: no reply within {o.tool_timeout_secs:g} s", is_error=True, broken=BROKEN)
        except Exception as error:  # a reply the client cannot read, a server that cannot be reached
            with self.lock:
                self.dead = self.dead or self.session is session  # the next call connects again
            error = _innermost(error)
            return ToolResult(f"{where}: {type(error).__name__}: {error}", is_error=True, broken=BROKEN)
        return ToolResult(clip(_text(result), o.max_tool_result_bytes), is_error=bool(result.is_error))


def _innermost(error: BaseException) -> BaseException:
    """The one error inside the task groups' exception groups (anyio's transports raise them)."""
    while isinstance(getattr(error, "exceptions", None), tuple) and len(error.exceptions) == 1:  # (Python 3.10: a backport's)
        error = error.exceptions[0]
    return error


def _text(result) -> str:
    """The text blocks of a result; other blocks by their kind, structured content as JSON."""
    parts = [block.text if block.type == "text" else f"[{block.type} content]" for block in result.content]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, sort_keys=True))
    return "\n".join(parts)
