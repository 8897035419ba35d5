"""SFT datasets: plain text, and records of any shape shapes.py knows (chat messages,
ShareGPT, TRL prompt/completion, Alpaca) in JSON Lines, CSV or Parquet -> examples with an
exact loss mask.

The container is `data_format` when given (`text`/`txt`; `jsonl`/`json`/`chat`/`chat-jsonl`;
`csv`; `parquet`), else the extension (`.txt`/`.md` text, `.jsonl`/`.json`, `.csv`,
`.parquet`), else sniffed: a file whose first non-blank line starts with `{` is JSON Lines.
The record shape is detected from the first record; `SFTData.description` states both for
the start-up line.

Text: the whole file is one token stream (with a BOS where the model adds one), cut into
windows of at most ctx tokens that overlap by one token, so every token but the very first
is trained exactly once.

Records: one example per record; only assistant turns are trained (see chat.py), and of a
TRL record only its completion. TRL's plain-text prompt/completion gets no chat template,
as in TRL: the example is the text prompt + completion, tokenized as one text, plus the EOS
token (trained, so the model learns to stop) unless the completion already ends with it; a
token that straddles the prompt's end belongs to the prompt. A record longer than ctx is
dropped, not truncated (a cut turn would teach the model to stop mid-answer, or never to
stop); `SFTData.dropped` lists them so the caller can report the count, and a file where
every record is too long is refused.

The training loop owns packing; examples come out in file order, deterministic given the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrograd.data.chat import encode_conversation
from retrograd.data.files import first_line, read_text
from retrograd.data.messages import parse_conversation
from retrograd.data.shapes import Chat, Plain, count, shaped
from retrograd.data.tables import EXTENSIONS, read_records
from retrograd.data.template import ChatFormat
from retrograd.errors import ConfigError, DataError

FORMAT_NAMES = {
    "text": "text", "txt": "text",
    "jsonl": "jsonl", "json": "jsonl", "chat": "jsonl", "chat-jsonl": "jsonl",
    "csv": "csv", "parquet": "parquet",
}
EXTENSION_FORMATS = {".txt": "text", ".md": "text"} | EXTENSIONS


@dataclass(frozen=True)
class Example:
    """One training sequence. mask[i] is True when predicting ids[i] from ids[:i] is part of
    the loss, so mask[0] is always False."""

    ids: tuple[int, ...]
    mask: tuple[bool, ...]
    source: str  # `file:line` for a chat record, `file#window` for a text window

    @property
    def n_trained(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class TokenSequence:
    """ids and a loss mask: mask[i] is True when predicting ids[i] from what precedes it counts
    (a completion's mask[0] too, when it continues a prompt packed before it)."""

    ids: tuple[int, ...]
    mask: tuple[bool, ...]

    @property
    def n_trained(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class SFTData:
    format: str  # "text" (one stream cut into windows) or "chat" (one example per record, of any shape)
    examples: tuple[Example, ...]
    dropped: tuple[str, ...] = ()  # sources of records longer than ctx, left out
    description: str = ""  # for the start-up line: `train.jsonl (ShareGPT conversations, 1,204 records)`


def load_sft(path: str | Path, chat: ChatFormat, *, ctx: int, data_format: str | None = None) -> SFTData:
    assert ctx >= 2, "ctx is validated by the config"
    path = Path(path)
    container = data_container(path, data_format)
    if container == "text":
        windows = text_windows(path, read_text(path), chat, ctx)
        description = f"{path.name} (plain text, {count(len(windows), 'window')} of up to {ctx} tokens)"
        return SFTData("text", tuple(windows), (), description)
    shape, items = shaped(read_records(path, container), "example")
    examples, dropped = record_examples(path, items, chat, ctx)
    n_records = len(examples) + len(dropped)
    return SFTData("chat", tuple(examples), tuple(dropped), f"{path.name} ({shape.name}, {count(n_records, 'record')})")


def text_windows(path: Path, text: str, chat: ChatFormat, ctx: int) -> list[Example]:
    ids = chat.tokenizer.encode(text) if text.strip() else []
    if len(ids) < 2:
        raise DataError(f"{path}: empty dataset (no text to train on)")
    stride = ctx - 1  # the last token of a window is the context of the next
    windows = []
    for n, start in enumerate(range(0, len(ids) - 1, stride)):
        window = tuple(ids[start : start + ctx])
        windows.append(Example(window, (False,) + (True,) * (len(window) - 1), f"{path}#{n}"))
    return windows


def record_examples(path: Path, items, chat: ChatFormat, ctx: int) -> tuple[list[Example], list[str]]:
    """`items` are (where, Chat | Plain) from shapes.shaped."""
    examples, dropped, shortest = [], [], None
    for where, item in items:
        if isinstance(item, Plain):
            ids, mask = _plain_example(chat, item, where)
        else:
            ids, mask = chat_example(path, chat, item, where)
        if len(ids) > ctx:
            dropped.append(where)
            shortest = len(ids) if shortest is None else min(shortest, len(ids))
        else:
            examples.append(Example(tuple(ids), tuple(mask), where))
    if not examples and dropped:
        raise DataError(
            f"{path}: every record is longer than ctx = {ctx} tokens ({len(dropped)} dropped, the shortest has "
            f"{shortest}); raise ctx or shorten the records"
        )
    if not examples:
        raise DataError(f"{path}: empty dataset (no records)")
    return examples, dropped


def chat_example(path: Path, chat: ChatFormat, item: Chat, where: str) -> tuple[list[int], list[bool]]:
    chat.require_template(path)
    conv = parse_conversation(item.record, where)
    if sum(m["role"] == "assistant" for m in conv.messages) <= item.context_turns:
        raise DataError(f"{where}: no assistant turn to train; SFT trains on assistant turns")
    return encode_conversation(chat, conv, where, context_turns=item.context_turns)


def _plain_example(chat: ChatFormat, item: Plain, where: str) -> tuple[list[int], list[bool]]:
    ids, starts = chat.tokenize(item.prompt + item.completion, where)
    boundary = len(item.prompt.encode("utf-8"))
    mask = [False] + [start >= boundary for start in starts[1:]]
    eos = chat.tokenizer.eos_id
    if eos is not None and ids[-1] != eos:
        ids.append(eos)
        mask.append(True)
    return ids, mask


def data_container(path: Path, declared: str | None) -> str:
    if declared is not None:
        if declared not in FORMAT_NAMES:
            raise ConfigError(f"data_format = {declared!r}: expected one of {', '.join(FORMAT_NAMES)}")
        return FORMAT_NAMES[declared]
    suffix = path.suffix.lower()
    if suffix in EXTENSION_FORMATS:
        return EXTENSION_FORMATS[suffix]
    return "jsonl" if first_line(read_text(path)).startswith("{") else "text"
