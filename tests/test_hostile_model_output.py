"""Model output cannot crash a run: whatever an assistant turn holds, parsing it gives tool
calls or an error observation for that trajectory alone, and whatever a tool prints, the
observation is bounded text. Seeded fuzzing through the functions the agent loop uses
(parse_turn, Toolset.call with a sandbox that answers every command with hostile output,
render_text / render_json), plus the agent loop itself on the confirmed crash."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
from test_agent import call, chat, local_pool, rollouts  # noqa: F401  (chat, local_pool: fixtures)

from retrograd.data.files import MAX_JSON_DEPTH, UnsafeJSON, load_json
from retrograd.data.tools import CALL_CLOSE, CALL_OPEN, ERROR_PREFIX, parse_calls
from retrograd.rollouts.agent import parse_turn
from retrograd.rollouts.sandbox import EnvironmentOptions, Limits, open_environment
from retrograd.rollouts.sandbox.base import ExecResult, Sandbox
from retrograd.rollouts.tools import MAX_ERROR_BYTES, ToolCatalog, ToolResult, render_json, render_text

LIMIT = 4096  # max_output_bytes of the fuzzed sandbox
TREE = {"type": "array", "items": {"$ref": "#/$defs/tree"}}
CATALOG = {
    "default": "fuzz",
    "toolset": {"fuzz": {"include": ["python"], "tools": ["reply", "tree"]}},
    "tool": [
        {"id": "reply", "description": "Any arguments; answers in the json protocol.", "input_schema": {"type": "object"},
         "exec": {"argv": ["reply"], "protocol": "json"}},
        {"id": "tree", "description": "A recursive schema: validation follows the arguments down.",
         "input_schema": {"type": "object", "properties": {"tree": {"$ref": "#/$defs/tree"}}, "$defs": {"tree": TREE}},
         "exec": {"argv": ["tree"]}},
    ],
}
NAMES = ["bash", "python", "read_file", "write_file", "edit_file", "list_dir", "grep", "submit", "reply", "tree", "rm_rf"]


class HostileSandbox(Sandbox):
    """Answers every command, whatever it is, with hostile output drawn from `rng`."""

    def __init__(self, rng: random.Random):
        super().__init__(Limits(exec_timeout_secs=1, max_output_bytes=LIMIT))
        self.rng = rng

    def _exec(self, argv, stdin, timeout) -> ExecResult:
        return hostile_result(self.rng)

    def destroy(self) -> None:
        pass


@pytest.fixture(scope="module")
def toolset(tmp_path_factory):
    return ToolCatalog.from_table(CATALOG, tmp_path_factory.mktemp("tools")).toolset()


# ---------------------------------------------------------------- hostile text


def text(rng: random.Random, n: int) -> str:
    """Random characters: ASCII, JSON syntax, controls, accents, emoji, lone surrogates."""
    alphabet = 'ab {}[]":,\\\n\t\x00\x1b\x7féλ中😀\ud800\udfff<>/'
    return "".join(rng.choice(alphabet) for _ in range(n))


def value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return text(rng, rng.randrange(12)).encode("utf-8", "replace").decode()  # no surrogates: valid JSON text
    if kind == 1:
        return rng.choice([0, -1, 2**53 + 1, 10**60, -(10**99)])
    if kind == 2:
        return rng.choice([0.5, -1e308, 1e-320, 3.14])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return "x" * rng.choice([0, 1, 1000, 200_000])
    if kind == 5:
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {text(rng, 3).encode("utf-8", "replace").decode(): value(rng, depth + 1) for _ in range(rng.randrange(4))}


def nested(n: int, open_: str, inner: str, close: str) -> str:
    return open_ * n + inner + close * n


def json_body(rng: random.Random) -> str:
    """What a model might put between the tags: calls well and badly formed."""
    name = json.dumps(rng.choice(NAMES))
    depth = rng.choice([2, MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH + 1, 1000, 100_000])
    candidates = [
        lambda: json.dumps({"name": rng.choice(NAMES), "arguments": value(rng)}),
        lambda: json.dumps({"name": rng.choice(NAMES), "arguments": json.dumps(value(rng))}),  # OpenAI's string form
        lambda: json.dumps({"name": "bash", "arguments": {"command": text(rng, 20)}}),
        lambda: json.dumps({"name": "tree", "arguments": {"tree": json.loads(nested(min(depth, 30), "[", "", "]"))}}),
        lambda: "[" * depth,
        lambda: nested(depth, "[", "1", "]"),
        lambda: '{"name": ' + name + ', "arguments": ' + nested(depth, '{"a": ', "1", "}") + "}",
        lambda: '{"name": ' + name + ', "arguments": {"x": ' + rng.choice(
            ["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "9" * 5000, "1." + "0" * 5000, '"\\ud800"',
             '"\\udfff\\ud800"', '"\\u0000"', '"' + "y" * 1_100_000 + '"', "[" * 40 + "]" * 40]) + "}}",
        lambda: '{"name": "bash", "name": "python", "arguments": {}}',
        lambda: '{"name": ' + rng.choice(["3", "null", "[]", '""', '{"a": 1}', '"\\ud800"']) + ', "arguments": {}}',
        lambda: '{"name": ' + name + ', "arguments": ' + rng.choice(["[]", "5", "null", '"nope"', '"[1]"', '"{"']) + "}",
        lambda: json.dumps({"name": rng.choice(NAMES), "arguments": value(rng)})[: rng.randrange(1, 40)],  # cut short
        lambda: text(rng, rng.randrange(200)),
        lambda: '"' + "\\" * rng.randrange(1, 2000),
        lambda: '["' + "]" * 50_000 + '"',  # brackets inside a string do not nest
    ]
    return rng.choice(candidates)()


def hostile_turn(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        if kind == 0:
            parts.append(text(rng, rng.randrange(300)))
        elif kind <= 3:
            parts.append(CALL_OPEN + "\n" + json_body(rng) + "\n" + CALL_CLOSE)
        elif kind == 4:
            parts.append(rng.choice([CALL_OPEN, CALL_CLOSE, CALL_OPEN * 50, CALL_OPEN + CALL_OPEN + "{}" + CALL_CLOSE])
                         + json_body(rng))
        else:
            parts.append((CALL_OPEN + '{"name": "submit", "arguments": {}}' + CALL_CLOSE) * rng.randrange(1, 30))
    return "\n".join(parts)


def hostile_bytes(rng: random.Random) -> bytes:
    kind = rng.randrange(9)
    if kind == 0:
        return rng.randbytes(rng.randrange(LIMIT))
    if kind == 1:
        return b"\xff\xfe" + "é".encode() + b"\xed\xa0\x80" + b"\xc0\xaf" + "中".encode()[:2]  # invalid, surrogate, cut
    if kind == 2:
        return b"[" * rng.choice([33, 1000, LIMIT])
    if kind == 3:
        return json.dumps({"content": text(rng, 50).encode("utf-8", "replace").decode(),
                           "reward": rng.choice([0.5, 1, -2.5]), "done": rng.random() < 0.5}).encode()
    if kind == 4:
        field = rng.choice(['"reward": NaN', '"reward": Infinity', '"reward": 1e999', '"reward": ' + "9" * 400,
                            '"reward": true', '"reward": "1"', '"content": "\\ud800"', '"content": 3',
                            '"content": "a", "content": "b"', '"score": 1', '"is_error": "yes"', '"done": 1'])
        return ('{"content": "ok", ' + field + "}").encode() if "content" not in field else ("{" + field + "}").encode()
    if kind == 5:
        return bytes(rng.randrange(32) for _ in range(rng.randrange(100)))  # control characters and NULs
    if kind == 6:
        return ('{"content": ' + nested(rng.choice([5, 40, 900]), "[", '"x"', "]") + "}").encode()
    if kind == 7:
        return b"x" * rng.randrange(LIMIT)
    return b""


def hostile_result(rng: random.Random) -> ExecResult:
    stdout, stderr = hostile_bytes(rng), hostile_bytes(rng)
    return ExecResult(exit_code=rng.choice([0, 0, 0, 1, 2, 3, 4, 126, 137]), stdout=stdout[:LIMIT], stderr=stderr[:LIMIT],
                      timed_out=rng.random() < 0.05,
                      truncated=rng.random() < 0.1 or max(len(stdout), len(stderr)) > LIMIT)


# ---------------------------------------------------------------- the checks


def assert_observation(result: ToolResult, limit: int) -> None:
    assert isinstance(result, ToolResult) and isinstance(result.content, str)
    assert len(result.content.encode("utf-8")) <= limit  # encodes: no lone surrogates
    assert result.reward is None or (isinstance(result.reward, float) and math.isfinite(result.reward))
    assert isinstance(result.is_error, bool) and isinstance(result.done, bool) and (result.is_error or not result.broken)


def test_fuzzed_assistant_turns_give_calls_or_an_error_observation(toolset):
    """2,000 seeded turns through parse_turn and Toolset.call, as the agent loop runs them."""
    rng = random.Random(1234)
    sandbox = HostileSandbox(random.Random(99))
    started = time.monotonic()
    outcomes = {"calls": 0, "notes": 0, "silent": 0}
    for _ in range(2000):
        turn = hostile_turn(rng)
        calls, note = parse_turn(turn, first_id=0)
        complete_block = CALL_OPEN in turn and CALL_CLOSE in turn[turn.index(CALL_OPEN):]
        if note is not None:
            assert calls == [] and note.startswith(ERROR_PREFIX) and "\n" not in note and len(note) < 500
            outcomes["notes"] += 1
        else:
            assert calls or not complete_block  # a complete block gives a call or a note, never nothing
            outcomes["calls" if calls else "silent"] += 1
        for call_ in calls[:5]:
            assert isinstance(call_.name, str) and call_.name and isinstance(call_.arguments, dict)
            # what rollouts.jsonl writes: strict JSON, UTF-8
            json.dumps({"name": call_.name, "arguments": call_.arguments}, ensure_ascii=False, allow_nan=False).encode()
            assert_observation(toolset.call(sandbox, call_.name, call_.arguments), max(LIMIT, MAX_ERROR_BYTES))
    assert time.monotonic() - started < 20
    assert min(outcomes.values()) > 50, outcomes  # the generator reaches every outcome


def test_fuzzed_tool_output_gives_bounded_observations():
    rng = random.Random(5678)
    for _ in range(2000):
        result = hostile_result(rng)
        for render in (render_text, render_json):
            observation = render(result, LIMIT, 1.0)
            assert_observation(observation, LIMIT)
            if render is render_json and observation.broken:
                assert observation.content.startswith("tool broke the json protocol: ")


# ---------------------------------------------------------------- each refusal


def test_the_confirmed_crash_is_an_error_observation():
    """1000 `[` raised RecursionError out of the parser and ended the whole run."""
    calls, note = parse_turn(CALL_OPEN + "[" * 1000 + CALL_CLOSE, first_id=3)
    assert calls == [] and note == f"{ERROR_PREFIX}<tool_call> block 1: JSON nested deeper than {MAX_JSON_DEPTH} levels"


@pytest.mark.parametrize("body,reason", [
    ("[" * 100_000, "nested deeper than 32 levels"),
    ('{"a": ' * 33 + "1" + "}" * 33, "nested deeper than 32 levels"),
    ('{"x": NaN}', "NaN is not a JSON number"),
    ('{"x": -Infinity}', "-Infinity is not a JSON number"),
    ('{"x": 1e999}', "the number 1e999 is out of range"),
    ('{"x": ' + "9" * 5000 + "}", "a number longer than 100 characters"),
    ('{"x": 1, "x": 2}', "the key 'x' appears twice in one object"),
    ('{"x": ["\\ud800"]}', "a string holds a lone UTF-16 surrogate"),
    ('{"\\udc00": 1}', "a string holds a lone UTF-16 surrogate"),
    ('"' + "a" * 1_000_001 + '"', "JSON longer than 1000000 characters"),
])
def test_unsafe_json_is_refused_before_or_while_parsing(body, reason):
    with pytest.raises(UnsafeJSON, match=reason.replace("(", r"\(")):
        load_json(body)


def test_what_every_reader_agrees_on_still_parses():
    deep_but_legal = '{"a": ' * 31 + "[]" + "}" * 31
    assert load_json(deep_but_legal) is not None
    assert load_json('{"s": "[[[[{{{{ \\" ]]", "e": "\\ud83d\\ude00", "n": 1e308, "i": -12}') == \
        {"s": '[[[[{{{{ " ]]', "e": "😀", "n": 1e308, "i": -12}
    assert parse_calls('<tool_call>{"name": "f", "arguments": "{\\"q\\": [1]}"}</tool_call> and '
                       '<tool_call>{"name": "g"}</tool_call>') == [("f", {"q": [1]}), ("g", {})]


@pytest.mark.parametrize("body,reason", [
    ('{"name": 3, "arguments": {}}', 'must be an object with a string "name"'),
    ('{"name": "", "arguments": {}}', 'must be an object with a string "name"'),
    ('["bash", {}]', 'must be an object with a string "name"'),
    ('{"name": "bash", "arguments": [1]}', '"arguments" must be a JSON object'),
    ('{"name": "bash", "arguments": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', '"arguments" must be a JSON object'),
    ('{"name": "bash"', "is not valid JSON"),
])
def test_malformed_calls_name_the_block(body, reason):
    problem = parse_calls(f"ok {CALL_OPEN}{{\"name\": \"submit\"}}{CALL_CLOSE} then {CALL_OPEN}{body}{CALL_CLOSE}")
    assert isinstance(problem, str) and problem.startswith("<tool_call> block 2") and reason in problem


def test_unclosed_tags_are_scanned_once():
    """A regex search rescanned the rest of the text after each unclosed tag: quadratic."""
    started = time.monotonic()
    assert parse_calls(CALL_OPEN * 20_000 + '{"name": "x"}') == []
    assert time.monotonic() - started < 2


def test_tool_calls_that_no_command_line_can_carry_are_error_observations(toolset):
    """Against the real local backend, where a NUL or an over-long argument made Popen raise."""
    options = EnvironmentOptions(type="local", allow_unsandboxed=True, limits=Limits(exec_timeout_secs=10))
    with open_environment(options) as pool:
        sandbox = pool.acquire()
        try:
            nul = toolset.call(sandbox, "bash", {"command": "echo a\0b"})
            assert nul == ToolResult("error: invalid arguments for bash: a string holds a NUL character", is_error=True)
            long = toolset.call(sandbox, "bash", {"command": "echo " + "x" * 300_000})
            assert long == ToolResult("error: the arguments of bash are too long for a command line", is_error=True)
            named = toolset.call(sandbox, "x" * 100_000, {})
            assert named.is_error and len(named.content.encode()) <= MAX_ERROR_BYTES
            assert toolset.call(sandbox, "bash", '{"command": "echo " NaN}').content.startswith("error: the arguments")
            assert toolset.call(sandbox, "bash", {"command": "echo fine"}) == ToolResult("fine\n")
        finally:
            sandbox.close()


def test_a_scripted_policy_cannot_crash_the_agent_loop(tmp_path, chat, local_pool):  # noqa: F811
    """The confirmed crash and its relatives, turn by turn, then a proper answer: every bad
    turn costs only an error observation, and the trajectory is scored as usual."""
    script = [
        CALL_OPEN + "[" * 1000 + CALL_CLOSE,
        CALL_OPEN + '{"name": "write_file", "arguments": {"path": "answer.txt", "content": NaN}}' + CALL_CLOSE,
        CALL_OPEN + '{"name": "write_file", "arguments": {"path": "\\ud800", "content": "x"}}' + CALL_CLOSE,
        call("write_file", path="answer\0.txt", content="42"),
        call("write_file", path="answer.txt", content="42") + call("submit"),
    ]
    (t,), _ = rollouts(tmp_path, chat, local_pool, [script], max_turns=8, max_new_tokens_per_turn=2048,
                       max_trajectory_tokens=16384)
    assert t.stop == "submitted" and t.terminal_reward == 1.0 and len(t.turns) == 5
    assert "nested deeper than 32 levels" in t.turns[0].note
    assert "NaN is not a JSON number" in t.turns[1].note
    assert "lone UTF-16 surrogate" in t.turns[2].note
    assert t.turns[3].note is None and t.turns[3].calls[0].is_error and "NUL" in t.turns[3].calls[0].content
