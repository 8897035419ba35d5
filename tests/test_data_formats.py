"""Data as users have it: ShareGPT, TRL prompt/completion, Alpaca, in JSON Lines, a JSON
array, CSV and Parquet. The strong check: each loads to exactly the Examples (token ids and
loss mask) and Prompts of the equivalent `messages` file, with SmolLM2's own chat template."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chats import write_chat
from test_data import gguf_chat_template, runs, write_jsonl

from retrograd.data import tables
from retrograd.data.prompts import load_prompts
from retrograd.data.sft import load_sft
from retrograd.data.template import ChatFormat
from retrograd.errors import DataError
from retrograd.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol_tok(smollm2) -> Tokenizer:
    return Tokenizer(smollm2)


@pytest.fixture(scope="module")
def smol(smollm2, smol_tok) -> ChatFormat:
    return ChatFormat(smol_tok, gguf_chat_template(smollm2), origin=str(smollm2))


def msgs(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


# Each shape: records of that shape, and the same conversations as `messages` records.
SHAREGPT = (
    [
        {"system": "Be terse.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"conversations": [{"from": "system", "value": "Count."}, {"from": "user", "value": "1?"},
                           {"from": "model", "value": "2"}, {"from": "human", "value": "3?"},
                           {"from": "assistant", "value": "4"}]},
    ],
    [
        {"messages": msgs(("system", "Be terse."), ("user", "Hi"), ("assistant", "Hello!"))},
        {"messages": msgs(("system", "Count."), ("user", "1?"), ("assistant", "2"), ("user", "3?"), ("assistant", "4"))},
    ],
)
ALPACA = (
    [
        {"instruction": "Add the numbers.", "input": "2, 3", "output": "5"},
        {"instruction": "Name a colour.", "input": None, "system": "", "output": "Blue."},  # null and empty: none
    ],
    [
        {"messages": msgs(("user", "Add the numbers.\n\n2, 3"), ("assistant", "5"))},
        {"messages": msgs(("user", "Name a colour."), ("assistant", "Blue."))},
    ],
)
TRL_CHAT = (
    [
        {"prompt": msgs(("system", "Be terse."), ("user", "Hi")), "completion": msgs(("assistant", "Hello!"))},
        {"prompt": msgs(("user", "1?"), ("assistant", "2"), ("user", "3?")), "completion": msgs(("assistant", "4"))},
    ],
    [
        {"messages": msgs(("system", "Be terse."), ("user", "Hi"), ("assistant", "Hello!"))},
        {"messages": msgs(("user", "1?"), ("assistant", "2"), ("user", "3?"), ("assistant", "4"))},
    ],
)
MESSAGES = (TRL_CHAT[1], TRL_CHAT[1])
SHAPES = {
    "ShareGPT conversations": SHAREGPT,
    "Alpaca instructions": ALPACA,
    "TRL prompt/completion (conversational)": TRL_CHAT,
    "chat messages": MESSAGES,
}


def write_records(path: Path, records: list[dict]) -> Path:
    """The records in the container the extension names: JSONL, a JSON array, CSV (lists as JSON cells), Parquet."""
    if path.suffix == ".jsonl":
        return write_jsonl(path, *records)
    if path.suffix == ".json":
        path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    elif path.suffix == ".csv":
        columns = list(dict.fromkeys(key for r in records for key in r))
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            for r in records:
                writer.writerow([json.dumps(r[c]) if isinstance(r.get(c), list) else r.get(c, "") for c in columns])
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    return path


def untrained_first_turn(mask: tuple[bool, ...]) -> tuple[bool, ...]:
    """The mask with its first trained run cleared: a TRL prompt's own assistant turn is context."""
    start = mask.index(True)
    end = start + next((i for i, m in enumerate(mask[start:]) if not m), len(mask) - start)
    return mask[:start] + (False,) * (end - start) + mask[end:]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_and_container_gives_the_examples_of_its_messages_file(tmp_path, smol, shape, suffix):
    records, equivalent = SHAPES[shape]
    data = load_sft(write_records(tmp_path / f"train{suffix}", records), smol, ctx=512)
    expected = load_sft(write_jsonl(tmp_path / "messages.jsonl", *equivalent), smol, ctx=512).examples
    if records is TRL_CHAT[0]:
        expected = [replace(e, mask=untrained_first_turn(e.mask)) if i == 1 else e for i, e in enumerate(expected)]
    assert [(e.ids, e.mask) for e in data.examples] == [(e.ids, e.mask) for e in expected]
    assert all(e.n_trained for e in data.examples)
    assert data.description == f"train{suffix} ({shape}, 2 records)"
    where = f"{tmp_path / f'train{suffix}'}" + (": row 2" if suffix == ".parquet" else ":3" if suffix == ".csv" else ":2")
    assert data.examples[1].source == where


def test_a_json_array_file_as_alpaca_ships_it(tmp_path, smol):
    data = load_sft(write_records(tmp_path / "alpaca_data.json", ALPACA[0]), smol, ctx=512)
    expected = load_sft(write_jsonl(tmp_path / "m.jsonl", *ALPACA[1]), smol, ctx=512).examples
    assert [(e.ids, e.mask) for e in data.examples] == [(e.ids, e.mask) for e in expected]
    assert data.examples[1].source == f"{tmp_path / 'alpaca_data.json'}: record 2"


def test_trl_plain_text_is_the_concatenation_with_only_the_completion_and_eos_trained(tmp_path, smol, smol_tok):
    records = [{"prompt": "The capital of France is", "completion": " Paris."}, {"prompt": "2+2=", "completion": "4"}]
    data = load_sft(write_records(tmp_path / "pc.csv", records), smol, ctx=64)
    first, second = data.examples
    eos = smol_tok.eos_id
    assert first.ids == tuple(smol_tok.encode("The capital of France is Paris.")) + (eos,)
    assert runs(smol_tok, first) == [(False, "The capital of France is"), (True, " Paris.<|im_end|>")]
    assert runs(smol_tok, second) == [(False, "2+2="), (True, "4<|im_end|>")]
    assert data.description == "pc.csv (TRL prompt/completion (plain text), 2 records)"


# --- prompt files ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_prompt_files_take_the_prompt_part_of_every_shape(tmp_path, smol, smol_tok, suffix):
    question = msgs(("system", "Be terse."), ("user", "Add 2 and 3.\n\n2, 3"))
    expected = load_prompts(write_jsonl(tmp_path / "m.jsonl", {"messages": question, "rubric": "5"}), smol)[0]
    shaped = {
        "sharegpt": {"system": "Be terse.", "conversations": [{"from": "human", "value": "Add 2 and 3.\n\n2, 3"},
                                                            {"from": "gpt", "value": "5"}], "rubric": "5"},
        "alpaca": {"system": "Be terse.", "instruction": "Add 2 and 3.", "input": "2, 3", "rubric": "5"},
        "trl": {"prompt": question, "completion": msgs(("assistant", "5")), "rubric": "5"},
    }
    for name, record in shaped.items():
        (prompt,) = load_prompts(write_records(tmp_path / f"{name}{suffix}", [record]), smol)
        assert (prompt.ids, prompt.text, prompt.rubric) == (expected.ids, expected.text, "5"), name
    plain = load_prompts(write_records(tmp_path / f"plain{suffix}", [{"prompt": "Once upon", "rubric": "story"}]), smol)
    assert (plain[0].ids, plain[0].text, plain[0].rubric) == (tuple(smol_tok.encode("Once upon")), "Once upon", "story")
    assert plain.description == f"plain{suffix} (TRL prompt/completion (plain text), 1 record)"


# --- errors: one line naming the file and line ----------------------------------------------


@pytest.mark.parametrize(
    "first, bad, message",
    [
        (ALPACA[0][0], {"instruction": "x"},
         'missing "output"; expected {"instruction", "input" \\(optional\\), "output"} \\(Alpaca instructions\\)'),
        (ALPACA[0][0], {"question": "x", "answer": "y"}, "expected {\"instruction\", .*; got keys question, answer"),
        (ALPACA[0][0], SHAREGPT[0][0],
         "this record is ShareGPT conversations, but the file's first is Alpaca instructions; one file holds one shape"),
        (TRL_CHAT[0][0], {"prompt": "text", "completion": "x"},
         ("this record is TRL prompt/completion \\(plain text\\), but the file's first is TRL prompt/completion "
          "\\(conversational\\)")),
        (SHAREGPT[0][0], {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Yo"}]},
         ("turn 2: unknown \"from\" 'bot'; expected one of system, human, user, gpt, assistant, model, function_call, "
          "tool, function, observation")),
        (SHAREGPT[0][0], {"conversations": [{"from": "human", "value": 3}]}, 'turn 1: "value" must be a string'),
        (TRL_CHAT[0][0], {"prompt": msgs(("user", "Hi")), "completion": []}, '"completion" must be a non-empty list'),
    ],
)
def test_a_record_of_the_wrong_shape_names_its_line_and_the_keys_expected(tmp_path, smol, first, bad, message):
    path = write_jsonl(tmp_path / "d.jsonl", first, "", bad)
    with pytest.raises(DataError, match=rf"^{path}:3: {message}"):
        load_sft(path, smol, ctx=512)


def test_an_unknown_first_record_lists_the_shapes(tmp_path, smol):
    path = write_jsonl(tmp_path / "d.jsonl", {"question": "x", "answer": "y"})
    with pytest.raises(DataError, match=rf'^{path}:1: no known record shape \(keys: question, answer\); expected one '
                                        r'of: chat messages .*; ShareGPT conversations .*; TRL .*; Alpaca instructions'):
        load_prompts(path, smol)


def test_table_rows_are_named_by_line_or_row(tmp_path, smol):
    records = [ALPACA[0][0], {"instruction": "Multi\nline", "input": "x"}]  # the quoted cell spans lines 2-3
    with pytest.raises(DataError, match=rf'^{tmp_path / "a.csv"}:4: missing "output"'):
        load_sft(write_records(tmp_path / "a.csv", [ALPACA[0][0], *records]), smol, ctx=512)
    with pytest.raises(DataError, match=rf'^{tmp_path / "a.parquet"}: row 3: missing "output"'):
        load_sft(write_records(tmp_path / "a.parquet", [ALPACA[0][0], *records]), smol, ctx=512)
    (tmp_path / "b.csv").write_text('messages\n"[{""role"": ""user""}"\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf'^{tmp_path / "b.csv"}:2: the "messages" cell is not valid JSON'):
        load_sft(tmp_path / "b.csv", smol, ctx=512)
    (tmp_path / "c.csv").write_text("instruction,output\na,b,c\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf'^{tmp_path / "c.csv"}:2: 3 cells, but the header names 2 columns'):
        load_sft(tmp_path / "c.csv", smol, ctx=512)


def test_table_cells_are_bounded_like_json(tmp_path, smol, monkeypatch):
    monkeypatch.setattr(tables, "MAX_CELL_CHARS", 100)
    long = [ALPACA[0][0], {"instruction": "x" * 101, "output": "y"}]
    with pytest.raises(DataError, match=rf'^{tmp_path / "l.csv"}:3: not valid CSV \(a cell longer than 100 characters'):
        load_sft(write_records(tmp_path / "l.csv", long), smol, ctx=512)
    with pytest.raises(DataError, match=rf'^{tmp_path / "l.parquet"}: row 2: a cell longer than 100 characters'):
        load_sft(write_records(tmp_path / "l.parquet", long), smol, ctx=512)
    deep = write_records(tmp_path / "deep.csv", [{"conversations": "[" * 40 + "]" * 40}])
    with pytest.raises(DataError, match=rf'^{deep}:2: the "conversations" cell is not valid JSON \(JSON nested deeper'):
        load_sft(deep, smol, ctx=512)


class CountedName(str):
    """A cell that counts the equality tests made on it (a quadratic header check makes n²)."""

    comparisons = 0

    def __eq__(self, other):
        CountedName.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__

    def strip(self, *chars):
        return CountedName(str.strip(self, *chars))


def test_a_wide_csv_header_is_checked_in_linear_time(tmp_path, monkeypatch):
    real_reader = csv.reader

    class CountingReader:
        def __init__(self, *args, **kwargs):
            self.rows = real_reader(*args, **kwargs)
            self.line_num = 0

        def __iter__(self):
            return self

        def __next__(self):
            cells = next(self.rows)
            self.line_num = self.rows.line_num
            return [CountedName(cell) for cell in cells]

    monkeypatch.setattr(csv, "reader", CountingReader)
    columns = 1000
    wide = tmp_path / "wide.csv"
    wide.write_text(",".join(f"c{i}" for i in range(columns)) + "\n" + "x," * (columns - 1) + "x\n", encoding="utf-8")
    [(where, record)] = tables.read_records(wide, "csv")
    assert len(record) == columns and CountedName.comparisons <= 2 * columns, CountedName.comparisons  # n² before
    repeated = tmp_path / "repeated.csv"
    repeated.write_text(",".join(f"c{i // 2}" for i in range(columns)) + "\n" + "x," * (columns - 1) + "x\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{repeated}:1: the header needs distinct, non-empty column names "
                                        r"\(repeated: c0, c1, c10, c100, c101, \.\.\.\)$"):
        list(tables.read_records(repeated, "csv"))


def hostile_parquet(kind: str) -> pa.Table:
    """A few hundred bytes of Parquet that decode to hundreds of MiB."""
    if kind == "a list cell of millions of values":
        n = 2_000_000  # run-length encoded nulls
        message = pa.struct([("role", pa.string()), ("content", pa.string())])
        return pa.table({"messages": pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), pa.nulls(n, message))})
    rows = 100  # one 1 MB dictionary value, named by every row
    return pa.table({"prompt": pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["x" * 1_000_000]))})


READ_IN_A_CHILD = """
import resource, sys
from pathlib import Path
import pyarrow.compute, pyarrow.parquet
from retrograd.data.tables import read_records
from retrograd.errors import DataError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    print(f"read {sum(1 for _ in read_records(Path(sys.argv[1]), 'parquet'))} rows")
except DataError as e:
    print(f"refused: {e}")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize("kind", ["a list cell of millions of values", "a dictionary value in every row"])
def test_a_parquet_file_that_decodes_to_far_more_than_its_size_is_refused_before_decoding(tmp_path, kind):
    path = tmp_path / "hostile.parquet"
    pq.write_table(hostile_parquet(kind), path, compression="zstd")
    size = path.stat().st_size
    assert size < 2000
    r = subprocess.run([sys.executable, "-c", READ_IN_A_CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    outcome, peak_growth_mib = r.stdout.splitlines()
    assert outcome.startswith(f"refused: {path}: "), outcome
    assert f"more than the 64 MiB a Parquet file of {size:,} bytes may decode to (256x its size, at least 64 MiB" in outcome
    assert int(peak_growth_mib) < 32, outcome  # the old reader grew by hundreds of MiB


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, smol, monkeypatch):
    path = write_records(tmp_path / "d.parquet", ALPACA[0])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=rf"^{path}: reading Parquet needs pyarrow: pip install 'retrograd\[parquet\]'$"):
        load_sft(path, smol, ctx=512)
    assert load_sft(write_records(tmp_path / "d.csv", ALPACA[0]), smol, ctx=512).examples  # other files need none


# --- end to end ---------------------------------------------------------------------------


def test_train_on_sharegpt_states_the_shape_at_start_up(tmp_path, tiny_model):
    chat = [json.loads(line) for line in write_chat(tmp_path / "chat.jsonl", 16).read_text().splitlines()]
    sharegpt = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                                   for m in r["messages"]]} for r in chat]
    write_jsonl(tmp_path / "train_sharegpt.jsonl", *sharegpt)
    (tmp_path / "run.toml").write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{tiny_model("llama")}"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
[training]
ctx = 64
micro_batch = 128
epochs = 1
threads = 2
[sft]
data = "train_sharegpt.jsonl"
""")
    r = subprocess.run([sys.executable, "-m", "retrograd", "train", "run.toml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert "data: train_sharegpt.jsonl (ShareGPT conversations, 16 records)" in r.stdout + r.stderr
    assert (tmp_path / "out/adapter.gguf").stat().st_size > 0


def test_the_example_alpaca_csv_is_the_arithmetic_eval_set(smol):
    examples = Path(__file__).parent.parent / "examples/data"
    alpaca = load_sft(examples / "arithmetic_eval_alpaca.csv", smol, ctx=128)
    chat = load_sft(examples / "arithmetic_eval.jsonl", smol, ctx=128)
    assert [(e.ids, e.mask) for e in alpaca.examples] == [(e.ids, e.mask) for e in chat.examples]
    assert alpaca.description == "arithmetic_eval_alpaca.csv (Alpaca instructions, 32 records)"


def test_sharegpt_tool_turns_become_tool_records(tmp_path, smol):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    in_text = {"conversations": [{"from": "human", "value": "2+3?"}, {"from": "gpt", "value": call},
                                 {"from": "observation", "value": "5"}, {"from": "gpt", "value": "It is 5."}]}
    as_json = {"conversations": [{"from": "human", "value": "2+3?"},
                                 {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 3}}'},
                                 {"from": "tool", "value": "5"}, {"from": "gpt", "value": "It is 5."}]}
    raw = {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": call, "raw": True},
                        {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]}
    declared = {"messages": [{"role": "user", "content": "2+3?"},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                             {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]}
    got = load_sft(write_jsonl(tmp_path / "s.jsonl", in_text, as_json), smol, ctx=512).examples
    want = load_sft(write_jsonl(tmp_path / "m.jsonl", raw, declared), smol, ctx=512).examples
    assert [(e.ids, e.mask) for e in got] == [(e.ids, e.mask) for e in want]
    assert all(sum(e.mask) > 5 for e in got)


def test_data_format_forces_the_container(tmp_path, smol):
    path = write_records(tmp_path / "export.csv", ALPACA[0]).rename(tmp_path / "export.dat")
    data = load_sft(path, smol, ctx=512, data_format="csv")
    assert data.description == "export.dat (Alpaca instructions, 2 records)" and len(data.examples) == 2
