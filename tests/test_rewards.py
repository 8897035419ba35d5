"""Rewards against real subprocesses: the reference example in both modes, and a program that breaks
the protocol in every way we promise to report (tests/reward_programs/misbehave.py), checking that
its whole process group, grandchild included, is gone afterwards."""

import json
import os
import shlex
import time
from pathlib import Path

import psutil
import pytest

from retrograd.rollouts.rewards import RewardError, make_reward, prompt_of

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "smoke_rl_reward.py"
MISBEHAVE = Path(__file__).resolve().parent / "reward_programs" / "misbehave.py"
PROMPTS = ["Calculate 14 + 7.", "Calculate 2 + 2."]
COMPLETIONS = ["21", "4"]

# (prompt, completion, reward worked out by hand: 1 / (1 + |answer - expected|), 0 without an integer)
ARITHMETIC = [
    ("Calculate 14 + 7. Reply with exactly one number.", "21", 1.0),
    ("Calculate 14 + 7. Reply with exactly one number.", "The answer is 20.", 1 / 2),
    ("Calculate 14 + 7. Reply with exactly one number.", "twenty-one", 0.0),
    ("Calculate 2 + 3 × 4. Reply with exactly one number.", "14", 1.0),  # × binds tighter
    ("Calculate 10 - 4 - 3. Reply with exactly one number.", "3", 1.0),  # left to right
    ("Calculate 7 ÷ 2. Reply with exactly one number.", "3", 1 / 1.5),
    ("Calculate 6 * -3. Reply with exactly one number.", "-18", 1.0),
    ("Calculate 20 / 4 + 1. Reply with exactly one number.", "9", 1 / 4),
]


def misbehaving(tmp_path, behaviour):
    pidfile = tmp_path / f"{behaviour}.pids"
    return [str(MISBEHAVE), behaviour, str(pidfile)], pidfile


def group_members(pgid):
    """Live (not zombie) processes of a process group."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return members


def assert_group_gone(pidfile):
    leader, grandchild = map(int, pidfile.read_text().split())
    deadline = time.monotonic() + 3
    while (left := group_members(leader)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], f"processes of the reward program's group {leader} still run"
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("mode", ["persistent", "oneshot"])
def test_example_scores_arithmetic_in_both_modes(mode):
    prompts, completions, expected = map(list, zip(*ARITHMETIC))
    with make_reward(command=[str(EXAMPLE)], mode=mode, timeout_seconds=20) as reward:
        assert reward.score(prompts, completions) == pytest.approx(expected)
        assert reward.score(prompts[:2], completions[:2]) == pytest.approx(expected[:2])
        assert reward.score([], []) == []


def test_example_relative_path_resolves_against_working_directory(monkeypatch):
    monkeypatch.chdir(ROOT)
    with make_reward(command=["examples/smoke_rl_reward.py"], mode="oneshot", timeout_seconds=20) as reward:
        assert reward.score(["Calculate 3 × 3."], ["9"]) == [1.0]


def test_persistent_worker_serves_several_batches_and_close_ends_it(tmp_path):
    argv, pidfile = misbehaving(tmp_path, "counter")
    reward = make_reward(command=argv, timeout_seconds=20)
    assert reward.score(["a", "b"], ["x", "y"]) == [1.0, 2.0]
    assert reward.score(["c"], ["z"]) == [3.0]  # the same worker remembers the first batch
    assert reward.score(["d", "e", "f"], ["x", "y", "z"]) == [4.0, 5.0, 6.0]
    reward.close()
    assert_group_gone(pidfile)


def test_failed_persistent_batch_kills_the_worker_and_the_next_starts_fresh(tmp_path):
    argv, pidfile = misbehaving(tmp_path, "counter")
    with make_reward(command=argv, timeout_seconds=20) as reward:
        assert reward.score(["a", "b"], ["x", "y"]) == [1.0, 2.0]
        with pytest.raises(
            RewardError, match=r"exited before sending the answer to request 2 of 2 \(batch 1\).*exit status 5"
        ):
            reward.score(["b", "crash"], ["x", "y"])
        assert_group_gone(pidfile)
        assert reward.score(["a"], ["x"]) == [1.0]  # a new worker counts from one again


FAILURES = [
    # behaviour, mode, timeout, what the message must say
    (
        "crash",
        "oneshot",
        20,
        ["exited after printing 0 answers for 2 requests", "exit status 3", "stderr: Traceback", "crashing on purpose"],
    ),
    ("crash", "persistent", 20, ["handshake", "exit status 3", "crashing on purpose"]),
    ("hang", "oneshot", 0.5, ["timed out after 0.5s", "waiting for the answer to request 1 of 2"]),
    (
        "hang_after_handshake",
        "persistent",
        0.5,
        ["timed out after 0.5s", "waiting for the answer to request 1 of 2 (batch 0)"],
    ),
    ("oneshot_only", "persistent", 0.5, ["timed out", "handshake", 'reward_mode = "oneshot"']),
    ("not_json", "oneshot", 20, ["'hello'", "not JSON"]),
    ("nan", "oneshot", 20, ["reward nan", "finite number"]),
    ("wrong_shape", "oneshot", 20, ["""'{"score": 1}'""", '"reward": <finite number>']),
    ("short", "oneshot", 20, ["exited after printing 1 answers for 2 requests"]),
    ("extra_oneshot", "oneshot", 20, ["more than 2 lines for 2 requests"]),
    ("huge_line", "oneshot", 20, ["stdout line longer than 8 MiB"]),
]


@pytest.mark.parametrize(
    ("behaviour", "mode", "timeout", "fragments"), FAILURES, ids=[f[0] + "-" + f[1] for f in FAILURES]
)
def test_misbehaving_program_fails_with_one_line_and_its_group_dies(tmp_path, behaviour, mode, timeout, fragments):
    argv, pidfile = misbehaving(tmp_path, behaviour)
    with make_reward(command=argv, mode=mode, timeout_seconds=timeout) as reward, pytest.raises(RewardError) as failure:
        reward.score(PROMPTS, COMPLETIONS)
    message = str(failure.value)
    assert message.startswith(f"reward program {shlex.join(argv)!r} ")
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    assert_group_gone(pidfile)


def test_extra_line_after_a_persistent_batch_is_a_protocol_error(tmp_path):
    argv, pidfile = misbehaving(tmp_path, "extra_persistent")
    with make_reward(command=argv, timeout_seconds=20) as reward:
        assert reward.score(PROMPTS, COMPLETIONS) == [1.0, 1.0]
        with pytest.raises(RewardError, match="extra"):  # the stray line is quoted, whenever it arrived
            reward.score(PROMPTS, COMPLETIONS)
    assert_group_gone(pidfile)


def test_big_stdout_lines_and_stderr_do_not_block(tmp_path):
    argv, pidfile = misbehaving(tmp_path, "big_output")
    with make_reward(command=argv, mode="oneshot", timeout_seconds=20) as reward:
        assert reward.score(PROMPTS, COMPLETIONS) == [0.25, 0.25]
    assert_group_gone(pidfile)  # a successful one-shot batch also takes its leftovers down


def test_unusable_programs_fail_at_set_up(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain = tmp_path / "plain.py"
    plain.write_text("print('hi')\n")
    cases = [
        ([str(tmp_path / "missing.py")], "not found"),
        (["./plain.py"], "is not executable"),
        (["plain.py"], "write './plain.py'"),
        (["no-such-reward-program-on-path"], "not found on PATH"),
        ([], "non-empty list of strings"),
    ]
    for argv, fragment in cases:
        with pytest.raises(RewardError, match=fragment):
            make_reward(command=argv)
    with pytest.raises(RewardError, match="reward_mode 'sometimes'"):
        make_reward(command=[str(EXAMPLE)], mode="sometimes")
    with pytest.raises(RewardError, match="reward_timeout_seconds 0"):
        make_reward(command=[str(EXAMPLE)], timeout_seconds=0)
    with pytest.raises(RewardError, match="exactly one"):
        make_reward(command=[str(EXAMPLE)], function="m:f")


REWARD_MODULE = """
def length(prompts, completions):
    return [float(len(p) + len(c)) for p, c in zip(prompts, completions)]

def too_few(prompts, completions):
    return [1.0]

def not_a_list(prompts, completions):
    return "1.0"

def infinite(prompts, completions):
    return [1.0, float("inf")]

def boom(prompts, completions):
    raise ValueError("no\\nway")
"""


@pytest.mark.parametrize("module", ["test_rewards_module_a", "sub/test_rewards_module_b.py"])
def test_function_reward_scores_a_batch(tmp_path, monkeypatch, module):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "test_rewards_module_a.py").write_text(REWARD_MODULE)
    (tmp_path / "sub" / "test_rewards_module_b.py").write_text(REWARD_MODULE)
    with make_reward(function=f"{module}:length") as reward:
        assert reward.score(["ab", "c"], ["xyz", ""]) == [5.0, 1.0]


def test_function_reward_failures_name_the_function(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "test_rewards_module_c.py").write_text(REWARD_MODULE)
    cases = {
        "too_few": "returned 1 values for 2 completions",
        "not_a_list": "returned a str for 2 completions",
        "infinite": "returned inf at index 1",
        "boom": "raised ValueError: no | way",
    }
    for name, fragment in cases.items():
        reward = make_reward(function=f"test_rewards_module_c:{name}")
        with pytest.raises(RewardError) as failure:
            reward.score(["a", "b"], ["c", "d"])
        assert str(failure.value).startswith(f"reward function 'test_rewards_module_c:{name}' ")
        assert fragment in str(failure.value)
    for spec, fragment in [
        ("test_rewards_module_c", "must look like 'module:function'"),
        ("test_rewards_module_c:missing", "has no function 'missing'"),
        ("no_such_module_xyz:f", "ModuleNotFoundError"),
        ("nowhere/rewards.py:f", "not found"),
    ]:
        with pytest.raises(RewardError, match=fragment):
            make_reward(function=spec)


def test_prompt_is_the_last_user_message():
    chat = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Calculate 1 + 1."},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Calculate 2 + 2."},
    ]
    assert prompt_of(chat) == "Calculate 2 + 2."


REFERENCE = Path(__file__).resolve().parent / "reward_programs" / "reference.py"


@pytest.mark.parametrize("mode", ["persistent", "oneshot"])
def test_a_reference_answer_travels_as_an_extra_request_field(tmp_path, mode):
    """Held-out records that end with their answer: the request carries it as "reference"
    (only where the prompt has one), as TRL passes a dataset's extra columns."""
    log = tmp_path / "requests.jsonl"
    with make_reward(command=[str(REFERENCE), str(log)], mode=mode, timeout_seconds=20) as reward:
        assert reward.score(["1 + 1?", "2 + 2?"], ["2", "5"], ["2", None]) == [1.0, -1.0]
        assert reward.score(["10 + 10?"], ["20"]) == [-1.0]
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"prompt": "1 + 1?", "completion": "2", "reference": "2"},
        {"prompt": "2 + 2?", "completion": "5"},
        {"prompt": "10 + 10?", "completion": "20"},
    ]


def test_a_reward_function_gets_reference_answers_as_a_keyword(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "test_rewards_module_d.py").write_text(
        "def exact(prompts, completions, reference=None):\n"
        "    return [-1.0 if r is None else float(c == r) for c, r in zip(completions, reference or [None] * len(prompts))]\n"
        "def plain(prompts, completions):\n"
        "    return [0.0] * len(completions)\n")
    with make_reward(function="test_rewards_module_d:exact") as reward:
        assert reward.score(["1 + 1?", "2 + 2?", "3 + 3?"], ["2", "5", "6"], ["2", "4", None]) == [1.0, 0.0, -1.0]
        assert reward.score(["1 + 1?"], ["2"]) == [-1.0]
    with make_reward(function="test_rewards_module_d:plain") as reward:  # no reference: called as before
        assert reward.score(["1 + 1?"], ["2"], [None]) == [0.0]
