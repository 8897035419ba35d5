"""The agentic rollout engine: the token sequence and its mask, turn endings, step rewards
and broken tools, cross-turn KV reuse on the real sampler, and whole updates driven by a
scripted policy through the namespace sandbox and real Docker containers."""

from __future__ import annotations

import json
import math
import uuid
from types import SimpleNamespace

import pytest

from retrograd.config import load_config
from retrograd.data import ChatFormat
from retrograd.data.chat import encode_conversation
from retrograd.data.messages import parse_conversation
from retrograd.errors import DataError
from retrograd.gguf.file import GGUFFile
from retrograd.gguf.spec import read_spec
from retrograd.model.tokenizer import Tokenizer
from retrograd.recipes.agent_grpo import open_task, train
from retrograd.recipes.common import prepare
from retrograd.rollouts.agent import AgentRollouts, Request, RolloutLimits
from retrograd.rollouts.sandbox import EnvironmentOptions, Limits, open_environment
from retrograd.rollouts.scenarios import load_scenarios
from retrograd.rollouts.tools import ToolCatalog
from retrograd.sampler import Completion, Sampler, SamplerOptions
from retrograd.training.report import SilentReporter
from retrograd.training.timeline import PhaseClock

TOOLS = {
    "default": "mini",
    "toolset": {"mini": {"tools": ["write_file", "read_file", "submit", "score", "flaky"]}},
    "tool": [
        {"id": "score", "description": "Scores the work so far.", "input_schema": {"type": "object"},
         "exec": {"argv": ["sh", "-c", 'cat >/dev/null; echo \'{"content": "half way", "reward": 0.5}\''], "protocol": "json"}},
        {"id": "flaky", "description": "Breaks its protocol.", "input_schema": {"type": "object"},
         "exec": {"argv": ["sh", "-c", "echo not-json"], "protocol": "json"}},
    ],
}
SCENARIO = {"id": "answer", "system": "Use the tools.", "user": "Write 42 to answer.txt.",
            "metadata": {"env": {"files": {"notes.txt": "the answer is 42\n"}, "verify": {"command": "grep -qx 42 answer.txt"}}}}


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedPolicy:
    """Stands in for the llama.cpp sampler: the i-th conversation of each open() says
    scripts[i] turn by turn, ending every turn with <|im_end|> unless the budget cuts it."""

    def __init__(self, tokenizer: Tokenizer, scripts: list[list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.end = tokenizer.encode("<|im_end|>", add_bos=False)
        self.turns: list[list[int]] = []  # every turn's tokens, in the order they were produced

    def open(self, seeds):
        return [SimpleNamespace(lines=list(self.scripts[i % len(self.scripts)]), close=lambda: None) for i in range(len(seeds))]

    def generate_turn(self, turns, sampling):
        out = []
        for conversation, context in turns:
            ids = (self.tokenizer.encode(conversation.lines.pop(0), add_bos=False) + self.end)[: sampling.max_new_tokens]
            self.turns.append(ids)
            out.append(Completion(ids, [-1.0] * len(ids), "eos" if ids[-1] == self.end[0] else "length", len(context), 0))
        return out

    def set_adapter(self, adapter):
        return SimpleNamespace(total_s=0.0)


@pytest.fixture(scope="module")
def chat(smollm2) -> ChatFormat:
    return ChatFormat(Tokenizer(smollm2), read_spec(GGUFFile(smollm2)).chat_template, origin=str(smollm2))


@pytest.fixture(scope="module")
def local_pool():
    options = EnvironmentOptions(type="local", allow_unsandboxed=True, limits=Limits(exec_timeout_secs=10))
    with open_environment(options) as pool:
        yield pool, options


def rollouts(tmp_path, chat, pool_and_options, scripts, scenario=SCENARIO, **limits):
    path = tmp_path / "scenarios.jsonl"
    path.write_text(json.dumps(scenario) + "\n")
    (scenario,) = load_scenarios(path, ToolCatalog.from_table(TOOLS, tmp_path), judged=False)
    pool, options = pool_and_options
    policy = ScriptedPolicy(chat.tokenizer, scripts)
    engine = AgentRollouts(policy, chat, pool, options, RolloutLimits(**({"max_turns": 4, "max_new_tokens_per_turn": 64,
                           "max_trajectory_tokens": 1024, "max_rollout_secs": 60} | limits)), concurrency=8)
    requests = [Request(scenario, 0, j, j) for j in range(len(scripts))]
    return engine.collect(requests, PhaseClock()), policy


def sampled_runs(mask: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of every run of sampled tokens."""
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


# ---------------------------------------------------------------- the sequence and its mask


def test_the_mask_marks_exactly_the_sampled_tokens_of_an_sft_identical_sequence(tmp_path, chat, local_pool):
    """Token by token: the sampled turns sit unchanged where the mask says, and the whole
    sequence is what retrograd.data makes of the same conversation as an SFT tool record,
    mask included (content and <|im_end|> trained; system, user, tool and template tokens not)."""
    script = [call("read_file", path="notes.txt"), "Now I write it. " + call("write_file", path="answer.txt", content="42"),
              call("read_file", path="missing.txt"), "Done."]
    (t,), policy = rollouts(tmp_path, chat, local_pool, [script])
    assert t.stop == "no_tool_call" and t.terminal_reward == 1.0 and len(t.turns) == 4
    runs = sampled_runs(t.mask)
    assert [list(t.tokens[a:b]) for a, b in runs] == policy.turns  # the policy's own tokens, never re-tokenized
    assert t.tokens[-1] == policy.end[0] and t.mask[-1]  # nothing trained follows the last turn

    messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Write 42 to answer.txt."}]
    for turn in t.turns:
        messages.append({"role": "assistant", "content": turn.text, "raw": True})
        messages += [{"role": "tool", "content": c.content, "is_error": c.is_error} for c in turn.calls]
    assert [c.content for c in t.turns[0].calls] == ["the answer is 42\n"]
    assert t.turns[2].calls[0].is_error and t.turns[2].calls[0].content == "error: /work/missing.txt does not exist"
    record = {"messages": messages, "tools": [tool.spec() for tool in load_scenarios(
        tmp_path / "scenarios.jsonl", ToolCatalog.from_table(TOOLS, tmp_path), judged=False)[0].toolset.tools]}
    ids, mask = encode_conversation(chat, parse_conversation(record, "sft"), "sft")
    ours = [*t.prompt, *t.tokens]
    assert ours == ids[: len(ours)]
    assert [False] * len(t.prompt) + list(t.mask) == mask[: len(ours)]
    assert chat.tokenizer.decode(ids[len(ours):]) == "\n"  # SFT's render only adds the template's last newline


NATIVE_TEMPLATE = (  # ChatML that renders the catalogue, structured calls and tool messages itself
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif -%}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_native_tools_renders_the_catalogue_and_observations_itself(tmp_path, chat, local_pool):
    native = ChatFormat(chat.tokenizer, NATIVE_TEMPLATE, origin="native")
    assert native.native_tools
    script = [call("read_file", path="notes.txt"), "It says 42."]
    (t,), policy = rollouts(tmp_path, native, local_pool, [script])
    text = chat.tokenizer.decode([*t.prompt, *t.tokens])
    assert text.startswith("<|im_start|>system\n# Tools\n{\"type\": \"function\"") and "<tools>" not in text
    assert "<|im_start|>tool\nthe answer is 42\n<|im_end|>\n<|im_start|>assistant\nIt says 42.<|im_end|>" in text
    assert [list(t.tokens[a:b]) for a, b in sampled_runs(t.mask)] == policy.turns


def test_a_template_that_rewrites_one_turn_ends_that_trajectory_and_one_that_rewrites_every_turn_is_refused(
        tmp_path, chat, local_pool):
    """Model output must not stop the run: a template that trims a turn's whitespace ends
    only the trajectories whose text it changed; a template that changes every earlier turn
    cannot grow any conversation token by token and is refused."""
    trimming = ChatFormat(chat.tokenizer, NATIVE_TEMPLATE.replace("{{ m.content }}", "{{ m.content | trim }}"),
                          origin="trimming")
    tidy, sloppy = [call("read_file", path="notes.txt"), "42"], [call("read_file", path="notes.txt") + "  ", "42"]
    (kept, cut), _ = rollouts(tmp_path, trimming, local_pool, [tidy, sloppy])
    assert (kept.stop, len(kept.turns)) == ("no_tool_call", 2)
    assert (cut.stop, len(cut.turns), cut.truncated) == ("template_rewrote_turn", 1, True)
    rewriting = ChatFormat(chat.tokenizer, NATIVE_TEMPLATE.replace(
        "{{ m.content }}", "{{ m.content if loop.last or m.role != 'assistant' else '(earlier turn)' }}"),
        origin="rewriting")
    with pytest.raises(DataError, match="rewriting does not render the earlier turns as an exact prefix"):
        rollouts(tmp_path, rewriting, local_pool, [tidy])


def test_turn_endings_and_truncations(tmp_path, chat, local_pool):
    prose = ["I think so.", "Still thinking.", "Yes.", "No."]
    runs = {
        "ends": ({}, prose, "no_tool_call", 1),
        "goes on": ({"end_on_no_tool_call": False}, prose, "max_turns", 4),
        "failed turns": ({"end_on_no_tool_call": False, "max_failed_turns": 2}, prose, "max_failed_turns", 2),
        "malformed calls": ({"max_failed_turns": 3}, ["<tool_call>{oops</tool_call>"] * 4, "max_failed_turns", 3),
        "submit": ({}, [call("write_file", path="answer.txt", content="42"), call("submit"), "late"], "submitted", 2),
        "clock": ({"max_rollout_secs": 1e-9}, prose, "max_rollout_secs", 0),
    }
    for name, (limits, script, stop, n_turns) in runs.items():
        (t,), _ = rollouts(tmp_path, chat, local_pool, [script], **limits)
        assert t.stop == stop, name
        if n_turns is not None:
            assert len(t.turns) == n_turns, name
        assert t.truncated == (stop in ("max_turns", "max_failed_turns", "max_trajectory_tokens", "max_rollout_secs")), name
        if name == "goes on":
            assert t.turns[0].note.startswith("ERROR: no tool call found")
        if name == "malformed calls":
            assert "not valid JSON" in t.turns[0].note
        if name == "clock":  # out of time before any turn: nothing sampled, nothing verified
            assert t.tokens == () and t.terminal_reward is None
        elif name == "submit":
            assert t.terminal_reward == 1.0
    room = len(t.prompt) + 80  # the second read_file turn gets only what is left of the trajectory
    (t,), _ = rollouts(tmp_path, chat, local_pool, [[call("read_file", path="notes.txt")] * 4], max_trajectory_tokens=room)
    assert t.stop == "max_trajectory_tokens" and t.truncated and len(t.turns) == 2
    assert len(t.prompt) + len(t.tokens) == room and t.turns[1].n_tokens < t.turns[0].n_tokens


def test_step_rewards_start_after_their_turn_and_a_broken_tool_costs_its_trajectory_only(tmp_path, chat, local_pool):
    scripts = [[call("score"), call("write_file", path="answer.txt", content="42"), "done"],
               [call("flaky")],
               [call("write_file", path="answer.txt", content="41"), "done"]]
    (scored, broken, wrong), _ = rollouts(tmp_path, chat, local_pool, scripts)
    first_turn_end = sampled_runs(scored.mask)[0][1]
    assert scored.step_rewards == ((first_turn_end, 0.5),) and scored.terminal_reward == 1.0
    assert broken.stop == "sandbox_broken" and broken.failed and broken.terminal_reward is None
    assert "broke the json protocol" in broken.turns[0].calls[0].content
    assert wrong.stop == "no_tool_call" and wrong.terminal_reward == 0.0

    per_token = scored.token_advantages(0.25)
    assert per_token.shape == (sum(scored.mask),)
    n_first = first_turn_end  # the first turn's sampled tokens are the first n of the mask
    # the first turn earned the step reward: its tokens get +0.5 above the later ones, centred on the mean
    assert per_token[:n_first].sub(per_token[n_first:].max()).allclose(per_token.new_tensor(0.5))
    assert float(per_token.mean()) == pytest.approx(0.25)


# ---------------------------------------------------------------- the real sampler's KV cache


def test_later_turns_prefill_only_the_new_tokens(tmp_path, tiny_model, chat, local_pool):
    """On the real sampler (a tiny random model with SmolLM2's vocabulary and template),
    turn k > 1 prefills exactly what the template added after turn k-1 plus that turn's
    last sampled token; forgetting the cache (the benchmark's other arm) prefills the whole
    context every turn."""
    path = tmp_path / "scenarios.jsonl"
    path.write_text(json.dumps({"id": "chat", "user": "Say something.", "metadata": {"env": {"verify": {"command": "true"}}}}) + "\n")
    catalog = ToolCatalog.from_table({"default": "one", "toolset": {"one": {"tools": ["read_file"]}}}, tmp_path)
    (scenario,) = load_scenarios(path, catalog, judged=False)
    limits = RolloutLimits(max_turns=3, max_new_tokens_per_turn=8, max_trajectory_tokens=1024, max_rollout_secs=0,
                           end_on_no_tool_call=False)
    requests = [Request(scenario, 0, j, 100 + j) for j in range(3)]
    outcome = {}
    with Sampler(tiny_model("llama"), SamplerOptions(n_ctx=1024, n_seq_max=4, n_threads=2)) as sampler:
        for reuse in (True, False):
            engine = AgentRollouts(sampler, chat, *local_pool, limits, concurrency=4, reuse_kv=reuse)
            outcome[reuse] = engine.collect(requests, PhaseClock())
            sampler.set_adapter(None)
    for t in outcome[True]:
        assert len(t.turns) == 3 and t.turns[0].prefilled + t.turns[0].reused == len(t.prompt)
        runs = sampled_runs(t.mask)
        for k in (1, 2):
            previous_end, start = runs[k - 1][1], runs[k][0]
            assert t.turns[k].prefilled == start - previous_end + 1  # new text + the last sampled token
            assert t.turns[k].reused == len(t.prompt) + previous_end - 1
    for with_reuse, without in zip(outcome[True], outcome[False]):
        assert without.turns[0].text == with_reuse.turns[0].text  # same seeds, same first turn
        runs = sampled_runs(without.mask)
        assert [turn.prefilled for turn in without.turns[1:]] == [len(without.prompt) + start for start, _ in runs[1:]]
    prefill = {reuse: sum(turn.prefilled for t in ts for turn in t.turns[1:]) for reuse, ts in outcome.items()}
    assert prefill[True] * 5 < prefill[False]


# ---------------------------------------------------------------- whole updates, scripted


@pytest.mark.parametrize("backend", [pytest.param("sandbox", marks=pytest.mark.namespace),
                                     pytest.param("container", marks=pytest.mark.container)])
def test_a_scripted_policy_trains_one_update_through_real_sandboxes(tmp_path, tiny_model, backend):
    client = None
    if backend == "container":  # reachable: conftest.py checked before the test
        import docker

        client = docker.from_env()
    run_id = f"test-{uuid.uuid4().hex[:8]}"
    (tmp_path / "scenarios.jsonl").write_text(json.dumps(SCENARIO) + "\n")
    environment = f'type = "{backend}"\n' + (f'run_id = "{run_id}"\n' if backend == "container" else "")
    (tmp_path / "agent.toml").write_text(f"""
[run]
algorithm = "agent_grpo"
[model]
path = "{tiny_model('llama')}"
[output]
path = "out/adapter.gguf"
[training]
ctx = 1024
micro_batch = 4096
lr = 1e-3
compute_dtype = "f32"
[agent]
scenarios = "scenarios.jsonl"
group_size = 3
epochs_per_update = 1
max_turns = 3
max_new_tokens_per_turn = 64
[agent.environment]
{environment}[agent.environment.pool]
max_live = 3
min_idle = 1
[agent.environment.tools]
{_toml_tools()}
""")
    cfg = load_config(tmp_path / "agent.toml")
    task = open_task(cfg, SilentReporter())
    scripts = [[call("read_file", path="notes.txt"), call("write_file", path="answer.txt", content="42"), "done"],
               [call("write_file", path="answer.txt", content="41"), call("score"), "done"],
               [call("bash", command="echo hi"), "ok"]]
    try:
        setup = prepare(cfg, SilentReporter(), task.chat)
        policy = ScriptedPolicy(task.chat.tokenizer, scripts)
        result = train(cfg, setup, policy, task, SilentReporter())
    finally:
        task.close()
    assert result.updates_done == 1 and result.steps == 1 and result.output.is_file()
    (m,) = [json.loads(line) for line in (tmp_path / "out/adapter.metrics.jsonl").read_text().splitlines()]
    assert m["reward/mean"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert m["agent/turns_per_traj_mean"] == pytest.approx((3 + 3 + 2) / 3)
    assert m["agent/tool_error_fraction"] == pytest.approx(1 / 5)  # bash is not in the toolset
    assert m["env/live_containers_max"] <= 3 and m["env/acquire_ms_mean"] > 0 and m["env/exec_timeout_fraction"] == 0
    assert m["generation/prefilled_tokens"] > 0 and "timing/tools_seconds" in m
    records = [json.loads(line) for line in (tmp_path / "out/adapter.rollouts.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in records] == [1.0, 0.5, 0.0] and all(r["trained"] for r in records)
    assert [r["advantage"] for r in records] == pytest.approx([0.5, 0.0, -0.5])  # reward - group mean
    # One epoch, one minibatch: the ratio is exactly 1, kl_coefficient is 0 and the step-reward
    # returns are centred per trajectory, so the budget-normalised loss is
    # -sum_i A_i * n_i / (trajectories * min(max_turns * max_new_tokens_per_turn, ctx)).
    expected = -sum(r["advantage"] * r["sampled_tokens"] for r in records) / (3 * min(3 * 64, 1024))
    assert records[0]["sampled_tokens"] != records[2]["sampled_tokens"]  # so the expected loss is not 0
    assert math.isfinite(m["policy/total_loss"]) and m["policy/total_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    first = records[0]["turns"]
    assert first[0]["calls"][0] == {"name": "read_file", "arguments": {"path": "notes.txt"},
                                    "observation": "the answer is 42\n", "is_error": False, "reward": None}
    assert first[1]["calls"][0]["observation"] == "wrote 2 bytes to /work/answer.txt"
    assert records[1]["step_rewards"] == [0.5] and records[2]["turns"][0]["calls"][0]["is_error"]
    if client is not None:  # nothing of this run is left on the daemon
        assert client.containers.list(all=True, filters={"label": f"retrograd.pool={run_id}"}) == []


def _toml_tools() -> str:
    lines = ['default = "mini"', "[agent.environment.tools.toolset.mini]",
             f"tools = {json.dumps(TOOLS['toolset']['mini']['tools'])}"]
    for tool in TOOLS["tool"]:
        lines += ["[[agent.environment.tools.tool]]", f'id = "{tool["id"]}"', f'description = "{tool["description"]}"',
                  "input_schema = { type = \"object\" }", f"exec = {{ argv = {json.dumps(tool['exec']['argv'])}, protocol = \"json\" }}"]
    return "\n".join(lines)
