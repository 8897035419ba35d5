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
from dataclasses import dataclass
from typing import Any

from retrograd.data.files import UnsafeJSON, load_json

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


def assistant_message(content: str, calls: list[ToolCall] | tuple[ToolCall, ...]) -> dict[str, Any]:
    """A structured assistant turn: its words, and its calls in OpenAI's form (arguments as an object)."""
    tool_calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return {"role": "assistant", "content": content} | ({"tool_calls": tool_calls} if tool_calls else {})


def text_around_calls(text: str) -> str:
    """An assistant turn's words besides its calls: the text before the first `<tool_call>`
    and after the last `</tool_call>` (not an open block's beginning), joined."""
    opened, closed = text.find(CALL_OPEN), text.rfind(CALL_CLOSE)
    after = text[closed + len(CALL_CLOSE) :].split(CALL_OPEN)[0]
    return "\n".join(part for part in (text[:opened].strip(), after.strip()) if part)


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
