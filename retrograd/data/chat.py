"""A validated conversation -> token ids and the assistant loss mask.

The whole conversation is rendered once and tokenized once, so token boundaries are
exactly llama.cpp's for the full text. Assistant turns are located by rendering prefixes:
turn k starts where `messages[:k]` with the generation prompt ends, and ends where
`messages[:k+1]` ends; both must be exact prefixes of the full render, or the record is
refused. Inside a turn everything up to and including its last end-of-generation token
(`<|im_end|>`, `<end_of_turn>`, ...) is trained: the prose, any call markup and the
end-of-turn marker; the newline a template writes after the marker is not. A token is in
a turn when it starts inside it: a token straddling the header and the content belongs to
the context, because at inference the model starts generating after the header.

Tool records are rendered by the template itself when it passes the native tool probe,
else with the Hermes/Qwen convention of tools.py.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from retrograd.data import tools as hermes
from retrograd.data.messages import Conversation
from retrograd.data.template import ChatFormat
from retrograd.data.tools import ToolCall
from retrograd.errors import DataError


@dataclass(frozen=True)
class ToolStyle:
    """How a tool record reaches the template, and how a rendered turn is checked against
    the calls it declares (returns a problem, or None)."""

    messages: Callable[[Conversation], tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]
    check_turn: Callable[[str, tuple[ToolCall, ...]], str | None]


def _native_messages(conv: Conversation) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    return list(conv.messages), list(conv.tools) or None


def _native_check(turn: str, calls: tuple[ToolCall, ...]) -> str | None:
    """Each template has its own call syntax; we can only insist that no call was dropped."""
    missing = [c.name for c in calls if c.name not in turn]
    return f"the chat template dropped the call(s) {', '.join(missing)}" if missing else None


def _hermes_messages(conv: Conversation) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Catalogue appended to the (last leading) system message, calls written into the
    assistant content, consecutive observations merged into one user turn."""
    messages: list[dict[str, Any]] = []
    calls = iter(conv.calls)
    in_observations = False
    for message in conv.messages:
        role = message["role"]
        if role == "tool" and in_observations:
            messages[-1] = {
                "role": "user",
                "content": messages[-1]["content"] + "\n" + hermes.observation(message["content"]),
            }
        elif role == "tool":
            messages.append({"role": "user", "content": hermes.observation(message["content"])})
        elif role == "assistant":
            turn_calls = list(next(calls))
            prose = message["content"]
            markup = hermes.call_markup(turn_calls) if "tool_calls" in message else ""
            messages.append({"role": "assistant", "content": "\n".join(part for part in (prose, markup) if part)})
        else:
            messages.append(dict(message))
        in_observations = role == "tool"
    if conv.tools:
        n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        catalogue = hermes.catalogue(list(conv.tools))
        if n_system:
            messages[n_system - 1]["content"] += "\n\n" + catalogue
        else:
            messages.insert(0, {"role": "system", "content": catalogue})
    return messages, None


def _hermes_check(turn: str, calls: tuple[ToolCall, ...]) -> str | None:
    parsed = hermes.parse_calls(turn)
    declared = [(c.name, c.arguments) for c in calls]
    if parsed != declared:
        return f"the rendered turn parses back to {parsed}, not to the declared calls {declared}"
    return None


NATIVE = ToolStyle(_native_messages, _native_check)
HERMES = ToolStyle(_hermes_messages, _hermes_check)


def tool_style(chat: ChatFormat, conv: Conversation) -> ToolStyle:
    return HERMES if conv.has_tools and not chat.native_tools else NATIVE


def render_prompt(chat: ChatFormat, conv: Conversation, where: str) -> str:
    """The conversation up to an open assistant header, rendered as tool records are: the
    catalogue and observations through the template when it passes the native probe, else
    with the Hermes convention (what agent rollouts and `serve` prompt the model with)."""
    messages, tools = tool_style(chat, conv).messages(conv)
    return chat.render(messages, tools=tools, add_generation_prompt=True, where=where)


def encode_conversation(
    chat: ChatFormat, conv: Conversation, where: str, *, context_turns: int = 0
) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and the per-token loss mask (True on assistant
    turns but the first `context_turns`, which are context: a TRL prompt's own answers)."""
    style = tool_style(chat, conv)
    messages, tools = style.messages(conv)
    text, spans = _assistant_spans(chat, messages, tools, where)
    assert len(spans) == len(conv.calls), "every assistant turn survives the tool style"
    ids, starts = chat.tokenize(text, where)
    eog = chat.tokenizer.eog_ids
    mask = [False] * len(ids)
    for k, ((begin, end), calls) in enumerate(zip(spans, conv.calls), 1):
        problem = style.check_turn(text[begin:end], calls)
        if problem:
            raise DataError(f"{where}: assistant turn {k}: {problem}")
        first = bisect_left(starts, len(text[:begin].encode("utf-8")))
        stop = bisect_left(starts, len(text[:end].encode("utf-8")))
        ends = [i for i in range(first, stop) if ids[i] in eog]
        if not ends:
            raise DataError(
                f"{where}: assistant turn {k}: the chat template of {chat.origin} ends it without an end-of-generation "
                "token, so the model would never learn to stop"
            )
        if k > context_turns:
            mask[first : ends[-1] + 1] = [True] * (ends[-1] + 1 - first)
    return ids, mask


def _assistant_spans(
    chat: ChatFormat, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The full render and the character span of every assistant turn in it."""
    full = chat.render(messages, tools=tools, where=where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat.render(messages[:i], tools=tools, add_generation_prompt=True, where=where)
        through = chat.render(messages[: i + 1], tools=tools, where=where)
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(
                f"{where}: assistant turn {len(spans) + 1}: the chat template of {chat.origin} does not render the "
                "earlier turns as an exact prefix of the later ones, so the turn cannot be located"
            )
        spans.append((len(before), len(through)))
    return full, spans
