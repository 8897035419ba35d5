"""Environments that are servers: an http environment (the Rust retrograd's routes) and MCP
servers as tools, each against a reference server written here (on loopback / over stdio),
also one that hangs, answers garbage or dies mid-episode: that trajectory ends with its
cause and the run goes on. Client level, the engine with a scripted policy, and a real
agentic GRPO update on the bundled SmolLM2."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from loopback import send_json
from test_agent import ScriptedPolicy, call
from test_agent_grpo import LENGTH_JUDGE, RETROGRAD

from retrograd.config import load_config
from retrograd.errors import ConfigError
from retrograd.model.tokenizer import Tokenizer
from retrograd.recipes import agent_grpo
from retrograd.recipes.agent_grpo import open_task, train
from retrograd.recipes.common import prepare
from retrograd.rollouts.http_env import EnvironmentBroken, HttpEnvironment, HttpEnvironmentOptions, HttpEpisode
from retrograd.rollouts.mcp_tools import McpServerError, McpServers, server_options
from retrograd.rollouts.scenarios import Scenario
from retrograd.rollouts.tools import ToolCatalog
from retrograd.training.report import SilentReporter

# ---------------------------------------------------------------- the reference http environment

GUESS = {"type": "function", "function": {
    "name": "guess", "description": "Guess the secret number, an integer from 1 to 3.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}}
SECRET = 2
WRONG = -0.25
# guesses that make the server misbehave instead of answering
HANG, GARBAGE, DIE, GONE = 0, -1, 99, 404


class GuessServer:
    """Guess the secret (2): a wrong guess earns -0.25 and a hint, the right one 1.0 and ends
    the episode. It logs every route it serves and every reward it gives."""

    def __init__(self):
        self.episodes: dict[str, dict] = {}
        self.resets: list[dict] = []
        self.closed: list[str] = []
        self.rewards: list[float] = []
        self.opening: str | None = "Game {seed}: guess the number."  # None: no opening observation
        self.dead = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.serve(self, "GET", None)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.serve(self, "POST", body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads, self.http.block_on_close = True, False
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        if not self.dead:
            self.http.shutdown()
        self.http.server_close()

    def serve(self, handler, method: str, body):
        if self.dead:  # a process that died answers nothing
            return self._hang_up(handler)
        route = handler.path
        if method == "GET" and route == "/tools":
            return send_json(handler, 200, {"tools": [GUESS]})
        if method == "POST" and route == "/reset":
            env_id = f"e{len(self.resets)}"
            self.resets.append(body)
            self.episodes[env_id] = {"guesses": [], "solved": False}
            opening = None if self.opening is None else self.opening.format(seed=body["seed"])
            return send_json(handler, 200, {"env_id": env_id, "observation": opening})
        if method == "POST" and route == "/step":
            return self._step(handler, body["env_id"], body["call"])
        if method == "GET" and route.startswith("/state/"):
            state = self.episodes.get(route.removeprefix("/state/"))
            return send_json(handler, 200, state) if state is not None else send_json(handler, 404, {})
        if method == "POST" and route == "/close":
            self.closed.append(body["env_id"])
            return send_json(handler, 200, {})
        return send_json(handler, 400, {"error": "no such route"})

    def _step(self, handler, env_id: str, action: dict):
        number = action["arguments"]["number"]
        if number == HANG:
            time.sleep(5)
            return None
        if number == GARBAGE:
            handler.send_response(200)
            handler.end_headers()
            return handler.wfile.write(b"<html>not json")
        if number == DIE:
            self.dead = True  # stop listening (from another thread: serve_forever waits for it), then hang up
            stop = threading.Thread(target=lambda: (self.http.shutdown(), self.http.server_close()))
            stop.start()
            stop.join()
            return self._hang_up(handler)
        if number == GONE or env_id not in self.episodes:
            return send_json(handler, 404, {"error": "unknown env_id"})
        episode = self.episodes[env_id]
        episode["guesses"].append(number)
        right = number == SECRET
        episode["solved"] |= right
        reward = 1.0 if right else WRONG
        self.rewards.append(reward)
        hint = "right" if right else "higher" if number < SECRET else "lower"
        return send_json(handler, 200, {"result": hint, "reward": reward, "done": right})

    @staticmethod
    def _hang_up(handler):
        handler.close_connection = True
        handler.connection.close()


@pytest.fixture
def guess_server():
    server = GuessServer()
    yield server
    server.close()


def scenario() -> Scenario:
    return Scenario("g", None, "Play.", None, None, None, "scenarios.jsonl:1")


def test_an_http_episode_runs_over_the_routes(guess_server):
    env = HttpEnvironment(HttpEnvironmentOptions.from_table({"type": "http", "base_url": guess_server.url + "/"}))
    try:
        assert ToolCatalog.of("http", env.tools).toolsets["http"].specs() == [GUESS]  # rendered like our own tools
        episode = env.reset(scenario(), 7)
        assert guess_server.resets == [{"scenario": {"id": "g", "system": None, "user": "Play.", "rubric": None}, "seed": 7}]
        assert episode.observation == "Game 7: guess the number."
        low = episode.step("guess", {"number": 1})
        assert (low.content, low.reward, low.done, low.broken) == ("higher", WRONG, False, None)
        right = episode.step("guess", {"number": 2})
        assert (right.content, right.reward, right.done) == ("right", 1.0, True)
        assert json.loads(episode.state()) == {"guesses": [1, 2], "solved": True}
        episode.close()
        assert guess_server.closed == ["e0"]
        assert HttpEpisode(env, "unknown", None).state() is None  # 404 on /state: no state, not an error
    finally:
        env.close()


@pytest.mark.parametrize("guess, cause", [
    (HANG, "POST /step: no reply within 0.5 s"),
    (GARBAGE, "POST /step: the reply is not a JSON object"),
    (DIE, "POST /step: RemoteProtocolError"),
    (GONE, "POST /step: HTTP 404: the server does not know this episode"),
])
def test_a_broken_http_episode_ends_with_its_cause(guess_server, guess, cause):
    env = HttpEnvironment(HttpEnvironmentOptions.from_table(
        {"type": "http", "base_url": guess_server.url, "request_timeout_secs": 0.5}))
    try:
        episode = env.reset(scenario(), 1)
        t0 = time.monotonic()
        result = episode.step("guess", {"number": guess})
        assert time.monotonic() - t0 < 3
        assert result.broken == "environment_broken" and result.is_error and result.content.startswith(cause), result
        episode.close()  # never raises, whatever the server did
        if guess == DIE:
            with pytest.raises(EnvironmentBroken, match="POST /reset: ConnectError"):
                env.reset(scenario(), 2)
    finally:
        env.close()


@pytest.mark.parametrize("table, needle", [
    ({}, "[agent.environment].base_url is required with type = 'http'"),
    ({"base_url": "127.0.0.1:80"}, "[agent.environment].base_url = '127.0.0.1:80': expected an http:// or https:// URL"),
    ({"base_url": "http://x", "request_timeout_secs": 0}, "[agent.environment].request_timeout_secs = 0.0: expected a number > 0"),
    ({"base_url": "http://x", "timeout": 3}, "[agent.environment].timeout: unknown key"),
    ({"base_url": "http://x", "api_key_env": "RETROGRAD_TEST_UNSET_KEY"},
     "[agent.environment].api_key_env = 'RETROGRAD_TEST_UNSET_KEY': the variable is not set"),
    ({"base_url": "http://x", "headers": {"X-A": 1}}, "[agent.environment].headers = {'X-A': 1}: expected a table of strings"),
])
def test_http_options_are_refused_on_one_line(table, needle):
    with pytest.raises(ConfigError) as error:
        HttpEnvironmentOptions.from_table({"type": "http"} | table)
    assert needle in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------- the reference mcp server

MCP_SERVER = '''\
import os, sys, time
from mcp.server.mcpserver import MCPServer

with open(sys.argv[1], "a") as log:
    log.write("started\\n")
app = MCPServer("lab")

@app.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)

@app.tool()
def oops() -> str:
    """Fails as a tool."""
    raise ValueError("no")

@app.tool()
def getenv(name: str) -> str:
    """A variable of the server's environment."""
    return os.environ.get(name, "unset")

@app.tool()
def hang() -> str:
    """Never answers."""
    time.sleep(3600)
    return ""

@app.tool()
def crash() -> str:
    """Ends the server."""
    os._exit(3)

app.run()
'''


@pytest.fixture
def mcp_script(tmp_path) -> Path:
    path = tmp_path / "lab_server.py"
    path.write_text(MCP_SERVER)
    return path


def lab(tmp_path, script, **keys) -> dict:
    return {"name": "lab", "command": [sys.executable, str(script), str(tmp_path / "starts.log")]} | keys


def test_mcp_server_tools_are_listed_filtered_called_and_a_dead_server_restarts(tmp_path, mcp_script):
    options = server_options([lab(tmp_path, mcp_script, denied_tools=["o*"], tool_timeout_secs=1)], None, tmp_path)
    servers = McpServers(options)
    try:
        assert [tool.name for tool in servers.tools] == ["add", "getenv", "hang", "crash"]  # deny wins over the default "*"
        tools = {tool.name: tool for tool in servers.tools}
        spec = tools["add"].spec()["function"]
        assert spec["description"] == "Add two integers." and set(spec["parameters"]["properties"]) == {"a", "b"}
        toolset = ToolCatalog.of("mcp", servers.tools).toolsets["mcp"]
        assert toolset.call(None, "add", {"a": 2, "b": 3}).content == "5"
        assert toolset.call(None, "add", {"a": "x"}).is_error  # checked against the server's schema, not sent
        t0 = time.monotonic()
        hung = toolset.call(None, "hang", {})
        assert hung.broken == "tool_broken" and hung.content.startswith("mcp server 'lab', tool 'hang': ")
        assert time.monotonic() - t0 < 5
        assert toolset.call(None, "add", {"a": 1, "b": 1}).content == "2"  # the server still answers
        crashed = toolset.call(None, "crash", {})
        assert crashed.broken == "tool_broken" and crashed.content == "mcp server 'lab', tool 'crash': Connection closed"
        assert toolset.call(None, "add", {"a": 4, "b": 4}).content == "8"  # started again
        assert (tmp_path / "starts.log").read_text() == "started\nstarted\n"
    finally:
        servers.close()


def test_a_stdio_servers_environment_is_what_env_passthrough_passes(tmp_path, mcp_script, monkeypatch):
    monkeypatch.setenv("RETROGRAD_TEST_SECRET", "s3cret")
    monkeypatch.setenv("RETROGRAD_TEST_PASSED", "yes")
    for passthrough, secret, passed in ((None, "s3cret", "yes"), (["RETROGRAD_TEST_PASSED"], "unset", "yes"), ([], "unset", "unset")):
        keys = {"env": {"SET_HERE": "${RETROGRAD_TEST_PASSED}"}} | ({} if passthrough is None else {"env_passthrough": passthrough})
        servers = McpServers(server_options([lab(tmp_path, mcp_script, allowed_tools=["getenv"], **keys)], None, tmp_path))
        try:
            toolset = ToolCatalog.of("mcp", servers.tools).toolsets["mcp"]
            got = {name: toolset.call(None, "getenv", {"name": name}).content
                   for name in ("RETROGRAD_TEST_SECRET", "RETROGRAD_TEST_PASSED", "SET_HERE", "PATH")}
        finally:
            servers.close()
        assert got == {"RETROGRAD_TEST_SECRET": secret, "RETROGRAD_TEST_PASSED": passed, "SET_HERE": "yes",
                       "PATH": __import__("os").environ["PATH"]}, passthrough


MCP_HTTP_SERVER = '''\
import os, sys
from mcp.server.mcpserver import Context, MCPServer

app = MCPServer("web")

@app.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)

@app.tool()
def token(ctx: Context) -> str:
    """The caller's X-Lab-Token header."""
    return (ctx.headers or {}).get("x-lab-token", "none")

@app.tool()
def crash() -> str:
    """Ends the server."""
    os._exit(3)

app.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
'''


class HttpMcpServer:
    """The reference server over streamable HTTP on a loopback port, (re)started on demand."""

    def __init__(self, tmp_path: Path):
        import socket

        self.script = tmp_path / "web_server.py"
        self.script.write_text(MCP_HTTP_SERVER)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.process = None

    def start(self) -> None:
        import socket

        self.process = subprocess.Popen([sys.executable, str(self.script), str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError("the reference mcp server did not listen")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def http_mcp(tmp_path):
    server = HttpMcpServer(tmp_path)
    server.start()
    yield server
    server.stop()


def test_a_streamable_http_mcp_server_is_called_with_its_headers_and_connected_again(tmp_path, http_mcp, monkeypatch):
    monkeypatch.setenv("RETROGRAD_TEST_TOKEN", "t0k")
    table = {"name": "web", "transport": {"type": "streamable_http", "url": http_mcp.url,
                                          "headers": {"X-Lab-Token": "${RETROGRAD_TEST_TOKEN}"}}, "tool_timeout_secs": 5}
    (options,) = server_options([table], None, tmp_path)
    assert options.url == http_mcp.url and options.headers == (("X-Lab-Token", "t0k"),) and options.command == ()
    servers = McpServers((options,))
    try:
        assert [tool.name for tool in servers.tools] == ["add", "token", "crash"]
        toolset = ToolCatalog.of("mcp", servers.tools).toolsets["mcp"]
        assert toolset.call(None, "add", {"a": 2, "b": 3}).content == "5"
        assert toolset.call(None, "token", {}).content == "t0k"
        crashed = toolset.call(None, "crash", {})
        assert crashed.broken == "tool_broken" and crashed.content.startswith("mcp server 'web', tool 'crash': ")
        gone = toolset.call(None, "add", {"a": 1, "b": 1})  # nobody listens: this trajectory breaks, the run goes on
        assert gone.broken == "tool_broken" and "restart failed" in gone.content, gone.content
        http_mcp.start()
        assert toolset.call(None, "add", {"a": 4, "b": 4}).content == "8"  # connected again
    finally:
        servers.close()


def test_a_server_that_is_not_required_is_left_out_when_it_cannot_be_reached(tmp_path, http_mcp, mcp_script):
    http_mcp.stop()
    unreachable = {"name": "web", "url": http_mcp.url, "required": False}
    servers = McpServers(server_options([unreachable, lab(tmp_path, mcp_script, allowed_tools=["add"])], None, tmp_path))
    try:
        assert [tool.name for tool in servers.tools] == ["add"]
        (line,) = servers.left_out
        assert line.startswith(f"agent.mcp_servers 'web' ({http_mcp.url}): cannot be reached: ConnectError") and "required = false" in line
    finally:
        servers.close()
    with pytest.raises(McpServerError, match="agent.mcp_servers 'web'"):
        McpServers(server_options([unreachable | {"required": True}], None, tmp_path))


def test_an_mcp_tool_error_is_an_observation(tmp_path, mcp_script):
    servers = McpServers(server_options([lab(tmp_path, mcp_script, allowed_tools=["oops"])], None, tmp_path))
    try:
        (oops,) = servers.tools
        result = ToolCatalog.of("mcp", servers.tools).toolsets["mcp"].call(None, "oops", {})
        assert oops.name == "oops" and result.is_error and result.broken is None and "oops" in result.content
    finally:
        servers.close()


def test_mcp_json_files_are_read_with_their_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("RETROGRAD_TEST_TOKEN", "t0k")
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "server-files", "${RETROGRAD_TEST_TOKEN}"], "env": {"T": "${RETROGRAD_TEST_TOKEN}"}},
        "web": {"type": "http", "url": "https://127.0.0.1:9/mcp", "headers": {"Authorization": "Bearer ${RETROGRAD_TEST_TOKEN}"},
                "stateless": True}}}))
    files, web = server_options((), "mcp.json", tmp_path)
    assert files.name == "files" and files.command == ("npx", "-y", "server-files", "t0k") and files.env == (("T", "t0k"),)
    assert files.tool_timeout_secs == 30 and files.max_tool_result_bytes == 65536 and files.url is None
    assert web.url == "https://127.0.0.1:9/mcp" and web.headers == (("Authorization", "Bearer t0k"),) and web.command == ()
    assert web.stateless and not files.stateless  # beside an environment, only the one that says so may serve
    with pytest.raises(ConfigError, match=r"mcp.json mcpServers.files.stateless: \[agent.environment\] is declared"):
        server_options((), "mcp.json", tmp_path, environment=True)



def test_an_mcp_json_variable_is_expanded_once(tmp_path, monkeypatch):
    """A value that itself holds `${...}` is the value, not another variable to look up."""
    monkeypatch.setenv("RETROGRAD_TEST_TOKEN", "a${RETROGRAD_TEST_UNSET_VAR}b")
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {
        "files": {"command": "run", "args": ["${RETROGRAD_TEST_TOKEN}"], "env": {"T": "${RETROGRAD_TEST_TOKEN}"}},
        "web": {"url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": "${RETROGRAD_TEST_TOKEN}"}}}}))
    files, web = server_options((), "mcp.json", tmp_path)
    literal = "a${RETROGRAD_TEST_UNSET_VAR}b"
    assert files.command == ("run", literal) and files.env == (("T", literal),) and web.headers == (("Authorization", literal),)

@pytest.mark.parametrize("servers, config, needle", [
    ([{"name": "a", "command": ["x"], "url": "http://x"}], None, "agent.mcp_servers[0]: give exactly one of command"),
    ([{"name": "a"}], None, "agent.mcp_servers[0]: give exactly one of command"),
    ([{"name": "a", "url": "ftp://x"}], None, "agent.mcp_servers[0].url = 'ftp://x': expected an http:// or https://"),
    ([{"name": "a", "url": "http://x", "env": {"A": "b"}}], None, "agent.mcp_servers[0].env: only for a stdio server"),
    ([{"name": "a", "command": ["x"], "headers": {"A": "b"}}], None, "agent.mcp_servers[0].headers: only for a streamable HTTP"),
    ([{"name": "a", "transport": {"type": "sse", "url": "http://x"}}], None, "agent.mcp_servers[0].transport = "),
    ([{"name": "a", "url": "http://x", "transport": {"type": "streamable_http", "url": "http://y"}}], None,
     "agent.mcp_servers[0].transport.url: also given outside transport"),
    ([{"name": "a", "command": ["x"], "env_passthrough": "PATH"}], None, "agent.mcp_servers[0].env_passthrough = 'PATH': expected a list"),
    ([{"name": "a", "command": ["x"], "required": "yes"}], None, "agent.mcp_servers[0].required = 'yes': expected true or false"),
    ([{"name": "a", "command": ["x"]}, {"name": "a", "command": ["y"]}], None, "two servers are named 'a'"),
    ([{"name": "a", "command": ["x"], "tool_timeout_secs": 0}], None, "agent.mcp_servers[0].tool_timeout_secs = 0.0: expected"),
    ([{"name": "a", "command": ["x"], "allow": ["*"]}], None, "agent.mcp_servers[0].allow: unknown key"),
    ((), "missing.json", "agent.mcp_config"),
    ((), "vars.json", "${RETROGRAD_TEST_UNSET_VAR} is not set"),
    ((), 3, "agent.mcp_config = 3: expected the path of an mcp.json file or a list of them"),
])
def test_mcp_options_are_refused_on_one_line(tmp_path, servers, config, needle):
    (tmp_path / "vars.json").write_text(json.dumps({"mcpServers": {"v": {"command": "${RETROGRAD_TEST_UNSET_VAR}"}}}))
    with pytest.raises(ConfigError) as error:
        server_options(servers, config, tmp_path)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_beside_an_environment_every_mcp_server_must_be_stateless(tmp_path):
    servers = [{"name": "a", "command": ["x"]}, {"name": "b", "command": ["y"], "stateless": True}]
    assert len(server_options(servers, None, tmp_path)) == 2
    with pytest.raises(ConfigError) as error:
        server_options(servers, None, tmp_path, environment=True)
    assert str(error.value).startswith("agent.mcp_servers[0].stateless: [agent.environment] is declared") \
        and "mcp_servers[1]" not in str(error.value)


def test_an_mcp_server_that_cannot_start_stops_the_run_before_the_model_loads(tmp_path):
    cfg = write_config(tmp_path, environment="", mcp=f'[[agent.mcp_servers]]\nname = "gone"\ncommand = ["{sys.executable}", "-c", "pass"]',
                       judge=True)
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], check=False, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: agent.mcp_servers 'gone'") and "cannot be started" in lines[0]


# ---------------------------------------------------------------- whole runs

AGENT = {"group_size": 3, "epochs_per_update": 1, "max_turns": 3, "max_new_tokens_per_turn": 48}
SMALL = {"group_size": 2, "max_turns": 2, "max_new_tokens_per_turn": 32, "temperature": 0.5,
         "system": "You only answer with a tool call."}


def write_config(tmp: Path, *, environment: str, mcp: str = "", judge: bool = False, model: Path | None = None,
                 system: str = "Use the tools.", user: str = "Play.", **agent) -> Path:
    (tmp / "scenarios.jsonl").write_text(json.dumps({"id": "game", "system": system, "user": user}) + "\n")
    (tmp / "judge.py").write_text(LENGTH_JUDGE)
    judge_table = f'[agent.judge]\ncommand = ["{sys.executable}", "{tmp / "judge.py"}"]' if judge else ""
    cfg = tmp / "agent.toml"
    cfg.write_text(f"""
[run]
algorithm = "agent_grpo"
{f'[model]{chr(10)}path = "{model}"' if model else ""}
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
dtype = "f32"
[training]
ctx = 768
micro_batch = 4096
lr = 1e-3
threads = 2
[agent]
scenarios = "scenarios.jsonl"
{chr(10).join(f"{k} = {json.dumps(v)}" for k, v in (AGENT | agent).items())}
{mcp}
{judge_table}
{environment}
""")
    return cfg


def scripted_run(cfg: Path, scripts: list[list[str]]):
    config = load_config(cfg)
    task = open_task(config, SilentReporter())
    try:
        setup = prepare(config, SilentReporter(), task.chat)
        result = train(config, setup, ScriptedPolicy(task.chat.tokenizer, scripts), task, SilentReporter())
    finally:
        task.close()
    records = [json.loads(line) for line in (cfg.parent / "out/adapter.rollouts.jsonl").read_text().splitlines()]
    (metrics,) = [json.loads(line) for line in (cfg.parent / "out/adapter.metrics.jsonl").read_text().splitlines()]
    return result, records, metrics, task


def test_a_scripted_update_through_the_http_environment(tmp_path, tiny_model, guess_server):
    """Per-step rewards summed, `done` ends the episode, the opening observation is each
    member's own prompt, a reply of garbage costs one trajectory, every episode is closed."""
    cfg = write_config(tmp_path, model=tiny_model("llama"), environment=f'[agent.environment]\ntype = "http"\nbase_url = "{guess_server.url}"')
    result, records, m, task = scripted_run(cfg, [[call("guess", number=2)],
                                                  [call("guess", number=3), call("guess", number=2)],
                                                  [call("guess", number=GARBAGE), "never said"]])
    assert result.updates_done == 1 and result.steps == 1 and result.output.is_file()
    assert [r["stop"] for r in records] == ["submitted", "submitted", "environment_broken"]
    assert [r["step_rewards"] for r in records] == [[1.0], [WRONG, 1.0], []]
    assert [r["reward"] for r in records[:2]] == [1.0, 1.0 + WRONG] and sorted(guess_server.rewards) == [WRONG, 1.0, 1.0]
    assert records[2]["cause"] == "POST /step: the reply is not a JSON object" and records[2]["skip_reason"] == "failed"
    assert [r["trained"] for r in records] == [True, True, False]
    assert json.loads(records[1]["state"]) == {"guesses": [3, 2], "solved": True}
    assert sorted(guess_server.closed) == ["e0", "e1", "e2"]
    seeds = [reset["seed"] for reset in guess_server.resets]
    prompts = [task.chat.tokenizer.decode(r["turns"][0]["prompt_ids"]) for r in records]
    assert all("Guess the secret number, an integer from 1 to 3." in p for p in prompts)  # the server's tool schema
    assert sorted(p.split("Game ")[1].split(":")[0] for p in prompts) == sorted(str(s) for s in seeds)  # each its own
    assert m["agent/stop/environment_broken"] == pytest.approx(1 / 3) and m["agent/failed_tool"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("drop", [False, True])
def test_a_group_the_judge_scored_alike_is_dropped_when_asked(tmp_path, tiny_model, guess_server, drop):
    """A judge that gives every member 0.5; the step rewards still differ, so the group trains
    unless agent.drop_degenerate_groups drops it."""
    cfg = write_config(tmp_path, model=tiny_model("llama"), judge=True, drop_degenerate_groups=drop,
                       environment=f'[agent.environment]\ntype = "http"\nbase_url = "{guess_server.url}"')
    (tmp_path / "judge.py").write_text("import json, sys\nfor line in sys.stdin:\n    print(json.dumps({'reward': 0.5}))\n")
    result, records, m, _ = scripted_run(cfg, [[call("guess", number=2)], [call("guess", number=3), call("guess", number=2)],
                                               [call("guess", number=1), call("guess", number=2)]])
    assert [r["terminal_reward"] for r in records] == [0.5, 0.5, 0.5]
    assert [r["reward"] for r in records] == [1.5, 1.5 + WRONG, 1.5 + WRONG]
    assert m["judge/groups"] == 1.0 and m["judge/degenerate_group_fraction"] == 1.0
    assert [r["trained"] for r in records] == [not drop] * 3 and result.steps == (0 if drop else 1)
    assert [r["skip_reason"] for r in records] == (["degenerate_judge"] * 3 if drop else [None] * 3)


def test_an_llm_judge_reads_compacted_transcripts_in_a_scripted_update(tmp_path, tiny_model, guess_server):
    """[agent.judge] type = "ruler" end to end (the scripted endpoint of test_judge scores by
    length): the longest transcript is over trigger_chars, so the members with more parts
    than keep_last (turns, then the environment's state) are judged on a summary of the
    earlier ones and their last two parts."""
    from test_judge import Endpoint

    endpoint = Endpoint("longer")
    try:
        cfg = write_config(tmp_path, model=tiny_model("llama"), judge=False,
                           environment=f'[agent.environment]\ntype = "http"\nbase_url = "{guess_server.url}"')
        cfg.write_text(cfg.read_text() + f'[agent.judge]\ntype = "ruler"\nbase_url = "{endpoint.url}"\nmodel = "judge"\n'
                       "[agent.judge.compaction]\ntrigger_chars = 200\ntarget_chars = 100\nkeep_last = 2\n")
        result, records, m, _ = scripted_run(cfg, [[call("guess", number=2)], [call("guess", number=3), call("guess", number=2)],
                                                   [call("guess", number=1), call("guess", number=3), call("guess", number=2)]])
    finally:
        endpoint.close()
    summaries = [b for b in endpoint.bodies if b["messages"][0]["content"].startswith("You shorten")]
    (verdict,) = [b for b in endpoint.bodies if b not in summaries]
    assert len(summaries) == 2 and m["judge/compacted_fraction"] == pytest.approx(2 / 3) and m["judge/groups"] == 1.0
    assert verdict["messages"][1]["content"].count("[summary of the earlier turns]") == 2
    assert all(r["terminal_reward"] is not None and 0 <= r["terminal_reward"] <= 1 for r in records)
    assert result.updates_done == 1


@pytest.mark.slow  # 13-16 s on 2 cores: an MCP server process and a run
def test_a_scripted_update_with_mcp_tools(tmp_path, tiny_model, mcp_script):
    """An mcp server's tools in the prompt, its answers as observations, a server that exits
    mid-episode costs that trajectory (judged run: no environment)."""
    mcp = (f'[[agent.mcp_servers]]\nname = "lab"\ncommand = ["{sys.executable}", "{mcp_script}", "{tmp_path / "starts.log"}"]\n'
           'denied_tools = ["hang"]')
    cfg = write_config(tmp_path, model=tiny_model("llama"), environment="", mcp=mcp, judge=True)
    result, records, m, task = scripted_run(cfg, [[call("add", a=2, b=3), "done"], [call("add", a=1, b=1), call("crash")],
                                                  [call("oops"), "a longer final answer"]])
    assert result.updates_done == 1 and result.steps == 1 and result.output.is_file()
    assert [r["stop"] for r in records] == ["no_tool_call", "tool_broken", "no_tool_call"]
    observations = [[c["observation"] for t in r["turns"] for c in t["calls"]] for r in records]
    assert observations[0] == ["5"] and observations[1][0] == "2" and "oops" in observations[2][0]
    assert records[1]["cause"] == "mcp server 'lab', tool 'crash': Connection closed"
    assert records[2]["turns"][0]["calls"][0]["is_error"] and [r["trained"] for r in records] == [True, False, True]
    prompt = task.chat.tokenizer.decode(records[0]["turns"][0]["prompt_ids"])
    assert "Add two integers." in prompt and "Ends the server." in prompt and "Never answers." not in prompt
    assert (tmp_path / "starts.log").read_text() == "started\n"  # once per run, shared by the trajectories

    # retrograd tools list: what the run showed its model, and the hash it checks on resume
    listed = subprocess.run([*RETROGRAD, "tools", "list", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[:2] == ["toolset mcp (default): 4 tool(s)", "  mcp.lab.add@1     add: Add two integers."]
    assert listed.stdout.splitlines()[-1] == f"catalogue sha256: {task.catalog.signature()}"
    doc = json.loads(subprocess.run([*RETROGRAD, "tools", "list", str(cfg), "--json"], capture_output=True, text=True).stdout)
    assert doc["signature"] == task.catalog.signature() and doc["toolsets"]["mcp"][0] == "mcp.lab.add@1"
    assert doc["tools"]["mcp.lab.add@1"]["input_schema"]["properties"].keys() == {"a", "b"}
    assert (tmp_path / "starts.log").read_text() == "started\n" * 3
    offline = subprocess.run([*RETROGRAD, "tools", "list", str(cfg), "--no-connect"], capture_output=True, text=True)
    assert offline.stdout.splitlines()[-1] == f"not connected (--no-connect): mcp server lab ({sys.executable} {mcp_script} " \
        f"{tmp_path / 'starts.log'})" and (tmp_path / "starts.log").read_text() == "started\n" * 3
    assert m["agent/stop/tool_broken"] == pytest.approx(1 / 3)


ECHO = '<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>\nRepeat exactly the text above.'  # SmolLM2 does


def test_one_update_on_smollm2_against_the_http_environment(tmp_path, guess_server, smollm2):
    guess_server.opening = None
    cfg = write_config(tmp_path, environment=f'[agent.environment]\ntype = "http"\nbase_url = "{guess_server.url}"',
                       user=ECHO.replace("NAME", "guess").replace("ARGS", '{"number": 2}'), **SMALL)
    result = agent_grpo.run(load_config(cfg), SilentReporter())
    assert result.updates_done == 1 and result.output.is_file()
    records = [json.loads(line) for line in (tmp_path / "out/adapter.rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 and len(guess_server.resets) == 2 and sorted(guess_server.closed) == ["e0", "e1"]
    # Whatever the model wrote (SmolLM2 seldom writes a well-formed call: the scripted tests
    # above pin the steps), the server's rewards are the records' and nothing else scored them.
    assert sorted(r for rec in records for r in rec["step_rewards"]) == sorted(guess_server.rewards)
    for rec in records:
        assert rec["reward"] == pytest.approx(sum(rec["step_rewards"])) and rec["terminal_reward"] == 0.0
        assert rec["stop"] in ("no_tool_call", "submitted", "max_turns") and rec["cause"] is None and rec["state"]
    prompt = Tokenizer(smollm2).decode(records[0]["turns"][0]["prompt_ids"])
    assert json.dumps(GUESS) in prompt  # the server's schema, rendered as our own tools are


@pytest.mark.slow  # 9-11 s on 2 cores: an MCP server and an update on SmolLM2
def test_one_update_on_smollm2_with_an_mcp_server(tmp_path, mcp_script, smollm2):
    mcp = f'[[agent.mcp_servers]]\nname = "lab"\ncommand = ["{sys.executable}", "{mcp_script}", "{tmp_path / "starts.log"}"]'
    cfg = write_config(tmp_path, environment="", mcp=mcp, judge=True,
                       user=ECHO.replace("NAME", "add").replace("ARGS", '{"a": 2, "b": 3}'), **SMALL)
    result = agent_grpo.run(load_config(cfg), SilentReporter())
    assert result.updates_done == 1 and result.output.is_file()
    records = [json.loads(line) for line in (tmp_path / "out/adapter.rollouts.jsonl").read_text().splitlines()]
    calls = [c for rec in records for turn in rec["turns"] for c in turn["calls"]]
    assert all(c["observation"] == "5" for c in calls if c["name"] == "add" and c["arguments"] == {"a": 2, "b": 3})
    assert all(rec["stop"] != "tool_broken" and rec["terminal_reward"] is not None for rec in records)  # judged
    prompt = Tokenizer(smollm2).decode(records[0]["turns"][0]["prompt_ids"])
    assert "Add two integers." in prompt and '"name": "crash"' in prompt
    assert (tmp_path / "starts.log").read_text() == "started\n"
    assert not [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
                if str(mcp_script) in line]  # the server ended with the run


def test_tools_list_of_a_run_without_tools_is_one_line():
    sft = Path(__file__).parents[1] / "examples/smoke_tiny_sft.toml"
    r = subprocess.run([*RETROGRAD, "tools", "list", str(sft)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {sft}: run.algorithm = 'sft'; only an agent_grpo run has tools", r.stderr
