"""Tools a policy calls inside its trajectory's sandbox: the built-ins and the
user's exec tools of `[agent.environment.tools]` (notes §5).

An observation is a deterministic function of the action and the workspace:
no container ids, host paths, pids, timings; listings sorted; error texts fixed;
output cut at `max_output_bytes` on a UTF-8 boundary with a fixed marker. A
tool is known as `id@version`; changing its name, description or schema means a
new version. Arguments are checked against the tool's JSON Schema: a mismatch is
an error observation, not a crash. A broken tool or sandbox is reported with
`broken` set to the trajectory's stop reason: the engine drops that trajectory."""

from __future__ import annotations

import codecs
import dataclasses
import errno
import functools
import hashlib
import json
import math
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import jsonschema.exceptions

from retrograd.data.files import UnsafeJSON, load_json
from retrograd.errors import ConfigError
from retrograd.rollouts.sandbox.base import WRITE_ERRORS, ExecResult, Sandbox, SandboxBroken, trusted

WHERE = "[agent.environment.tools]"
TRUNCATED = "\n[output truncated at {limit} bytes]"
TIMED_OUT = "error: the command did not finish within {seconds:g} s and was killed"
MAX_SCRIPT_BYTES = 100_000
MAX_ERROR_BYTES = 2_000  # an error observation about a call quotes at most this much of it
MAX_TOOL_REWARD = 1e6  # a json tool's reward; beyond it a reply is a protocol break
PROTOCOLS = ("text", "json")
PYTHON = re.compile(r"python[0-9.]*")  # interpreter names that get -I


@dataclass(frozen=True)
class ExecToolSpec:
    argv: tuple[str, ...]  # run inside the sandbox; the arguments arrive on stdin as one JSON object
    timeout_secs: float | None = None  # None: the sandbox's exec timeout
    protocol: str = "text"  # "text" | "json"


@dataclass(frozen=True)
class ToolResult:
    content: str  # what the model reads
    is_error: bool = False  # the action failed; the episode goes on
    reward: float | None = None  # step reward (json exec tools)
    done: bool = False  # the episode ends here (submit, json exec tools): run verify next
    broken: str | None = None  # the tool or its world broke: the trajectory's stop reason (agent.FAILED), it is dropped


@dataclass(frozen=True)
class Tool:
    id: str
    version: int
    name: str  # what the model calls
    description: str
    input_schema: dict = field(hash=False)
    run: Callable[[Sandbox, dict], ToolResult] = field(repr=False, compare=False)
    validator: jsonschema.protocols.Validator = field(repr=False, compare=False)
    exec_spec: ExecToolSpec | None = None  # None for built-ins

    @property
    def key(self) -> str:
        return f"{self.id}@{self.version}"

    def spec(self) -> dict:
        """The OpenAI function-calling form that chat templates render."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.input_schema}}


def make_tool(id: str, version: int, name: str, description: str, input_schema: dict,
              run: Callable[[Sandbox, dict], ToolResult], where: str, exec_spec: ExecToolSpec | None = None) -> Tool:
    """Checks the schema once, at start-up."""
    if not isinstance(input_schema, dict) or input_schema.get("type") != "object":
        raise ConfigError(f"{where}.input_schema of {id}@{version}: expected a JSON Schema with type = 'object'")
    cls = jsonschema.validators.validator_for(input_schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(input_schema)
    except jsonschema.exceptions.SchemaError as error:
        raise ConfigError(f"{where}.input_schema of {id}@{version} is not a valid JSON Schema: "
                          f"{error.message}") from None
    return Tool(id, version, name, description, input_schema, run, cls(input_schema), exec_spec)


@dataclass(frozen=True)
class Toolset:
    name: str
    tools: tuple[Tool, ...]

    def specs(self) -> list[dict]:
        return [tool.spec() for tool in self.tools]

    def call(self, sandbox: Sandbox | object | None, name: str, arguments: dict | str) -> ToolResult:
        """Runs one tool call on what the tools act on: the trajectory's sandbox, its http episode
        (rollouts.http_env), or None (mcp tools only). `arguments` is the parsed object or its JSON
        text. Whatever the model wrote, the answer is a ToolResult: a bad call is an error observation."""
        tool = next((tool for tool in self.tools if tool.name == name), None)
        if tool is None:
            return _refused(f"unknown tool {name!r}; available: {', '.join(sorted(t.name for t in self.tools))}")
        if isinstance(arguments, str):
            try:
                arguments = load_json(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return _refused(f"the arguments of {name} are not valid JSON")
            except UnsafeJSON as error:
                return _refused(f"the arguments of {name} are refused: {error}")
        error = jsonschema.exceptions.best_match(tool.validator.iter_errors(arguments))
        if error is not None:
            at = "/".join(str(part) for part in error.absolute_path)
            return _refused(f"invalid arguments for {name}: {error.message}" + (f" (at {at})" if at else ""))
        if _holds_nul(arguments):
            return _refused(f"invalid arguments for {name}: a string holds a NUL character")
        try:
            result = tool.run(sandbox, arguments)
        except SandboxBroken as broken:
            return ToolResult(f"sandbox broken: {broken}", is_error=True, broken="sandbox_broken")
        except OSError as error:
            if error.errno != errno.E2BIG:
                raise
            return _refused(f"the arguments of {name} are too long for a command line")
        if not isinstance(sandbox, Sandbox):  # a server's tool (http, mcp): it cut its own result
            return result
        # An error text may quote the model's arguments (a path, say): it is cut like output.
        return dataclasses.replace(result, content=clip(result.content, sandbox.limits.max_output_bytes))


def _refused(reason: str) -> ToolResult:
    return ToolResult(clip("error: " + reason, MAX_ERROR_BYTES), is_error=True)


def _holds_nul(value) -> bool:
    """A NUL cannot travel on a command line, where the built-ins pass their arguments.
    (Parsed arguments are at most data.tools.MAX_JSON_DEPTH deep.)"""
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, dict):
        return any(_holds_nul(item) for item in value.values())
    return isinstance(value, list) and any(_holds_nul(item) for item in value)


# --- observation text ---------------------------------------------------------------------------

def decode(data: bytes) -> str:
    """UTF-8 with U+FFFD for bad bytes; an incomplete last character (from a cut) is dropped."""
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=False)


def clip(text: str, limit: int, truncated: bool = False) -> str:
    """At most `limit` bytes of UTF-8, ending with the fixed marker when anything was cut."""
    data = text.encode()
    if len(data) <= limit and not truncated:
        return text
    marker = TRUNCATED.format(limit=limit)
    return decode(data[:max(limit - len(marker.encode()), 0)]) + marker


def render_text(result: ExecResult, limit: int, timeout: float) -> ToolResult:
    """stdout, then stderr and a non-zero exit code, each on its own lines."""
    if result.timed_out:
        return ToolResult(TIMED_OUT.format(seconds=timeout), is_error=True)
    parts = [decode(result.stdout)] if result.stdout else []
    if result.stderr:
        parts.append("[stderr]\n" + decode(result.stderr))
    if result.exit_code != 0:
        parts.append(f"[exit code {result.exit_code}]")
    content = ""
    for part in parts:
        content += ("\n" if content and not content.endswith("\n") else "") + part
    return ToolResult(clip(content or "(no output)", limit, result.truncated), is_error=result.exit_code != 0)


def render_json(result: ExecResult, limit: int, timeout: float) -> ToolResult:
    """stdout must be {"content": str, "is_error"?: bool, "reward"?: number, "done"?: bool};
    anything else from a command that exited 0 is a broken tool."""
    if result.timed_out or result.exit_code != 0:
        return render_text(result, limit, timeout)
    try:
        reply = load_json(result.stdout.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, UnsafeJSON):
        reply = None
    problem = _json_reply_problem(reply, result.truncated)
    if problem is not None:
        return ToolResult(clip(f"tool broke the json protocol: {problem}", limit), is_error=True, broken="sandbox_broken")
    return ToolResult(clip(reply["content"], limit), is_error=reply.get("is_error", False),
                      reward=float(reply["reward"]) if "reward" in reply else None, done=reply.get("done", False))


def _json_reply_problem(reply, truncated: bool) -> str | None:
    if truncated:
        return "stdout is longer than max_output_bytes"
    if not isinstance(reply, dict):
        return "stdout is not one JSON object"
    unknown = sorted(set(reply) - {"content", "is_error", "reward", "done"})
    checks = [
        (not unknown, f"unknown fields {unknown}"),
        (isinstance(reply.get("content"), str), "'content' must be a string"),
        (isinstance(reply.get("is_error", False), bool), "'is_error' must be true or false"),
        (isinstance(reply.get("done", False), bool), "'done' must be true or false"),
        ("reward" not in reply or is_reward(reply["reward"]),
         f"'reward' must be a number within ±{MAX_TOOL_REWARD:g}"),
    ]
    return next((problem for ok, problem in checks if not ok), None)


def is_reward(value) -> bool:
    """Within ±MAX_TOOL_REWARD: a larger one would swamp or overflow the group's advantages."""
    return _is_finite(value) and abs(value) <= MAX_TOOL_REWARD


def _is_finite(value) -> bool:
    """A number a float can hold: not a bool, NaN, an infinity or an integer past float's range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


RENDERERS = {"text": render_text, "json": render_json}


# --- built-in tools -----------------------------------------------------------------------------

# Each script exits 3.. to name a problem in fixed words instead of the tool's own message.
READ_SCRIPT = ('[ -d "$1" ] && exit 3; [ -e "$1" ] || exit 4; [ -r "$1" ] || exit 5; '
               'exec cat -- "$1" 2>/dev/null')
LIST_SCRIPT = '[ -e "$1" ] || exit 4; [ -d "$1" ] || exit 6; exec find "$1" -mindepth 1 -maxdepth 1 -printf "%y %f\\0"'
GREP_SCRIPT = '[ -e "$1" ] || exit 4; p=$1; shift; exec grep -rnIHZE "$@" -- "$p"'
PATH_ERRORS = {3: "is a directory", 4: "does not exist", 5: "is not readable", 6: "is not a directory"}


def _path(sandbox: Sandbox, path: str) -> tuple[str, str]:
    """(path inside the sandbox, path as the model sees it): relative paths start at
    /work, and /work maps to the sandbox's workspace (a temp dir for `local`)."""
    shown = posixpath.normpath(posixpath.join("/work", path))
    inside = sandbox.workdir + shown[len("/work"):] if shown == "/work" or shown.startswith("/work/") else shown
    return inside, shown


def _shell(interpreter: list[str], key: str):
    def run(sandbox: Sandbox, args: dict) -> ToolResult:
        result = sandbox.exec([*interpreter, args[key]])
        return render_text(result, sandbox.limits.max_output_bytes, sandbox.limits.exec_timeout_secs)
    return run


def _read_file(sandbox: Sandbox, args: dict) -> ToolResult:
    inside, shown = _path(sandbox, args["path"])
    result = sandbox.exec(["sh", "-c", READ_SCRIPT, "sh", inside])
    return _failed(sandbox, result, shown, "read") or ToolResult(
        clip(decode(result.stdout) or "(empty file)", sandbox.limits.max_output_bytes, result.truncated))


def _write_file(sandbox: Sandbox, args: dict) -> ToolResult:
    inside, shown = _path(sandbox, args["path"])
    data = args["content"].encode()
    result = sandbox.write(inside, data)
    if result.exit_code in WRITE_ERRORS and not result.timed_out:
        return ToolResult(f"error: cannot write {shown}: {WRITE_ERRORS[result.exit_code]}", is_error=True)
    return _failed(sandbox, result, shown, "write") or ToolResult(f"wrote {len(data)} bytes to {shown}")


def _edit_file(sandbox: Sandbox, args: dict) -> ToolResult:
    inside, shown = _path(sandbox, args["path"])
    old, new = args["old_string"], args["new_string"]
    if not old:
        return ToolResult("error: old_string must not be empty", is_error=True)
    result = sandbox.exec(["sh", "-c", READ_SCRIPT, "sh", inside])
    failed = _failed(sandbox, result, shown, "read")
    if failed:
        return failed
    if result.truncated:
        return ToolResult(f"error: {shown} is larger than {sandbox.limits.max_output_bytes} bytes; "
                          f"edit it with another tool", is_error=True)
    try:
        text = result.stdout.decode("utf-8")
    except UnicodeDecodeError:
        return ToolResult(f"error: {shown} is not UTF-8 text", is_error=True)
    count = text.count(old)
    if count == 0:
        return ToolResult(f"error: old_string was not found in {shown}", is_error=True)
    if count > 1 and not args.get("replace_all", False):
        return ToolResult(f"error: old_string occurs {count} times in {shown}; include more context to make it "
                          f"unique, or set replace_all", is_error=True)
    written = _write_file(sandbox, {"path": args["path"], "content": text.replace(old, new)})
    if written.is_error:
        return written
    return ToolResult(f"replaced {count} occurrence{'s' if count > 1 else ''} in {shown}")


def _list_dir(sandbox: Sandbox, args: dict) -> ToolResult:
    inside, shown = _path(sandbox, args.get("path", "."))
    result = sandbox.exec(["sh", "-c", LIST_SCRIPT, "sh", inside])
    failed = _failed(sandbox, result, shown, "list")
    if failed:
        return failed
    entries = sorted(entry.split(" ", 1) for entry in decode(result.stdout).split("\0") if " " in entry)
    lines = [name + ("/" if kind == "d" else "") for kind, name in sorted(entries, key=lambda e: e[1].encode())]
    return ToolResult(clip("\n".join(lines) or "(empty directory)", sandbox.limits.max_output_bytes,
                           result.truncated))


def _grep(sandbox: Sandbox, args: dict) -> ToolResult:
    inside, shown = _path(sandbox, args.get("path", "."))
    flags = ["-i"] if args.get("ignore_case", False) else []
    result = sandbox.exec(["sh", "-c", GREP_SCRIPT, "sh", inside, *flags, "-e", args["pattern"]])
    if result.exit_code == 1 and not result.timed_out:
        return ToolResult("no matches")
    if result.exit_code == 2 and not result.timed_out:
        message = decode(result.stderr).strip().splitlines()
        reason = message[0].removeprefix("grep: ") if message else "grep failed"
        return ToolResult(f"error: {reason}", is_error=True)
    failed = _failed(sandbox, result, shown, "search")
    if failed:
        return failed
    matches = []
    for line in decode(result.stdout).splitlines():
        file, _, rest = line.partition("\0")
        number, _, text = rest.partition(":")
        if number.isdigit():
            matches.append((_shown_path(sandbox, file).encode(), int(number), text))
    lines = [f"{file.decode()}:{number}:{text}" for file, number, text in sorted(matches)]
    return ToolResult(clip("\n".join(lines), sandbox.limits.max_output_bytes, result.truncated))


def _submit(sandbox: Sandbox, args: dict) -> ToolResult:
    return ToolResult("submitted", done=True)


def _failed(sandbox: Sandbox, result: ExecResult, shown: str, action: str) -> ToolResult | None:
    if result.timed_out:
        return ToolResult(TIMED_OUT.format(seconds=sandbox.limits.exec_timeout_secs), is_error=True)
    if result.exit_code in PATH_ERRORS:
        return ToolResult(f"error: {shown} {PATH_ERRORS[result.exit_code]}", is_error=True)
    if result.exit_code != 0:
        return ToolResult(f"error: cannot {action} {shown}", is_error=True)
    return None


def _shown_path(sandbox: Sandbox, inside: str) -> str:
    if sandbox.workdir != "/work" and (inside == sandbox.workdir or inside.startswith(sandbox.workdir + "/")):
        return "/work" + inside[len(sandbox.workdir):]
    return inside


def _schema(required: list[str], **properties) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _string(description: str) -> dict:
    return {"type": "string", "description": description}


PATH_HELP = "path relative to /work, or absolute"
BUILTINS = {tool.id: tool for tool in (
    make_tool("bash", 1, "bash", "Run a bash command in /work; returns stdout, stderr and the exit code.",
              _schema(["command"], command=_string("the bash command")), _shell(["bash", "-c"], "command"), "bash"),
    make_tool("python", 1, "python", "Run a Python 3 program (python3 -c) in /work; returns its output.",
              _schema(["code"], code=_string("the program text")), _shell(["python3", "-c"], "code"), "python"),
    make_tool("read_file", 1, "read_file", "Read a text file.",
              _schema(["path"], path=_string(PATH_HELP)), _read_file, "read_file"),
    make_tool("write_file", 1, "write_file", "Create or overwrite a file, creating parent directories.",
              _schema(["path", "content"], path=_string(PATH_HELP), content=_string("the whole new file text")),
              _write_file, "write_file"),
    make_tool("edit_file", 1, "edit_file", "Replace old_string by new_string in a file; old_string must occur "
              "exactly once unless replace_all is true.",
              _schema(["path", "old_string", "new_string"], path=_string(PATH_HELP),
                      old_string=_string("exact text to replace"), new_string=_string("replacement text"),
                      replace_all={"type": "boolean", "description": "replace every occurrence"}),
              _edit_file, "edit_file"),
    make_tool("list_dir", 1, "list_dir", "List a directory, sorted by name; directories end with '/'.",
              _schema([], path=_string(PATH_HELP + "; default /work")), _list_dir, "list_dir"),
    make_tool("grep", 1, "grep", "Search files under a path for an extended regular expression; "
              "prints path:line:text sorted by path and line.",
              _schema(["pattern"], pattern=_string("extended regular expression"),
                      path=_string(PATH_HELP + "; default /work"),
                      ignore_case={"type": "boolean", "description": "match case-insensitively"}),
              _grep, "grep"),
    make_tool("submit", 1, "submit", "Finish the task, optionally with a final answer.",
              _schema([], answer=_string("the final answer")), _submit, "submit"),
)}
BUILTIN_TOOLSETS = {
    "base": ("bash", "read_file", "write_file", "edit_file", "list_dir", "grep", "submit"),
    "python": ("bash", "read_file", "write_file", "edit_file", "list_dir", "grep", "submit", "python"),
}


# --- user exec tools ----------------------------------------------------------------------------

def run_exec_tool(spec: ExecToolSpec, sandbox: Sandbox, args: dict) -> ToolResult:
    """Runs as a trusted program (base.TRUSTED_SCRIPT), a Python interpreter isolated (-I): what
    the policy wrote to the workspace cannot replace the modules the tool imports."""
    stdin = json.dumps(args, sort_keys=True, separators=(",", ":")).encode()
    timeout = spec.timeout_secs or sandbox.limits.exec_timeout_secs
    result = sandbox.exec(trusted(_isolated(spec.argv)), stdin=stdin, timeout=timeout)
    return RENDERERS[spec.protocol](result, sandbox.limits.max_output_bytes, timeout)


def _isolated(argv: tuple[str, ...]) -> tuple[str, ...]:
    """python3 -I: neither the cwd nor the script's folder on sys.path, no user site, no PYTHON* variables."""
    if PYTHON.fullmatch(posixpath.basename(argv[0])):
        return (argv[0], "-I", *argv[1:])
    return argv


def _exec_tool(entry, where: str, base_dir: Path) -> Tool:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} = {entry!r}: expected a table")
    problems = [f"{where}.{key}: unknown key (known: description, exec, id, input_schema, name, version)"
                for key in entry if key not in ("id", "version", "name", "description", "input_schema", "exec")]
    tool_id, version = entry.get("id"), entry.get("version", 1)
    if not (isinstance(tool_id, str) and tool_id.replace("_", "").replace("-", "").isalnum()):
        problems.append(f"{where}.id = {tool_id!r}: expected a name of letters, digits, '_' or '-'")
    if not (isinstance(version, int) and not isinstance(version, bool) and version >= 1):
        problems.append(f"{where}.version = {version!r}: expected an integer >= 1")
    name, description = entry.get("name", tool_id), entry.get("description")
    if not (isinstance(name, str) and name):
        problems.append(f"{where}.name = {name!r}: expected a non-empty string")
    if not isinstance(description, str):
        problems.append(f"{where}.description is required: a string telling the model what the tool does")
    spec = _exec_spec(entry.get("exec"), f"{where}.exec", base_dir, problems)
    if problems:
        raise ConfigError("; ".join(problems))
    return make_tool(tool_id, version, name, description, entry.get("input_schema"),
                     functools.partial(run_exec_tool, spec), where, spec)


def _exec_spec(table, where: str, base_dir: Path, problems: list[str]) -> ExecToolSpec:
    if not isinstance(table, dict):
        problems.append(f"{where} is required: a table with argv, and optionally script, timeout_secs, protocol")
        return ExecToolSpec(argv=())
    problems += [f"{where}.{key}: unknown key (known: argv, protocol, script, timeout_secs)"
                 for key in table if key not in ("argv", "script", "timeout_secs", "protocol")]
    argv, timeout, protocol = table.get("argv"), table.get("timeout_secs"), table.get("protocol", "text")
    if not (isinstance(argv, list) and argv and all(isinstance(arg, str) for arg in argv)):
        problems.append(f"{where}.argv = {argv!r}: expected a non-empty list of strings (run inside the sandbox)")
        argv = []
    if timeout is not None and not (_is_finite(timeout) and timeout > 0):
        problems.append(f"{where}.timeout_secs = {timeout!r}: expected a number > 0")
        timeout = None
    if protocol not in PROTOCOLS:
        problems.append(f"{where}.protocol = {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        protocol = "text"
    if "script" in table:
        argv = [*argv, _script_text(table["script"], f"{where}.script", base_dir, problems)]
    return ExecToolSpec(argv=tuple(argv), timeout_secs=None if timeout is None else float(timeout), protocol=protocol)


def _script_text(script, where: str, base_dir: Path, problems: list[str]) -> str:
    """A host file passed as the last argv element (e.g. after python3 -c)."""
    path = base_dir / script if isinstance(script, str) else None
    try:
        data = path.read_bytes() if path else b""
    except OSError as error:
        problems.append(f"{where} = {script!r}: cannot read {path}: {error.strerror}")
        return ""
    if path is None or len(data) > MAX_SCRIPT_BYTES:
        problems.append(f"{where} = {script!r}: expected a path to a file of at most {MAX_SCRIPT_BYTES} bytes")
        return ""
    return data.decode("utf-8", "replace")


# --- the catalogue ------------------------------------------------------------------------------

class ToolCatalog:
    """Every tool and toolset of a run. A scenario picks a toolset with
    `metadata.env.toolset`: the default or one of `scenario_toolsets`."""

    def __init__(self, tools: dict[str, Tool], toolsets: dict[str, Toolset], default: str,
                 scenario_toolsets: tuple[str, ...] = ()):
        self.tools = tools  # by id@version
        self.toolsets = toolsets
        self.default = default
        self.scenario_toolsets = scenario_toolsets

    @classmethod
    def of(cls, name: str, tools: tuple[Tool, ...]) -> ToolCatalog:
        """One toolset of servers' tools (an http environment's, mcp servers'): every scenario's."""
        return cls({tool.key: tool for tool in tools}, {name: Toolset(name, tools)}, name)

    def with_tools(self, extra: tuple[Tool, ...], where: str) -> ToolCatalog:
        """Every toolset with `extra` (mcp servers' tools) added; a name used twice is refused."""
        toolsets = {}
        for name, toolset in self.toolsets.items():
            names = [tool.name for tool in (*toolset.tools, *extra)]
            clashes = sorted({n for n in names if names.count(n) > 1})
            if clashes:
                raise ConfigError(f"{where}: tool {clashes[0]!r} is also in toolset {name!r}; deny one of them")
            toolsets[name] = Toolset(name, toolset.tools + extra)
        return ToolCatalog(self.tools | {tool.key: tool for tool in extra}, toolsets, self.default, self.scenario_toolsets)

    @classmethod
    def builtin(cls, default: str = "python") -> ToolCatalog:
        return cls.from_table({"default": default}, Path("."))

    @classmethod
    def from_table(cls, table: dict, base_dir: Path) -> ToolCatalog:
        """`table` is `[agent.environment.tools]`; scripts resolve against `base_dir`
        (the TOML's directory). Every problem is reported at once."""
        problems = [f"{WHERE}.{key}: unknown key (known: default, scenario_toolsets, tool, toolset)"
                    for key in table if key not in ("default", "scenario_toolsets", "tool", "toolset")]
        tools = {tool.key: tool for tool in BUILTINS.values()}
        entries = table.get("tool", [])
        if not isinstance(entries, list):
            problems.append(f"{WHERE}.tool: expected an array of tables [[{WHERE[1:-1]}.tool]]")
            entries = []
        for i, entry in enumerate(entries):
            try:
                tool = _exec_tool(entry, f"{WHERE}.tool[{i}]", base_dir)
            except ConfigError as error:
                problems.append(str(error))
                continue
            if tool.key in tools:
                problems.append(f"{WHERE}.tool[{i}]: {tool.key} is already defined")
            tools[tool.key] = tool
        definitions = table.get("toolset", {})
        if not isinstance(definitions, dict):
            problems.append(f"{WHERE}.toolset: expected tables [{WHERE[1:-1]}.toolset.NAME]")
            definitions = {}
        problems += [f"{WHERE}.toolset.{name}: redefines a built-in toolset" for name in definitions
                     if name in BUILTIN_TOOLSETS]
        toolsets = {}
        for name in [*BUILTIN_TOOLSETS, *definitions]:
            try:
                toolsets[name] = Toolset(name, _resolve(name, definitions, tools, ()))
            except ConfigError as error:
                problems.append(str(error))
        default, scenario_toolsets = table.get("default"), table.get("scenario_toolsets", [])
        if default not in toolsets:
            problems.append(f"{WHERE}.default = {default!r}: expected one of {', '.join(sorted(toolsets))}")
        if not isinstance(scenario_toolsets, list):
            problems.append(f"{WHERE}.scenario_toolsets = {scenario_toolsets!r}: expected a list of toolset names")
            scenario_toolsets = []
        problems += [f"{WHERE}.scenario_toolsets: unknown toolset {name!r}" for name in scenario_toolsets
                     if name not in toolsets]
        if problems:
            raise ConfigError("; ".join(problems))
        return cls(tools, toolsets, default, tuple(scenario_toolsets))

    def toolset(self, name: str | None = None, where: str = "metadata.env.toolset") -> Toolset:
        """The default toolset, or a scenario's pick (checked at start-up by the caller)."""
        if name is None or name == self.default:
            return self.toolsets[self.default]
        if name not in self.scenario_toolsets:
            raise ConfigError(f"{where} = {name!r}: a scenario may use the default toolset {self.default!r} or one of "
                              f"{WHERE}.scenario_toolsets ({', '.join(self.scenario_toolsets) or 'none listed'})")
        return self.toolsets[name]

    def signature(self) -> str:
        """sha256 over every definition and toolset: resume refuses a changed catalogue."""
        described = {
            "tools": [[t.key, t.name, t.description, t.input_schema,
                       None if t.exec_spec is None else [list(t.exec_spec.argv), t.exec_spec.timeout_secs, t.exec_spec.protocol]]
                      for t in sorted(self.tools.values(), key=lambda t: t.key)],
            "toolsets": {name: [t.key for t in toolset.tools] for name, toolset in sorted(self.toolsets.items())},
            "default": self.default, "scenario_toolsets": list(self.scenario_toolsets),
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _resolve(name: str, definitions: dict, tools: dict[str, Tool], stack: tuple[str, ...]) -> tuple[Tool, ...]:
    where = f"{WHERE}.toolset.{name}"
    if name in BUILTIN_TOOLSETS:
        return tuple(tools[f"{tool_id}@1"] for tool_id in BUILTIN_TOOLSETS[name])
    if name in stack:
        raise ConfigError(f"{where}: includes itself through {' -> '.join(stack + (name,))}")
    definition = definitions.get(name)
    if not isinstance(definition, dict):
        raise ConfigError(f"{WHERE}: unknown toolset {name!r}" if definition is None else f"{where}: expected a table")
    unknown = [key for key in definition if key not in ("include", "tools", "deny")]
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (known: deny, include, tools)")
    chosen: list[Tool] = []
    for included in _names(definition, "include", where):
        chosen += _resolve(included, definitions, tools, stack + (name,))
    chosen += [_lookup(ref, tools, f"{where}.tools") for ref in _names(definition, "tools", where)]
    denied = set(_names(definition, "deny", where))
    kept = {tool.key: tool for tool in chosen if tool.id not in denied and tool.key not in denied}
    names = [tool.name for tool in kept.values()]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise ConfigError(f"{where}: two tools are named {clashes[0]!r}; deny one of them")
    return tuple(kept.values())


def _names(definition: dict, key: str, where: str) -> list[str]:
    value = definition.get(key, [])
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise ConfigError(f"{where}.{key} = {value!r}: expected a list of names")
    return value


def _lookup(ref: str, tools: dict[str, Tool], where: str) -> Tool:
    if ref in tools:
        return tools[ref]
    versions = [tool for tool in tools.values() if tool.id == ref]
    if len(versions) == 1:
        return versions[0]
    if versions:
        raise ConfigError(f"{where}: {ref!r} has versions {', '.join(sorted(t.key for t in versions))}; "
                          f"write id@version")
    raise ConfigError(f"{where}: unknown tool {ref!r} (known: {', '.join(sorted(tools))})")
