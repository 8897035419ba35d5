"""Chat templates come inside downloaded GGUF files, so they run with a budget: a hostile
one is refused with one line naming the GGUF and the limit, within about a second and
in little memory (also through the CLI), while real templates render exactly as in
Jinja's plain immutable sandbox."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc

import gguf_factory
import pytest
from chats import write_chat
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_data import TOOL_TEMPLATE

from retrograd.data import bounded_jinja
from retrograd.data.template import CHAT_TEMPLATES, PINNED_NOW, ChatFormat, TemplateBudgetError
from retrograd.errors import DataError
from retrograd.gguf.file import GGUFFile
from retrograd.gguf.spec import read_spec
from retrograd.model.tokenizer import Tokenizer

ORIGIN = "/models/downloaded.gguf"
HI = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
A_LOT = "x" * 1000

# name -> (template, the limit its refusal names, whether it is about size: memory is measured)
HOSTILE = {
    "repeat": ("{{ 'a' * 20000000 }}", "a value longer than 4000000 characters", True),
    "power": ("{{ 2 ** 100000 }}", "a number of more than 4096 bits", True),
    "squaring": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
                 "a number of more than 4096 bits", True),
    "huge range": ("{% for i in range(100000000) %}x{% endfor %}", "range() of more than 100000 items", True),
    "nested huge ranges": ("{% for i in range(10**6) %}{% for j in range(10**6) %}{% endfor %}{% endfor %}",
                           "range() of more than 100000 items", True),
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "more than 200000 steps", False),
    "loop over a long string": ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
                                "more than 200000 steps", False),
    "recursive macro": ("{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}", "macro calls nested deeper than 100", False),
    "branching macro": ("{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(60) }}",
                        "more than 200000 steps", False),
    "output by a loop": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
                         "output longer than 4000000 characters", True),
    "text kept by a loop": ("{% set t %}{% for i in range(100000) %}" + A_LOT + "{% endfor %}{% endset %}{{ t|length }}",
                            "more than 64000000 characters of text made", True),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "a value longer than 4000000 characters", True),
    "shared references": (("{% set ns = namespace(l=['abc']) %}{% for i in range(60) %}{% set ns.l = [ns.l, ns.l] %}"
                           "{% endfor %}{{ ns.l }}"), "a value longer than 4000000 characters", True),
    "padding": ("{{ 'a'.ljust(10**9) }}", "a value longer than 4000000 characters", True),
    "center": ("{{ 'a' | center(10**9) }}", "a value longer than 4000000 characters", True),
    "printf width": ("{{ '%1000000000s' % 'a' }}", "a value longer than 4000000 characters", True),
    "format width": ("{{ '{:>{}}'.format('a', 10**9) }}", "a value longer than 4000000 characters", True),
    "replace": ("{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}", "a value longer than 4000000 characters", True),
    "join": ("{% set s = 'a' * 1000000 %}{{ (s, s, s, s, s) | join(s) }}", "a value longer than 4000000 characters", True),
    "indent": ("{{ ('\\n' * 1000000) | indent(1000) }}", "a value longer than 4000000 characters", True),
    "fill": ("{{ [1] | batch(10**9, 0) | list }}", "a value longer than 4000000 characters", True),
    "tojson indent": ("{{ [1] | tojson(indent=10**6) }}", "a tojson indent wider than 64", True),
}


@pytest.fixture(scope="module")
def smol_tok(smollm2) -> Tokenizer:
    return Tokenizer(smollm2)


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_refused_with_one_line(smol_tok, name):
    source, limit, sized = HOSTILE[name]
    chat = ChatFormat(smol_tok, source, origin=ORIGIN)
    if sized:
        tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(TemplateBudgetError) as refusal:
            chat.render(HI, where="data.jsonl:1")
    finally:
        seconds = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1] if sized else 0
        tracemalloc.stop()
    message = str(refusal.value)
    assert message.startswith(f"data.jsonl:1: the chat template of {ORIGIN} exceeds its budget: ")
    assert limit in message and "\n" not in message
    assert seconds < 3 and peak < 64 << 20, (seconds, peak)


def test_the_clock_is_a_backstop(smol_tok, monkeypatch):
    """Work between two counted steps (here a search through a long string) meets the wall clock."""
    monkeypatch.setattr(bounded_jinja, "MAX_SECONDS", 0.3)
    source = "{% set s = 'a' * 4000000 %}{% for i in range(100000) %}{% if 'b' in s %}{% endif %}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(TemplateBudgetError, match="exceeds its budget: more than 0.3 s$"):
        ChatFormat(smol_tok, source, origin=ORIGIN).render(HI, where="x")
    assert time.monotonic() - started < 2


def test_templates_that_cannot_compile_safely_are_refused(smol_tok):
    too_long = ChatFormat(smol_tok, "x" * (bounded_jinja.MAX_SOURCE + 1), origin=ORIGIN)
    with pytest.raises(TemplateBudgetError, match=f"^{ORIGIN}: the chat template is refused: the template is longer than"):
        too_long.render(HI, where="x")
    deep = ChatFormat(smol_tok, "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", origin=ORIGIN)
    with pytest.raises(DataError, match=rf"^{ORIGIN}: the chat template does not compile \(nested too deeply\)$"):
        deep.render(HI, where="x")


def test_a_template_error_is_quoted_on_one_line(smol_tok):
    chat = ChatFormat(smol_tok, "{{ raise_exception('line one\\nline two ' + 'x' * 5000) }}", origin=ORIGIN)
    with pytest.raises(DataError) as refusal:
        chat.render(HI, where="x")
    message = str(refusal.value)
    assert "refuses this conversation: line one line two xxx" in message and "\n" not in message and len(message) < 500


def test_the_tool_probe_does_not_hide_a_hostile_template(smol_tok):
    with pytest.raises(TemplateBudgetError):
        _ = ChatFormat(smol_tok, "{{ 'a' * 10**9 if tools else '' }}", origin=ORIGIN).native_tools


# ---------------------------------------------------------------- real templates, unchanged

# In the style of Llama 3.1's template: dates, trims, slices, tools in the first user turn, tojson(indent=4).
LLAMA3 = """{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

# In the style of Qwen3's: a namespace, a reversed scan, splits and strips, tool calls and merged tool turns.
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' ~ message.content ~ '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Gemma 3's: the system text opens the first user turn, roles must alternate, `model` for the assistant.
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}{%- set role = "model" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}"""

TOOL = {"type": "function", "function": {"name": "add", "description": "Adds <a> & <b>, é", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CONVERSATIONS = {
    "chat": ([{"role": "user", "content": "  Hi, é中😀 <>&  "}, {"role": "assistant", "content": "Hello!\n"},
              {"role": "user", "content": "2+2?"}], None),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nhm\n</think>\n\nYo"}], None),
    "tools": ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
               {"role": "tool", "content": "5", "tool_call_id": "call_0", "name": "add"},
               {"role": "assistant", "content": "It is 5."}], [TOOL]),
}


def reference_render(source: str, chat: ChatFormat, messages, tools, add_generation_prompt: bool) -> str:
    """What the template rendered to before it had a budget: Jinja's immutable sandbox as is."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(RuntimeError(message))
    env.globals["strftime_now"] = PINNED_NOW.strftime
    return env.from_string(source).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                          bos_token=chat.bos_token, eos_token=chat.eos_token)


def test_real_templates_render_exactly_as_before(smollm2, smol_tok):
    templates = {"smollm2 (its GGUF)": read_spec(GGUFFile(smollm2)).chat_template, **CHAT_TEMPLATES,
                 "tool-aware": TOOL_TEMPLATE, "llama3": LLAMA3, "qwen3": QWEN3, "gemma3": GEMMA3}
    compared = 0
    for name, source in templates.items():
        chat = ChatFormat(smol_tok, source, origin=name)
        for (messages, tools), prompt in [(c, p) for c in CONVERSATIONS.values() for p in (False, True)]:
            try:
                expected = reference_render(source, chat, messages, tools, prompt)
            except RuntimeError:  # the template's raise_exception: ours refuses the same conversation
                with pytest.raises(DataError, match="refuses this conversation"):
                    chat.render(messages, tools=tools, add_generation_prompt=prompt, where=name)
                continue
            assert chat.render(messages, tools=tools, add_generation_prompt=prompt, where=name) == expected, name
            compared += 1
    assert compared >= 30


def test_the_budget_leaves_room_for_long_conversations(smol_tok):
    """2,000 turns with tool calls through the Qwen-style template: well within the steps."""
    _, tools = CONVERSATIONS["tools"]
    messages = [CONVERSATIONS["chat"][0][0]] + CONVERSATIONS["tools"][0][2:4] * 1000
    chat = ChatFormat(smol_tok, QWEN3, origin="qwen3")
    assert chat.render(messages, tools=tools, where="x") == reference_render(QWEN3, chat, messages, tools, False)


# ---------------------------------------------------------------- through the CLI


def test_a_gguf_with_a_hostile_template_stops_training_with_one_line(tmp_path, monkeypatch):
    vocabulary = gguf_factory._vocab()
    monkeypatch.setattr(gguf_factory, "_vocab", lambda: {**vocabulary, "chat_template": "{{ 'a' * 20000000 }}"})
    model = gguf_factory.write_tiny_model(tmp_path / "hostile.gguf", "llama")
    write_chat(tmp_path / "train.jsonl", 4)
    (tmp_path / "run.toml").write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
[output]
path = "out/adapter.gguf"
[training]
ctx = 64
[sft]
data = "train.jsonl"
""")
    r = subprocess.run([sys.executable, "-m", "retrograd", "train", "run.toml"], check=False, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: ") and str(model) in lines[0] and "4000000 characters" in lines[0]
    assert not (tmp_path / "out/adapter.gguf").exists()
