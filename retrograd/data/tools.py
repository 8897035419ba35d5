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
CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
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


def observation(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def parse_calls(text: str) -> list[tuple[str, dict[str, Any]]] | str:
    """Every `<tool_call>` block in `text` as (name, arguments), or a one-line reason why a
    block is malformed. `arguments` may be an object or a JSON string holding one."""
    calls = []
    for n, body in enumerate(CALL_PATTERN.findall(text), 1):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return f"<tool_call> block {n} is not valid JSON ({e.msg})"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return f'<tool_call> block {n} must be an object with a string "name"'
        arguments = decode_arguments(obj.get("arguments", {}))
        if arguments is None:
            return f'<tool_call> block {n}: "arguments" must be a JSON object'
        calls.append((obj["name"], arguments))
    return calls


def decode_arguments(value: Any) -> dict[str, Any] | None:
    """Call arguments as an object: given as one, or as a JSON string holding one (OpenAI's form)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None
