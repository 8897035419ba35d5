"""Preference datasets -> pairs (chosen and rejected answers to one prompt) or, for KTO,
labelled answers, tokenized with a loss mask on the answer only.

Record shapes, detected from the first record (JSON Lines, JSON, CSV or Parquet, read as
SFT data is):

  explicit prompt, conversational  {"prompt": [messages], "chosen": [assistant...], "rejected": [...]}
  explicit prompt, plain text      {"prompt": "...", "chosen": "...", "rejected": "..."}   (no chat template)
  implicit prompt, conversational  {"chosen": [whole conversation], "rejected": [...]}
  implicit prompt, plain text      {"chosen": "...", "rejected": "..."}
  unpaired (KTO)                   {"prompt": ..., "completion": ..., "label": true | false}

An implicit prompt is the longest common prefix, as TRL splits it: the messages both
conversations share (ending on a user or tool turn), or the text both strings share, one
character shorter when that character is a space. A conversational record is rendered with the chat template and trains
the answer's assistant turns (its prose, calls and end-of-turn marker, as SFT does); a plain
one is prompt + answer as one text plus the EOS token, trained from the first token where
it tokenizes differently from the prompt alone (TRL's rule). An optional "tools" catalogue is
rendered into both. The prompt is shared: both answers must follow the same prompt tokens.
A record whose answers are equal, empty, or longer than ctx with the prompt is an error
naming `file:line`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrograd.data.sft import TokenSequence, chat_example, data_container
from retrograd.data.shapes import Chat, count
from retrograd.data.tables import read_records
from retrograd.data.template import ChatFormat
from retrograd.errors import DataError


@dataclass(frozen=True)
class Pair:
    prompt: tuple[int, ...]  # the shared prefix: everything before the first trained token of either answer
    chosen: TokenSequence  # continues the prompt
    rejected: TokenSequence
    source: str  # file:line

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.chosen.ids) + len(self.rejected.ids)


@dataclass(frozen=True)
class Labelled:
    """KTO's unpaired record: one answer, desirable or not."""

    prompt: tuple[int, ...]
    answer: TokenSequence
    desirable: bool
    source: str

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.answer.ids)


@dataclass(frozen=True)
class PreferenceData:
    items: tuple[Pair, ...] | tuple[Labelled, ...]
    description: str  # for the start-up line


SHAPES = {
    "explicit": "pairs with an explicit prompt",
    "implicit": "pairs with an implicit prompt (split at the longest common prefix)",
    "unpaired": "unpaired answers with a label (KTO)",
}


def load_preference(path: str | Path, chat: ChatFormat, *, ctx: int, unpaired: bool, data_format: str | None = None) -> PreferenceData:
    path = Path(path)
    container = data_container(path, data_format)
    if container == "text":
        raise DataError(f"{path}: preference data is records (JSON Lines, JSON, CSV or Parquet), not plain text")
    items, shape, text = [], None, None
    for where, record in read_records(path, container):
        found = _shape(record, where)
        if shape is None:
            shape, text = found, isinstance(record.get("chosen", record.get("completion")), str)
            if unpaired != (shape == "unpaired"):
                want = "unpaired records {prompt, completion, label}" if unpaired else "pairs {prompt?, chosen, rejected}"
                raise DataError(f"{where}: loss {'kto' if unpaired else 'dpo/ipo/simpo/orpo'} reads {want}; this file's first record is "
                                f"{SHAPES[found]}")
        elif found != shape:
            raise DataError(f"{where}: this record is {SHAPES[found]}, but the file's first is {SHAPES[shape]}; one file holds one shape")
        elif isinstance(record.get("chosen", record.get("completion")), str) != text:
            kinds = ("conversational", "plain text") if text else ("plain text", "conversational")
            raise DataError(f"{where}: this record is {kinds[1]}, but the file's first is {kinds[0]}; one file holds one shape")
        item = _labelled(record, where, path, chat) if unpaired else _pair(record, where, path, chat, shape)
        answers = (item.answer,) if unpaired else (item.chosen, item.rejected)
        if len(item.prompt) + max(len(a.ids) for a in answers) > ctx:
            raise DataError(f"{where}: prompt and answer take more than ctx = {ctx} tokens; raise training.ctx or shorten the record")
        items.append(item)
    if not items:
        raise DataError(f"{path}: empty dataset (no records)")
    kind = f"{SHAPES[shape]}, {'plain text' if text else 'conversational'}"
    return PreferenceData(tuple(items), f"{path.name} ({kind}, {count(len(items), 'record')})")


def _shape(record: dict[str, Any], where: str) -> str:
    if "label" in record or "completion" in record:
        missing = [k for k in ("prompt", "completion", "label") if k not in record]
        if missing:
            raise DataError(f"{where}: an unpaired (KTO) record needs prompt, completion and label; missing {', '.join(missing)}")
        return "unpaired"
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise DataError(f'{where}: expected {{"prompt" (optional), "chosen", "rejected"}} or {{"prompt", "completion", "label"}}; '
                        f"missing {', '.join(missing)}")
    return "explicit" if "prompt" in record else "implicit"


def _pair(record: dict[str, Any], where: str, path: Path, chat: ChatFormat, shape: str) -> Pair:
    chosen, rejected = record["chosen"], record["rejected"]
    if type(chosen) is not type(rejected) or not isinstance(chosen, (str, list)):
        raise DataError(f'{where}: "chosen" and "rejected" must both be text or both lists of messages')
    if shape == "explicit":
        prompt = record["prompt"]
        if type(prompt) is not type(chosen):
            raise DataError(f'{where}: "prompt" must be {"text" if isinstance(chosen, str) else "a list of messages"}, as "chosen" is')
    else:
        prompt, chosen, rejected = _split_common_prefix(chosen, rejected, where)
    if chosen == rejected:
        raise DataError(f"{where}: the chosen and rejected answers are the same")
    extra = {"tools": record["tools"]} if "tools" in record else {}
    c_ids, c_mask = _encode(prompt, chosen, where, path, chat, extra, "chosen")
    r_ids, r_mask = _encode(prompt, rejected, where, path, chat, extra, "rejected")
    shared = 0
    limit = min(c_mask.index(True), r_mask.index(True))
    while shared < limit and c_ids[shared] == r_ids[shared]:
        shared += 1
    if shared == 0:
        raise DataError(f"{where}: the chosen and rejected answers share no prompt tokens")
    return Pair(tuple(c_ids[:shared]), TokenSequence(tuple(c_ids[shared:]), tuple(c_mask[shared:])),
                TokenSequence(tuple(r_ids[shared:]), tuple(r_mask[shared:])), where)


def _labelled(record: dict[str, Any], where: str, path: Path, chat: ChatFormat) -> Labelled:
    prompt, answer, label = record["prompt"], record["completion"], record["label"]
    if isinstance(label, str) and label.lower() in ("true", "false"):  # CSV cells are text
        label = label.lower() == "true"
    if not isinstance(label, bool):
        raise DataError(f'{where}: "label" must be true or false, got {label!r}'[:200])
    if type(prompt) is not type(answer) or not isinstance(answer, (str, list)):
        raise DataError(f'{where}: "prompt" and "completion" must both be text or both lists of messages')
    ids, mask = _encode(prompt, answer, where, path, chat, {"tools": record["tools"]} if "tools" in record else {}, "completion")
    start = mask.index(True)
    return Labelled(tuple(ids[:start]), TokenSequence(tuple(ids[start:]), tuple(mask[start:])), label, where)


def _encode(prompt, answer, where: str, path: Path, chat: ChatFormat, extra: dict, name: str) -> tuple[list[int], list[bool]]:
    if isinstance(answer, str):
        if not answer.strip():
            raise DataError(f'{where}: empty "{name}" answer')
        if not prompt:
            raise DataError(f'{where}: empty "prompt"')
        return _plain(chat, prompt, answer, where)
    if not answer or not any(isinstance(m, dict) and m.get("role") == "assistant" for m in answer):
        raise DataError(f'{where}: "{name}" has no assistant turn to train')
    if not all(isinstance(m, dict) and m.get("role") in ("assistant", "tool") for m in answer):
        raise DataError(f'{where}: "{name}" holds only the answer: assistant (and tool) messages')
    context = sum(isinstance(m, dict) and m.get("role") == "assistant" for m in prompt)
    ids, mask = chat_example(path, chat, Chat(extra | {"messages": list(prompt) + list(answer)}, context), where)
    if not any(mask):
        raise DataError(f'{where}: empty "{name}" answer')
    return ids, mask


def _plain(chat: ChatFormat, prompt: str, answer: str, where: str) -> tuple[list[int], list[bool]]:
    """prompt + answer as one text, no template, plus EOS; trained from the first token where it
    and the prompt alone tokenize differently (TRL's rule: a token spanning the boundary is the
    answer's, so an answer that starts mid-word trains that word)."""
    ids, _ = chat.tokenize(prompt + answer, where)
    alone, _ = chat.tokenize(prompt, where)
    first = next((i for i, (a, b) in enumerate(zip(ids, alone)) if a != b), min(len(alone), len(ids)))
    mask = [i >= max(first, 1) for i in range(len(ids))]
    eos = chat.tokenizer.eos_id
    if eos is not None and ids[-1] != eos:
        ids.append(eos)
        mask.append(True)
    if not any(mask):
        raise DataError(f"{where}: the answer adds no token to train after the prompt")
    return ids, mask


def _split_common_prefix(chosen, rejected, where: str):
    """TRL's implicit prompt: what both share, ending on a user or tool turn (messages), or
    backed up to a space (text)."""
    if isinstance(chosen, str):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n < min(len(chosen), len(rejected)) and n and chosen[n - 1] == " ":
            n -= 1
        if n == 0:
            raise DataError(f'{where}: "chosen" and "rejected" share no prompt text')
        return chosen[:n], chosen[n:], rejected[n:]
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n and not (isinstance(chosen[n - 1], dict) and chosen[n - 1].get("role") in ("user", "tool")):
        n -= 1
    if n == 0:
        raise DataError(f'{where}: "chosen" and "rejected" share no prompt ending on a user turn')
    return chosen[:n], chosen[n:], rejected[n:]
