"""Rollout prompts for GRPO and on-policy distillation: chat JSONL whose last message is the
user turn the model answers, optionally with a `rubric` for the judge.

Each prompt is rendered with the generation prompt (`<|im_start|>assistant\\n` and the like)
and tokenized once. The reward program receives `Prompt.text`, the last user message
without any template markup (notes section 3). A prompt longer than `max_tokens` is
refused rather than dropped: the user chose ctx and max_new_tokens and should hear which
line does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrograd.data.files import json_lines, read_text
from retrograd.data.messages import parse_conversation
from retrograd.data.template import ChatFormat
from retrograd.errors import DataError


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]  # the rendered conversation, ending with the assistant header
    text: str  # content of the last user message: the reward program's "prompt"
    rubric: str | None
    source: str  # `file:line`


def load_prompts(path: str | Path, chat: ChatFormat, *, max_tokens: int | None = None) -> tuple[Prompt, ...]:
    path = Path(path)
    text = read_text(path)
    chat.require_template(path)
    prompts = [_prompt(where, record, chat, max_tokens) for where, record in json_lines(path, text)]
    if not prompts:
        raise DataError(f"{path}: empty dataset (no prompts)")
    return tuple(prompts)


def _prompt(where: str, record: dict, chat: ChatFormat, max_tokens: int | None) -> Prompt:
    conv = parse_conversation(record, where)
    if conv.has_tools:
        raise DataError(
            f"{where}: tools and tool messages belong in SFT tool records; a prompt has system, user and assistant messages"
        )
    last = conv.messages[-1]
    if last["role"] != "user":
        raise DataError(
            f"{where}: does not end with a user message (the last is {last['role']}); the model answers the last user turn"
        )
    rubric = record.get("rubric")
    if rubric is not None and (not isinstance(rubric, str) or not rubric.strip()):
        raise DataError(f'{where}: "rubric" must be a non-empty string, got {rubric!r}')
    rendered = chat.render(list(conv.messages), add_generation_prompt=True, where=where)
    ids, _ = chat.tokenize(rendered, where)
    if max_tokens is not None and len(ids) > max_tokens:
        raise DataError(
            f"{where}: the prompt is {len(ids)} tokens, more than the {max_tokens} that leave room to answer"
        )
    return Prompt(tuple(ids), last["content"], rubric, where)
