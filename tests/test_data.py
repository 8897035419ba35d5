"""SFT data and rollout prompts against the real SmolLM2 and Gemma-3 tokenizers: the loss
mask is checked token by token against hand-written renders of each conversation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from retrograd.data.prompts import load_prompts
from retrograd.data.sft import load_sft
from retrograd.data.template import CHAT_TEMPLATES, ChatFormat, resolve_chat_template
from retrograd.errors import ConfigError, DataError
from retrograd.model.tokenizer import Tokenizer
from retrograd.runtime.llamacpp import llama_cpp

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def gguf_chat_template(path: Path) -> str | None:
    """tokenizer.chat_template as llama.cpp reads it (faster than parsing the whole GGUF)."""
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return llm.metadata.get("tokenizer.chat_template")
    finally:
        llm.close()


@pytest.fixture(scope="module")
def smol_tok(smollm2) -> Tokenizer:
    return Tokenizer(smollm2)


@pytest.fixture(scope="module")
def smol(smollm2, smol_tok) -> ChatFormat:
    return ChatFormat(smol_tok, gguf_chat_template(smollm2), origin=str(smollm2))


@pytest.fixture(scope="module")
def gemma_tok(gemma3) -> Tokenizer:
    return Tokenizer(gemma3)


def write_jsonl(path: Path, *records) -> Path:
    """Records are dicts (dumped) or raw strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def runs(tok: Tokenizer, example) -> list[tuple[bool, str]]:
    """The example as maximal runs of equally-masked tokens: [(trained, decoded text), ...]."""
    out: list[tuple[bool, list[int]]] = []
    for token, trained in zip(example.ids, example.mask):
        if out and out[-1][0] == trained:
            out[-1][1].append(token)
        else:
            out.append((trained, [token]))
    return [(trained, tok.decode(ids)) for trained, ids in out]


def chat(*turns: tuple[str, str], **extra) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns], **extra}


# --- chat SFT -----------------------------------------------------------------------------


def test_single_turn_trains_only_the_answer_and_its_end_marker(tmp_path, smol, smol_tok):
    data = load_sft(
        write_jsonl(tmp_path / "d.jsonl", chat(("user", "Hi"), ("assistant", "Hello there!"))), smol, ctx=512
    )
    (example,) = data.examples
    head = SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert example.ids == tuple(smol_tok.encode(head + "Hello there!<|im_end|>\n"))  # llama.cpp's own boundaries
    assert runs(smol_tok, example) == [(False, head), (True, "Hello there!<|im_end|>"), (False, "\n")]
    assert example.source == f"{tmp_path / 'd.jsonl'}:1" and data.format == "chat" and data.dropped == ()


def test_multi_turn_with_system_prompt(tmp_path, smol, smol_tok):
    record = chat(
        ("system", "Be brief."),
        ("user", "2+2?"),
        ("assistant", "4"),
        ("user", "And 3+3?"),
        ("assistant", "6, of course."),
    )
    (example,) = load_sft(write_jsonl(tmp_path / "d.jsonl", record), smol, ctx=512).examples
    assert runs(smol_tok, example) == [
        (False, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
        (True, "4<|im_end|>"),
        (False, "\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"),
        (True, "6, of course.<|im_end|>"),
        (False, "\n"),
    ]
    assert example.n_trained == len(smol_tok.encode("4<|im_end|>6, of course.<|im_end|>"))


def test_non_ascii_content_keeps_exact_boundaries(tmp_path, smol, smol_tok):
    answer = "Ça coûte 5 € — 日本語 🎉"
    (example,) = load_sft(
        write_jsonl(tmp_path / "d.jsonl", chat(("user", "Prix ?"), ("assistant", answer))), smol, ctx=512
    ).examples
    assert [text for trained, text in runs(smol_tok, example) if trained] == [answer + "<|im_end|>"]


def test_records_longer_than_ctx_are_dropped_and_listed(tmp_path, smol):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        chat(("user", "Hi"), ("assistant", "Yo")),
        chat(("user", "Hi"), ("assistant", "word " * 80)),
    )
    data = load_sft(path, smol, ctx=64)
    assert [e.source for e in data.examples] == [f"{path}:1"] and data.dropped == (f"{path}:2",)
    assert all(len(e.ids) <= 64 for e in data.examples)


def test_every_record_too_long_is_refused(tmp_path, smol):
    path = write_jsonl(tmp_path / "d.jsonl", chat(("user", "Hi"), ("assistant", "Hello")))
    with pytest.raises(
        DataError, match=r"every record is longer than ctx = 8 tokens \(1 dropped, the shortest has \d+\)"
    ):
        load_sft(path, smol, ctx=8)


def test_loading_is_deterministic(tmp_path, smol):
    path = write_jsonl(tmp_path / "d.jsonl", *(chat(("user", f"q{i}"), ("assistant", f"a{i}")) for i in range(5)))
    assert load_sft(path, smol, ctx=512) == load_sft(path, smol, ctx=512)


# --- tool records -------------------------------------------------------------------------

ADD_TOOL = {
    "type": "function",
    "function": {"name": "add", "description": "Add two integers.", "parameters": {"type": "object"}},
}


def tool_record(**extra) -> dict:
    return {
        "tools": [ADD_TOOL],
        "messages": [
            {"role": "user", "content": "What is 2+3 and 4+5?"},
            {
                "role": "assistant",
                "content": "Adding.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
                    {"id": "second", "type": "function", "function": {"name": "add", "arguments": {"a": 4, "b": 5}}},
                ],
            },
            {"role": "tool", "tool_call_id": "second", "content": "9"},
            {"role": "tool", "content": "overflow", "is_error": True},
            {"role": "assistant", "content": "4+5 is 9; the other call failed."},
        ],
        **extra,
    }


def test_tool_record_without_native_support_uses_hermes_convention(tmp_path, smol, smol_tok):
    """SmolLM2's template renders no catalogue, so the catalogue joins the system prompt,
    calls become <tool_call> blocks and observations one user turn."""
    assert not smol.native_tools
    (example,) = load_sft(write_jsonl(tmp_path / "t.jsonl", tool_record()), smol, ctx=1024).examples
    parts = runs(smol_tok, example)
    assert [trained for trained, _ in parts] == [False, True, False, True, False]
    context = parts[0][1]
    assert context.startswith("<|im_start|>system\n# Tools\n") and json.dumps(ADD_TOOL) in context
    assert context.endswith("<|im_start|>user\nWhat is 2+3 and 4+5?<|im_end|>\n<|im_start|>assistant\n")
    assert parts[1][1] == (
        'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>'
    )
    assert parts[2][1] == (
        "\n<|im_start|>user\n<tool_response>\n9\n</tool_response>\n<tool_response>\nERROR: overflow\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert parts[3][1] == "4+5 is 9; the other call failed.<|im_end|>"


def test_raw_assistant_turn_is_trained_as_written(tmp_path, smol, smol_tok):
    """Also: a flat tool definition, the catalogue joining an existing system prompt, and a
    user message right after an observation."""
    raw = 'Sure.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    record = {
        "tools": [{"name": "add", "parameters": {}}],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "raw": True, "content": raw},
            {"role": "tool", "content": "2"},
            {"role": "user", "content": "Thanks, and?"},
            {"role": "assistant", "content": "It is 2."},
        ],
    }
    (example,) = load_sft(write_jsonl(tmp_path / "t.jsonl", record), smol, ctx=1024).examples
    parts = runs(smol_tok, example)
    assert [text for trained, text in parts if trained] == [raw + "<|im_end|>", "It is 2.<|im_end|>"]
    assert (
        parts[0][1].startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
        and '{"name": "add", "parameters": {}}' in parts[0][1]
    )
    assert parts[2][1] == (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks, and?<|im_end|>\n<|im_start|>assistant\n"
    )


# A small tool-aware template in the style of Qwen's: catalogue in a system block, calls as
# <call> markup after the content, observations in a `tool` turn.
TOOL_TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>system\\nTools:\\n' }}{%- for t in tools -%}{{ t | tojson + '\\n' }}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] -%}{{ '<call>' + c.function.name + ' ' + c.function.arguments | tojson + '</call>' }}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_tool_record_through_a_tool_aware_template(tmp_path, smol_tok):
    native = ChatFormat(smol_tok, TOOL_TEMPLATE)
    assert native.native_tools
    (example,) = load_sft(write_jsonl(tmp_path / "t.jsonl", tool_record()), native, ctx=1024).examples
    parts = runs(smol_tok, example)
    head = f"<|im_start|>system\nTools:\n{json.dumps(ADD_TOOL)}\n<|im_end|>\n"
    assert parts[0] == (False, head + "<|im_start|>user\nWhat is 2+3 and 4+5?<|im_end|>\n<|im_start|>assistant\n")
    assert parts[1] == (True, 'Adding.<call>add {"a": 2, "b": 3}</call><call>add {"a": 4, "b": 5}</call><|im_end|>')
    assert parts[2] == (
        False,
        "\n<|im_start|>tool\n9<|im_end|>\n<|im_start|>tool\nERROR: overflow<|im_end|>\n<|im_start|>assistant\n",
    )
    assert parts[3:] == [(True, "4+5 is 9; the other call failed.<|im_end|>"), (False, "\n")]


def test_a_template_that_drops_calls_is_refused(tmp_path, smol_tok):
    """Passes the probe for one call, but renders only the first call of a turn."""
    first_call_only = TOOL_TEMPLATE.replace("m.tool_calls or []", "(m.tool_calls or [])[:1]")
    record = tool_record()
    record["tools"].append({"name": "mul", "parameters": {}})
    record["messages"][1]["tool_calls"][1]["function"]["name"] = "mul"
    path = write_jsonl(tmp_path / "t.jsonl", record)
    with pytest.raises(DataError, match=rf"^{path}:1: assistant turn 1: the chat template dropped the call\(s\) mul$"):
        load_sft(path, ChatFormat(smol_tok, first_call_only), ctx=1024)


# --- templates ----------------------------------------------------------------------------


def test_template_helpers_and_variables(smol_tok):
    source = (
        "{{ bos_token }}|{{ strftime_now('%Y-%m-%d') }}|{{ tools | tojson }}|{{ persona }}|"
        "{%- for m in messages -%}{%- if loop.index > 1 -%}{% break %}{%- endif -%}{{ m.content }}{%- endfor -%}"
        "{{ '<|im_start|>assistant\\n' if add_generation_prompt }}"
    )
    fmt = ChatFormat(smol_tok, source, variables={"persona": "Zoë"})
    text = fmt.render(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        tools=[{"name": "é<&>"}],
        add_generation_prompt=True,
        where="x",
    )
    assert text == '<|im_start|>|2025-01-01|[{"name": "é<&>"}]|Zoë|a<|im_start|>assistant\n'


def test_raise_exception_names_the_line(tmp_path, smol_tok):
    strict = "{% if messages[0].role == 'user' %}{{ raise_exception('no user-first chats') }}{% endif %}"
    path = write_jsonl(tmp_path / "d.jsonl", chat(("user", "Hi"), ("assistant", "Yo")))
    with pytest.raises(
        DataError, match=rf"^{path}:1: the chat template of the model refuses this conversation: no user-first chats$"
    ):
        load_sft(path, ChatFormat(smol_tok, strict), ctx=512)


def test_templates_run_sandboxed(smol_tok):
    with pytest.raises(DataError, match="fails on this conversation"):
        ChatFormat(smol_tok, "{{ messages.append(1) }}").render([], where="x")
    with pytest.raises(DataError, match="does not compile"):
        ChatFormat(smol_tok, "{% for %}").render([], where="x")


def test_template_that_rewrites_history_is_refused(tmp_path, smol_tok):
    """Like reasoning templates that hide earlier turns' thoughts: earlier renders are no
    prefix of later ones, so the turn cannot be located."""
    hides_history = CHAT_TEMPLATES["chatml"].replace(
        "message['content']", "(message['content'] if loop.last or message['role'] != 'assistant' else '...')"
    )
    assert hides_history != CHAT_TEMPLATES["chatml"]
    path = write_jsonl(tmp_path / "d.jsonl", chat(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")))
    with pytest.raises(
        DataError, match=rf"^{path}:1: assistant turn 1: .* not render the earlier turns as an exact prefix"
    ):
        load_sft(path, ChatFormat(smol_tok, hides_history), ctx=512)


def test_turns_without_end_of_generation_token_are_refused(tmp_path, smol_tok):
    plain = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n\\n' }}{% endfor %}{{ 'assistant: ' if add_generation_prompt }}"
    path = write_jsonl(tmp_path / "d.jsonl", chat(("user", "a"), ("assistant", "b")))
    with pytest.raises(DataError, match=rf"^{path}:1: assistant turn 1: .* without an end-of-generation token"):
        load_sft(path, ChatFormat(smol_tok, plain), ctx=512)


class _LossyPieces(Tokenizer):
    """The real tokenizer, but its pieces lose the leading space (as SentencePiece pieces
    can): nothing to place a mask by."""

    def piece(self, token):
        return super().piece(token).lstrip(b" ")


def test_pieces_that_do_not_spell_the_text_are_refused(tmp_path, smollm2, smol):
    lossy = ChatFormat(_LossyPieces(smollm2), smol.source)
    path = write_jsonl(tmp_path / "d.jsonl", chat(("user", "Hi"), ("assistant", "Hello there")))
    with pytest.raises(DataError, match=rf"^{path}:1: llama.cpp's tokens .* do not spell it back"):
        load_sft(path, lossy, ctx=512)


def test_reserved_template_variables_are_refused(smol_tok):
    with pytest.raises(ConfigError, match="template_variables: messages is set by retrograd"):
        ChatFormat(smol_tok, CHAT_TEMPLATES["chatml"], variables={"messages": []})


def test_resolving_a_template(tmp_path):
    assert resolve_chat_template("gguf's", None) == "gguf's"
    assert resolve_chat_template(None, "gemma") == CHAT_TEMPLATES["gemma"]
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert resolve_chat_template("gguf's", str(tmp_path / "t.jinja")) == "{{ messages }}"
    with pytest.raises(ConfigError, match="'llama9': neither a built-in .* nor a file"):
        resolve_chat_template(None, "llama9")


# --- Gemma-3 (no chat template in its GGUF) -------------------------------------------------


def test_gemma_has_no_template_and_chat_data_is_refused_clearly(tmp_path, gemma3, gemma_tok):
    assert gguf_chat_template(gemma3) is None
    fmt = ChatFormat(gemma_tok, None, origin=str(gemma3))
    for path, load in [
        (
            write_jsonl(tmp_path / "d.jsonl", chat(("user", "Hi"), ("assistant", "Yo"))),
            lambda p: load_sft(p, fmt, ctx=512),
        ),
        (write_jsonl(tmp_path / "p.jsonl", chat(("user", "Hi"))), lambda p: load_prompts(p, fmt)),
    ]:
        expected = rf"^{re.escape(str(path))}: chat data needs a chat template and {re.escape(str(gemma3))} has none .*built-in: chatml, gemma"
        with pytest.raises(DataError, match=expected):
            load(path)


def test_gemma_plain_text_windows(tmp_path, gemma_tok, ordinary_text):
    """Gemma adds a BOS, so the stream starts with it (and it is never a target)."""
    path = tmp_path / "notes.md"
    path.write_text(ordinary_text)
    data = load_sft(path, ChatFormat(gemma_tok, None), ctx=100)
    stream = gemma_tok.encode(ordinary_text)
    assert stream[0] == gemma_tok.bos_id and gemma_tok.decode(stream[1:]) == ordinary_text
    assert_windows_cover(data, stream, ctx=100)


def test_gemma_with_its_builtin_template(tmp_path, gemma_tok):
    fmt = ChatFormat(gemma_tok, resolve_chat_template(None, "gemma"))
    record = chat(
        ("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye"), ("assistant", "Bye!")
    )
    (example,) = load_sft(write_jsonl(tmp_path / "d.jsonl", record), fmt, ctx=512).examples
    assert example.ids.count(gemma_tok.bos_id) == 1 and example.ids[0] == gemma_tok.bos_id  # the template wrote it
    assert runs(gemma_tok, example) == [
        (False, "<bos><start_of_turn>user\nBe kind.\n\nHi<end_of_turn>\n<start_of_turn>model\n"),
        (True, "Hello!<end_of_turn>"),
        (False, "\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"),
        (True, "Bye!<end_of_turn>"),
        (False, "\n"),
    ]


# --- plain text ---------------------------------------------------------------------------


def assert_windows_cover(data, stream: list[int], ctx: int) -> None:
    """Windows overlap by one token and together train every token but the first, once."""
    assert data.format == "text" and data.dropped == ()
    rebuilt = list(data.examples[0].ids) + [t for e in data.examples[1:] for t in e.ids[1:]]
    assert rebuilt == stream
    assert all(len(e.ids) <= ctx and e.mask[0] is False and all(e.mask[1:]) for e in data.examples)
    assert sum(e.n_trained for e in data.examples) == len(stream) - 1
    assert all(len(e.ids) == ctx for e in data.examples[:-1])


def test_text_file_is_one_stream_cut_into_windows(tmp_path, smol_tok, smol, ordinary_text):
    path = tmp_path / "notes.txt"
    path.write_text(ordinary_text)
    data = load_sft(path, smol, ctx=64)
    assert_windows_cover(data, smol_tok.encode(ordinary_text), ctx=64)
    assert data.examples[1].source == f"{path}#1"


@pytest.mark.parametrize(
    "name, first_line, declared, expected",
    [
        ("data.dat", '{"messages": []}', None, "chat"),
        ("data.dat", "Once upon a time", None, "text"),
        ("data.jsonl", "Once upon a time", "text", "text"),
        ("data.txt", '{"looks": "like json"}', None, "text"),
    ],
)
def test_format_from_name_content_or_declaration(tmp_path, smol, name, first_line, declared, expected):
    path = tmp_path / name
    record = json.dumps(chat(("user", "Hi"), ("assistant", "Yo")))
    path.write_text(f"\n{record}\n" if expected == "chat" else f"\n{first_line}\nmore words here\n")
    assert load_sft(path, smol, ctx=64, data_format=declared).format == expected


def test_unknown_data_format_is_refused(tmp_path, smol):
    (tmp_path / "d.txt").write_text("hello world")
    with pytest.raises(ConfigError, match="data_format = 'xml': expected one of text, txt, jsonl, json, chat, chat-jsonl, csv, parquet"):
        load_sft(tmp_path / "d.txt", smol, ctx=64, data_format="xml")


# --- errors that name the file and line -------------------------------------------------------

U, A = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {}}}],
}


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": [', r"not valid JSON \(.*\); expected one object per line"),
        ('{"messages": ' + "[" * 5000 + "]" * 5000 + "}", "JSON nested deeper than 32 levels"),
        ('{"messages": [], "messages": []}', "the key 'messages' appears twice in one object"),
        ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone UTF-16 surrogate"),
        ("[1, 2]", "expected a JSON object per line, got list"),
        ({"conversation": []}, 'expected {"messages": .*} \\(chat messages, .*\\); got keys conversation'),
        ({"messages": []}, '"messages" must be a non-empty list'),
        ({"messages": [U, {"role": "narrator", "content": "x"}]}, "message 2: unknown role 'narrator'"),
        ({"messages": [U, {"role": "assistant", "content": "  "}]}, "message 2: empty content"),
        (
            {"messages": [U, {"role": "assistant", "content": ["parts"]}]},
            'message 2: "content" must be a string, got list',
        ),
        ({"messages": [U]}, "no assistant turn"),
        ({"messages": [U, A, A]}, "message 3: two assistant turns in a row"),
        ({"messages": [U, U, A]}, "message 2: two user messages in a row"),
        ({"messages": [A, U]}, "message 1: the conversation starts with an assistant turn"),
        (
            {"messages": [U, {"role": "system", "content": "late"}, A]},
            "message 2: system message after the conversation started",
        ),
        ({"messages": [U, A, {"role": "tool", "content": "5"}]}, "message 3: tool message answers nothing"),
        ({"messages": [U, CALL]}, "tool call\\(s\\) call_0 are never answered"),
        ({"messages": [U, CALL, A]}, "message 3: assistant turn while tool call\\(s\\) call_0 are unanswered"),
        (
            {"messages": [U, CALL, {"role": "tool", "tool_call_id": "x9", "content": "1"}, A]},
            "message 3: tool_call_id 'x9' matches no pending",
        ),
        (
            {"tools": [{"name": "mul"}], "messages": [U, CALL, {"role": "tool", "content": "1"}, A]},
            "message 2: calls 'add', which is not in",
        ),
        (
            {"messages": [U, {"role": "assistant", "raw": True, "content": "<tool_call>{oops}</tool_call>"}]},
            "raw assistant turn: <tool_call> block 1 is not valid JSON",
        ),
        (
            {"messages": [U, dict(CALL, raw=True, content='<tool_call>{"name": "sub", "arguments": {}}</tool_call>')]},
            "differ from its tool_calls",
        ),
    ],
)
def test_malformed_record_names_file_and_line(tmp_path, smol, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", chat(("user", "ok"), ("assistant", "fine")), "", line)
    with pytest.raises(DataError, match=rf"^{path}:3: .*{message}"):
        load_sft(path, smol, ctx=512)


def test_non_utf8_file_names_the_line(tmp_path, smol):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(chat(("user", "a"), ("assistant", "b"))).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=rf"^{path}:2: not UTF-8 text \(byte 0xff at offset \d+\)"):
        load_sft(path, smol, ctx=512)


def test_unreadable_and_empty_files(tmp_path, smol):
    with pytest.raises(DataError, match=rf"^{tmp_path / 'missing.jsonl'}: cannot read"):
        load_sft(tmp_path / "missing.jsonl", smol, ctx=512)
    with pytest.raises(DataError, match=rf"^{tmp_path}: cannot read"):
        load_sft(tmp_path, smol, ctx=512, data_format="text")
    for name in ("empty.jsonl", "empty.txt"):
        (tmp_path / name).write_text("\n  \n")
        with pytest.raises(DataError, match=rf"^{tmp_path / name}: empty dataset"):
            load_sft(tmp_path / name, smol, ctx=512)


# --- rollout prompts ----------------------------------------------------------------------


def test_prompts_render_with_the_generation_prompt(tmp_path, smol, smol_tok):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        chat(("user", "What is 2+2?"), rubric="Exactly 4."),
        chat(("system", "Terse."), ("user", "1+1?"), ("assistant", "2"), ("user", "And 2+2?")),
    )
    first, second = load_prompts(path, smol)
    assert first.ids == tuple(
        smol_tok.encode(SMOL_SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    )
    assert (first.text, first.rubric, first.source) == ("What is 2+2?", "Exactly 4.", f"{path}:1")
    assert smol_tok.decode(list(second.ids)).endswith("<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert (second.text, second.rubric) == ("And 2+2?", None)


@pytest.mark.parametrize(
    "line, message",
    [
        (chat(("user", "a"), ("assistant", "b")), "does not end with a user message \\(the last is assistant\\)"),
        (chat(("user", "a"), rubric=""), '"rubric" must be a non-empty string'),
        ({"tools": [ADD_TOOL], "messages": [U]}, "tools and tool messages belong in SFT tool records"),
        (chat(("user", "a"), ("user", "b")), "message 2: two user messages in a row"),
        (chat(("user", "word " * 100)), "the prompt is \\d+ tokens, more than the 50"),
    ],
)
def test_bad_prompt_lines_name_file_and_line(tmp_path, smol, line, message):
    path = write_jsonl(tmp_path / "p.jsonl", chat(("user", "fine")), line)
    with pytest.raises(DataError, match=rf"^{path}:2: .*{message}"):
        load_prompts(path, smol, max_tokens=50)


def test_held_out_records_may_end_with_their_reference_answer(tmp_path, smol):
    """An evaluation file's record is the question and its known answer: the prompt stops at
    the last user turn and the answer becomes the reference; a training prompt file still
    must end with the user turn."""
    asked = write_jsonl(tmp_path / "asked.jsonl", chat(("system", "Terse."), ("user", "1+1?")),
                        chat(("user", "2+2?")))
    answered = write_jsonl(tmp_path / "answered.jsonl", chat(("system", "Terse."), ("user", "1+1?"), ("assistant", "2")),
                           chat(("user", "2+2?")))
    held_out = load_prompts(answered, smol, evaluation=True)
    expected = load_prompts(asked, smol)
    assert [p.ids for p in held_out] == [p.ids for p in expected] and [p.text for p in held_out] == ["1+1?", "2+2?"]
    assert [p.reference for p in held_out] == ["2", None] and [p.reference for p in expected] == [None, None]
    assert held_out.description == ('answered.jsonl (chat messages, 2 records; 1 with a reference answer, '
                                    'which the reward receives as "reference")')
    assert expected.description == "asked.jsonl (chat messages, 2 records)"
    with pytest.raises(DataError, match=rf"^{answered}:1: does not end with a user message \(the last is assistant\); "
                                        "the model answers the last user turn$"):
        load_prompts(answered, smol)


def test_empty_prompt_file_is_refused(tmp_path, smol):
    (tmp_path / "p.jsonl").write_text("")
    with pytest.raises(DataError, match="empty dataset \\(no prompts\\)"):
        load_prompts(tmp_path / "p.jsonl", smol)
