"""One JSONL record -> a validated conversation, in the shape chat templates expect.

Rules (notes section 3 and 4.1): roles are system/user/assistant/tool; system messages come
first; then user and assistant turns alternate, starting with a user turn. Tool records
(a `tools` catalogue, assistant `tool_calls`, or `tool` messages) also allow two user
messages in a row, and every call must be answered by a `tool` message before the next
turn. Content is a non-empty string, except for an assistant turn that only calls tools
and for a tool observation (a command may print nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retrograd.data.tools import ERROR_PREFIX, ToolCall, assistant_message, decode_arguments, parse_calls
from retrograd.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    messages: tuple[dict[str, Any], ...]  # role, content; tool_calls / tool_call_id + name for tool records
    tools: tuple[dict[str, Any], ...]  # the catalogue in OpenAI form; empty for plain chat
    calls: tuple[tuple[ToolCall, ...], ...]  # the calls of each assistant turn, in order

    @property
    def has_tools(self) -> bool:
        return bool(self.tools) or any(self.calls) or any(m["role"] == "tool" for m in self.messages)


def parse_conversation(record: dict[str, Any], where: str) -> Conversation:
    if "messages" not in record:
        raise DataError(
            f'{where}: missing "messages" (expected {{"messages": [{{"role": ..., "content": ...}}, ...]}})'
        )
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    tools = _catalogue(record.get("tools", []), where)
    tool_record = "tools" in record or any(
        isinstance(m, dict) and ("tool_calls" in m or m.get("role") == "tool") for m in messages
    )
    turns = _Turns(tool_names={t["function"]["name"] for t in tools}, consecutive_users=tool_record)
    for n, message in enumerate(messages, 1):
        turns.add(message, f"{where}: message {n}")
    if turns.pending:
        raise DataError(
            f"{where}: tool call(s) {', '.join(c.id for c in turns.pending)} are never answered by a tool message"
        )
    return Conversation(tuple(turns.out), tools, tuple(turns.calls))


class _Turns:
    """Walks the messages once, checking each against the turns before it."""

    def __init__(self, tool_names: set[str], consecutive_users: bool):
        self.tool_names = tool_names
        self.consecutive_users = consecutive_users
        self.out: list[dict[str, Any]] = []
        self.calls: list[tuple[ToolCall, ...]] = []
        self.pending: list[ToolCall] = []
        self.call_ids: set[str] = set()

    @property
    def previous(self) -> str | None:
        return self.out[-1]["role"] if self.out else None

    def add(self, message: Any, at: str) -> None:
        if not isinstance(message, dict):
            raise DataError(f"{at}: expected an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{at}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        {"system": self.system, "user": self.user, "assistant": self.assistant, "tool": self.tool}[role](message, at)

    def system(self, message: dict, at: str) -> None:
        if self.previous not in (None, "system"):
            raise DataError(f"{at}: system message after the conversation started; system messages go first")
        self.out.append({"role": "system", "content": _content(message, at)})

    def user(self, message: dict, at: str) -> None:
        if self.pending:
            raise DataError(f"{at}: user message while tool call(s) {_ids(self.pending)} are unanswered")
        if self.previous == "user" and not self.consecutive_users:
            raise DataError(f"{at}: two user messages in a row; user and assistant turns alternate")
        self.out.append({"role": "user", "content": _content(message, at)})

    def assistant(self, message: dict, at: str) -> None:
        if self.pending:
            raise DataError(f"{at}: assistant turn while tool call(s) {_ids(self.pending)} are unanswered")
        if self.previous == "assistant":
            raise DataError(f"{at}: two assistant turns in a row; user and assistant turns alternate")
        if self.previous in (None, "system"):
            raise DataError(f"{at}: the conversation starts with an assistant turn; the first turn is a user message")
        raw = message.get("raw", False)
        if not isinstance(raw, bool):
            raise DataError(f'{at}: "raw" must be true or false, got {raw!r}')
        declared = self._declared_calls(message.get("tool_calls", []), at)
        if raw:
            content = _content(message, at)
            calls = self._raw_calls(content, declared, at)
            self.out.append({"role": "assistant", "content": content})
        else:
            calls = declared
            content = _content(message, at, optional=bool(calls))
            self.out.append(assistant_message(content, calls))
        for call in calls:
            if self.tool_names and call.name not in self.tool_names:
                raise DataError(
                    f"{at}: calls {call.name!r}, which is not in the record's tools ({', '.join(sorted(self.tool_names))})"
                )
        self.calls.append(tuple(calls))
        self.pending = list(calls)

    def tool(self, message: dict, at: str) -> None:
        if not self.pending:
            raise DataError(f"{at}: tool message answers nothing (no tool call is pending)")
        call_id = message.get("tool_call_id")
        if call_id is None:
            call = self.pending.pop(0)
        else:
            call = next((c for c in self.pending if c.id == call_id), None)
            if call is None:
                raise DataError(
                    f"{at}: tool_call_id {call_id!r} matches no pending call (pending: {_ids(self.pending)})"
                )
            self.pending.remove(call)
        is_error = message.get("is_error", False)
        if not isinstance(is_error, bool):
            raise DataError(f'{at}: "is_error" must be true or false, got {is_error!r}')
        content = (ERROR_PREFIX if is_error else "") + _content(message, at, optional=True)
        self.out.append({"role": "tool", "content": content, "tool_call_id": call.id, "name": call.name})

    def _declared_calls(self, value: Any, at: str) -> list[ToolCall]:
        if not isinstance(value, list):
            raise DataError(
                f'{at}: "tool_calls" must be a list of {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
            )
        calls = []
        for n, entry in enumerate(value, 1):
            fn = entry.get("function") if isinstance(entry, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise DataError(f'{at}: tool call {n} needs "function": {{"name": ..., "arguments": ...}}')
            arguments = decode_arguments(fn.get("arguments"))
            if arguments is None:
                raise DataError(
                    f"{at}: tool call {n} ({fn['name']}): arguments must be an object or a JSON string holding one"
                )
            calls.append(ToolCall(self._call_id(entry.get("id"), at), fn["name"], arguments))
        return calls

    def _raw_calls(self, content: str, declared: list[ToolCall], at: str) -> list[ToolCall]:
        """A raw turn's calls are the <tool_call> blocks in its text; declared calls must match them."""
        parsed = parse_calls(content)
        if isinstance(parsed, str):
            raise DataError(f"{at}: raw assistant turn: {parsed}")
        if declared and [(c.name, c.arguments) for c in declared] != parsed:
            raise DataError(f"{at}: raw assistant turn: its <tool_call> blocks {parsed} differ from its tool_calls")
        return declared or [ToolCall(self._call_id(None, at), name, arguments) for name, arguments in parsed]

    def _call_id(self, given: Any, at: str) -> str:
        call_id = f"call_{len(self.call_ids)}" if given is None else given
        if not isinstance(call_id, str) or not call_id or call_id in self.call_ids:
            raise DataError(f"{at}: tool call id {call_id!r} must be a unique non-empty string")
        self.call_ids.add(call_id)
        return call_id


def _content(message: dict, at: str, optional: bool = False) -> str:
    content = message.get("content", "" if optional else None)
    if content is None and optional:
        content = ""
    if not isinstance(content, str):
        raise DataError(f'{at}: "content" must be a string, got {type(content).__name__}')
    if not optional and not content.strip():
        raise DataError(f"{at}: empty content")
    return content


def _catalogue(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    """Tools as OpenAI function definitions; the flat {name, description, parameters} form is accepted."""
    if not isinstance(value, list):
        raise DataError(f'{where}: "tools" must be a list of function definitions')
    tools, names = [], set()
    for n, tool in enumerate(value, 1):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DataError(
                f'{where}: tool {n} needs a "name" (as {{"type": "function", "function": {{"name", ...}}}})'
            )
        if fn["name"] in names:
            raise DataError(f"{where}: tool {n}: the name {fn['name']!r} is defined twice")
        names.add(fn["name"])
        tools.append({"type": "function", "function": dict(fn)})
    return tuple(tools)


def _ids(calls: list[ToolCall]) -> str:
    return ", ".join(c.id for c in calls)
