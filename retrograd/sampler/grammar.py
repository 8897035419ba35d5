"""Grammar-constrained decoding: llama.cpp's GBNF grammars, and JSON schemas turned into them.

`Grammar` wraps llama.cpp's grammar sampler over our own logits rows: `allows(token)` asks it
about one token, `mask(row)` sets every token it forbids to -inf, `accept(token)` advances it.
`constrained_pick` draws as usual and keeps the token when the grammar allows it; otherwise
it draws again from the masked row, as llama.cpp's own sampler does (the token kept is then
drawn from the allowed tokens renormalised: the constrained distribution). Greedy picks look
among the TOP_K most likely tokens first, so a rejection rarely costs a full mask. Checking one
token costs ~8 us, masking SmolLM2's 49,152 tokens ~6 ms.

`schema_grammar` turns JSON schemas into one grammar with llama-cpp-python's converter, after
`check_schema` has refused what the converter would silently drop: a schema whose constraint
cannot be enforced while sampling is an error naming the keyword and where it sits, never a
reply that looks structured and breaks the schema.
"""

from __future__ import annotations

import copy
import ctypes
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from llama_cpp.llama_grammar import STRING_FORMAT_RULES, SchemaConverter

from retrograd.errors import DataError
from retrograd.runtime.llamacpp import C

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"}
)
ENFORCED = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "$ref",
        "$defs",
        "definitions",
        "pattern",
        "format",
        "minLength",
        "maxLength",
    }
)
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
FORMATS = frozenset(
    ["uuid", *(name.removesuffix("-string") for name in STRING_FORMAT_RULES if name.endswith("-string"))]
)
TOP_K = 1024  # greedy: candidates checked before the whole vocabulary is masked
MAX_REPEAT = 1000  # largest minLength / maxLength / minItems / maxItems: the converter spells repetitions out
# A JSON string character: no raw control character (JSON forbids them; the converter's own rule allows them).
CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


class SchemaError(DataError):
    """A JSON schema this module cannot enforce."""


class GrammarError(DataError):
    """A grammar llama.cpp cannot parse."""


class Grammar:
    """One reply's grammar state over a vocabulary (llama.cpp's grammar sampler)."""

    def __init__(self, vocab, n_vocab: int, gbnf: str):
        self._sampler = C.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), b"root")
        if not self._sampler:
            raise GrammarError("llama.cpp could not parse the grammar made for this request")
        self._one = np.zeros(1, TOKEN_DATA)
        self._top = np.zeros(TOP_K, TOKEN_DATA)
        self._all = np.zeros(n_vocab, TOKEN_DATA)
        self._all["id"] = np.arange(n_vocab)

    def _apply(self, data: np.ndarray) -> None:
        array = C.llama_token_data_array(data.ctypes.data_as(C.llama_token_data_p), len(data), -1, False)
        C.llama_sampler_apply(self._sampler, ctypes.byref(array))

    def allows(self, token: int) -> bool:
        self._one[0] = (token, 0.0, 0.0)
        self._apply(self._one)
        return bool(np.isfinite(self._one["logit"][0]))

    def best_allowed(self, row: np.ndarray) -> int | None:
        """The most likely allowed token (lowest id among equals, as argmax) when one is among
        the TOP_K most likely, else None."""
        top = np.argpartition(-row, TOP_K)[:TOP_K]
        top = top[np.lexsort((top, -row[top]))]
        self._top["id"], self._top["logit"] = top, row[top]
        self._apply(self._top)
        allowed = np.flatnonzero(np.isfinite(self._top["logit"]))
        return int(top[allowed[0]]) if allowed.size else None

    def mask(self, row: np.ndarray) -> np.ndarray:
        """`row` with every token the grammar forbids at -inf (end-of-generation tokens are
        allowed exactly when the grammar is complete)."""
        self._all["logit"] = row
        self._apply(self._all)
        return self._all["logit"].copy()

    def accept(self, token: int) -> None:
        """Advance past `token`, which must be allowed (llama.cpp aborts the process otherwise)."""
        C.llama_sampler_accept(self._sampler, token)

    def close(self) -> None:
        if self._sampler:
            C.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self):
        self.close()


# ---- JSON schemas


def check_schema(schema: Any, where: str) -> None:
    """Refuses, naming the keyword and its JSON pointer, what schema_grammar cannot enforce."""
    try:
        _check(schema, "", where, top=True)
    except RecursionError:
        raise SchemaError(f"{where}: the schema is nested too deeply") from None


def _check(schema: Any, at: str, where: str, *, top: bool = False) -> None:
    def refuse(why: str) -> SchemaError:
        return SchemaError(f"{where}: {why} (at {at or '/'}); it cannot be enforced while sampling, so it is refused")

    if not isinstance(schema, dict):
        raise refuse(f"a schema must be an object, got {json.dumps(schema)[:40]}")
    unknown = sorted(set(schema) - ENFORCED - ANNOTATIONS)
    if unknown:
        raise refuse(f"`{unknown[0]}` is not supported")
    structural = set(schema) - ANNOTATIONS - {"$defs", "definitions"}
    if not top and ({"$defs", "definitions"} & set(schema)):
        raise refuse("`$defs` below the top level is not supported")
    kind = schema.get("type")
    for alone in ("$ref", "anyOf", "oneOf"):
        if alone in schema and structural - {alone}:
            raise refuse(f"`{sorted(structural - {alone})[0]}` beside `{alone}` is not supported")
    if ("const" in schema or "enum" in schema) and structural - {"const", "enum", "type"}:
        raise refuse(f"`{sorted(structural - {'const', 'enum', 'type'})[0]}` beside `const`/`enum` is not supported")
    if isinstance(kind, list):
        if structural - {"type"} or not kind or not set(kind) <= TYPES:
            raise refuse("a list of types is supported only alone, with known type names")
    elif kind is not None and kind not in TYPES:
        raise refuse(f"unknown type {json.dumps(kind)[:40]}")
    if "$ref" in schema:
        ref = schema["$ref"]
        if not (
            isinstance(ref, str)
            and (ref == "#" or ref.count("/") == 2 and ref.split("/")[1] in ("$defs", "definitions"))
        ):
            raise refuse("only `$ref` to `#` or `#/$defs/NAME` is supported")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise refuse("`enum` must be a non-empty list")
    string_keys = {"pattern", "format", "minLength", "maxLength"} & structural
    if string_keys:
        if kind != "string":
            raise refuse(f'`{sorted(string_keys)[0]}` needs `"type": "string"` beside it')
        if len(string_keys & {"pattern", "format"}) + bool(string_keys & {"minLength", "maxLength"}) > 1:
            raise refuse("only one of `pattern`, `format` and `minLength`/`maxLength` per string")
        if "format" in schema and schema["format"] not in FORMATS:
            raise refuse(
                f"format {json.dumps(schema['format'])[:40]} is not supported (supported: {', '.join(sorted(FORMATS))})"
            )
        if "pattern" in schema and not (
            isinstance(schema["pattern"], str) and schema["pattern"].startswith("^") and schema["pattern"].endswith("$")
        ):
            raise refuse("a `pattern` must be anchored, starting with ^ and ending with $")
    for bound in ("minLength", "maxLength", "minItems", "maxItems"):
        value = schema.get(bound)
        if value is not None and not (
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_REPEAT
        ):
            raise refuse(f"`{bound}` must be an integer in [0, {MAX_REPEAT}]")
    if {"minItems", "maxItems"} & structural and not isinstance(schema.get("items"), dict):
        raise refuse("`minItems`/`maxItems` need `items` (one schema for every item) beside them")
    required = schema.get("required", [])
    properties = schema.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        raise refuse("`required` must be a list and `properties` an object")
    missing = [name for name in required if name not in properties]
    if missing:
        raise refuse(f"`required` names {json.dumps(missing[0])[:40]}, which is not in `properties`")
    for name, sub in properties.items():
        _check(sub, f"{at}/properties/{name}", where)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        _check(extra, f"{at}/additionalProperties", where)
    elif extra is not None and not isinstance(extra, bool):
        raise refuse("`additionalProperties` must be a schema, true or false")
    items = schema.get("items")
    if isinstance(items, list):  # the older tuple form
        for i, sub in enumerate(items):
            _check(sub, f"{at}/items/{i}", where)
    elif items is not None:
        _check(items, f"{at}/items", where)
    for key in ("prefixItems", "anyOf", "oneOf"):
        subs = schema.get(key)
        if subs is not None:
            if not isinstance(subs, list) or not subs:
                raise refuse(f"`{key}` must be a non-empty list")
            for i, sub in enumerate(subs):
                _check(sub, f"{at}/{key}/{i}", where)
    for key in ("$defs", "definitions"):
        defs = schema.get(key, {})
        if not isinstance(defs, dict):
            raise refuse(f"`{key}` must be an object")
        for name, sub in defs.items():
            _check(sub, f"{at}/{key}/{name}", where)


def _hoisted(schema: dict, name: str, defs: dict) -> dict:
    """`schema` moved into `defs` under `name`, its own definitions beside it as `name-DEF`,
    and its references rewritten to match: many schemas can then share one converter
    without their definitions' names meeting. Returns a reference to it."""
    schema = copy.deepcopy(schema)
    own = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}

    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items() if k != "$ref"}
        if "$ref" in node:
            ref = node["$ref"]
            out["$ref"] = f"#/$defs/{name}" if ref == "#" else f"#/$defs/{name}-{ref.split('/')[2]}"
        return out

    defs[name] = rewrite(schema)
    for key, sub in own.items():
        defs[f"{name}-{key}"] = rewrite(sub)
    return {"$ref": f"#/$defs/{name}"}


def schema_grammar(
    reply: dict | None, tools: Mapping[str, dict] | None, *, call_open: str, call_close: str, parallel: bool = True
) -> str:
    """A GBNF grammar for a reply that is JSON valid under `reply`, or (with `tools`, name ->
    parameters schema) one or more calls `call_open {"name": ..., "arguments": {...}} call_close`
    (one only unless `parallel`), or either when both are given. Schemas must have passed
    check_schema."""
    defs: dict[str, dict] = {}
    pieces: dict[str, dict] = {}
    if reply is not None:
        pieces["reply"] = _hoisted(reply, "reply-schema", defs)
    for i, (tool, parameters) in enumerate((tools or {}).items()):
        arguments = _hoisted(parameters or {"type": "object"}, f"tool{i}-arguments", defs)
        pieces[f"call{i}"] = {
            "type": "object",
            "properties": {"name": {"const": tool}, "arguments": arguments},
            "required": ["name", "arguments"],
        }
    converter = SchemaConverter(
        prop_order={"name": 0, "arguments": 1}, allow_fetch=False, dotall=False, raw_pattern=False
    )
    whole = converter.resolve_refs({"$defs": defs, "pieces": pieces}, "")
    try:
        rules = {key: converter.visit(piece, key) for key, piece in whole["pieces"].items()}
    except (AssertionError, ValueError, KeyError, TypeError) as e:
        raise SchemaError(f"the schema cannot be turned into a grammar ({e})") from None
    if "char" in converter._rules:
        converter._rules["char"] = CHAR_RULE
    lines = [converter.format_grammar()]
    alternatives = [rules["reply"]] if reply is not None else []
    if tools:
        call = " | ".join(rules[key] for key in rules if key.startswith("call"))
        lines.append(
            f"tool-call-markup ::= {_literal(call_open + chr(10))} ( {call} ) {_literal(chr(10) + call_close)}"
        )
        alternatives.append('tool-call-markup ( "\\n" tool-call-markup )*' if parallel else "tool-call-markup")
    lines.append("root ::= " + " | ".join(f"( {a} )" for a in alternatives))
    return "\n".join(lines) + "\n"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def constrained_pick(row: np.ndarray, grammar: Grammar, pick, *, greedy: bool) -> int | None:
    """pick(row), or when the grammar forbids that token, pick from the row masked by it
    (greedy: the most likely allowed token); None when the grammar allows nothing at all."""
    token = pick(row)
    if grammar.allows(token):
        return token
    if greedy and (token := grammar.best_allowed(row)) is not None:
        return token
    masked = grammar.mask(row)
    if not np.isfinite(masked).any():
        return None
    return pick(masked)
