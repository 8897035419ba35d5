"""SFT datasets: plain text, chat JSONL and tool records -> examples with an exact loss mask.

The format is `data_format` when given (`text`/`txt`, or `jsonl`/`chat`/`chat-jsonl`), else
the extension (`.txt`/`.md` text, `.jsonl`/`.json` chat), else sniffed: a file whose first
non-blank line starts with `{` is chat JSONL.

Text: the whole file is one token stream (with a BOS where the model adds one), cut into
windows of at most ctx tokens that overlap by one token, so every token but the very first
is trained exactly once.

Chat: one example per record; only assistant turns are trained (see chat.py). A record
longer than ctx is dropped, not truncated (a cut turn would teach the model to stop
mid-answer, or never to stop); `SFTData.dropped` lists them so the caller can report the
count, and a file where every record is too long is refused.

The training loop owns packing; examples come out in file order, deterministic given the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrograd.data.chat import encode_conversation
from retrograd.data.files import first_line, json_lines, read_text
from retrograd.data.messages import parse_conversation
from retrograd.data.template import ChatFormat
from retrograd.errors import ConfigError, DataError

FORMAT_NAMES = {"text": "text", "txt": "text", "jsonl": "chat", "chat": "chat", "chat-jsonl": "chat"}
EXTENSION_FORMATS = {".txt": "text", ".md": "text", ".jsonl": "chat", ".json": "chat"}


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
class SFTData:
    format: str  # "text" or "chat"
    examples: tuple[Example, ...]
    dropped: tuple[str, ...] = ()  # sources of chat records longer than ctx, left out


def load_sft(path: str | Path, chat: ChatFormat, *, ctx: int, data_format: str | None = None) -> SFTData:
    assert ctx >= 2, "ctx is validated by the config"
    path = Path(path)
    text = read_text(path)
    kind = _format(path, text, data_format)
    examples, dropped = LOADERS[kind](path, text, chat, ctx)
    return SFTData(kind, tuple(examples), tuple(dropped))


def text_windows(path: Path, text: str, chat: ChatFormat, ctx: int) -> tuple[list[Example], list[str]]:
    ids = chat.tokenizer.encode(text) if text.strip() else []
    if len(ids) < 2:
        raise DataError(f"{path}: empty dataset (no text to train on)")
    stride = ctx - 1  # the last token of a window is the context of the next
    windows = []
    for n, start in enumerate(range(0, len(ids) - 1, stride)):
        window = tuple(ids[start : start + ctx])
        windows.append(Example(window, (False,) + (True,) * (len(window) - 1), f"{path}#{n}"))
    return windows, []


def chat_records(path: Path, text: str, chat: ChatFormat, ctx: int) -> tuple[list[Example], list[str]]:
    chat.require_template(path)
    examples, dropped, shortest = [], [], None
    for where, record in json_lines(path, text):
        conv = parse_conversation(record, where)
        if not any(m["role"] == "assistant" for m in conv.messages):
            raise DataError(f"{where}: no assistant turn; SFT trains on assistant turns")
        ids, mask = encode_conversation(chat, conv, where)
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


LOADERS = {"text": text_windows, "chat": chat_records}


def _format(path: Path, text: str, declared: str | None) -> str:
    if declared is not None:
        if declared not in FORMAT_NAMES:
            raise ConfigError(f"data_format = {declared!r}: expected one of {', '.join(FORMAT_NAMES)}")
        return FORMAT_NAMES[declared]
    suffix = path.suffix.lower()
    if suffix in EXTENSION_FORMATS:
        return EXTENSION_FORMATS[suffix]
    return "chat" if first_line(text).startswith("{") else "text"
