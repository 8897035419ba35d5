"""Generation for people: one llama.cpp model, any number of LoRA adapters loaded once and
picked per call, prompts rendered with the GGUF's own chat template, text streamed as it
comes. `retrograd chat` and `retrograd serve` both stand on this.

Adapters. llama.cpp applies adapters to a context, not to a sequence, and a KV cell holds
what the weights applied at the time computed. So every model name (`base`, each adapter)
owns one sequence of the context, and only that name ever decodes into it: a cached prefix
is reused only by the name that computed it, and switching names never mixes base and
adapter KV. The adapter applied to the context is changed only when the name changes.

Reuse. What llama.cpp computes for a token row depends on the batch it was computed in
(see retrograd/sampler/sampler.py). A prompt is therefore always prefilled from position 0
in pieces that end at multiples of PREFILL_CHUNK, and a cached prefix is reused only in
whole pieces that such a prefill computed: a continued chat or a repeated prompt computes
exactly the numbers a fresh process would (tests/test_chat.py checks this against a fresh
llama.cpp run).

Decoding steps one token at a time, as llama.cpp's own generation does; temperature 0 is
greedy (the first most likely token, as llama.cpp's greedy sampler), otherwise
retrograd.sampler's draw with its own numpy Generator, seeded when the caller gives a seed.
Generation stops at any end-of-generation token of the vocabulary, at the token the chat
template closes an assistant turn with, at a stop string, or at the token budget. With a
grammar (`Settings.grammar`, GBNF) every token is one the grammar allows, drawn as
retrograd/sampler/grammar.py says, and the reply ends once the grammar is complete and the
model ends it.
"""

from __future__ import annotations

import codecs
import ctypes
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import numpy as np

from retrograd.data import ChatFormat, resolve_chat_template
from retrograd.data.chat import render_prompt
from retrograd.data.messages import parse_conversation
from retrograd.errors import DataError, GGUFError
from retrograd.gguf.adapter import read_fitting_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.model.tokenizer import Tokenizer
from retrograd.runtime.llamacpp import C
from retrograd.sampler.engine import Engine, Feed
from retrograd.sampler.grammar import Grammar, constrained_pick
from retrograd.sampler.sampler import PREFILL_CHUNK
from retrograd.sampler.sampling import Sampling, sample_token

BASE = "base"  # the model name of the base without any adapter
DEFAULT_CTX = 4096  # positions per model name, capped at the model's trained context
TURN_PROBE = "retrograd-end-of-turn-probe"
MAX_TOP_LOGPROBS = 20  # alternatives per position a request may ask for (OpenAI's bound)
SCORE_CHUNK = 64  # prompt tokens per decode when each one's logits are wanted (echo): 64 rows of [V] floats


class ContextFull(DataError):
    """The prompt does not leave room for a single new token."""


@dataclass(frozen=True)
class Settings:
    """How one reply is generated."""

    max_tokens: int | None = None  # None: until the context is full; 0 (with echo): score the prompt only
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: fresh entropy
    stop: tuple[str, ...] = ()  # the reply ends before the first of these strings
    grammar: str | None = None  # GBNF the reply must follow (retrograd.sampler.grammar); it ends when complete
    logprobs: int | None = None  # each reply token's log-prob and its `logprobs` most likely alternatives
    echo: bool = False  # with logprobs: the prompt tokens' log-probs too

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise DataError(f"max_tokens {self.max_tokens} must be at least 1 (0 only to score an echoed prompt)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise DataError(f"logprobs {self.logprobs} must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.temperature < 0:
            raise DataError(f"temperature {self.temperature} must be >= 0 (0: greedy)")


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (at the request's temperature; 1 when
    greedy) and the `top` most likely tokens of that position with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, temperature: float, top: int) -> TokenLogprob:
    """From one position's logits [V]: log_softmax(logits / T) of `token`, and the `top` best."""
    scaled = logits.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    finite = scaled[np.isfinite(scaled)]
    logz = finite.max() + np.log(np.exp(finite - finite.max()).sum())
    best = np.argpartition(-scaled, top)[:top] if 0 < top < len(scaled) else np.arange(len(scaled))[:top]
    best = best[np.argsort(-scaled[best], kind="stable")]
    return TokenLogprob(token, float(scaled[token] - logz), tuple((int(t), float(scaled[t] - logz)) for t in best))


@dataclass
class _Slot:
    """One model name's sequence: the tokens resident at positions 0.., of which the first
    `aligned` were computed by a prefill from position 0 (reusable in whole chunks)."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    aligned: int = 0

    def reusable(self, prompt: list[int]) -> int:
        """Leading prompt positions whose cache can be kept: whole prefill chunks, always
        leaving at least the last prompt token to decode (its logits start the reply)."""
        limit = min(self.aligned, len(prompt) - 1)
        same = next((i for i, (a, b) in enumerate(zip(self.tokens[:limit], prompt)) if a != b), limit)
        return same // PREFILL_CHUNK * PREFILL_CHUNK


class Inference:
    def __init__(
        self,
        model: Path,
        adapters: Mapping[str, Path] | None = None,
        *,
        n_ctx: int = DEFAULT_CTX,
        n_threads: int = 0,
        chat_template: str | None = None,
    ):
        adapters = dict(adapters or {})
        if BASE in adapters:
            raise GGUFError(f"adapter name {BASE!r} is the base model's; name the adapter otherwise (NAME=PATH)")
        base = GGUFFile(model)
        for path in adapters.values():
            read_fitting_adapter(Path(path), base)
        trained = base.get_int(f"{base.get_str('general.architecture')}.context_length", n_ctx) or n_ctx
        self.n_ctx = min(n_ctx, trained)
        template = resolve_chat_template(base.get_str("tokenizer.chat_template"), chat_template)
        self.chat = ChatFormat(Tokenizer(model), template, origin=str(model))
        self.engine = Engine(
            Path(model),
            n_ctx=self.n_ctx,
            n_seq_max=1 + len(adapters),
            n_batch=PREFILL_CHUNK,
            kv_dtype="f16",
            n_threads=n_threads or len(os.sched_getaffinity(0)),
            n_outputs=SCORE_CHUNK,
        )
        try:
            self._adapters = {BASE: None} | {name: self.engine.load_adapter(Path(p)) for name, p in adapters.items()}
        except BaseException:
            self.engine.close()
            raise
        self._slots = {name: _Slot(i) for i, name in enumerate(self._adapters)}
        self._applied = BASE
        self.stop_ids = self.engine.eog_ids | self._end_of_turn_ids()
        # Under a grammar: tokens a reply may not take. A control token's text is matched by
        # the grammar but never written into the reply; a stop token that is not end-of-generation
        # would end the reply before the grammar completes.
        self.unwritten_ids = np.array(sorted(
            t for t in range(self.engine.n_vocab)
            if t not in self.engine.eog_ids and (C.llama_vocab_is_control(self.engine.vocab, t) or t in self.stop_ids)
        ), dtype=np.int64)
        self._pieces: dict[int, bytes] = {}

    @property
    def names(self) -> list[str]:
        """Model names, base first."""
        return list(self._adapters)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.engine.close()  # frees the adapters with the model

    # ---- prompts

    def require_chat_template(self) -> None:
        if self.chat.source is None:
            raise DataError(
                f"{self.chat.origin} has no chat template (no tokenizer.chat_template in its GGUF); "
                "name one with --chat-template (chatml, gemma or a Jinja file)"
            )

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` rendered by the model's chat template, ready for the reply.
        A conversation with tools (a catalogue, assistant `tool_calls`, `tool` messages) is
        checked and rendered as tool records are (retrograd.data.chat.render_prompt)."""
        self.require_chat_template()
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            conversation = parse_conversation({"messages": messages, "tools": tools or []}, "messages")
            text = render_prompt(self.chat, conversation, "chat")
        else:
            text = self.chat.render(messages, add_generation_prompt=True, where="chat")
        return self.chat.tokenize(text, "chat")[0]

    def text_prompt(self, text: str) -> list[int]:
        """Token ids of plain text, with a BOS where the model adds one."""
        return self.chat.tokenizer.encode(text)

    # ---- generation

    def generate(self, name: str, prompt: list[int], settings: Settings = Settings()) -> Generation:
        """The reply of model `name` (BASE or an adapter name) to `prompt`; iterate it for the
        text as it comes. Nothing runs until it is iterated."""
        if name not in self._adapters:
            raise DataError(f"unknown model {name!r} (models: {', '.join(self.names)})")
        if not prompt:
            raise DataError("the prompt is empty")
        room = self.n_ctx - len(prompt)
        if room < (0 if settings.max_tokens == 0 else 1):
            raise ContextFull(f"the prompt is {len(prompt)} tokens; the context holds {self.n_ctx}")
        budget = room if settings.max_tokens is None else min(settings.max_tokens, room)
        grammar = None
        if settings.grammar is not None:  # compiled now: a grammar llama.cpp cannot parse fails the request
            grammar = Grammar(self.engine.vocab, self.engine.n_vocab, settings.grammar)
        return Generation(self, name, list(prompt), settings, budget, grammar)

    def _prefill(self, name: str, prompt: list[int], score: Settings | None = None) -> tuple[np.ndarray, int, list]:
        """Logits after the last prompt token, decoding only what `name`'s cache lacks, and
        how many prompt tokens the cache had; with `score` (echo) the whole prompt is decoded
        and the log-prob of each prompt token after the first comes back too."""
        if self._applied != name:
            self.engine.set_adapter(self._adapters[name])
            self._applied = name
        slot = self._slots[name]
        keep = 0 if score else slot.reusable(prompt)
        if not self.engine.keep(slot.seq_id, keep):
            keep = 0
        slot.tokens, slot.aligned = prompt[:keep], keep
        row, scored = None, []
        chunk = SCORE_CHUNK if score else PREFILL_CHUNK
        for start in range(keep, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            last = start + len(piece) == len(prompt)
            rows = self.engine.decode([Feed(slot.seq_id, start, piece, want_logits=last, every_logits=bool(score))])[0]
            if score:
                following = prompt[start + 1 : start + len(piece) + 1]  # the token each row predicts
                scored += [token_logprob(r, t, score.temperature, score.logprobs) for r, t in zip(rows, following)]
                rows = rows[-1]
            row = rows
            slot.tokens += piece
            slot.aligned = 0 if score else len(slot.tokens)  # scored in other pieces: not reused (see Reuse above)
        return row, keep, scored

    def _step(self, name: str, token: int) -> np.ndarray:
        slot = self._slots[name]
        row = self.engine.decode([Feed(slot.seq_id, len(slot.tokens), [token], want_logits=True)])[0]
        slot.tokens.append(token)
        return row

    def piece(self, token: int) -> bytes:
        """The bytes token `token` adds to a reply (control tokens add none)."""
        if token not in self._pieces:
            buf = ctypes.create_string_buffer(64)
            n = C.llama_token_to_piece(self.engine.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = C.llama_token_to_piece(self.engine.vocab, token, buf, len(buf), 0, False)
            self._pieces[token] = buf.raw[:n]
        return self._pieces[token]

    def _end_of_turn_ids(self) -> frozenset[int]:
        """The control token the chat template closes an assistant turn with, when there is
        one: ChatML's <|im_end|>, Gemma's <end_of_turn>, even where the vocabulary does not
        mark it end-of-generation."""
        if self.chat.source is None:
            return frozenset()
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": TURN_PROBE}]
        try:
            text = self.chat.render(messages, where="end-of-turn probe")
        except DataError:
            return frozenset()
        _, found, tail = text.partition(TURN_PROBE)
        ids = self.chat.tokenizer.encode(tail, add_bos=False, special=True) if found and tail else []
        return frozenset(ids[:1]) if ids and C.llama_vocab_is_control(self.engine.vocab, ids[0]) else frozenset()


class Generation:
    """One reply. Iterating yields its text in pieces (whole UTF-8 characters, stop strings
    held back until they are ruled out); afterwards `text`, `completion_tokens` and
    `finish_reason` ("stop": end of turn or a stop string, "length": the token budget or
    the context ran out) are set. Abandoning the iteration leaves the model ready for the
    next call; so does setting `cancelled` (from any thread), which ends the iteration
    before its next token with `finish_reason` None."""

    def __init__(
        self, inference: Inference, name: str, prompt: list[int], settings: Settings, budget: int,
        grammar: Grammar | None,
    ):
        self.inference, self.name, self.prompt, self.settings = inference, name, prompt, settings
        self.budget, self.grammar = budget, grammar
        self.prompt_tokens = len(prompt)
        self.reused = 0  # prompt tokens whose KV was already cached
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.text = ""
        self.cancelled = threading.Event()
        self.prompt_logprobs: list[TokenLogprob | None] = []  # with echo: None for the first prompt token
        self.token_logprobs: list[TokenLogprob] = []  # with logprobs: one per reply token

    def __iter__(self) -> Iterator[str]:
        inf, s = self.inference, self.settings
        scoring = s if s.echo and s.logprobs is not None else None
        row, self.reused, scored = inf._prefill(self.name, self.prompt, scoring)
        if scoring:
            self.prompt_logprobs = [None, *scored]
        if self.budget == 0:  # echo with max_tokens 0: the prompt's log-probs were the point
            self.finish_reason = "length"
            return
        sampling = Sampling(self.budget, s.temperature, s.top_p) if s.temperature > 0 else None
        rng = np.random.default_rng(s.seed)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = StopStrings(s.stop)

        def pick(logits: np.ndarray) -> int:
            return int(np.argmax(logits)) if sampling is None else sample_token(logits, sampling, rng)[0]
        while True:
            if self.cancelled.is_set():
                return
            model_row = row.copy() if s.logprobs is not None else row  # picking may mask or scale the row
            if self.grammar is None:
                token = pick(row)
            else:  # the grammar allows an end-of-generation token only once it is complete
                row[inf.unwritten_ids] = -np.inf
                token = constrained_pick(row, self.grammar, pick, greedy=sampling is None)
                if token is None or token in inf.engine.eog_ids:
                    self.finish_reason = "stop"
                    break
                self.grammar.accept(token)
            if token in inf.stop_ids:
                self.finish_reason = "stop"
                break
            if s.logprobs is not None:  # the model's own distribution, before any grammar mask
                self.token_logprobs.append(token_logprob(model_row, token, s.temperature, s.logprobs))
            self.completion_tokens += 1
            text, stopped = stops.feed(decoder.decode(inf.piece(token)))
            if text:
                self.text += text
                yield text
            if stopped:
                self.finish_reason = "stop"
                return
            if self.completion_tokens >= self.budget:
                self.finish_reason = "length"
                break
            row = inf._step(self.name, token)
        text, _ = stops.feed(decoder.decode(b"", final=True))
        text += stops.flush()
        if text:
            self.text += text
            yield text

    def run(self) -> str:
        """Generate the whole reply."""
        for _ in self:
            pass
        return self.text


class StopStrings:
    """Cuts a text stream before the first stop string, holding back a tail that might
    still become one. Each stop is matched as the text streams by, one character at a time
    (Knuth-Morris-Pratt), so a piece costs time linear in its length and the held tail,
    however long the stops are."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.fallbacks = [_longest_borders(s) for s in self.stops]
        self.matched = [0] * len(self.stops)  # per stop: its longest prefix the stream ends with
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        start = len(self.pending)
        self.pending += text
        cut = None
        for i, (stop, fallback) in enumerate(zip(self.stops, self.fallbacks)):
            matched = self.matched[i]
            for offset, char in enumerate(text):
                while matched and stop[matched] != char:
                    matched = fallback[matched - 1]
                matched += stop[matched] == char
                if matched == len(stop):
                    begins = start + offset + 1 - len(stop)
                    cut = begins if cut is None else min(cut, begins)
                    break
            self.matched[i] = matched
        if cut is not None:
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = max(self.matched, default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _longest_borders(text: str) -> list[int]:
    """For each prefix text[:k + 1], the length of its longest proper prefix that is also its
    suffix (where a match of `text` falls back to when the next character differs)."""
    borders = [0] * len(text)
    for k in range(1, len(text)):
        border = borders[k - 1]
        while border and text[k] != text[border]:
            border = borders[border - 1]
        borders[k] = border + (text[k] == text[border])
    return borders
