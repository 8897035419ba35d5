"""Agentic GRPO scenario files: what a valid file gives, and every malformed line refused
with its file:line before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrograd.errors import RetrogradError
from retrograd.rollouts.scenarios import load_scenarios
from retrograd.rollouts.tools import ToolCatalog

CATALOG = ToolCatalog.from_table({"default": "base", "scenario_toolsets": ["python"]}, Path("."))
VERIFIED = {"env": {"files": {"a.py": "print(1)\n"}, "setup": ["true"],
                    "verify": {"command": "python3 a.py", "reward_on_success": 2.0}}}


def write(tmp_path: Path, *records) -> Path:
    path = tmp_path / "scenarios.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_a_valid_file_gives_scenarios_with_their_task_toolset_and_suffix(tmp_path):
    path = write(tmp_path,
                 {"id": "one", "system": "Be brief.", "user": "Run a.py.", "metadata": VERIFIED},
                 "",
                 {"id": "two", "user": "Say hi.", "metadata": {"rubric": "friendly", "env": {"toolset": "python"}}})
    one, two = load_scenarios(path, CATALOG, judged=True, system_suffix=" Think first.")
    assert one.source == f"{path}:1" and two.source == f"{path}:3"
    assert one.messages() == [{"role": "system", "content": "Be brief. Think first."}, {"role": "user", "content": "Run a.py."}]
    assert two.system == " Think first."  # created for the suffix
    assert one.verifiable and not two.verifiable
    assert one.env.files == (("a.py", "print(1)\n"),) and one.env.verify.reward_on_success == 2.0
    assert one.env.verify.command == ("sh", "-c", "python3 a.py")
    assert one.toolset.name == "base" and two.toolset.name == "python" and two.rubric == "friendly"


def test_without_an_environment_there_are_no_tools_and_the_judge_scores(tmp_path):
    (scenario,) = load_scenarios(write(tmp_path, {"id": "q", "user": "2+2?"}), None, judged=True)
    assert scenario.toolset is None and scenario.env is None and scenario.system is None


@pytest.mark.parametrize("record, needle", [
    ({"user": "hi"}, 'missing "id"'),
    ({"id": "", "user": "hi"}, 'missing "id"'),
    ({"id": "x"}, '"user" must be a non-empty string, got nothing'),
    ({"id": "x", "user": "  "}, '"user" must be a non-empty string'),
    ({"id": "x", "user": "hi", "system": 3}, '"system" must be a non-empty string'),
    ({"id": "x", "user": "hi", "prompt": "?"}, "unknown key 'prompt'"),
    ({"id": "x", "user": "hi", "metadata": {"enviroment": {}}}, "unknown key metadata.enviroment"),
    ({"id": "x", "user": "hi", "metadata": []}, '"metadata" must be an object'),
    ({"id": "x", "user": "hi", "metadata": {"env": {"toolset": "nope"}}}, "metadata.env.toolset = 'nope'"),
    ({"id": "x", "user": "hi", "metadata": {"env": {"files": {"../up": "x"}}}}, "must be relative to /work"),
    ({"id": "x", "user": "hi", "metadata": {"env": {"verify": {"cmd": "true"}}}}, "metadata.env.verify"),
    ({"id": "x", "user": "hi", "metadata": {"env": {"verify": {"command": "true", "check_files": ["t.py"]}}}},
     "metadata.env.verify.check_files: 't.py' is not one of metadata.env.files"),
    ({"id": "x", "user": "hi", "metadata": {"env": {}}}, "nothing could score it"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object per line"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, record, needle):
    path = write(tmp_path, {"id": "fine", "user": "ok", "metadata": VERIFIED}, record)
    with pytest.raises(RetrogradError) as error:
        load_scenarios(path, CATALOG, judged=False)
    message = str(error.value)
    assert f"{path}:2" in message and needle in message and "\n" not in message


def test_duplicate_ids_name_both_lines(tmp_path):
    path = write(tmp_path, {"id": "same", "user": "a", "metadata": VERIFIED}, {"id": "same", "user": "b", "metadata": VERIFIED})
    with pytest.raises(RetrogradError, match=rf"{path}:2: id 'same' is already used at {path}:1"):
        load_scenarios(path, CATALOG, judged=False)


def test_a_sandbox_task_needs_an_environment(tmp_path):
    path = write(tmp_path, {"id": "x", "user": "hi", "metadata": VERIFIED})
    with pytest.raises(RetrogradError, match=r":1: metadata.env describes a sandbox task, but the config has no \[agent.environment\]"):
        load_scenarios(path, None, judged=True)


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(RetrogradError, match="no scenarios"):
        load_scenarios(path, CATALOG, judged=True)
