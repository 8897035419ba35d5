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
import re
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
MAX_REPEAT = 1000  # largest minLength / maxLength / minItems / maxItems / {m,n}: the converter spells repetitions out
MAX_DEPTH = 32  # schema nesting
MAX_PROPERTIES = 256  # per object (the converter recurses per optional property)
MAX_ENUM = 512  # values per enum (masking grows with their number)
MAX_NAME = 128  # characters of a property name (rule names repeat it)
MAX_GRAMMAR_CHARS = 1 << 20
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
        k = min(TOP_K, len(row) - 1)
        top = np.argpartition(-row, k)[:k]
        top = top[np.lexsort((top, -row[top]))]
        some = self._top[:k]
        some["id"], some["logit"] = top, row[top]
        self._apply(some)
        allowed = np.flatnonzero(np.isfinite(some["logit"]))
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
    """Refuses, naming the keyword and its JSON pointer, what schema_grammar cannot enforce
    exactly (the converter would drop it or spell it wrongly) or could not build safely."""
    try:
        _Checker(schema, where).check(schema, "", 0)
    except RecursionError:
        raise SchemaError(f"{where}: the schema is nested too deeply") from None


class _Checker:
    def __init__(self, root: Any, where: str):
        self.where = where
        defs = {}
        if isinstance(root, dict):
            for key in ("$defs", "definitions"):
                if key in root and not isinstance(root[key], dict):
                    raise SchemaError(f"{where}: `{key}` must be an object")
                for name in root.get(key, {}):
                    if name in defs:
                        raise SchemaError(f"{where}: {json.dumps(name)[:40]} is defined in both `$defs` and `definitions`")
                    defs[name] = root[key][name]
        self.defs = defs

    def refuse(self, why: str, at: str) -> SchemaError:
        return SchemaError(f"{self.where}: {why} (at {at or '/'}); it cannot be enforced while sampling, so it is refused")

    def check(self, schema: Any, at: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise self.refuse(f"schemas nested more than {MAX_DEPTH} deep are not supported", at)
        if not isinstance(schema, dict):
            raise self.refuse(f"a schema must be an object, got {json.dumps(schema)[:40]}", at)
        unknown = sorted(set(schema) - ENFORCED - ANNOTATIONS)
        if unknown:
            hint = " (use anyOf: a reply matching two alternatives would break oneOf)" if unknown[0] == "oneOf" else ""
            raise self.refuse(f"`{unknown[0]}` is not supported{hint}", at)
        if depth and {"$defs", "definitions"} & set(schema):
            raise self.refuse("`$defs` below the top level is not supported", at)
        structural = set(schema) - ANNOTATIONS - {"$defs", "definitions"}
        kind = schema.get("type")
        for alone in ("$ref", "anyOf"):
            if alone in schema and structural - {alone}:
                raise self.refuse(f"`{sorted(structural - {alone})[0]}` beside `{alone}` is not supported", at)
        if isinstance(kind, list):
            if structural - {"type"} or not kind or not all(isinstance(k, str) and k in TYPES for k in kind):
                raise self.refuse("a list of types is supported only alone, with known type names", at)
        elif kind is not None and kind not in TYPES:
            raise self.refuse(f"unknown type {json.dumps(kind)[:40]}", at)
        if "const" in schema or "enum" in schema:
            self.check_values(schema, structural, kind, at)
        if "$ref" in schema:
            self.check_ref(schema["$ref"], at)
        self.check_string(schema, structural, kind, at)
        self.check_array(schema, structural, at, depth)
        self.check_object(schema, at, depth)
        for i, sub in enumerate(self.list_of(schema, "anyOf", at)):
            self.check(sub, f"{at}/anyOf/{i}", depth + 1)
        if depth == 0:
            for name, sub in self.defs.items():
                self.check(sub, f"/$defs/{name}", 1)

    def list_of(self, schema: dict, key: str, at: str) -> list:
        subs = schema.get(key, [])
        if not isinstance(subs, list) or (key in schema and not subs):
            raise self.refuse(f"`{key}` must be a non-empty list", at)
        return subs

    def check_values(self, schema: dict, structural: set, kind: Any, at: str) -> None:
        if structural - {"const", "enum", "type"}:
            raise self.refuse(f"`{sorted(structural - {'const', 'enum', 'type'})[0]}` beside `const`/`enum` is not supported", at)
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values or len(values) > MAX_ENUM:
            raise self.refuse(f"`enum` must be a list of 1 to {MAX_ENUM} values", at)
        for value in values:
            if isinstance(kind, str) and not _is_type(value, kind):
                raise self.refuse(f"the value {json.dumps(value)[:40]} is not of type {kind!r}", at)
            self.check_text_in(value, at)

    def check_text_in(self, value: Any, at: str) -> None:
        """Strings the converter writes as grammar literals must need no JSON escape."""
        if isinstance(value, str):
            if not _literal_safe(value):
                raise self.refuse(f"the string {json.dumps(value)[:40]} holds a quote, backslash, control or non-BMP "
                                  "character, which the grammar cannot spell", at)
        elif isinstance(value, list):
            for item in value:
                self.check_text_in(item, at)
        elif isinstance(value, dict):
            for key, item in value.items():
                self.check_text_in(key, at)
                self.check_text_in(item, at)

    def check_ref(self, ref: Any, at: str) -> None:
        parts = ref.split("/") if isinstance(ref, str) else []
        if ref == "#":
            return
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            raise self.refuse("only `$ref` to `#` or `#/$defs/NAME` is supported", at)
        if parts[2] not in self.defs:
            raise self.refuse(f"`$ref` {json.dumps(ref)[:60]} names no definition", at)

    def check_string(self, schema: dict, structural: set, kind: Any, at: str) -> None:
        string_keys = {"pattern", "format", "minLength", "maxLength"} & structural
        if not string_keys:
            return
        if kind != "string":
            raise self.refuse(f'`{sorted(string_keys)[0]}` needs `"type": "string"` beside it', at)
        if len(string_keys & {"pattern", "format"}) + bool(string_keys & {"minLength", "maxLength"}) > 1:
            raise self.refuse("only one of `pattern`, `format` and `minLength`/`maxLength` per string", at)
        if "format" in schema and schema["format"] not in FORMATS:
            raise self.refuse(
                f"format {json.dumps(schema['format'])[:40]} is not supported (supported: {', '.join(sorted(FORMATS))})", at
            )
        if "pattern" in schema:
            problem = _pattern_problem(schema["pattern"])
            if problem:
                raise self.refuse(f"`pattern` {json.dumps(schema['pattern'])[:60]}: {problem}", at)
        self.check_bounds(schema, "minLength", "maxLength", at)

    def check_bounds(self, schema: dict, low: str, high: str, at: str) -> None:
        for bound in (low, high):
            value = schema.get(bound)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_REPEAT):
                raise self.refuse(f"`{bound}` must be an integer in [0, {MAX_REPEAT}]", at)
        if schema.get(low, 0) > schema.get(high, MAX_REPEAT):
            raise self.refuse(f"`{low}` is more than `{high}`: nothing satisfies it", at)

    def check_array(self, schema: dict, structural: set, at: str, depth: int) -> None:
        items = schema.get("items")
        if {"minItems", "maxItems"} & structural and not isinstance(items, dict):
            raise self.refuse("`minItems`/`maxItems` need `items` (one schema for every item) beside them", at)
        if "prefixItems" in schema and "items" in schema:
            raise self.refuse("`prefixItems` with `items` is not supported", at)
        self.check_bounds(schema, "minItems", "maxItems", at)
        if isinstance(items, list):  # the older tuple form
            for i, sub in enumerate(items):
                self.check(sub, f"{at}/items/{i}", depth + 1)
        elif items is not None:
            self.check(items, f"{at}/items", depth + 1)
        for i, sub in enumerate(self.list_of(schema, "prefixItems", at)):
            self.check(sub, f"{at}/prefixItems/{i}", depth + 1)

    def check_object(self, schema: dict, at: str, depth: int) -> None:
        required = schema.get("required", [])
        properties = schema.get("properties", {})
        if not isinstance(required, list) or not isinstance(properties, dict):
            raise self.refuse("`required` must be a list and `properties` an object", at)
        if len(properties) > MAX_PROPERTIES:
            raise self.refuse(f"more than {MAX_PROPERTIES} properties in one object are not supported", at)
        missing = [name for name in required if name not in properties]
        if missing:
            raise self.refuse(f"`required` names {json.dumps(missing[0])[:40]}, which is not in `properties`", at)
        extra = schema.get("additionalProperties")
        if extra not in (None, False) and properties:
            raise self.refuse("`additionalProperties` other than false beside `properties` is not supported", at)
        if isinstance(extra, dict):
            self.check(extra, f"{at}/additionalProperties", depth + 1)
        elif extra is not None and not isinstance(extra, bool):
            raise self.refuse("`additionalProperties` must be a schema, true or false", at)
        for name, sub in properties.items():
            if len(name) > MAX_NAME or not _literal_safe(name) or name == "$ref":
                raise self.refuse(f"the property name {json.dumps(name)[:40]} is longer than {MAX_NAME} characters or "
                                  "holds a character the grammar cannot spell", at)
            self.check(sub, f"{at}/properties/{name}", depth + 1)


def _is_type(value: Any, kind: str) -> bool:
    return {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }[kind]


def _literal_safe(text: str) -> bool:
    return not any(c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F or ord(c) > 0xFFFF for c in text)


def _pattern_problem(pattern: Any) -> str | None:
    """Why the converter cannot enforce `pattern` inside a JSON string, or None. Its rules
    match the raw JSON text, so only literal characters that need no escape, classes of
    them, groups, | and bounded quantifiers are accepted."""
    if not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$") and len(pattern) >= 2):
        return "it must be anchored, starting with ^ and ending with $"
    body = pattern[1:-1]
    if "\\" in body or '"' in body:
        return "escapes (\\d, \\., ...) and quotes are not supported"
    if "." in re.sub(r"\[[^\]]*\]", "", body):
        return "`.` is not supported (it would match quotes and backslashes): use a class such as [a-z]"
    for cls in re.findall(r"\[([^\]]*)\]", body):
        if cls.startswith("^"):
            return "negated classes [^...] are not supported (they would match quotes and backslashes)"
        for low, high in re.findall(r"(.)-(.)", cls):
            if any(low <= c <= high for c in '"\\') or ord(low) < 0x20:
                return f"the range {low}-{high} holds a quote, backslash or control character"
    for low, high in re.findall(r"\{(\d+)(?:,(\d*))?\}", body):
        if int(low) > MAX_REPEAT or (high and int(high) > MAX_REPEAT):
            return f"a repetition bound over {MAX_REPEAT}"
    if not all(ord(c) >= 0x20 and ord(c) <= 0xFFFF for c in body):
        return "control or non-BMP characters are not supported"
    return None


def _hoisted(schema: dict, prefix: str, defs: dict) -> dict:
    """`schema` moved into `defs` as `PREFIX-schema`, its own definitions beside it as
    `PREFIX-defs-0`, `PREFIX-defs-1`, ... (names no property path, which extends
    `PREFIX-schema-`, can produce), and its references rewritten to match, so that many schemas
    share one converter without their rule names meeting. Returns a reference to it."""
    name = f"{prefix}-schema"
    schema = copy.deepcopy(schema)
    own = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}
    renamed = {key: f"{prefix}-defs-{k}" for k, key in enumerate(own)}

    def rewrite(node: dict) -> dict:  # a schema (checked: its subschemas sit only where these keys say)
        out = dict(node)
        if "$ref" in node:
            ref = node["$ref"]
            out["$ref"] = f"#/$defs/{name}" if ref == "#" else f"#/$defs/{renamed[ref.split('/')[2]]}"
        if "properties" in node:
            out["properties"] = {key: rewrite(sub) for key, sub in node["properties"].items()}
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                out[key] = rewrite(node[key])
            elif isinstance(node.get(key), list):
                out[key] = [rewrite(sub) for sub in node[key]]
        for key in ("anyOf", "prefixItems"):
            if key in node:
                out[key] = [rewrite(sub) for sub in node[key]]
        return out

    defs[name] = rewrite(schema)
    for key, sub in own.items():
        defs[renamed[key]] = rewrite(sub)
    return {"$ref": f"#/$defs/{name}"}


def schema_grammar(
    reply: dict | None,
    tools: Mapping[str, dict] | None,
    *,
    call_open: str,
    call_close: str,
    parallel: bool = True,
    where: str = "response_format",
) -> str:
    """A GBNF grammar for a reply that is JSON valid under `reply`, or (with `tools`, name ->
    parameters schema) one or more calls `call_open {"name": ..., "arguments": {...}} call_close`
    (one only unless `parallel`), or either when both are given. Schemas must have passed
    check_schema; SchemaError (naming `where`) when the grammar would still be too large."""
    defs: dict[str, dict] = {}
    pieces: dict[str, dict] = {}
    if reply is not None:
        pieces["reply"] = _hoisted(reply, "reply", defs)
    for i, (tool, parameters) in enumerate((tools or {}).items()):
        arguments = _hoisted(parameters, f"tool{i}", defs)
        pieces[f"call{i}"] = {
            "type": "object",
            "properties": {"name": {"const": tool}, "arguments": arguments},
            "required": ["name", "arguments"],
        }
    converter = SchemaConverter(
        prop_order={"name": 0, "arguments": 1}, allow_fetch=False, dotall=False, raw_pattern=False
    )
    try:
        whole = converter.resolve_refs({"$defs": defs, "pieces": pieces}, "")
        rules = {key: converter.visit(piece, key) for key, piece in whole["pieces"].items()}
    except (AssertionError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise SchemaError(f"{where}: the schema cannot be turned into a grammar ({type(e).__name__})") from None
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
    gbnf = "\n".join(lines) + "\n"
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise SchemaError(f"{where}: the schema makes a grammar of {len(gbnf):,} characters, more than "
                          f"{MAX_GRAMMAR_CHARS:,}; bound it less (fewer or smaller repetition bounds, enums, names)")
    return gbnf


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
    token = pick(masked)
    return token if grammar.allows(token) else None  # (a forbidden token must never reach accept)
