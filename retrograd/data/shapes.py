"""The record shapes datasets come in, turned into our `messages` records (messages.py).

A file holds one shape, detected from its first record by the key that names it:

  messages       {"messages": [{"role", "content"}, ...]}              chat messages (ours, OpenAI's)
  conversations  {"conversations": [{"from", "value"}, ...]}            ShareGPT (optional "system", "tools")
  prompt         {"prompt": "...", "completion": "..."}                 TRL, plain text: no chat template,
                                                                        the text is prompt + completion
  prompt         {"prompt": [messages], "completion": [messages]}       TRL, conversational
  instruction    {"instruction", "input" (optional), "output"}         Alpaca (optional "system")

A record of another shape is an error naming its line, as is a record missing the keys of
the file's shape. Other keys pass through (a prompt's `rubric`, a chat record's `tools`).

Each shape gives two parts: the `example` SFT trains on (for TRL, only the completion is
trained; a conversational prompt's own assistant turns are context) and the `prompt` a
rollout answers (TRL's prompt, a ShareGPT conversation without its final assistant turn,
Alpaca's instruction and input), so prompt files need no completion or output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

from retrograd.data.files import load_json
from retrograd.errors import DataError


@dataclass(frozen=True)
class Chat:
    """A record in messages form; its first `context_turns` assistant turns are not trained."""

    record: dict[str, Any]
    context_turns: int = 0


@dataclass(frozen=True)
class Plain:
    """TRL's plain prompt/completion: text with no chat template (completion None for a prompt)."""

    prompt: str
    completion: str | None
    extra: dict[str, Any]


@dataclass(frozen=True)
class Shape:
    name: str  # as the start-up line states it
    keys: str  # what a record of this shape holds, for errors
    detect: Callable[[dict[str, Any]], bool]
    example: Callable[[dict[str, Any], str], Chat | Plain]
    prompt: Callable[[dict[str, Any], str], Chat | Plain]


def shaped(records: Iterable[tuple[str, dict[str, Any]]], part: str) -> tuple[Shape | None, Iterator]:
    """(the file's shape, (where, Chat | Plain) for each record); part is "example" or "prompt".
    The shape is None for a file without records."""
    records = iter(records)
    first = next(records, None)
    if first is None:
        return None, iter(())
    where, record = first
    shape = next((s for s in SHAPES if s.detect(record)), None)
    if shape is None:
        raise DataError(f"{where}: no known record shape (keys: {_keys(record)}); expected one of: "
                        + "; ".join(f"{s.name} {s.keys}" for s in DISTINCT_SHAPES))

    def convert() -> Iterator[tuple[str, Chat | Plain]]:
        for where, record in chain([first], records):
            if not shape.detect(record):
                other = next((s for s in SHAPES if s.detect(record)), None)
                if other is not None:
                    raise DataError(f"{where}: this record is {other.name}, but the file's first is {shape.name}; "
                                    "one file holds one shape")
                raise DataError(f"{where}: expected {shape.keys} ({shape.name}, as the file's first record); "
                                f"got keys {_keys(record)}")
            yield where, getattr(shape, part)(record, where)

    return shape, convert()


def count(n: int, noun: str) -> str:
    """`1 record`, `1,204 records`: for the start-up line."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _keys(record: dict[str, Any]) -> str:
    return ", ".join(key[:40] for key in list(record)[:10]) or "none"


def _text(record: dict[str, Any], key: str, where: str, *, shape: Shape, required: bool = True) -> str:
    value = record.get(key)
    if value is None and not required:
        return ""
    if value is None:
        raise DataError(f'{where}: missing "{key}"; expected {shape.keys} ({shape.name})')
    if not isinstance(value, str):
        raise DataError(f'{where}: "{key}" must be a string, got {type(value).__name__}')
    return value


def _system(record: dict[str, Any], where: str, shape: Shape) -> list[dict[str, str]]:
    """The optional top-level "system" of ShareGPT and Alpaca exports; empty means none."""
    system = _text(record, "system", where, shape=shape, required=False)
    return [{"role": "system", "content": system}] if system.strip() else []


def _others(record: dict[str, Any], *taken: str) -> dict[str, Any]:
    return {key: value for key, value in record.items() if key not in taken}


# --- messages ----------------------------------------------------------------------------


def _messages(record: dict[str, Any], where: str) -> Chat:
    return Chat(record)


MESSAGES = Shape('chat messages', '{"messages": [{"role", "content"}, ...]}', lambda r: "messages" in r,
                 _messages, _messages)


# --- ShareGPT ----------------------------------------------------------------------------

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "function_call": "assistant",  # LLaMA-Factory: the value is the call as JSON
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def _sharegpt_example(record: dict[str, Any], where: str) -> Chat:
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise DataError(f'{where}: "conversations" must be a non-empty list of {{"from", "value"}} objects')
    messages = _system(record, where, SHAREGPT)
    for n, turn in enumerate(turns, 1):
        at = f"{where}: turn {n}"
        if not isinstance(turn, dict):
            raise DataError(f'{at}: expected an object with "from" and "value", got {type(turn).__name__}')
        source = turn.get("from")
        if not isinstance(source, str) or source not in SHAREGPT_ROLES:
            raise DataError(f'{at}: unknown "from" {repr(source)[:50]}; expected one of {", ".join(SHAREGPT_ROLES)}')
        value = turn.get("value")
        if not isinstance(value, str):
            raise DataError(f'{at}: "value" must be a string, got {type(value).__name__}')
        messages.append(_sharegpt_call(value, at) if source == "function_call" else
                        {"role": SHAREGPT_ROLES[source], "content": value})
    for message, after in pairwise(messages):
        if message["role"] == "assistant" and after["role"] == "tool" and "tool_calls" not in message:
            message["raw"] = True  # the calls are written in its text (<tool_call> blocks)
    tools = record.get("tools")
    if isinstance(tools, str):  # LLaMA-Factory writes the catalogue as JSON text, "" for none
        tools = _json(tools, f'{where}: "tools"') if tools.strip() else None
    return Chat(_others(record, "conversations", "system", "tools") | {"messages": messages}
                | ({"tools": tools} if tools else {}))


def _sharegpt_call(value: str, at: str) -> dict[str, Any]:
    calls = _json(value, f"{at}: function_call")
    calls = calls if isinstance(calls, list) else [calls]
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": call} for call in calls]}


def _json(text: str, what: str) -> Any:
    try:
        return load_json(text)
    except ValueError as e:
        raise DataError(f"{what} is not valid JSON ({e})") from None


def _sharegpt_prompt(record: dict[str, Any], where: str) -> Chat:
    chat = _sharegpt_example(record, where)
    messages = chat.record["messages"]
    if len(messages) > 1 and messages[-1]["role"] == "assistant":
        return Chat(chat.record | {"messages": messages[:-1]})
    return chat


SHAREGPT = Shape("ShareGPT conversations", '{"conversations": [{"from", "value"}, ...]}',
                 lambda r: "conversations" in r, _sharegpt_example, _sharegpt_prompt)


# --- TRL prompt/completion -----------------------------------------------------------------


def _trl_text_example(record: dict[str, Any], where: str) -> Plain:
    completion = _text(record, "completion", where, shape=TRL_TEXT)
    if not completion.strip():
        raise DataError(f'{where}: empty "completion"')
    return Plain(_text(record, "prompt", where, shape=TRL_TEXT), completion, _others(record, "prompt", "completion"))


def _trl_text_prompt(record: dict[str, Any], where: str) -> Plain:
    prompt = _text(record, "prompt", where, shape=TRL_TEXT)
    if not prompt.strip():
        raise DataError(f'{where}: empty "prompt"')
    return Plain(prompt, None, _others(record, "prompt", "completion"))


def _message_list(record: dict[str, Any], key: str, where: str) -> list:
    value = record.get(key)
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: "{key}" must be a non-empty list of {{"role", "content"}} objects, as in the '
                        f"file's first record; expected {TRL_CHAT.keys} ({TRL_CHAT.name})")
    return value


def _trl_chat_example(record: dict[str, Any], where: str) -> Chat:
    prompt = _message_list(record, "prompt", where)
    completion = _message_list(record, "completion", where)
    context = sum(isinstance(m, dict) and m.get("role") == "assistant" for m in prompt)
    return Chat(_others(record, "prompt", "completion") | {"messages": prompt + completion}, context)


def _trl_chat_prompt(record: dict[str, Any], where: str) -> Chat:
    return Chat(_others(record, "prompt", "completion") | {"messages": _message_list(record, "prompt", where)})


TRL_TEXT = Shape("TRL prompt/completion (plain text)", '{"prompt": "...", "completion": "..."}',
                 lambda r: isinstance(r.get("prompt"), str), _trl_text_example, _trl_text_prompt)
TRL_CHAT = Shape("TRL prompt/completion (conversational)",
                 '{"prompt": [{"role", "content"}, ...], "completion": [{"role": "assistant", ...}]}',
                 lambda r: isinstance(r.get("prompt"), list), _trl_chat_example, _trl_chat_prompt)


# --- Alpaca --------------------------------------------------------------------------------


def _alpaca_user(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    """User turn = the instruction, then the input after a blank line when there is one."""
    instruction = _text(record, "instruction", where, shape=ALPACA)
    extra = _text(record, "input", where, shape=ALPACA, required=False)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return _system(record, where, ALPACA) + [{"role": "user", "content": user}]


def _alpaca_example(record: dict[str, Any], where: str) -> Chat:
    answer = {"role": "assistant", "content": _text(record, "output", where, shape=ALPACA)}
    return Chat(_others(record, "instruction", "input", "output", "system")
                | {"messages": _alpaca_user(record, where) + [answer]})


def _alpaca_prompt(record: dict[str, Any], where: str) -> Chat:
    return Chat(_others(record, "instruction", "input", "output", "system") | {"messages": _alpaca_user(record, where)})


ALPACA = Shape("Alpaca instructions", '{"instruction", "input" (optional), "output"}',
               lambda r: "instruction" in r, _alpaca_example, _alpaca_prompt)

# In order of precedence: a record with both "messages" and "prompt" is chat messages.
SHAPES = (MESSAGES, SHAREGPT, TRL_TEXT, TRL_CHAT, ALPACA)
DISTINCT_SHAPES = (MESSAGES, SHAREGPT, TRL_TEXT, ALPACA)  # TRL's two differ in values, not keys
