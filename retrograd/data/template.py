"""A model's chat template and tokenizer together: render conversations with the GGUF's own
Jinja template and tokenize the result exactly as llama.cpp does.

The template runs in Jinja's immutable sandbox, with a budget of steps, sizes and time
(bounded_jinja.py: a template inside a downloaded GGUF is untrusted code), and with the
helpers Hugging Face and llama.cpp templates expect: `raise_exception`, `strftime_now`, a
`tojson` that leaves non-ASCII and `<>&` alone, `bos_token`/`eos_token`,
`add_generation_prompt`, `tools`, the loop-control extension, plus the user's
`template_variables`.

A model without a template (Gemma-3-270M ships none) gets no silent ChatML: chat data is
refused with an error that says how to name a template explicitly (a built-in name from
CHAT_TEMPLATES or a Jinja file). Plain-text data needs no template at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2

from retrograd.data import bounded_jinja
from retrograd.data.bounded_jinja import BoundedEnvironment, BudgetExceeded
from retrograd.errors import ConfigError, DataError
from retrograd.model.tokenizer import Tokenizer

# Templates that print the date (Llama 3) would otherwise make the data depend on the day
# the run starts, and a resumed run could tokenize differently. The clock is pinned;
# `template_variables = { date_string = "..." }` sets another date where templates read it.
PINNED_NOW = datetime(2025, 1, 1)
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})

CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# Gemma's convention: no system role (system text opens the first user turn), the
# assistant is called `model`, and every turn ends with <end_of_turn>.
GEMMA = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' + ns.system }}"
    "{%- set ns.system = '' -%}"
    "{{ message['content'] + '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
CHAT_TEMPLATES = {"chatml": CHATML, "gemma": GEMMA}

PROBE_CATALOGUE = "probe-catalogue-sentinel"
PROBE_ARGUMENT = "probe-argument-sentinel"
PROBE_OBSERVATION = "probe-observation-sentinel"
MAX_QUOTED = 300  # characters of a template's own error text quoted in ours


class TemplateBudgetError(DataError):
    """A chat template went past its rendering budget (bounded_jinja.py)."""


def resolve_chat_template(gguf_template: str | None, override: str | None = None) -> str | None:
    """The template to use: `override` (a CHAT_TEMPLATES name or a Jinja file) when given,
    else the GGUF's `tokenizer.chat_template` (None when the model has none)."""
    if override is None:
        return gguf_template
    if override in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[override]
    path = Path(override)
    if not path.is_file():
        raise ConfigError(f"chat_template = {override!r}: neither a built-in ({', '.join(CHAT_TEMPLATES)}) nor a file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"chat_template = {override!r}: cannot read the file ({e})") from None


class ChatFormat:
    """Renders conversations for one model and tokenizes them the way llama.cpp does.

    `origin` names the model in messages (usually its path)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str | None,
        *,
        variables: Mapping[str, Any] | None = None,
        origin: str = "the model",
    ):
        variables = dict(variables or {})
        clash = sorted(RESERVED_VARIABLES & variables.keys())
        if clash:
            raise ConfigError(f"template_variables: {', '.join(clash)} is set by retrograd and cannot be overridden")
        self.tokenizer = tokenizer
        self.source = template
        self.variables = variables
        self.origin = origin
        self.bos_token = _token_text(tokenizer, tokenizer.bos_id)
        self.eos_token = _token_text(tokenizer, tokenizer.eos_id)
        self._pieces: dict[int, bytes] = {}

    def require_template(self, data: Path) -> None:
        if self.source is None:
            raise DataError(
                f"{data}: chat data needs a chat template and {self.origin} has none (no tokenizer.chat_template "
                f"in its GGUF); name one explicitly (built-in: {', '.join(CHAT_TEMPLATES)}, or a Jinja file); "
                "plain-text SFT data needs none"
            )

    @cached_property
    def _template(self) -> jinja2.Template:
        assert self.source is not None, "require_template() first"
        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = PINNED_NOW.strftime
        try:
            return env.compile_template(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(
                f"{self.origin}: the chat template does not compile (line {e.lineno}: {_one_line(e.message)})"
            ) from None
        except RecursionError:
            raise DataError(f"{self.origin}: the chat template does not compile (nested too deeply)") from None
        except BudgetExceeded as e:
            raise TemplateBudgetError(f"{self.origin}: the chat template is refused: {e}") from None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        where: str,
    ) -> str:
        template = self._template  # compile errors are the template's, not this conversation's
        context = self.variables | {
            "messages": messages,
            "tools": tools or None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            return bounded_jinja.render(template, context)
        except BudgetExceeded as e:
            raise TemplateBudgetError(f"{where}: the chat template of {self.origin} exceeds its budget: {e}") from None
        except RecursionError:
            raise TemplateBudgetError(
                f"{where}: the chat template of {self.origin} exceeds its budget: recursion deeper than Python allows"
            ) from None
        except _TemplateRefusal as e:
            raise DataError(
                f"{where}: the chat template of {self.origin} refuses this conversation: {_one_line(str(e))}"
            ) from None
        except Exception as e:  # noqa: BLE001 (a template bug meeting this data: TypeError, SecurityError, ...)
            raise DataError(
                f"{where}: the chat template of {self.origin} fails on this conversation ({_one_line(str(e))})"
            ) from None

    def tokenize(self, text: str, where: str) -> tuple[list[int], list[int]]:
        """Token ids of the rendered `text` (special-token text becomes special ids; a BOS is
        added only where the model adds one and the template did not write it), and the
        byte offset in `text` where each token starts (-1 for an added BOS).

        Refuses text whose token pieces do not spell it back, since the loss mask is placed
        by those offsets."""
        add_bos = self.tokenizer.add_bos and not (self.bos_token and text.startswith(self.bos_token))
        ids = self.tokenizer.encode(text, add_bos=add_bos, special=True)
        n_added = int(add_bos)
        pieces = [self.piece(token) for token in ids[n_added:]]
        starts, offset = [-1] * n_added, 0
        for piece in pieces:
            starts.append(offset)
            offset += len(piece)
        spelled, expected = b"".join(pieces), text.encode("utf-8")
        if spelled != expected:
            differ = next(
                (i for i, (a, b) in enumerate(zip(spelled, expected)) if a != b), min(len(spelled), len(expected))
            )
            raise DataError(
                f"{where}: llama.cpp's tokens of the rendered conversation do not spell it back (they differ from byte "
                f"{differ}), so the loss mask cannot be placed"
            )
        return ids, starts

    def piece(self, token: int) -> bytes:
        if token not in self._pieces:
            self._pieces[token] = self.tokenizer.piece(token)
        return self._pieces[token]

    @cached_property
    def native_tools(self) -> bool:
        """Whether the template itself renders a catalogue, a structured call and a tool
        observation (probed once with sentinels); otherwise tools/tools.py's convention is used."""
        tool = {"type": "function", "function": {"name": "probe_fn", "description": PROBE_CATALOGUE, "parameters": {}}}
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "probe_fn", "arguments": {"q": PROBE_ARGUMENT}},
        }
        messages = [
            {"role": "user", "content": "probe"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": PROBE_OBSERVATION, "tool_call_id": "call_0", "name": "probe_fn"},
        ]
        try:
            text = self.render(messages, tools=[tool], where="tool probe")
        except TemplateBudgetError:
            raise
        except DataError:
            return False
        return all(s in text for s in (PROBE_CATALOGUE, PROBE_ARGUMENT, PROBE_OBSERVATION))


class _TemplateRefusal(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRefusal(message)


def _one_line(text: str) -> str:
    """A template's own message (it may span lines, or be long) as part of one error line."""
    text = " ".join(text.split())
    return text if len(text) <= MAX_QUOTED else text[:MAX_QUOTED] + "..."


def _token_text(tokenizer: Tokenizer, token: int | None) -> str:
    return "" if token is None else tokenizer.piece(token).decode("utf-8", errors="replace")
