"""Rewards the model cannot forge. A scripted policy (tool calls, no model) plants modules and
start-up hooks in its workspace and edits the check file; verify and json exec tools must still
report what the task earns: 0 while add.py is wrong, on every backend.

Each attack below works against a command run as the policy would run it (`sandbox.exec`):
`test_each_attack_forges_a_plain_run` shows it, so the other tests fail if the protection goes."""

from __future__ import annotations

import json

import pytest

from retrograd.errors import ConfigError
from retrograd.rollouts.sandbox import EnvironmentOptions, Limits, PoolOptions, ScenarioEnv, open_environment
from retrograd.rollouts.tools import ToolCatalog

LIMITS = Limits(memory_mb=256, pids=64, exec_timeout_secs=10, max_output_bytes=4096)
BUGGY, FIXED = "def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n"
CHECK = """\
import json, unittest
from add import add

class Add(unittest.TestCase):
    def test_add(self):
        self.assertEqual(json.loads(json.dumps(add(2, 3))), 5)

unittest.main()
"""
ENV = ScenarioEnv.from_json({"files": {"add.py": BUGGY, "test_add.py": CHECK},
                             "verify": {"command": "python3 test_add.py", "check_files": ["test_add.py"]}},
                            "forging:1 metadata.env")
FORGE = "import os; os._exit(0)\n"  # any Python that runs before the test ends it with success
USER_SITE = "{site}"  # the user site-packages folder under HOME (= /work for the policy)
ATTACKS = {  # name -> files the policy writes (paths relative to /work)
    "stdlib modules in the workspace": {"json.py": FORGE, "unittest.py": FORGE},
    "user site hooks": {f"{USER_SITE}/usercustomize.py": FORGE, f"{USER_SITE}/forge.pth": FORGE},
    "edited check file": {"test_add.py": "print('all tests passed')\n"},
    "check file made a link": {"test_add.py": None},  # None: a symlink to /dev/null (an empty script)
}
# Not effective against a plain run, but next to the sitecustomize that verify's Python gets.
HOOKS_IN_THE_WORKSPACE = {"sitecustomize.py": FORGE, "usercustomize.py": FORGE}
SCORE_TOOL = """\
import json, sys
json.load(sys.stdin)
print(json.dumps({"content": "scored", "reward": 0.0}))
"""
FORGED_JSON = ("def load(stream): return {}\n"
               "def dumps(obj): return '{\"content\": \"forged\", \"reward\": 1.0}'\n")


@pytest.fixture(scope="module", params=[pytest.param("container", marks=pytest.mark.container),
                                        pytest.param("sandbox", marks=pytest.mark.namespace), "local"])
def pool(request):
    options = EnvironmentOptions(type=request.param, limits=LIMITS, pool=PoolOptions(max_live=2),
                                 allow_unsandboxed=request.param == "local")
    with open_environment(options) as pool:
        yield pool


@pytest.fixture
def sandbox(pool):
    sandbox = pool.acquire()
    sandbox.prepare(ENV, setup_timeout=30, where="forging:1")
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "score.py").write_text(SCORE_TOOL)
    entries = [{"id": "score", "description": "Score the work.", "input_schema": {"type": "object"},
                "exec": {"argv": ["python3", "-c"], "script": "score.py", "protocol": "json"}},
               {"id": "score_sh", "description": "Score the work.", "input_schema": {"type": "object"},
                "exec": {"argv": ["sh", "-c", 'exec python3 -c "$0"'], "script": "score.py", "protocol": "json"}}]
    table = {"default": "forging", "tool": entries,
             "toolset": {"forging": {"include": ["base"], "tools": ["score", "score_sh"]}}}
    return ToolCatalog.from_table(table, folder).toolset()


def plant(tools, sandbox, files: dict) -> None:
    """The policy's moves: write_file for each file, a bash ln for a link."""
    site = tools.call(sandbox, "bash", {"command": "python3 -c 'import site; print(site.getusersitepackages())'"})
    relative_site = site.content.strip().removeprefix(sandbox.workdir + "/")
    for path, text in files.items():
        path = path.replace(USER_SITE, relative_site)
        if text is None:
            result = tools.call(sandbox, "bash", {"command": f"rm -f {path}; ln -s /dev/null {path}"})
        else:
            result = tools.call(sandbox, "write_file", {"path": path, "content": text})
        assert not result.is_error, result.content


@pytest.mark.parametrize("attack", ATTACKS)
def test_each_attack_forges_a_plain_run(tools, sandbox, attack):
    if attack == "user site hooks":
        user_site = tools.call(sandbox, "bash", {"command": "python3 -c 'import site; print(site.ENABLE_USER_SITE)'"})
        if user_site.content.strip() != "True":  # a local sandbox inherits PATH: an activated venv's python3 has none
            pytest.skip("the sandbox's python3 reads no user site (a virtual environment's), so there is nothing to forge")
    assert sandbox.exec(ENV.verify.command).exit_code != 0  # add.py is wrong
    plant(tools, sandbox, ATTACKS[attack])
    assert sandbox.exec(ENV.verify.command).exit_code == 0  # ... yet the plain run succeeds


@pytest.mark.parametrize("attack", [*ATTACKS, "all at once"])
def test_verify_reward_is_not_forged(tools, sandbox, attack):
    files = {k: v for name in ATTACKS for k, v in ATTACKS[name].items() if v is not None} | HOOKS_IN_THE_WORKSPACE
    plant(tools, sandbox, files if attack == "all at once" else ATTACKS[attack])
    assert sandbox.verify(ENV.verify, timeout=10) == 0.0
    assert tools.call(sandbox, "read_file", {"path": "test_add.py"}).content == CHECK  # written afresh


def test_a_solved_task_still_earns_its_reward(tools, sandbox):
    assert sandbox.verify(ENV.verify, timeout=10) == 0.0
    tools.call(sandbox, "edit_file", {"path": "add.py", "old_string": "a - b", "new_string": "a + b"})
    assert sandbox.verify(ENV.verify, timeout=10) == 1.0  # the workspace's own modules still import


@pytest.mark.parametrize("tool", ["score", "score_sh"])
def test_json_tool_reward_is_not_forged(tools, sandbox, tool):
    assert tools.call(sandbox, tool, {}).reward == 0.0
    plant(tools, sandbox, {"json.py": FORGED_JSON})
    forged = json.loads(sandbox.exec(["python3", "-c", SCORE_TOOL], stdin=b"{}").stdout)
    assert forged["reward"] == 1.0  # what the tool would report, run as the policy runs Python
    plant(tools, sandbox, HOOKS_IN_THE_WORKSPACE | ATTACKS["user site hooks"])
    result = tools.call(sandbox, tool, {})
    assert (result.content, result.reward, result.is_error) == ("scored", 0.0, False)


@pytest.mark.container
def test_container_verify_runs_as_another_uid_that_cannot_write_the_workspace(tools):
    options = EnvironmentOptions(type="container", limits=LIMITS)
    uid = options.verify_user.split(":")[0]
    as_verifier = ScenarioEnv.from_json({"verify": {"command": f"test $(id -u) = {uid}"}}, "v").verify
    writes = ScenarioEnv.from_json({"verify": {"command": "touch /work/x || touch x"}}, "v").verify
    with open_environment(options) as pool:
        sandbox = pool.acquire()
        assert sandbox.verify(as_verifier, 10) == 1.0
        assert sandbox.verify(writes, 10) == 0.0
        assert tools.call(sandbox, "bash", {"command": "touch x && echo ok"}).content == "ok\n"
        sandbox.close()


def test_check_files_must_be_scenario_files():
    with pytest.raises(ConfigError, match=r"s:1 metadata.env.verify.check_files: 'missing.py' is not one of "
                                        r"metadata.env.files"):
        ScenarioEnv.from_json({"files": {"a.py": ""}, "verify": {"command": "true", "check_files": ["missing.py"]}},
                              "s:1 metadata.env")
    with pytest.raises(ConfigError, match=r"check_files = 'a.py': expected a list of paths"):
        ScenarioEnv.from_json({"files": {"a.py": ""}, "verify": {"command": "true", "check_files": "a.py"}}, "s:2")
    assert ENV.verify.check_files == (("test_add.py", CHECK),)


def test_check_files_in_a_folder_replace_links_on_the_way(tools, pool):
    env = ScenarioEnv.from_json({"files": {"tests/check.sh": "test \"$(cat ../answer)\" = 42\n"},
                                 "verify": {"command": "cd tests && sh check.sh", "check_files": ["tests/check.sh"]}},
                                "s:3")
    sandbox = pool.acquire()
    try:
        sandbox.prepare(env, setup_timeout=30, where="s:3")
        tools.call(sandbox, "bash", {"command": 'mkdir -p "$TMPDIR/fake" && echo "exit 0" > "$TMPDIR/fake/check.sh" && '
                                                'rm -r tests && ln -s "$TMPDIR/fake" tests'})
        assert sandbox.exec(["sh", "-c", "cd tests && sh check.sh"]).exit_code == 0  # forged for a plain run
        assert sandbox.verify(env.verify, timeout=10) == 0.0
        tools.call(sandbox, "write_file", {"path": "answer", "content": "42"})
        assert sandbox.verify(env.verify, timeout=10) == 1.0
        # the link was removed, not written through
        assert tools.call(sandbox, "bash", {"command": 'cat "$TMPDIR/fake/check.sh"'}).content == "exit 0\n"
    finally:
        sandbox.close()
