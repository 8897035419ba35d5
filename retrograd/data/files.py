"""Reading data files: strict UTF-8, one JSON object per line, every problem named by
`file:line`. Nothing here knows what the objects mean."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from retrograd.errors import DataError


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


def first_line(text: str) -> str:
    """The first non-blank line, stripped ('' when there is none)."""
    return next((line.strip() for line in text.split("\n") if line.strip()), "")


def json_lines(path: Path, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (`file:line`, object) for every non-blank line of `text` (read from `path`);
    blank lines keep their number."""
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: not valid JSON ({e.msg} at column {e.colno}); expected one object per line"
            ) from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
        yield where, obj
