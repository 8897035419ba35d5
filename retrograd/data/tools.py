"""The Hermes/Qwen tool convention, used when a model's chat template cannot render tools
itself (notes 4.1, 5 "Chat templates and tools"):

- the catalogue goes at the end of the system prompt, one JSON signature per line inside
  `<tools></tools>`;
- the assistant writes each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  after its prose;
- observations come back as a user turn, each inside `<tool_response></tool_response>`.

Training data and rollouts must agree on this text, so the agent loop renders and parses
calls with these same functions.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

CATALOGUE_HEADER = (
    "# Tools\n\nYou can call the functions whose signatures are listed inside <tools></tools>, one per line:\n<tools>\n"
)
CATALOGUE_FOOTER = (
    "\n</tools>\n\n"
    "To call a function, write a JSON object with its name and its arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>\n'
    "Each result comes back inside <tool_response></tool_response> tags."
)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ERROR_PREFIX = "ERROR: "

# Bounds on JSON a model or a tool writes (a call, its arguments, a json tool's reply).
MAX_JSON_CHARS = 1_000_000
MAX_JSON_DEPTH = 32
MAX_NUMBER_CHARS = 100
# A JSON string (closed or running to the end of the text) or a bracket: enough to measure
# nesting before the recursive parser sees the text. Linear: no alternative backtracks.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class UnsafeJSON(ValueError):
    """Syntactically JSON, but not something every reader (and our UTF-8 output) can take."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def same_call(self, other: ToolCall) -> bool:
        return (self.name, self.arguments) == (other.name, other.arguments)


def catalogue(tools: list[dict[str, Any]]) -> str:
    """System-prompt text describing `tools` (OpenAI form: {"type": "function", "function": {...}})."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return CATALOGUE_HEADER + lines + CATALOGUE_FOOTER


def call_markup(calls: list[ToolCall]) -> str:
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False) + "\n</tool_call>"
        for c in calls
    )


def observation(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def parse_calls(text: str) -> list[tuple[str, dict[str, Any]]] | str:
    """Every `<tool_call>` block in `text` as (name, arguments), or a one-line reason why a
    block is malformed. `arguments` may be an object or a JSON string holding one. Whatever
    the text, the answer is one of the two: model output never raises here."""
    calls = []
    for n, body in enumerate(_call_bodies(text), 1):
        try:
            obj = load_json(body)
        except json.JSONDecodeError as e:
            return f"<tool_call> block {n} is not valid JSON ({e.msg})"
        except UnsafeJSON as e:
            return f"<tool_call> block {n}: {e}"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return f'<tool_call> block {n} must be an object with a string "name"'
        arguments = decode_arguments(obj.get("arguments", {}))
        if arguments is None:
            return f'<tool_call> block {n}: "arguments" must be a JSON object'
        calls.append((obj["name"], arguments))
    return calls


def _call_bodies(text: str):
    """The text inside each <tool_call></tool_call> pair, in one pass (a regex search would
    rescan the rest of the text after every unclosed tag)."""
    start = 0
    while (opened := text.find(CALL_OPEN, start)) != -1:
        closed = text.find(CALL_CLOSE, opened + len(CALL_OPEN))
        if closed == -1:
            return
        yield text[opened + len(CALL_OPEN) : closed]
        start = closed + len(CALL_CLOSE)


def decode_arguments(value: Any) -> dict[str, Any] | None:
    """Call arguments as an object: given as one, or as a JSON string holding one (OpenAI's form)."""
    if isinstance(value, str):
        try:
            value = load_json(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def load_json(text: str) -> Any:
    """json.loads for text a model or a tool wrote. Size and nesting are checked before the
    (recursive) parser runs; NaN and Infinity, numbers longer than MAX_NUMBER_CHARS,
    duplicate keys and lone UTF-16 surrogates (which cannot be written as UTF-8) are
    refused. Raises json.JSONDecodeError for broken syntax, UnsafeJSON for the rest; both
    are ValueErrors with a one-line message."""
    if len(text) > MAX_JSON_CHARS:
        raise UnsafeJSON(f"JSON longer than {MAX_JSON_CHARS} characters")
    depth = 0
    for token in _STRING_OR_BRACKET.finditer(text):
        bracket = text[token.start()]
        if bracket in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise UnsafeJSON(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        elif bracket in "]}":
            depth -= 1
    value = json.loads(text, parse_constant=_no_constant, parse_int=_integer, parse_float=_real,
                       object_pairs_hook=_unique_keys)
    _check_strings(value)
    return value


def _no_constant(name: str):
    raise UnsafeJSON(f"{name} is not a JSON number")


def _integer(digits: str) -> int:
    return int(_short(digits))


def _real(digits: str) -> float:
    value = float(_short(digits))
    if not math.isfinite(value):
        raise UnsafeJSON(f"the number {digits} is out of range")
    return value


def _short(digits: str) -> str:
    if len(digits) > MAX_NUMBER_CHARS:
        raise UnsafeJSON(f"a number longer than {MAX_NUMBER_CHARS} characters")
    return digits


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise UnsafeJSON(f"the key {key[:50]!r} appears twice in one object")
        obj[key] = value
    return obj


def _check_strings(value: Any) -> None:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending += item.keys()
            pending += item.values()
        elif isinstance(item, list):
            pending += item
        elif isinstance(item, str) and not item.isascii() and _SURROGATE.search(item):
            raise UnsafeJSON("a string holds a lone UTF-16 surrogate, which is not Unicode text")
