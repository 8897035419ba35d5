"""An OpenAI-compatible chat endpoint as the agent's policy: `collect --api` with
`[agent.collect_api]` (the Rust retrograd's name), for traces of a stronger model than the
one being trained.

The episode is agent.AgentRollouts' (sandboxes or an http episode, tools, verify, the wall
budget and the turn limits); only the turn differs. The conversation goes to the endpoint as
messages with the scenario's tool catalogue, and its reply comes back as content and
structured `tool_calls`, which are kept as such: each assistant turn is held as a structured
record holds it (content, then the calls the template renders), with no tokens of ours, so
the trajectory's `tokens` are empty and `collect` writes structured records. The token
budget is still the local template's: after each turn the conversation is rendered and
tokenized as SFT will see it, and one over `max_trajectory_tokens` ends there.

A request that fails for a while (a server error, 408 or 429, a timeout, a reply without a
message) is retried `max_retries` times, waiting 0.5 s, 1 s, 2 s, ... (or the `Retry-After` the
endpoint asks for); one the endpoint refuses for its content (another 4xx: a conversation
longer than its context) is not retried. Either way that trajectory alone fails as
`policy_broken`, its cause recorded. A refusal that would be the same for every request (401,
403, 404: a missing key, a wrong model name) stops the collection on one line instead. A call
whose arguments are not a JSON object makes the turn malformed (the model reads an error, as
with a local policy's unparsable markup); a finish other than `stop` or `tool_calls` (`length`,
`content_filter`) is a cut turn.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from retrograd.config import CollectApiSection
from retrograd.data.tools import ERROR_PREFIX, ToolCall, assistant_message, call_markup, decode_arguments
from retrograd.errors import ConfigError, DataError
from retrograd.rollouts.agent import AgentRollouts, LiveTrajectory, Turn, render

NO_STRUCTURED_CALL = "no tool call found; call one of the tools, or call submit when you are done"
STOPS_ALL = (401, 403, 404)  # the same for every request: the collection stops
TRANSIENT = (408, 429)  # with 5xx and transport errors: retried
CLEAN_FINISH = (None, "stop", "tool_calls", "function_call")  # anything else cut the turn


class PolicyBroken(Exception):
    """The endpoint gave no usable reply in every try."""


@dataclass(frozen=True)
class Reply:
    content: str
    calls: tuple[ToolCall, ...]
    note: str | None  # the error the model reads instead of its calls when one is malformed
    finish: str  # "eos" | "length"
    n_tokens: int  # the endpoint's completion_tokens (0 when it does not say)


@dataclass(frozen=True)
class Seeded:
    """What `open` hands each trajectory, as the llama.cpp sampler hands a conversation."""

    seed: int

    def close(self) -> None:
        pass


class EndpointPolicy:
    """Chat completions from `section`'s endpoint; thread-safe (trajectories ask in parallel)."""

    def __init__(self, section: CollectApiSection):
        self.s = section
        key = os.environ.get(section.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=section.base_url.rstrip("/"), headers=headers, timeout=section.timeout_secs)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

    def describe(self) -> str:
        return f"{self.s.model} at {self.s.base_url}"

    def open(self, seeds: list[int]) -> list[Seeded]:
        return [Seeded(seed) for seed in seeds]

    def reply(self, messages: list[dict], tools: list[dict], seed: int, max_tokens: int, first_id: int) -> Reply:
        """The next assistant turn; its calls are numbered call_{first_id} on, as a local
        policy's are."""
        body = {"model": self.s.model, "messages": wire(messages), "max_tokens": max_tokens, "seed": seed}
        if tools:
            body["tools"] = tools
        if self.s.temperature is not None:
            body["temperature"] = self.s.temperature
        for attempt in range(self.s.max_retries + 1):
            wait = 0.5 * 2**attempt
            try:
                response = self.client.post("/chat/completions", json=body)
            except httpx.HTTPError as e:
                problem = f"{type(e).__name__}: {e}"
            else:
                status, text = response.status_code, " ".join(response.text.split())[:300]
                if status in STOPS_ALL:
                    raise ConfigError(f"agent.collect_api: {self.s.base_url} refused the request with {status}: {text}")
                if 400 <= status < 500 and status not in TRANSIENT:
                    raise PolicyBroken(f"{self.s.base_url} refused the conversation with {status}: {text}")
                if status == 200:
                    try:
                        payload = response.json()
                        choice = payload["choices"][0]
                        return read_reply(choice["message"], choice.get("finish_reason"),
                                          (payload.get("usage") or {}).get("completion_tokens", 0), first_id)
                    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                        problem = f"a reply without a message ({type(e).__name__}: {e})"
                else:
                    problem = f"{status}: {text}"
                    wait = max(wait, _retry_after(response))
            if attempt < self.s.max_retries:
                time.sleep(min(wait, 30.0))
        problem = " ".join(problem.split())[:300]
        raise PolicyBroken(f"{self.s.base_url} gave no usable reply in {self.s.max_retries + 1} tries (last: {problem})")


def _retry_after(response: httpx.Response) -> float:
    """The seconds a 429 or 503 asks to wait (0 when it does not say, or says a date)."""
    try:
        return float(response.headers.get("Retry-After", 0))
    except ValueError:
        return 0.0


def read_reply(message: dict, finish_reason: str | None, n_tokens: int, first_id: int) -> Reply:
    """An OpenAI assistant message as a turn: its calls, or the note of the first malformed one."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise TypeError(f"the message's content is {type(content).__name__}, not text")
    calls, note = [], None
    for n, call in enumerate(message.get("tool_calls") or (), 1):
        function = call.get("function") or {}
        name, arguments = function.get("name"), decode_arguments(function.get("arguments") or {})  # "" or null: none
        if not isinstance(name, str) or not name or arguments is None:
            calls, note = [], ERROR_PREFIX + f"tool call {n} needs a function name and arguments that are a JSON object"
            break
        calls.append(ToolCall(f"call_{first_id + len(calls)}", name, arguments))
    return Reply(content, tuple(calls), note, "eos" if finish_reason in CLEAN_FINISH else "length", int(n_tokens or 0))


def wire(messages: list[dict]) -> list[dict]:
    """Messages as an OpenAI endpoint takes them: call arguments as JSON text."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = m | {"tool_calls": [c | {"function": c["function"] | {"arguments": json.dumps(c["function"]["arguments"])}}
                                    for c in m["tool_calls"]]}
        out.append(m)
    return out


class EndpointRollouts(AgentRollouts):
    """AgentRollouts whose turns come from an EndpointPolicy (`sampler`)."""

    def _sample(self, running: list[LiveTrajectory]) -> None:
        with ThreadPoolExecutor(max_workers=len(running), thread_name_prefix="retrograd-policy") as threads:
            list(threads.map(self._ask, running))

    def _ask(self, live: LiveTrajectory) -> None:
        room = self.limits.max_trajectory_tokens - self._length(live)
        if live.stop is not None:
            return
        tools = live.scenario.toolset.specs() if live.scenario.toolset else []
        try:
            reply = self.sampler.reply(live.messages, tools, live.conversation.seed + len(live.turns),
                                       min(self.limits.max_new_tokens_per_turn, room), sum(map(len, live.calls)))
        except PolicyBroken as broken:
            live.stop, live.cause = "policy_broken", str(broken)
            return
        note = reply.note
        live.pending = list(reply.calls)
        live.calls.append(reply.calls)
        live.messages.append(assistant_message(reply.content, reply.calls))
        if not reply.calls and note is None:
            if self.limits.end_on_no_tool_call:
                live.stop = "no_tool_call"
            else:
                note = ERROR_PREFIX + NO_STRUCTURED_CALL
        text = "\n".join(part for part in (reply.content, call_markup(list(reply.calls))) if part)
        live.turns.append(Turn(text, reply.n_tokens, reply.finish, 0, 0, 0, note=note, content=reply.content))
        live.failed_turns = 0 if live.pending else live.failed_turns + 1
        if reply.finish == "length" and room < self.limits.max_new_tokens_per_turn:
            live.stop = "max_trajectory_tokens"

    def _extend(self, live: LiveTrajectory) -> int:
        """The conversation rendered as a structured record; its length in tokens."""
        live.rendered = render(self.chat, live.scenario, live.messages, live.calls)
        return self._length(live)

    def _length(self, live: LiveTrajectory) -> int:
        """Tokens of the render so far; text the local tokenizer cannot spell back (odd bytes
        from the endpoint) breaks the trajectory rather than the collection."""
        try:
            return len(self.chat.tokenize(live.rendered, live.scenario.source)[0])
        except DataError as e:
            live.stop, live.cause = "policy_broken", f"the reply cannot be tokenized: {' '.join(str(e).split())[:300]}"
            return self.limits.max_trajectory_tokens
