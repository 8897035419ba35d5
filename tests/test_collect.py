"""`retrograd collect`: scripted trajectories through a real local environment become SFT
tool records that the SFT loader turns back into exactly the rollout's tokens and mask (or,
--structured, into content and tool_calls); the filters (--keep, --min-reward, duplicates),
--pairs, the atomic write, the report, bad input refused on one line; and --api, with an
OpenAI-shaped endpoint on loopback (scripted, and a real `retrograd serve`) as the policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from loopback import JsonEndpoint
from test_agent import call
from test_serve import running, without_key

from retrograd.config import load_config
from retrograd.data.preference import load_preference
from retrograd.data.sft import load_sft
from retrograd.errors import DataError
from retrograd.evaluation.collect import collect_with
from retrograd.evaluation.collect_request import CollectOptions, check_request
from retrograd.recipes.agent_grpo import open_task
from retrograd.rollouts import agent
from retrograd.sampler import Completion
from retrograd.training.report import SilentReporter

RETROGRAD = [sys.executable, "-m", "retrograd"]
SCENARIOS = [
    {"id": "answer", "system": "Use the tools.", "user": "Write 42 to answer.txt.",
     "metadata": {"env": {"verify": {"command": "grep -qx 42 answer.txt"}}}},
    {"id": "greet", "user": "Write hi to hello.txt.", "metadata": {"env": {"verify": {"command": "grep -qx hi hello.txt"}}}},
]
WRITE_42 = call("write_file", path="answer.txt", content="42")
SCRIPTS = [
    [WRITE_42, "Done."],  # 0: passes, reward 1
    ["I give up."],  # 1: complete, reward 0
    [WRITE_42, "Done."],  # 2: a duplicate of 0
    [WRITE_42, "All done: the file holds 42."],  # 3: passes, longer than 0
    [call("write_file", path="answer.txt", content="41"), call("write_file", path="answer.txt", content="40")],  # 4: max_turns
    ['<tool_call>\n{"name": oops}\n</tool_call>', "ok"],  # 5: a malformed call
]


class Policy:
    """Stands in for the llama.cpp sampler: the j-th conversation of each open() says
    scripts[j] turn by turn, each turn ending with <|im_end|>; a turn given as a tuple of
    pieces is tokenized piece by piece (a tokenization the tokenizer would not choose)."""

    def __init__(self, tokenizer, scripts, fail_on_open: int | None = None):
        self.tokenizer, self.scripts, self.fail_on_open, self.opened = tokenizer, scripts, fail_on_open, 0
        self.end = tokenizer.encode("<|im_end|>", add_bos=False)

    def open(self, seeds):
        self.opened += 1
        if self.opened == self.fail_on_open:
            raise KeyboardInterrupt
        return [SimpleNamespace(lines=list(self.scripts[j % len(self.scripts)]), close=lambda: None) for j in range(len(seeds))]

    def generate_turn(self, turns, sampling):
        out = []
        for conversation, context in turns:
            line = conversation.lines.pop(0)
            ids = [i for piece in (line if isinstance(line, tuple) else (line,)) for i in self.tokenizer.encode(piece, add_bos=False)]
            ids = (ids + self.end)[: sampling.max_new_tokens]
            out.append(Completion(ids, [-1.0] * len(ids), "eos" if ids[-1] == self.end[0] else "length", len(context), 0))
        return out


def write_config(tmp: Path, model: Path, scenarios=SCENARIOS[:1], algorithm: str = "agent_grpo") -> Path:
    (tmp / "scenarios.jsonl").write_text("".join(json.dumps(s) + "\n" for s in scenarios))
    cfg = tmp / "agent.toml"
    cfg.write_text(f"""
[run]
algorithm = "{algorithm}"
[model]
path = "{model}"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
[training]
ctx = 1024
threads = 2
[agent]
scenarios = "scenarios.jsonl"
updates = 1
scenarios_per_update = 1
group_size = {len(SCRIPTS)}
max_turns = 2
max_new_tokens_per_turn = 64
[agent.environment]
type = "local"
allow_unsandboxed = true
[agent.environment.tools]
default = "mini"
[agent.environment.tools.toolset.mini]
tools = ["write_file", "submit"]
""")
    return cfg


@pytest.fixture
def run(tmp_path, tiny_model, monkeypatch):
    """run(scripts, **options) -> (result, task, every trajectory rolled out)."""
    rolled = []
    collect = agent.AgentRollouts.collect

    def recording(self, requests, clock):
        rolled.extend(collect(self, requests, clock))
        return rolled[-len(requests):]

    monkeypatch.setattr(agent.AgentRollouts, "collect", recording)
    cfg = load_config(write_config(tmp_path, tiny_model("llama"), scenarios=SCENARIOS))

    def go(scripts=SCRIPTS, fail_on_open=None, **options):
        options = CollectOptions(**({"out": tmp_path / "traces.jsonl", "report": tmp_path / "report.json"} | options))
        check_request(cfg, options)
        task = open_task(cfg, SilentReporter())
        try:
            result = collect_with(cfg, options, task, Policy(task.chat.tokenizer, scripts, fail_on_open), SilentReporter())
        finally:
            task.close()
        return result, task, rolled

    return go


def assert_is_the_rollout(ids, mask, t) -> None:
    """The rollout's prompt and tokens, trained on exactly the sampled ones (the render may
    add untrained text after the last turn)."""
    ours = [*t.prompt, *t.tokens]
    assert list(ids[: len(ours)]) == ours
    assert list(mask[: len(ours)]) == [False] * len(t.prompt) + list(t.mask)
    assert not any(mask[len(ours):])


def test_records_retokenize_exactly_as_the_rollout_was(run, tmp_path):
    """Loaded by the SFT loader, every record is the rollout's prompt and tokens, trained on
    exactly the sampled tokens; the duplicate, the truncated and the malformed are dropped."""
    result, task, rolled = run(min_reward=0.0, keep=6, limit=1)
    data = load_sft(tmp_path / "traces.jsonl", task.chat, ctx=1024)
    assert [e.source.rsplit(":", 1)[1] for e in data.examples] == ["1", "2", "3"]
    kept = [rolled[m] for m in (0, 3, 1)]  # reward 1 shortest first, then reward 0
    for example, t in zip(data.examples, kept, strict=True):
        assert_is_the_rollout(example.ids, example.mask, t)
    assert result.dropped == {"duplicate": 1, "truncated (max_turns)": 1, "malformed_call": 1}
    records = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert records[0]["messages"][2:] == [{"role": "assistant", "content": WRITE_42, "raw": True},
                                          {"role": "tool", "content": records[0]["messages"][3]["content"]},
                                          {"role": "assistant", "content": "Done.", "raw": True}]
    assert [t["function"]["name"] for t in records[0]["tools"]] == ["write_file", "submit"]


def test_keep_min_reward_and_a_tokenization_the_tokenizer_would_not_choose(run, tmp_path):
    """By default only successful traces, the best one per scenario; a trace whose tokens the
    loader would not reproduce is dropped rather than written wrong."""
    result, _, rolled = run(limit=1)
    (record,) = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert record["messages"][-1]["content"] == "Done." and record["reward"] == 1.0
    assert result.dropped == {"duplicate": 1, "over_keep": 1, "not_successful": 1, "truncated (max_turns)": 1,
                              "malformed_call": 1}
    pieces = [[WRITE_42, ("Do", "ne", ".")], ["nothing"]]
    result, _, _ = run(pieces, force=True, limit=1, keep=2)
    assert result.written == 0 and result.dropped["not_reproducible"] == 3 and result.dropped["not_successful"] == 3
    assert (tmp_path / "traces.jsonl").read_text() == ""


def test_a_turn_cut_by_its_token_budget_is_not_written(run, tmp_path):
    """A reply longer than max_new_tokens_per_turn never sampled its end of turn, which SFT
    on the record would teach: dropped as turn_cut, whatever its reward."""
    result, _, rolled = run([["many words " * 40]], min_reward=0.0, keep=6, limit=1)
    assert all(t.turns[-1].finish == "length" and not t.truncated for t in rolled)
    assert result.written == 0 and result.dropped == {"turn_cut": 6}


def test_pairs_are_best_against_worst_and_respect_min_gap(run, tmp_path):
    result, task, rolled = run(pairs=True, limit=1)
    assert result.written == 1
    pairs = load_preference(tmp_path / "traces.jsonl", task.chat, ctx=1024, unpaired=False).items
    (pair,) = pairs
    for answer, t in ((pair.chosen, rolled[0]), (pair.rejected, rolled[1])):
        assert_is_the_rollout(pair.prompt + answer.ids, (False,) * len(pair.prompt) + answer.mask, t)
    (line,) = [json.loads(x) for x in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert (line["chosen_reward"], line["rejected_reward"]) == (1.0, 0.0) and line["rejected"][0]["content"] == "I give up."
    result, _, _ = run(pairs=True, min_gap=1.5, force=True, limit=1)
    assert result.written == 0 and result.dropped["pair: gap below min_gap"] == 1


def test_require_verified_keeps_only_what_a_verify_command_passed(tmp_path, tiny_model):
    """A judged scenario (no verify) whose judge gives 1.0 is a success, kept by default and
    dropped as not_verified with require_verified; the verified scenario's trace stays."""
    free = {"id": "free", "user": "Say something kind."}
    cfg_path = write_config(tmp_path, tiny_model("llama"), scenarios=[SCENARIOS[0], free])
    (tmp_path / "judge.py").write_text("import json, sys\nfor line in sys.stdin:\n    print(json.dumps({'reward': 1.0}))\n")
    cfg_path.write_text(cfg_path.read_text() + f'[agent.judge]\ncommand = ["{sys.executable}", "{tmp_path / "judge.py"}"]\n')
    cfg = load_config(cfg_path)
    kept = {}
    for require in (False, True):
        options = CollectOptions(out=tmp_path / f"{require}.jsonl", require_verified=require)
        task = open_task(cfg, SilentReporter())
        try:
            result = collect_with(cfg, options, task, Policy(task.chat.tokenizer, SCRIPTS), SilentReporter())
        finally:
            task.close()
        kept[require] = [json.loads(line)["scenario"] for line in options.out.read_text().splitlines()]
        if require:
            # the judged scenario's four complete, well-formed traces and the one whose verify failed
            assert result.dropped["not_verified"] == 5 and "not_successful" not in result.dropped
    assert kept == {False: ["answer", "free"], True: ["answer"]}


def test_the_output_appears_whole_or_not_at_all_and_the_report(run, tmp_path):
    out = tmp_path / "traces.jsonl"
    with pytest.raises(KeyboardInterrupt):  # while the second scenario rolls out
        run(fail_on_open=2)
    assert not out.exists() and not (tmp_path / "traces.jsonl.tmp").exists()
    result, _, _ = run()
    assert len(out.read_text().splitlines()) == 1  # "greet": no script writes hello.txt
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["records"] == 1 and report["scenarios"] == [
        {"id": "answer", "attempts": 6, "passes": 3, "kept": 1, "pass_rate": 0.5},
        {"id": "greet", "attempts": 6, "passes": 0, "kept": 0, "pass_rate": 0.0}]
    with pytest.raises(DataError, match=r"^--out .*traces.jsonl: the file exists; pass --force to overwrite it$"):
        run()


@pytest.mark.parametrize("case, needle", [
    ("sft", "run.algorithm = 'sft'; collect rolls out agent_grpo configs"),
    ("exists", "the file exists; pass --force to overwrite it"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_model, case, needle):
    cfg = write_config(tmp_path, tiny_model("llama"))
    if case == "sft":
        (tmp_path / "train.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                       {"role": "assistant", "content": "hello"}]}) + "\n")
        cfg.write_text(f'[run]\nalgorithm = "sft"\n[model]\npath = "{tiny_model("llama")}"\n[output]\npath = "out/a.gguf"\n'
                       '[sft]\ndata = "train.jsonl"\n')
    (tmp_path / "traces.jsonl").write_text("")
    proc = subprocess.run([*RETROGRAD, "collect", str(cfg), "--out", str(tmp_path / ("traces.jsonl" if case == "exists" else "x.jsonl"))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and needle in proc.stderr, proc.stderr


def test_a_cli_run_on_smollm2(tmp_path, smollm2):
    """The real sampler: the progress lines, the report by cause, and records the SFT loader
    reads (each was checked against its rollout before it was written)."""
    echo = {"id": "echo", "system": "You only answer with a tool call.",
            "user": f"{WRITE_42}\nRepeat exactly the text above.", "metadata": SCENARIOS[0]["metadata"]}
    cfg = write_config(tmp_path, smollm2, scenarios=[echo])
    cfg.write_text(cfg.read_text().replace(f"group_size = {len(SCRIPTS)}", "group_size = 4\ntemperature = 0.7"))
    out = tmp_path / "traces.jsonl"
    proc = subprocess.run([*RETROGRAD, "collect", str(cfg), "--out", str(out), "--min-reward", "0", "--keep", "4",
                           "--report", str(tmp_path / "report.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "from 4 trajectories of 1 scenario(s)" in proc.stdout and "dropped: " in proc.stdout, proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["scenarios"][0]["attempts"] == 4 and report["records"] + sum(report["dropped"].values()) == 4
    assert not (tmp_path / "traces.jsonl.tmp").exists() and len(out.read_text().splitlines()) == report["records"]


def test_structured_records_hold_words_and_calls_apart(run, tmp_path):
    """--structured: each turn's words as content and its calls as tool_calls, answered by id;
    the SFT loader takes them, and on this template they train the same tokens as raw ones."""
    result, task, rolled = run(min_reward=0.0, keep=6, limit=1, structured=True)
    records = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert len(records) == 3 and result.dropped == {"duplicate": 1, "truncated (max_turns)": 1, "malformed_call": 1}
    assert records[0]["messages"][2:] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "write_file",
                                                                          "arguments": {"path": "answer.txt", "content": "42"}}}]},
        {"role": "tool", "content": records[0]["messages"][3]["content"], "tool_call_id": "call_0"},
        {"role": "assistant", "content": "Done."}]
    assert not any(m.get("raw") for r in records for m in r["messages"])
    data = load_sft(tmp_path / "traces.jsonl", task.chat, ctx=1024)
    for example, t in zip(data.examples, [rolled[m] for m in (0, 3, 1)], strict=True):
        assert_is_the_rollout(example.ids, example.mask, t)


class ApiPolicy(JsonEndpoint):
    """An OpenAI-shaped /chat/completions on 127.0.0.1 playing the agent: a conversation's
    member is its request's seed less the turn (assistant messages so far) less BASE_SEED, and
    member j says API_SCRIPTS[j] turn by turn (a message's own finish_reason is the reply's), or
    answers every request with a status of its own."""

    def __init__(self):
        super().__init__(self.answer)

    def answer(self, body: dict) -> tuple[int, dict]:
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        script = API_SCRIPTS[(body["seed"] - turn - BASE_SEED) % len(API_SCRIPTS)]
        if isinstance(script, int):
            return script, {"error": {"message": f"status {script}\nsecond line"}}
        message = dict(script[turn])
        finish = message.pop("finish_reason", "tool_calls" if "tool_calls" in message else "stop")
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant"} | message, "finish_reason": finish}],
                     "usage": {"completion_tokens": 7}}


BASE_SEED = 42  # [agent].seed's default


def api_call(name: str, arguments: str) -> dict:
    return {"content": None, "tool_calls": [{"id": "x1", "type": "function", "function": {"name": name, "arguments": arguments}}]}


API_SCRIPTS = [
    [api_call("write_file", json.dumps({"path": "answer.txt", "content": "42"})), {"content": "Done."}],  # passes
    [{"content": "I give up."}],  # complete, reward 0
    [api_call("write_file", "{not json"), {"content": "ok"}],  # a malformed call
    500,  # every request fails: retried, then policy_broken
    400,  # the endpoint refuses this conversation: policy_broken at once
    [api_call("submit", "")],  # a call without arguments (as some servers send them): complete, verify fails
    [{"content": "Done", "finish_reason": "content_filter"}],  # cut by the endpoint
]


@pytest.fixture
def api_policy():
    served = ApiPolicy()
    yield served
    served.close()


def test_api_collects_structured_records_from_an_endpoint(tmp_path, tiny_model, api_policy):
    """--api: the endpoint is the policy in the real local environment; the passing trace is
    written as a structured record the SFT loader takes, a malformed call and a broken endpoint
    are dropped by cause, and what the endpoint was sent is an OpenAI conversation."""
    cfg = write_config(tmp_path, tiny_model("llama"))
    cfg.write_text(cfg.read_text().replace(f"group_size = {len(SCRIPTS)}", f"group_size = {len(API_SCRIPTS)}")
                   + f'[agent.collect_api]\nbase_url = "{api_policy.url}"\nmodel = "scripted"\nmax_retries = 1\n')
    out = tmp_path / "traces.jsonl"
    proc = subprocess.run([*RETROGRAD, "collect", str(cfg), "--out", str(out), "--api", "--report", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"policy: scripted at {api_policy.url}" in proc.stdout, proc.stdout
    assert f"  failed (policy_broken), first: {api_policy.url} gave no usable reply in 2 tries (last: 500: " in proc.stdout, proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["records"] == 1 and report["dropped"] == {"not_successful": 2, "malformed_call": 1, "failed (policy_broken)": 2,
                                                            "turn_cut": 1}
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert record["messages"][2]["tool_calls"][0]["function"] == {"name": "write_file", "arguments": {"path": "answer.txt", "content": "42"}}
    assert record["messages"][3]["tool_call_id"] == "call_0" and record["messages"][4] == {"role": "assistant", "content": "Done."}
    task = open_task(load_config(cfg), SilentReporter())
    try:
        (example,) = load_sft(out, task.chat, ctx=1024).examples
        assert any(example.mask) and not all(example.mask)
    finally:
        task.close()
    second = next(b for b in api_policy.bodies if len(b["messages"]) == 4 and b["messages"][2].get("tool_calls"))
    assert second["model"] == "scripted" and second["max_tokens"] == 64
    assert [t["function"]["name"] for t in second["tools"]] == ["write_file", "submit"]
    assert json.loads(second["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"path": "answer.txt", "content": "42"}
    assert second["messages"][3]["role"] == "tool" and second["messages"][3]["tool_call_id"] == "call_0"
    first = [b["seed"] - BASE_SEED for b in api_policy.bodies if len(b["messages"]) == 2]
    assert sorted(first) == [0, 1, 2, 3, 3, 4, 5, 6]  # the 500 retried once, the 400 not


def test_api_a_refusal_that_every_request_would_get_stops_on_one_line(tmp_path, tiny_model):
    endpoint = JsonEndpoint(lambda body: (401, {"error": {"message": "no key"}}))
    try:
        cfg = write_config(tmp_path, tiny_model("llama"))
        cfg.write_text(cfg.read_text() + f'[agent.collect_api]\nbase_url = "{endpoint.url}"\nmodel = "m"\n')
        proc = subprocess.run([*RETROGRAD, "collect", str(cfg), "--out", str(tmp_path / "x.jsonl"), "--api"],
                              capture_output=True, text=True, timeout=120)
    finally:
        endpoint.close()
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: agent.collect_api: {endpoint.url} refused the request with 401: ") and "no key" in proc.stderr
    # No member asked twice (a refusal is not retried); members whose request had not started
    # when the first refusal came back are not asked at all (Executor.map cancels them: 5 of 6
    # on a loaded machine).
    seeds = [body["seed"] for body in endpoint.bodies]
    assert 1 <= len(seeds) <= len(SCRIPTS) and len(set(seeds)) == len(seeds), seeds
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.tmp").exists()


@pytest.mark.parametrize("extra, needle", [
    ([], "--api needs an [agent.collect_api] table"),
    (["--raw"], "--raw needs the local model's own tokens"),
    (["--device", "cpu"], "--device applies to the local model, not to --api"),
])
def test_api_misuse_is_one_line_and_exit_2(tmp_path, tiny_model, extra, needle):
    cfg = write_config(tmp_path, tiny_model("llama"))
    if extra:
        cfg.write_text(cfg.read_text() + '[agent.collect_api]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n')
    proc = subprocess.run([*RETROGRAD, "collect", str(cfg), "--out", str(tmp_path / "x.jsonl"), "--api", *extra],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.slow  # ~15 s: a serve process and two collect runs
def test_api_with_a_real_retrograd_serve(tmp_path, smollm2):
    """The bundled model behind `retrograd serve` on loopback as the policy: every trajectory
    is accounted for, and whatever is written the SFT loader takes."""
    echo = {"id": "echo", "system": "You only answer with a tool call.",
            "user": f"{WRITE_42}\nRepeat exactly the text above.", "metadata": SCENARIOS[0]["metadata"]}
    # llama.cpp's plain kernels: SmolLM2's greedy reply ends within the turn there, while with
    # the AMX matmul (another activation quantisation, KL 4e-3 from it) it runs past 256 tokens
    with running("--ctx", "1024", env=without_key(RETROGRAD_LLAMA_AMX="off")) as url:
        cfg = write_config(tmp_path, smollm2, scenarios=[echo])
        cfg.write_text(cfg.read_text().replace(f"group_size = {len(SCRIPTS)}", "group_size = 2")
                       .replace("max_new_tokens_per_turn = 64", "max_new_tokens_per_turn = 256")
                       + f'[agent.collect_api]\nbase_url = "{url}"\nmodel = "base"\ntemperature = 0\n')
        out = tmp_path / "traces.jsonl"
        proc = subprocess.run([*RETROGRAD, "collect", str(cfg), "--out", str(out), "--api", "--min-reward", "0", "--keep", "2",
                               "--report", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
        cfg.write_text(cfg.read_text().replace('model = "base"', 'model = "gpt-9"'))
        refused = subprocess.run([*RETROGRAD, "collect", str(cfg), "--out", str(tmp_path / "x.jsonl"), "--api"],
                                 capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "agent.collect_api: " in refused.stderr and "refused the request with 404" in refused.stderr and "gpt-9" in refused.stderr
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.tmp").exists()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["scenarios"][0]["attempts"] == 2 and report["records"] + sum(report["dropped"].values()) == 2
    assert not any("policy_broken" in cause for cause in report["dropped"]), report
    task = open_task(load_config(cfg), SilentReporter())
    try:
        assert len(load_sft(out, task.chat, ctx=1024).examples) == report["records"]
    finally:
        task.close()
