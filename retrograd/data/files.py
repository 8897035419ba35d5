"""Reading data files: strict UTF-8, one JSON object per line, every problem named by
`file:line`. Nothing here knows what the objects mean."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from retrograd.errors import DataError

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


def read_text(path: Path) -> str:
    """The whole file as text; a leading byte-order mark is dropped."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save the file as UTF-8"
        ) from None
    return text.removeprefix("\ufeff")


def write_json(doc, path: Path) -> None:
    """`doc` as indented JSON in `path`, written whole or not at all (a temporary file, renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def first_line(text: str) -> str:
    """The first non-blank line, stripped ('' when there is none)."""
    return next((line.strip() for line in text.split("\n") if line.strip()), "")


def json_records(path: Path, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """JSONL, or (as Alpaca's own `alpaca_data.json` is) one JSON array of objects, whose
    records are named `file: record N`."""
    if not first_line(text).startswith("["):
        yield from json_lines(path, text)
        return
    try:
        array = load_json(text, max_chars=None)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); expected an array of objects"
        ) from None
    except UnsafeJSON as e:
        raise DataError(f"{path}: {e}") from None
    if not isinstance(array, list):
        raise DataError(f"{path}: expected one JSON object per line or an array of objects")
    for number, obj in enumerate(array, 1):
        where = f"{path}: record {number}"
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def json_lines(path: Path, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (`file:line`, object) for every non-blank line of `text` (read from `path`);
    blank lines keep their number."""
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = load_json(line, max_chars=None)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: not valid JSON ({e.msg} at column {e.colno}); expected one object per line"
            ) from None
        except UnsafeJSON as e:
            raise DataError(f"{where}: {e}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
        yield where, obj


def load_json(text: str, max_chars: int | None = MAX_JSON_CHARS) -> Any:
    """json.loads for text a model or a tool wrote. Size and nesting are checked before the
    (recursive) parser runs; NaN and Infinity, numbers longer than MAX_NUMBER_CHARS,
    duplicate keys and lone UTF-16 surrogates (which cannot be written as UTF-8) are
    refused. Raises json.JSONDecodeError for broken syntax, UnsafeJSON for the rest; both
    are ValueErrors with a one-line message."""
    if max_chars is not None and len(text) > max_chars:
        raise UnsafeJSON(f"JSON longer than {max_chars} characters")
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
