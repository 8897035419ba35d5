"""`[agent.environment] type = "http"`: an environment that is a server, reached with the
Rust retrograd's routes (notes §5; OpenEnv servers speak them too):

    GET  /tools                      -> {"tools": [OpenAI-style function schemas]}   once per run
    POST /reset {scenario, seed}     -> {env_id, observation | null}                  one episode per trajectory
    POST /step  {env_id, call}       -> {result, reward | null, done}                 one per tool call
    GET  /state/{env_id}             -> the terminal state (404: none)                 before close
    POST /close {env_id}             -> any 2xx                                        always, also after a failure

The server's tools are rendered into the chat template like our own and a call goes to
/step (after its arguments were checked against the tool's schema). The world is the
server's: anything but a well-formed reply (a timeout, a refused or reset connection, a 404
or 410 on the episode, an error status, garbage) breaks that trajectory only, with the
cause recorded; the run goes on. A failed action is the server's to report as a result.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from retrograd.errors import ConfigError, RetrogradError
from retrograd.rollouts.sandbox.options import checked_kwargs
from retrograd.rollouts.tools import Tool, ToolResult, clip, is_reward, make_tool

WHERE = "[agent.environment]"
BROKEN = "environment_broken"  # the stop reason of a trajectory whose environment broke


class EnvironmentUnavailable(RetrogradError):
    """The server's tool list cannot be had at start-up: the run stops before the model loads."""


class EnvironmentBroken(Exception):
    """The server broke this episode; the message is the recorded cause."""


@dataclass(frozen=True)
class HttpEnvironmentOptions:
    """The Rust retrograd's keys; `api_key_env` names a variable whose value is sent as a
    bearer token (the key itself never goes in TOML)."""

    base_url: str
    request_timeout_secs: float = 60.0
    connect_timeout_secs: float = 10.0
    pool_size: int = 16  # connections; keep >= group_size
    max_result_bytes: int = 65536  # an observation, result or state is cut here
    headers: tuple[tuple[str, str], ...] = ()
    api_key_env: str | None = None

    @classmethod
    def from_table(cls, table: dict) -> HttpEnvironmentOptions:
        """From `[agent.environment]` with type = "http"; every problem at once, on one line."""
        problems: list[str] = []
        rest = {key: value for key, value in table.items() if key not in ("type", "headers")}
        kwargs = checked_kwargs(cls, rest, WHERE, problems)
        headers = table.get("headers", {})
        if not (isinstance(headers, dict) and all(isinstance(v, str) for v in headers.values())):
            problems.append(f"{WHERE}.headers = {headers!r}: expected a table of strings")
            headers = {}
        if "base_url" not in table:
            problems.append(f"{WHERE}.base_url is required with type = 'http' (e.g. \"http://127.0.0.1:8000\")")
        elif "base_url" in kwargs and not kwargs["base_url"].startswith(("http://", "https://")):
            problems.append(f"{WHERE}.base_url = {kwargs['base_url']!r}: expected an http:// or https:// URL")
        checks = [("request_timeout_secs", lambda v: v > 0, "a number > 0"),
                  ("connect_timeout_secs", lambda v: v > 0, "a number > 0"),
                  ("pool_size", lambda v: v >= 1, "an integer >= 1"),
                  ("max_result_bytes", lambda v: v >= 256, "an integer >= 256")]
        problems += [f"{WHERE}.{key} = {kwargs[key]!r}: expected {want}" for key, ok, want in checks
                     if key in kwargs and not ok(kwargs[key])]
        key_env = kwargs.get("api_key_env")
        if key_env is not None and not os.environ.get(key_env):
            problems.append(f"{WHERE}.api_key_env = {key_env!r}: the variable is not set")
        if problems:
            raise ConfigError("; ".join(problems))
        return cls(**kwargs, headers=tuple(sorted(headers.items())))


class HttpEnvironment:
    """The client of one run: its tools (listed at start-up) and a fresh episode per
    trajectory. Thread-safe: the trajectories of a wave step in parallel threads."""

    def __init__(self, options: HttpEnvironmentOptions):
        self.options = options
        headers = dict(options.headers)
        if options.api_key_env is not None:
            headers["Authorization"] = f"Bearer {os.environ[options.api_key_env]}"
        pool = options.pool_size
        self.client = httpx.Client(
            base_url=options.base_url.rstrip("/"), headers=headers,
            timeout=httpx.Timeout(options.request_timeout_secs, connect=options.connect_timeout_secs),
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool))
        try:
            self.tools = self._list_tools()
        except BaseException:
            self.client.close()
            raise

    def close(self) -> None:
        self.client.close()

    def _list_tools(self) -> tuple[Tool, ...]:
        where = f"{WHERE} GET {self.options.base_url.rstrip('/')}/tools"
        try:
            reply = self.request("GET", "/tools")
        except EnvironmentBroken as broken:
            raise EnvironmentUnavailable(f"{where}: {broken}") from None
        specs = reply.get("tools")
        if not isinstance(specs, list):
            raise EnvironmentUnavailable(f"{where}: expected {{\"tools\": [...]}}")
        tools = tuple(_tool(spec, f"{where} tools[{i}]") for i, spec in enumerate(specs))
        names = [tool.name for tool in tools]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise EnvironmentUnavailable(f"{where}: two tools are named {twice[0]!r}")
        return tools

    def reset(self, scenario, seed: int) -> HttpEpisode:
        """A new episode of `scenario` (retrograd.rollouts.scenarios.Scenario)."""
        body = {"scenario": {"id": scenario.id, "system": scenario.system, "user": scenario.user,
                             "rubric": scenario.rubric}, "seed": seed}
        reply = self.request("POST", "/reset", body)
        env_id = reply.get("env_id")
        if not (isinstance(env_id, str) and env_id or isinstance(env_id, int) and not isinstance(env_id, bool)):
            raise EnvironmentBroken("POST /reset: 'env_id' must be a non-empty string or an integer")
        observation = reply.get("observation")
        return HttpEpisode(self, env_id, None if observation is None else self.text(observation))

    def request(self, method: str, route: str, body: dict | None = None, *, absent_ok: bool = False,
                wants_reply: bool = True) -> dict | None:
        """The reply's JSON object (None for a 404 when `absent_ok`, or when no reply is
        wanted); EnvironmentBroken with the cause for anything else."""
        what = f"{method} /{route.split('/')[1]}"  # the route without the episode's id
        try:
            response = self.client.request(method, route, json=body)
        except httpx.TimeoutException:
            raise EnvironmentBroken(f"{what}: no reply within {self.options.request_timeout_secs:g} s") from None
        except httpx.HTTPError as error:  # refused, reset, closed mid-reply
            raise EnvironmentBroken(f"{what}: {type(error).__name__}: {error}") from None
        if response.status_code == 404 and absent_ok:
            return None
        if response.status_code in (404, 410):
            raise EnvironmentBroken(f"{what}: HTTP {response.status_code}: the server does not know this episode")
        if not response.is_success:
            raise EnvironmentBroken(f"{what}: HTTP {response.status_code}")
        if not wants_reply:
            return None
        try:
            parsed = response.json()
        except (ValueError, UnicodeDecodeError):
            parsed = None
        if not isinstance(parsed, dict):
            raise EnvironmentBroken(f"{what}: the reply is not a JSON object")
        return parsed

    def text(self, value) -> str:
        """What the model reads: a string as it is, other JSON compact; cut at max_result_bytes."""
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
        return clip(text, self.options.max_result_bytes)


@dataclass
class HttpEpisode:
    """One trajectory's episode: what its tools act on (Toolset.call's `sandbox`)."""

    environment: HttpEnvironment
    env_id: str | int
    observation: str | None  # the opening observation of /reset

    def step(self, name: str, arguments: dict) -> ToolResult:
        """One call; a broken step is a ToolResult with `broken` set, so the engine drops the
        trajectory like one whose sandbox broke."""
        try:
            reply = self.environment.request("POST", "/step", {"env_id": self.env_id,
                                                               "call": {"name": name, "arguments": arguments}})
            problem = _step_problem(reply)
            if problem is not None:
                raise EnvironmentBroken(f"POST /step: {problem}")
        except EnvironmentBroken as broken:
            return ToolResult(str(broken), is_error=True, broken=BROKEN)
        reward = reply.get("reward")
        return ToolResult(self.environment.text(reply["result"]), is_error=reply.get("is_error", False),
                          reward=None if reward is None else float(reward), done=reply["done"])

    def state(self) -> str | None:
        """The terminal state for the judge and the rollout record; None when the server keeps none."""
        state = self.environment.request("GET", f"/state/{quote(str(self.env_id), safe='')}", absent_ok=True)
        return None if state is None else self.environment.text(state)

    def close(self) -> None:
        """Ends the episode on the server; a server that is gone has nothing left to close."""
        try:
            self.environment.request("POST", "/close", {"env_id": self.env_id}, wants_reply=False)
        except EnvironmentBroken:
            pass


def _step_problem(reply: dict) -> str | None:
    checks = [("result" in reply, "the reply has no 'result'"),
              (isinstance(reply.get("done"), bool), "'done' must be true or false"),
              (reply.get("reward") is None or is_reward(reply["reward"]), "'reward' must be a number or null"),
              (isinstance(reply.get("is_error", False), bool), "'is_error' must be true or false")]
    return next((problem for ok, problem in checks if not ok), None)


def _tool(spec, where: str) -> Tool:
    """One OpenAI-style schema {"type": "function", "function": {name, description, parameters}}."""
    function = spec.get("function") if isinstance(spec, dict) and spec.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(name, str) and name):
        raise EnvironmentUnavailable(f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                     "\"description\": ..., \"parameters\": {...}}}}")
    description = function.get("description", "")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    try:
        return make_tool(f"http.{name}", 1, name, description if isinstance(description, str) else "", parameters,
                         functools.partial(_step, name), where)
    except ConfigError as error:
        raise EnvironmentUnavailable(str(error)) from None


def _step(name: str, episode: HttpEpisode, arguments: dict) -> ToolResult:
    return episode.step(name, arguments)
