"""Structured outputs and tool calls in `retrograd serve`: replies sampled under a grammar made
from `response_format` or `tools`, checked against llama.cpp's own grammar sampling, validated
with `jsonschema`, and round-tripped through the official `openai` client against a real
server on loopback."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_serve import running, without_key

from retrograd.runtime.llamacpp import C, llama_cpp
from retrograd.sampler.grammar import SchemaError, check_schema
from retrograd.serving.inference import BASE, Inference, Settings
from retrograd.serving.structured import Calls, reply_grammar, split_reply

N_CTX = 1024
JUDGE = {
    "type": "object",
    "properties": {"winner": {"enum": ["a", "b"]}, "reason": {"type": "string", "maxLength": 80}},
    "required": ["winner", "reason"],
}
JUDGE_QUESTION = [
    {
        "role": "user",
        "content": "Question: what is 2 + 2?\nAnswer a: 4\nAnswer b: 5\nWhich answer is better? Reply with JSON.",
    }
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def server():
    with running("--ctx", str(N_CTX), env=without_key()) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(smollm2):
    with Inference(smollm2, n_ctx=N_CTX, n_threads=2) as inference:
        yield inference


def llama_grammar_greedy(model, prompt: list[int], gbnf: str, max_tokens: int) -> str:
    """A fresh llama-cpp-python run under its own grammar sampler, greedy (the context as
    retrograd.serving.inference makes it: f16 KV, flash attention, 64-token prefill pieces)."""
    llm = llama_cpp.Llama(
        model_path=str(model), n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_threads=2, flash_attn=True, verbose=False
    )
    try:
        grammar = llama_cpp.LlamaGrammar.from_string(gbnf, verbose=False)
        out: list[int] = []
        for token in llm.generate(prompt, temp=0.0, grammar=grammar):
            if C.llama_vocab_is_eog(llm._model.vocab, token) or len(out) == max_tokens:
                break
            out.append(token)
        return llm.detokenize(out).decode("utf-8", errors="replace")
    finally:
        llm.close()


def test_greedy_structured_replies_equal_llama_cpp_sampling_under_the_same_grammar(smollm2, local):
    calls = Calls({"get_weather": WEATHER["function"]["parameters"]}, forced=True, parallel=False)
    cases = [
        (local.chat_prompt(JUDGE_QUESTION), reply_grammar(JUDGE, None)),
        (local.chat_prompt(WEATHER_QUESTION, [WEATHER]), reply_grammar(None, calls)),
    ]
    for prompt, gbnf in cases:
        generation = local.generate(BASE, prompt, Settings(max_tokens=120, grammar=gbnf))
        assert generation.run() == llama_grammar_greedy(smollm2, prompt, gbnf, 120)
        assert generation.finish_reason == "stop"  # the grammar completed and the model ended the reply
    assert json.loads(generation.text.removeprefix("<tool_call>").removesuffix("</tool_call>"))["name"] == "get_weather"


def test_every_seeded_judge_reply_validates_under_its_schema(server):
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": JUDGE, "strict": True}}
    texts = set()
    for seed in range(8):
        body = {
            "model": "base",
            "messages": JUDGE_QUESTION,
            "temperature": 1.0,
            "seed": seed,
            "response_format": response_format,
        }
        reply = httpx.post(f"{server}/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert reply["finish_reason"] == "stop"
        jsonschema.validate(json.loads(reply["message"]["content"]), JUDGE)
        texts.add(reply["message"]["content"])
    assert len(texts) > 1  # sampled, not one forced string
    unconstrained = {"model": "base", "messages": JUDGE_QUESTION, "temperature": 0, "max_tokens": 40}
    with pytest.raises(ValueError):  # without the grammar the model answers in prose
        json.loads(
            httpx.post(f"{server}/chat/completions", json=unconstrained, timeout=120).json()["choices"][0]["message"][
                "content"
            ]
        )


def test_json_object_mode_on_completions_and_a_stream_equal_to_the_whole_reply(server):
    body = {
        "model": "base",
        "prompt": 'People as JSON:\n{"name": "Ada", "age": 36}\n',
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    choice = httpx.post(f"{server}/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["text"]), dict)
    chat = {
        "model": "base",
        "messages": JUDGE_QUESTION,
        "temperature": 0.8,
        "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": JUDGE}},
    }
    whole = httpx.post(f"{server}/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"]["content"]
    pieces = []
    with httpx.stream("POST", f"{server}/chat/completions", json=chat | {"stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                pieces += [c["delta"].get("content") or "" for c in choices]
    assert len([p for p in pieces if p]) > 3 and "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), JUDGE)


UNENFORCEABLE = [
    ({"type": "integer", "minimum": 3}, "`minimum`"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "`not`"),
    ({"allOf": [{"type": "object"}]}, "`allOf`"),
    ({"type": "string", "format": "email"}, 'format "email"'),
    ({"type": "string", "pattern": "[a-z]+"}, "anchored"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, '`required` names "b"'),
    ({"type": "string", "maxLength": 10**6}, "`maxLength`"),
    ({"type": "array", "maxItems": 3}, "`maxItems`"),
    ({"$ref": "https://example.com/schema.json"}, "`$ref`"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}}, "`if`"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x", "type": "string"}}}, "beside `$ref`"),
    ({"$ref": "#/$defs/missing"}, "names no definition"),
    ({"type": "string", "pattern": "^[a-z]{0,30000}$"}, "a repetition bound over 1000"),  # would overflow llama.cpp's parser
    ({"type": "string", "pattern": "^.*$"}, "`.` is not supported"),  # would match quotes inside the JSON string
    ({"type": "string", "pattern": "^[ -~]+$"}, "holds a quote, backslash or control"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}, "`additionalProperties`"),
    ({"const": "C:\\dir"}, "cannot spell"),
    ({"type": "string", "enum": ["a", 1]}, "is not of type 'string'"),
    ({"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 2}, "nothing satisfies it"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "`oneOf`"),
    ({"enum": list(range(600))}, "`enum` must be a list of 1 to 512"),
]


@pytest.mark.parametrize("schema, named", UNENFORCEABLE, ids=[case[1] for case in UNENFORCEABLE])
def test_a_schema_that_cannot_be_enforced_is_refused_by_name(server, schema, named):
    body = {
        "model": "base",
        "messages": JUDGE_QUESTION,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    response = httpx.post(f"{server}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format" and named in error["message"], error
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}}}
    body = {"model": "base", "messages": JUDGE_QUESTION, "tools": [tool], "tool_choice": "required"}
    error = httpx.post(f"{server}/chat/completions", json=body, timeout=60).json()["error"]
    assert error["param"] == "tools" and named in error["message"] and error["message"].startswith("tools (f)")
    if len(json.dumps(schema)) < 200:  # (a long one does not fit the prompt)
        body["tool_choice"] = "auto"  # sampled freely: nothing to enforce, so nothing refused
        assert httpx.post(f"{server}/chat/completions", json=body | {"max_tokens": 2}, timeout=60).status_code == 200


def test_schemas_with_definitions_recursion_and_unions_are_enforced(local):
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 12},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["label", "children"],
            }
        },
        "type": "object",
        "properties": {
            "root": {"$ref": "#/$defs/node"},
            "size": {"type": ["integer", "null"]},
            "when": {"type": "string", "format": "date"},
        },
        "required": ["root", "size", "when"],
    }
    check_schema(tree, "tree")
    prompt = local.chat_prompt([{"role": "user", "content": "Describe a small family tree as JSON."}])
    for seed in range(3):
        generation = local.generate(
            BASE, prompt, Settings(max_tokens=200, temperature=1.0, seed=seed, grammar=reply_grammar(tree, None))
        )
        generation.run()
        if generation.finish_reason == "stop":  # a deep tree may run out of tokens; what ends is valid
            jsonschema.validate(json.loads(generation.text), tree)
    with pytest.raises(SchemaError, match="nested more than 32 deep"):
        deep: dict = {"type": "string"}
        for _ in range(5000):
            deep = {"type": "array", "items": deep}
        check_schema(deep, "deep")


def test_the_openai_client_round_trips_a_tool_call(client, local):
    first = client.chat.completions.create(
        model="base",
        messages=WEATHER_QUESTION,
        tools=[WEATHER, ADD],
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"} and arguments["unit"] in "CF"
    history = [
        *WEATHER_QUESTION,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    second = client.chat.completions.create(
        model="base", messages=history, tools=[WEATHER, ADD], temperature=0, max_tokens=30, tool_choice="none"
    ).choices[0]
    assert second.message.tool_calls is None and second.message.content
    # what the model read: the catalogue, its own call and the observation, as SFT tool records render them
    rendered = local.chat.tokenizer.decode(
        local.chat_prompt(
            [
                *WEATHER_QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
            ],
            [WEATHER, ADD],
        )
    )
    assert '"name": "add"' in rendered and '"name": "get_weather"' in rendered
    assert "<tool_call>" in rendered and "<tool_response>\nsunny, 21 degrees\n</tool_response>" in rendered


@pytest.mark.parametrize("parallel, max_tokens, finished", [(False, None, "tool_calls"), (True, 100, "length")])
def test_required_tool_calls_stream_as_openai_deltas(client, parallel, max_tokens, finished):
    """One call; or, in parallel, calls until the budget (a small model repeats them): the
    complete ones arrive, the cut one does not, and the finish reason says so."""
    stream = client.chat.completions.create(
        model="base",
        messages=WEATHER_QUESTION,
        tools=[WEATHER, ADD],
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == finished and calls and (parallel or len(calls) == 1)
    for entry in calls.values():
        schema = {"get_weather": WEATHER, "add": ADD}[entry["name"]]["function"]["parameters"]
        jsonschema.validate(json.loads(entry["arguments"]), schema)


def test_a_reply_is_split_into_content_and_calls_only_where_the_markup_parses():
    calls = Calls({"add": {}, "get_weather": {}})
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
    )
    content, tool_calls = split_reply(text, calls)
    assert content == "Let me add."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert len({c["id"] for c in tool_calls}) == 2
    assert split_reply(text + "\nDone.", calls)[0] == "Let me add.\nDone."  # prose after the calls is content too
    cut = split_reply(text + '\n<tool_call>\n{"name": "add", "argu', calls)  # a last call cut by the token budget
    assert cut[0] == "Let me add." and len(cut[1]) == 2
    for kept in (
        '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',  # malformed
        '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>',  # not offered
        "no markup at all",
    ):
        assert split_reply(kept, calls) == (kept, [])
    assert split_reply(text, Calls({"add": {}}, parsed=False)) == (text, [])  # tool_choice "none"


BAD_TOOL_REQUESTS = [
    (
        "named tool not offered",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
        "tool_choice",
    ),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("two tools of one name", {"tools": [WEATHER, WEATHER]}, "tools"),
    (
        "bad function name",
        {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
        "tools.0.function.name",
    ),
    (
        "answer to no call",
        {
            "tools": [WEATHER],
            "messages": [*WEATHER_QUESTION, {"role": "tool", "tool_call_id": "x", "content": "sunny"}],
        },
        "messages",
    ),
]


@pytest.mark.parametrize(
    "extra, param", [case[1:] for case in BAD_TOOL_REQUESTS], ids=[c[0] for c in BAD_TOOL_REQUESTS]
)
def test_malformed_tool_requests_are_400_naming_the_parameter(server, extra, param):
    body = {"model": "base", "messages": WEATHER_QUESTION} | extra
    response = httpx.post(f"{server}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param, response.json()
