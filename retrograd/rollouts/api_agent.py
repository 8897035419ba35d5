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

A request that fails (a server error, a timeout, a reply without a message) is retried
`max_retries` times; then that trajectory alone fails as `policy_broken`, its cause recorded.
One the endpoint refuses (a 4xx other than 408 and 429: a wrong model name, a bad key) would
be refused for every trajectory, so it stops the collection on one line instead.
A call whose arguments are not a JSON object makes the turn malformed (the model reads an
error, as with a local policy's unparsable markup).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from retrograd.config import CollectApiSection
from retrograd.data.tools import ERROR_PREFIX, ToolCall, call_markup, decode_arguments
from retrograd.errors import ConfigError
from retrograd.rollouts.agent import NO_CALL, AgentRollouts, LiveTrajectory, Turn, render


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
        problem = ""
        for _ in range(self.s.max_retries + 1):
            try:
                response = self.client.post("/chat/completions", json=body)
                if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
                    raise ConfigError(f"agent.collect_api: {self.s.base_url} refused the request with {response.status_code}: "
                                      f"{' '.join(response.text.split())[:300]}")
                response.raise_for_status()
                choice = response.json()["choices"][0]
                return read_reply(choice["message"], choice.get("finish_reason"),
                                  (response.json().get("usage") or {}).get("completion_tokens", 0), first_id)
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                problem = f"{type(e).__name__}: {e}"[:300]
        raise PolicyBroken(f"{self.s.base_url} gave no usable reply in {self.s.max_retries + 1} tries (last: {problem})")


def read_reply(message: dict, finish_reason: str | None, n_tokens: int, first_id: int) -> Reply:
    """An OpenAI assistant message as a turn: its calls, or the note of the first malformed one."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise TypeError(f"the message's content is {type(content).__name__}, not text")
    calls, note = [], None
    for n, call in enumerate(message.get("tool_calls") or (), 1):
        function = call.get("function") or {}
        name, arguments = function.get("name"), decode_arguments(function.get("arguments", {}))
        if not isinstance(name, str) or not name or arguments is None:
            calls, note = [], ERROR_PREFIX + f"tool call {n} needs a function name and arguments that are a JSON object"
            break
        calls.append(ToolCall(f"call_{first_id + len(calls)}", name, arguments))
    return Reply(content, tuple(calls), note, "length" if finish_reason == "length" else "eos", int(n_tokens or 0))


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
        room = self.limits.max_trajectory_tokens - len(self.chat.tokenize(live.rendered, live.scenario.source)[0])
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
        live.messages.append({"role": "assistant", "content": reply.content}
                             | ({"tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                                for c in reply.calls]} if reply.calls else {}))
        if not reply.calls and note is None:
            if self.limits.end_on_no_tool_call:
                live.stop = "no_tool_call"
            else:
                note = ERROR_PREFIX + NO_CALL
        text = "\n".join(part for part in (reply.content, call_markup(list(reply.calls))) if part)
        live.turns.append(Turn(text, reply.n_tokens, reply.finish, 0, 0, 0, note=note))
        live.failed_turns = 0 if live.pending else live.failed_turns + 1
        if reply.finish == "length" and room < self.limits.max_new_tokens_per_turn:
            live.stop = "max_trajectory_tokens"

    def _extend(self, live: LiveTrajectory) -> int:
        """The conversation rendered as a structured record; its length in tokens."""
        live.rendered = render(self.chat, live.scenario, live.messages, live.calls)
        return len(self.chat.tokenize(live.rendered, live.scenario.source)[0])
