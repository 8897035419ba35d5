"""Structured replies for `serve`: `response_format` and `tools` turned into a grammar the
reply is sampled under, and a reply's text turned back into OpenAI `tool_calls`.

Tool calls are written in the Hermes convention of retrograd/data/tools.py, as SFT tool
records and agentic rollouts write them: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
`tool_choice` "required" or a named function samples under a grammar of such blocks whose
arguments follow each function's `parameters` schema; "auto" samples freely (under the
`response_format` grammar or the calls, when a format is given) and parses what came; "none"
renders the tools but parses nothing.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from retrograd.data.tools import CALL_CLOSE, CALL_OPEN, parse_calls, text_around_calls
from retrograd.sampler.grammar import SchemaError, check_schema, schema_grammar
from retrograd.serving.inference import StopStrings

JSON_OBJECT = {"type": "object"}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters


@dataclass(frozen=True)
class Calls:
    """How a request's tools are used: the functions (name -> parameters schema), whether
    a call is forced, and whether replies are parsed for calls at all."""

    functions: dict[str, dict]
    forced: bool = False
    parsed: bool = True
    parallel: bool = True


def reply_grammar(reply_schema: dict | None, calls: Calls | None) -> str | None:
    """The GBNF a reply is sampled under, or None for free text. The schemas it enforces are
    checked first (retrograd.sampler.grammar.SchemaError names what cannot be enforced); tools
    sampled freely ("auto" without a response_format) are not."""
    forced = calls is not None and calls.forced
    if reply_schema is not None and not forced:
        check_schema(reply_schema, "response_format")
    functions = calls.functions if calls is not None and calls.parsed and (forced or reply_schema is not None) else None
    for name, parameters in (functions or {}).items():
        where = f"tools ({name}): parameters"
        check_schema(parameters, where)
        if parameters.get("type") != "object":
            raise SchemaError(f'{where}: must be an object schema ("type": "object"), as call arguments are an object')
    if forced:
        return schema_grammar(
            None, functions, call_open=CALL_OPEN, call_close=CALL_CLOSE, parallel=calls.parallel, where="tools"
        )
    if reply_schema is None:
        return None
    return schema_grammar(
        reply_schema, functions, call_open=CALL_OPEN, call_close=CALL_CLOSE, parallel=bool(calls and calls.parallel)
    )


def split_reply(text: str, calls: Calls | None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a reply. Text before the first `<tool_call>` and after
    the last `</tool_call>` is the content (None when empty and there are calls); a block left
    open by the token budget is dropped (the finish reason says "length"); markup that does not
    parse, or names a function the request did not offer, stays content."""
    if calls is None or not calls.parsed or (opened := text.find(CALL_OPEN)) == -1:
        return text, []
    parsed = parse_calls(text[opened:])
    if isinstance(parsed, str) or not parsed or any(name not in calls.functions for name, _ in parsed):
        return text, []
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
        for name, arguments in parsed
    ]
    return text_around_calls(text) or None, tool_calls


class ContentStream:
    """A streamed reply's content: text passes until a `<tool_call>` may begin; from there
    on it is held until the reply is whole and split_reply decides."""

    def __init__(self, calls: Calls | None):
        self.watch = calls is not None and calls.parsed
        self.stops = StopStrings((CALL_OPEN,))
        self.held = False

    def feed(self, text: str) -> str:
        if not self.watch or self.held:
            return "" if self.held else text
        out, self.held = self.stops.feed(text)
        return out
