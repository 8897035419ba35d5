"""Rollout prompts for GRPO and on-policy distillation, in any record shape shapes.py knows
and any container tables.py reads: the prompt part of each record (chat messages ending with
the user turn the model answers; TRL's prompt; a ShareGPT conversation without its final
assistant turn; Alpaca's instruction and input), optionally with a `rubric` for the judge.
In an evaluation file a chat record may end with its reference answer (an assistant turn
after the last user turn): the prompt stops at the user turn, and the reward program gets
the answer as the request's "reference", as TRL hands a dataset's extra columns to reward
functions. A training prompt must end with the user turn.

A chat prompt is rendered with the generation prompt (`<|im_start|>assistant\\n` and the like)
and tokenized once; a TRL plain-text prompt is tokenized as it is, with no template, and the
model continues the text. The reward program receives `Prompt.text`, the last user message
(or the plain prompt) without any template markup (notes section 3). A prompt longer than
`max_tokens` is refused rather than dropped: the user chose ctx and max_new_tokens and
should hear which line does not fit.

The prompt stream of a rollout recipe is a pure function of its position: which prompt the
k-th draw is and the seed of each completion, so a resumed run draws the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.data.messages import parse_conversation
from retrograd.data.shapes import Chat, Plain, count, shaped
from retrograd.data.tables import EXTENSIONS, read_records
from retrograd.data.template import ChatFormat
from retrograd.errors import DataError


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]  # the rendered conversation, ending with the assistant header
    text: str  # content of the last user message: the reward program's "prompt"
    rubric: str | None
    reference: str | None  # the answer an evaluation record ends with: the reward's "reference"
    source: str  # `file:line`


class Prompts(tuple):
    """The prompts of one file in file order (a plain tuple to every caller), and the
    `description` the start-up line states: `prompts.csv (Alpaca instructions, 40 records)`."""

    description: str

    def __new__(cls, prompts=(), description: str = ""):
        self = super().__new__(cls, prompts)
        self.description = description
        return self


def load_prompts(path: str | Path, chat: ChatFormat, *, max_tokens: int | None = None,
                 evaluation: bool = False) -> Prompts:
    """`evaluation`: a held-out file, whose chat records may end with their reference answer."""
    path = Path(path)
    shape, items = shaped(read_records(path, EXTENSIONS.get(path.suffix.lower(), "jsonl")), "prompt")
    prompts = [_prompt(path, where, item, chat, max_tokens, evaluation) for where, item in items]
    if not prompts:
        raise DataError(f"{path}: empty dataset (no prompts)")
    references = sum(p.reference is not None for p in prompts)
    told = f'; {references:,} with a reference answer, which the reward receives as "reference"'
    return Prompts(prompts, f"{path.name} ({shape.name}, {count(len(prompts), 'record')}{told if references else ''})")


def _prompt(path: Path, where: str, item: Chat | Plain, chat: ChatFormat, max_tokens: int | None,
            evaluation: bool) -> Prompt:
    record = item.extra if isinstance(item, Plain) else item.record
    rubric = record.get("rubric")
    if rubric is not None and (not isinstance(rubric, str) or not rubric.strip()):
        raise DataError(f'{where}: "rubric" must be a non-empty string, got {rubric!r}')
    if isinstance(item, Plain):
        ids, text, reference = chat.tokenizer.encode(item.prompt), item.prompt, None
    else:
        ids, text, reference = _chat_prompt(path, where, item, chat, evaluation)
    if max_tokens is not None and len(ids) > max_tokens:
        raise DataError(
            f"{where}: the prompt is {len(ids)} tokens, more than the {max_tokens} that leave room to answer"
        )
    return Prompt(tuple(ids), text, rubric, reference, where)


def _chat_prompt(path: Path, where: str, item: Chat, chat: ChatFormat,
                 evaluation: bool) -> tuple[list[int], str, str | None]:
    chat.require_template(path)
    conv = parse_conversation(item.record, where)
    if conv.has_tools:
        raise DataError(
            f"{where}: tools and tool messages belong in SFT tool records; a prompt has system, user and assistant messages"
        )
    messages, reference = list(conv.messages), None
    if evaluation and messages[-1]["role"] == "assistant":  # turns alternate, so a user turn precedes it
        reference = messages.pop()["content"]
    last = messages[-1]
    if last["role"] != "user":
        raise DataError(
            f"{where}: does not end with a user message (the last is {last['role']}); the model answers the last user turn"
        )
    rendered = chat.render(messages, add_generation_prompt=True, where=where)
    ids, _ = chat.tokenize(rendered, where)
    return ids, last["content"], reference


def completion_seed(base: int, stream_position: int, member: int) -> int:
    """A 63-bit seed per completion, a pure function of its place in the prompt stream."""
    return int(np.random.SeedSequence([base, stream_position, member]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def prompt_index(position: int, n_prompts: int, *, order: str, seed: int) -> int:
    """Which prompt the stream's `position`-th draw is: round robin, or a fresh permutation
    of the prompt file per pass when shuffled."""
    if order == "sequential":
        return position % n_prompts
    epoch, k = divmod(position, n_prompts)
    return int(np.random.default_rng([seed, epoch]).permutation(n_prompts)[k])


def order_name(name: str) -> str:
    """prompt_order as prompt_index spells it: the config also accepts "shuffle"."""
    return "sequential" if name == "sequential" else "shuffled"
