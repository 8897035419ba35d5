"""Built-in tools, exec tools and the catalogue, run in real sandboxes: bubblewrap
namespaces (when bwrap is installed) and the unsandboxed local backend."""

from __future__ import annotations

import json

import pytest

from retrograd.errors import ConfigError
from retrograd.rollouts.sandbox import EnvironmentOptions, Limits, open_environment
from retrograd.rollouts.tools import BUILTINS, TIMED_OUT, ToolCatalog, ToolResult

LIMITS = Limits(exec_timeout_secs=1, max_output_bytes=400)


@pytest.fixture(scope="module", params=[pytest.param("sandbox", marks=pytest.mark.namespace), "local"])
def pool(request):
    pool = open_environment(EnvironmentOptions(type=request.param, allow_unsandboxed=request.param == "local",
                                               limits=LIMITS))
    yield pool
    pool.close()


@pytest.fixture
def sandbox(pool):
    sandbox = pool.acquire()
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="module")
def tools():
    return ToolCatalog.builtin().toolset()


def call(tools, sandbox, name, **args) -> ToolResult:
    return tools.call(sandbox, name, args)


def test_builtin_catalogue_matches_retrograd_toolsets():
    catalog = ToolCatalog.builtin()
    base = {tool.key for tool in catalog.toolsets["base"].tools}
    assert base == {"bash@1", "read_file@1", "write_file@1", "edit_file@1", "list_dir@1", "grep@1", "submit@1"}
    assert {tool.key for tool in catalog.toolsets["python"].tools} == base | {"python@1"}
    for tool in BUILTINS.values():
        spec = tool.spec()
        assert spec["function"]["name"] == tool.name and spec["function"]["parameters"]["type"] == "object"


def test_write_read_edit_round_trip(tools, sandbox):
    text = "print('héllo')\nx = 1\nx = 1\n"
    assert call(tools, sandbox, "write_file", path="pkg/a.py", content=text) == \
        ToolResult(f"wrote {len(text.encode())} bytes to /work/pkg/a.py")
    assert call(tools, sandbox, "read_file", path="/work/pkg/a.py").content == text
    twice = call(tools, sandbox, "edit_file", path="pkg/a.py", old_string="x = 1", new_string="y = 2")
    assert twice.is_error and twice.content.startswith("error: old_string occurs 2 times in /work/pkg/a.py")
    assert call(tools, sandbox, "edit_file", path="pkg/a.py", old_string="x = 1", new_string="y = 2",
                replace_all=True).content == "replaced 2 occurrences in /work/pkg/a.py"
    assert call(tools, sandbox, "read_file", path="pkg/a.py").content == text.replace("x = 1", "y = 2")
    missing = call(tools, sandbox, "edit_file", path="pkg/a.py", old_string="zzz", new_string="")
    assert missing == ToolResult("error: old_string was not found in /work/pkg/a.py", is_error=True)


def test_path_errors_are_fixed_texts(tools, sandbox):
    call(tools, sandbox, "write_file", path="d/f.txt", content="x")
    assert call(tools, sandbox, "read_file", path="d") == ToolResult("error: /work/d is a directory", is_error=True)
    assert call(tools, sandbox, "read_file", path="nope") == ToolResult("error: /work/nope does not exist",
                                                                         is_error=True)
    assert call(tools, sandbox, "list_dir", path="d/f.txt") == ToolResult("error: /work/d/f.txt is not a directory",
                                                                           is_error=True)
    assert call(tools, sandbox, "write_file", path="d", content="x") == \
        ToolResult("error: cannot write /work/d: it is a directory", is_error=True)


def test_list_dir_is_sorted_and_marks_directories(tools, sandbox):
    for path in ["b.txt", "A.txt", "a/x", ".hidden", "c/d/e"]:
        call(tools, sandbox, "write_file", path=path, content="")
    assert call(tools, sandbox, "list_dir").content == ".hidden\nA.txt\na/\nb.txt\nc/"
    assert call(tools, sandbox, "list_dir", path="c/d").content == "e"
    call(tools, sandbox, "bash", command="mkdir empty")
    assert call(tools, sandbox, "list_dir", path="empty").content == "(empty directory)"


def test_grep_sorts_by_path_then_line(tools, sandbox):
    call(tools, sandbox, "write_file", path="z.txt", content="needle\nhay\nNeedle again\n")
    call(tools, sandbox, "write_file", path="sub/a.txt", content="hay\n" * 9 + "needle 10\n")
    call(tools, sandbox, "write_file", path="sub/b.bin", content="needle\0binary")
    assert call(tools, sandbox, "grep", pattern="needle").content == \
        "/work/sub/a.txt:10:needle 10\n/work/z.txt:1:needle"
    assert call(tools, sandbox, "grep", pattern="needle", path="z.txt", ignore_case=True).content == \
        "/work/z.txt:1:needle\n/work/z.txt:3:Needle again"
    assert call(tools, sandbox, "grep", pattern="absent") == ToolResult("no matches")
    bad = call(tools, sandbox, "grep", pattern="(unclosed")
    assert bad.is_error and bad.content.startswith("error: ") and "/work" not in bad.content
    assert call(tools, sandbox, "grep", pattern="x", path="nope") == \
        ToolResult("error: /work/nope does not exist", is_error=True)


def test_bash_and_python_show_stdout_stderr_and_exit_code(tools, sandbox):
    result = call(tools, sandbox, "bash", command="echo out; echo err >&2; exit 4")
    assert result == ToolResult("out\n[stderr]\nerr\n[exit code 4]", is_error=True)
    assert call(tools, sandbox, "python", code="print(6 * 7)") == ToolResult("42\n")
    assert call(tools, sandbox, "bash", command="true") == ToolResult("(no output)")
    assert call(tools, sandbox, "bash", command="pwd").content == sandbox.workdir + "\n"


def test_timeout_text_is_fixed_and_partial_output_hidden(tools, sandbox):
    result = call(tools, sandbox, "bash", command="echo started; sleep 30")
    assert result == ToolResult(TIMED_OUT.format(seconds=LIMITS.exec_timeout_secs), is_error=True)
    assert call(tools, sandbox, "bash", command="echo alive").content == "alive\n"


def test_output_is_cut_on_a_utf8_boundary_with_a_marker(tools, sandbox):
    result = call(tools, sandbox, "python", code="print('é' * 1000)")
    marker = f"\n[output truncated at {LIMITS.max_output_bytes} bytes]"
    assert result.content.endswith(marker)
    body = result.content[:-len(marker)]
    assert set(body) == {"é"} and len(result.content.encode()) <= LIMITS.max_output_bytes
    assert len(body.encode()) > LIMITS.max_output_bytes - len(marker) - 2


def test_invalid_arguments_are_error_observations(tools, sandbox):
    assert call(tools, sandbox, "read_file") == \
        ToolResult("error: invalid arguments for read_file: 'path' is a required property", is_error=True)
    wrong_type = call(tools, sandbox, "bash", command=3)
    assert wrong_type == ToolResult("error: invalid arguments for bash: 3 is not of type 'string' (at command)",
                                    is_error=True)
    assert tools.call(sandbox, "bash", '{"command": ') == \
        ToolResult("error: the arguments of bash are not valid JSON", is_error=True)
    assert tools.call(sandbox, "bash", '{"command": "echo hi"}') == ToolResult("hi\n")
    unknown = tools.call(sandbox, "rm_rf", {})
    assert unknown.is_error and unknown.content.startswith("error: unknown tool 'rm_rf'; available: bash, edit_file")


def test_submit_ends_the_episode(tools, sandbox):
    assert call(tools, sandbox, "submit", answer="42") == ToolResult("submitted", done=True)


def exec_catalog(tmp_path) -> ToolCatalog:
    script = tmp_path / "double.py"
    script.write_text("import json, sys\nargs = json.load(sys.stdin)\n"
                      "print(json.dumps({'content': str(2 * args['x']), 'reward': 0.25, 'done': args['x'] > 9}))\n")
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    table = {
        "default": "lab",
        "tool": [
            {"id": "double", "description": "doubles x", "input_schema": schema,
             "exec": {"argv": ["python3", "-c"], "script": "double.py", "protocol": "json"}},
            {"id": "echo_args", "version": 2, "description": "shows its stdin", "input_schema": {"type": "object"},
             "exec": {"argv": ["sh", "-c", "cat; echo; echo warn >&2; exit 3"]}},
            {"id": "liar", "description": "prints no JSON", "input_schema": {"type": "object"},
             "exec": {"argv": ["echo", "not json"], "protocol": "json"}},
            {"id": "extra", "description": "unknown field", "input_schema": {"type": "object"},
             "exec": {"argv": ["echo", '{"content": "x", "score": 1}'], "protocol": "json"}},
            {"id": "greedy", "description": "claims a huge reward", "input_schema": {"type": "object"},
             "exec": {"argv": ["echo", '{"content": "x", "reward": 1e300}'], "protocol": "json"}},
            {"id": "failing", "description": "json tool exiting 1", "input_schema": {"type": "object"},
             "exec": {"argv": ["sh", "-c", "echo bad input >&2; exit 1"], "protocol": "json"}},
            {"id": "slow", "description": "never answers", "input_schema": {"type": "object"},
             "exec": {"argv": ["sleep", "60"], "timeout_secs": 0.5, "protocol": "json"}},
        ],
        "toolset": {"lab": {"include": ["base"], "tools": ["double", "echo_args@2", "liar", "extra", "greedy", "failing", "slow"],
                            "deny": ["grep"]}},
    }
    return ToolCatalog.from_table(table, tmp_path)


def test_exec_tools_in_both_protocols(tmp_path, sandbox):
    lab = exec_catalog(tmp_path).toolset()
    assert "grep" not in [tool.name for tool in lab.tools]
    assert lab.call(sandbox, "double", {"x": 4}) == ToolResult("8", reward=0.25)
    assert lab.call(sandbox, "double", {"x": 10}) == ToolResult("20", reward=0.25, done=True)
    assert lab.call(sandbox, "echo_args", {"b": 1, "a": [1, 2]}) == \
        ToolResult('{"a":[1,2],"b":1}\n[stderr]\nwarn\n[exit code 3]', is_error=True)
    assert lab.call(sandbox, "failing", {}) == ToolResult("[stderr]\nbad input\n[exit code 1]", is_error=True)
    assert lab.call(sandbox, "slow", {}) == ToolResult(TIMED_OUT.format(seconds=0.5), is_error=True)


def test_a_broken_json_tool_is_not_an_ordinary_error(tmp_path, sandbox):
    lab = exec_catalog(tmp_path).toolset()
    liar = lab.call(sandbox, "liar", {})
    assert liar.broken and liar.is_error and liar.content == "tool broke the json protocol: stdout is not one JSON object"
    extra = lab.call(sandbox, "extra", {})
    assert extra.broken and extra.content == "tool broke the json protocol: unknown fields ['score']"
    greedy = lab.call(sandbox, "greedy", {})  # would overflow the group's advantages
    assert greedy.broken and greedy.reward is None and "'reward' must be a number within ±1e+06" in greedy.content
    assert not lab.call(sandbox, "failing", {}).broken


def test_catalogue_errors_name_the_key(tmp_path):
    def problems(table) -> str:
        with pytest.raises(ConfigError) as error:
            ToolCatalog.from_table(table, tmp_path)
        assert "\n" not in str(error.value)
        return str(error.value)

    bad_schema = {"id": "t", "description": "d", "input_schema": {"type": "object", "properties": {"x": {"type": 5}}},
                  "exec": {"argv": ["true"]}}
    assert "input_schema of t@1 is not a valid JSON Schema" in problems({"default": "base", "tool": [bad_schema]})
    message = problems({"default": "nope", "tool": [{"id": "t", "description": "d", "input_schema": {"type": "object"},
                                                     "exec": {"argv": [], "protocol": "xml", "script": "missing.py"}}]})
    for expected in ["[agent.environment.tools].tool[0].exec.argv = []", "protocol = 'xml'", "missing.py",
                     "[agent.environment.tools].default = 'nope'"]:
        assert expected in message
    assert "includes itself" in problems({"default": "a", "toolset": {"a": {"include": ["b"]}, "b": {"include": ["a"]}}})
    assert "redefines a built-in toolset" in problems({"default": "base", "toolset": {"base": {"tools": ["bash"]}}})
    assert "unknown tool 'nope'" in problems({"default": "a", "toolset": {"a": {"tools": ["nope"]}}})
    assert "is already defined" in problems({"default": "base", "tool": [dict(bad_schema, id="bash",
                                                                             input_schema={"type": "object"})]})


def test_scenario_toolsets(tmp_path):
    catalog = exec_catalog(tmp_path)
    assert catalog.toolset("lab") is catalog.toolset()
    with pytest.raises(ConfigError, match="scenario_toolsets"):
        catalog.toolset("python")
    allowed = ToolCatalog.from_table({"default": "base", "scenario_toolsets": ["python"]}, tmp_path)
    assert "python" in [tool.name for tool in allowed.toolset("python").tools]
    assert json.loads(json.dumps(catalog.toolset().specs()))[0]["type"] == "function"


def test_signature_follows_script_contents(tmp_path):
    table = {"default": "lab", "toolset": {"lab": {"tools": ["t"]}},
             "tool": [{"id": "t", "description": "d", "input_schema": {"type": "object"},
                       "exec": {"argv": ["python3", "-c"], "script": "t.py"}}]}
    (tmp_path / "t.py").write_text("print(1)\n")
    first = ToolCatalog.from_table(table, tmp_path).signature()
    assert ToolCatalog.from_table(table, tmp_path).signature() == first
    (tmp_path / "t.py").write_text("print(2)\n")
    assert ToolCatalog.from_table(table, tmp_path).signature() != first
