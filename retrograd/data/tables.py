"""Records from JSON Lines, CSV and Parquet files: the containers datasets are exported in.
Every record is a dict named by `file:line` (`file: row N` in Parquet); what the keys mean
is shapes.py's business.

Tables are held to the limits of JSON data (files.py): strict UTF-8, no cell longer than
MAX_CELL_CHARS, nesting no deeper than MAX_JSON_DEPTH, and JSON inside a cell parsed by
load_json. An empty CSV cell and a Parquet null are a key that is absent.

A cell of a column that holds a list (`messages`, `conversations`, `tools`) may be JSON text,
as it must be in CSV. So may `prompt`, `completion`, `chosen` and `rejected` (TRL's conversational shapes) when the
first record's cell starts with `[`: the file decides once, so a plain-text prompt that
happens to start with a bracket further down stays text.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from retrograd.data.files import MAX_JSON_CHARS, MAX_JSON_DEPTH, json_records, load_json, read_text
from retrograd.errors import DataError

Records = Iterator[tuple[str, dict[str, Any]]]

CONTAINERS = ("jsonl", "csv", "parquet")
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}
MAX_CELL_CHARS = MAX_JSON_CHARS
JSON_COLUMNS = frozenset({"messages", "conversations", "tools"})
MAYBE_JSON_COLUMNS = frozenset({"prompt", "completion", "chosen", "rejected"})
PARQUET_BATCH_ROWS = 256  # rows decoded at a time, once their row group is measured
PARQUET_EXPANSION = 256  # decoded bytes a Parquet file may hold per byte on disk (text compresses 3-10x)
PARQUET_MIN_BUDGET = 64 << 20  # ... and at least this many, whatever its size
PARQUET_VALUE_BYTES = 64  # what each decoded value is counted as: about its cost as a Python object


def read_records(path: Path, container: str) -> Records:
    assert container in CONTAINERS
    if container == "parquet":
        return _json_cells(parquet_records(path))
    if container == "csv":
        return _json_cells(csv_records(path))
    return json_records(path, read_text(path))


def csv_records(path: Path) -> Records:
    """Rows of a CSV file with a header line (the standard library's reader, strict quoting)."""
    text = read_text(path)
    previous_limit = csv.field_size_limit(MAX_CELL_CHARS)
    try:
        rows = list(_csv_rows(path, text))  # read while the limit holds; it is process-wide
    finally:
        csv.field_size_limit(previous_limit)
    return iter(rows)


def _csv_rows(path: Path, text: str) -> Records:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: list[str] | None = None
    line = 1
    try:
        for cells in reader:
            where, line = f"{path}:{line}", reader.line_num + 1  # a quoted cell may span lines
            if not any(cell.strip() for cell in cells):
                continue
            if header is None:
                header = [cell.strip() for cell in cells]
                repeated = sorted(name for name, times in Counter(header).items() if times > 1)
                if repeated or "" in header:
                    raise DataError(f"{where}: the header needs distinct, non-empty column names (repeated: "
                                    f"{', '.join(repeated[:5]) + (', ...' if len(repeated) > 5 else '') or 'none'})")
                continue
            if len(cells) != len(header):
                raise DataError(f"{where}: {len(cells)} cells, but the header names {len(header)} columns")
            yield where, {name: cell for name, cell in zip(header, cells) if cell != ""}
    except csv.Error as e:
        problem = f"a cell longer than {MAX_CELL_CHARS} characters" if "field limit" in str(e) else str(e)
        raise DataError(f"{path}:{reader.line_num}: not valid CSV ({problem})") from None


def parquet_records(path: Path) -> Records:
    """Rows of a Parquet file through pyarrow, imported only now (the `parquet` extra).

    A few hundred bytes of Parquet can decode to gigabytes (a run-length encoded list of
    millions of values, a dictionary value repeated in every row), so what a file may decode
    to is bounded by its size (parquet_budget): the footer's counts are checked before
    anything is decoded, and each row group is measured (_row_group_bytes) before its rows
    are decoded, PARQUET_BATCH_ROWS at a time, into Python objects."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'retrograd[parquet]'") from None
    try:
        table = pyarrow.parquet.ParquetFile(path)
        text_columns = [column.path for column in table.schema if column.physical_type == "BYTE_ARRAY"]
        compact = pyarrow.parquet.ParquetFile(path, read_dictionary=text_columns)
        size = path.stat().st_size
    except (OSError, pyarrow.ArrowException) as e:
        raise DataError(f"{path}: cannot read as Parquet ({e})") from None
    for field in table.schema_arrow:
        if _depth(field.type) > MAX_JSON_DEPTH:
            raise DataError(f"{path}: column {field.name!r} is nested deeper than {MAX_JSON_DEPTH} levels")
    budget = parquet_budget(size)
    chunks = [table.metadata.row_group(g).column(c)
              for g in range(table.metadata.num_row_groups) for c in range(table.metadata.num_columns)]
    declared = sum(chunk.total_uncompressed_size + PARQUET_VALUE_BYTES * chunk.num_values for chunk in chunks)
    if declared > budget:
        raise DataError(_over_budget(f"{path}: its footer declares", declared, size, budget))
    number = decoded = 0
    try:
        for g in range(table.metadata.num_row_groups):
            decoded += _row_group_bytes(compact, g)
            if decoded > budget:
                rows = number + table.metadata.row_group(g).num_rows
                raise DataError(_over_budget(f"{path}: rows 1-{rows:,} hold", decoded, size, budget))
            for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[g]):
                for row in batch.to_pylist():
                    number += 1
                    where = f"{path}: row {number}"
                    yield where, _plain_values(row, where)
    except (OSError, pyarrow.ArrowException, UnicodeDecodeError) as e:
        raise DataError(f"{path}: row {number + 1}: cannot read ({e})") from None


def parquet_budget(file_bytes: int) -> int:
    """What a Parquet file of `file_bytes` may decode to: text and binary bytes plus
    PARQUET_VALUE_BYTES for every value (nulls included)."""
    return max(PARQUET_MIN_BUDGET, PARQUET_EXPANSION * file_bytes)


def _over_budget(what: str, decoded: int, file_bytes: int, budget: int) -> str:
    return (f"{what} {decoded / 2**20:,.0f} MiB once decoded, more than the {budget / 2**20:,.0f} MiB a Parquet file "
            f"of {file_bytes:,} bytes may decode to ({PARQUET_EXPANSION}x its size, at least "
            f"{PARQUET_MIN_BUDGET >> 20} MiB; {PARQUET_VALUE_BYTES} bytes a value plus its text)")


def _row_group_bytes(compact, g: int) -> int:
    """What row group `g` decodes to, measured on `compact` (the file opened with its text
    columns read as dictionaries): a value repeated through a dictionary is held once and
    counted as often as it is used."""
    group = compact.read_row_group(g)
    return sum(_decoded_bytes(chunk) for column in group.columns for chunk in column.chunks)


def _decoded_bytes(array) -> int:
    """What `array` is charged against parquet_budget, dictionaries counted as if expanded
    (without expanding them). A struct's values are its fields', a list's its items'."""
    import pyarrow

    if pyarrow.types.is_struct(array.type):
        return sum(_decoded_bytes(array.field(i)) for i in range(array.type.num_fields))
    values = PARQUET_VALUE_BYTES * len(array)
    if isinstance(array, (pyarrow.ListArray, pyarrow.LargeListArray, pyarrow.FixedSizeListArray)):
        return values + _decoded_bytes(array.flatten())
    if isinstance(array, pyarrow.DictionaryArray):
        return values + _text_bytes(array.dictionary, array.indices)
    return values + _text_bytes(array)


def _text_bytes(values, indices=None) -> int:
    """Bytes of text or binary `values`, each counted as often as `indices` name it; 0 for other types."""
    import pyarrow
    import pyarrow.compute

    kind = values.type
    if not any(test(kind) for test in (pyarrow.types.is_string, pyarrow.types.is_large_string,
                                       pyarrow.types.is_binary, pyarrow.types.is_large_binary)):
        return 0
    lengths = pyarrow.compute.binary_length(values)
    if indices is not None:
        lengths = pyarrow.compute.take(lengths, indices)
    return pyarrow.compute.sum(lengths).as_py() or 0


def _depth(arrow_type) -> int:
    children = [arrow_type.field(i).type for i in range(arrow_type.num_fields)]
    return 1 + max(map(_depth, children)) if children else 0


def _plain_values(value: Any, where: str) -> Any:
    """A Parquet value as JSON would hold it: nulls dropped from objects, text bounded, no bytes."""
    if isinstance(value, dict):
        return {key: _plain_values(item, where) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_plain_values(item, where) for item in value]
    if isinstance(value, str) and len(value) > MAX_CELL_CHARS:
        raise DataError(f"{where}: a cell longer than {MAX_CELL_CHARS} characters")
    if isinstance(value, (bytes, bytearray)):
        raise DataError(f"{where}: a binary cell; expected text")
    return value


def _json_cells(records: Iterable[tuple[str, dict[str, Any]]]) -> Records:
    json_columns = None
    for where, record in records:
        if json_columns is None:
            json_columns = JSON_COLUMNS | {
                name for name in MAYBE_JSON_COLUMNS
                if isinstance(record.get(name), str) and record[name].lstrip().startswith("[")
            }
        for name in json_columns & record.keys():
            if isinstance(record[name], str):
                try:
                    record[name] = load_json(record[name], max_chars=MAX_CELL_CHARS)
                except ValueError as e:
                    raise DataError(f'{where}: the "{name}" cell is not valid JSON ({e})') from None
        yield where, record
