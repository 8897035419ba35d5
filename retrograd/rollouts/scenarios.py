"""Agentic GRPO scenarios: one JSON object per line, strict, checked once at start-up.

    {"id": "fix-1", "system": "Use tools when useful.", "user": "Fix add.py.",
     "metadata": {"env": {"files": {"add.py": "...", "add_test.py": "..."}, "setup": ["..."],
                          "verify": {"command": "python3 add_test.py", "reward_on_success": 1.0,
                                     "check_files": ["add_test.py"]},
                          "toolset": "python"},
                  "rubric": "criteria for the judge"}}

`id` and `user` are required, ids are unique; `system` is optional. `metadata.env` is the
sandbox task (retrograd.rollouts.sandbox.ScenarioEnv); its toolset must be the catalogue's
default or one of its `scenario_toolsets`. A scenario is scored by its `verify` command
when it has one, else by the judge, so a scenario with neither is refused. Every problem
names `file:line`.

`verify.check_files` names the files of `files` that the command relies on (its tests):
they are written afresh just before it runs, so a policy that edits them gains nothing.
The command runs as a trusted program (Sandbox.verify): Python started by it finds the
workspace's modules after its own, never instead of them. The code under test still runs
inside the command and could end it with success (os._exit(0) on import): a check that
must hold against that runs the solution in a child process and judges its output.

The system message gets `system_suffix` appended (one is created when the scenario has no
system text and the suffix is not empty), as retrograd does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrograd.data.files import json_lines, read_text
from retrograd.errors import DataError
from retrograd.rollouts.sandbox import ScenarioEnv
from retrograd.rollouts.tools import ToolCatalog, Toolset

KEYS = ("id", "system", "user", "metadata")
METADATA_KEYS = ("env", "rubric")


@dataclass(frozen=True)
class Scenario:
    id: str
    system: str | None  # with system_suffix applied; None: no system message
    user: str
    rubric: str | None
    env: ScenarioEnv | None  # None: no sandbox task (scored by the judge)
    toolset: Toolset | None  # None: no environment, so no tools
    source: str  # `file:line`

    @property
    def verifiable(self) -> bool:
        return self.env is not None and self.env.verify is not None

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": self.user}]


def load_scenarios(path: Path, catalog: ToolCatalog | None, *, judged: bool, system_suffix: str = "",
                   sandboxed: bool = True) -> tuple[Scenario, ...]:
    """Every scenario of `path`; `catalog` is None when the run has no tools, `judged` says
    whether something scores scenarios without `verify` (an [agent.judge], or an http
    environment's step rewards) and `sandboxed` whether the tools run in sandboxes, where the
    tasks of metadata.env are set up (not mcp servers' or an http environment's)."""
    path = Path(path)
    text = read_text(path)
    scenarios: list[Scenario] = []
    first_seen: dict[str, str] = {}
    for where, record in json_lines(path, text):
        scenario = _scenario(record, where, catalog, judged, system_suffix, sandboxed)
        if scenario.id in first_seen:
            raise DataError(f"{where}: id {scenario.id!r} is already used at {first_seen[scenario.id]}; ids must be unique")
        first_seen[scenario.id] = where
        scenarios.append(scenario)
    if not scenarios:
        raise DataError(f"{path}: no scenarios (expected one JSON object per line with at least id and user)")
    return tuple(scenarios)


def _scenario(record: dict, where: str, catalog: ToolCatalog | None, judged: bool, suffix: str, sandboxed: bool) -> Scenario:
    unknown = [k for k in record if k not in KEYS]
    if unknown:
        raise DataError(f"{where}: unknown key {unknown[0]!r} (a scenario has {', '.join(KEYS)})")
    scenario_id = record.get("id")
    if not isinstance(scenario_id, str) or not scenario_id.strip():
        raise DataError(f'{where}: missing "id" (expected a non-empty string naming the scenario)')
    user = _text(record, "user", where, required=True)
    system = _text(record, "system", where, required=False)
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DataError(f'{where}: "metadata" must be an object with env and/or rubric, got {type(metadata).__name__}')
    unknown = [k for k in metadata if k not in METADATA_KEYS]
    if unknown:
        raise DataError(f"{where}: unknown key metadata.{unknown[0]} (known: {', '.join(METADATA_KEYS)})")
    rubric = _text(metadata, "rubric", f"{where} metadata", required=False)
    env = None
    if "env" in metadata:
        if catalog is None or not sandboxed:
            raise DataError(f"{where}: metadata.env describes a sandbox task, but the config has no [agent.environment] "
                            "with sandboxes (type = container, sandbox or local)")
        env = ScenarioEnv.from_json(metadata["env"], f"{where} metadata.env")
    toolset = None
    if catalog is not None:
        toolset = catalog.toolset(env.toolset if env else None, f"{where} metadata.env.toolset")
    if not (env and env.verify) and not judged:
        raise DataError(f"{where}: scenario {scenario_id!r} has no metadata.env.verify, so nothing could score it "
                        "(the judge scores training scenarios when there is an [agent.judge]; evaluation uses the "
                        "environment reward only)")
    if suffix:
        system = (system or "") + suffix
    return Scenario(scenario_id, system, user, rubric, env, toolset, where)


def _text(record: dict, key: str, where: str, *, required: bool) -> str | None:
    value = record.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        got = "nothing" if value is None else repr(value)[:60]
        raise DataError(f'{where}: "{key}" must be a non-empty string, got {got}')
    return value

