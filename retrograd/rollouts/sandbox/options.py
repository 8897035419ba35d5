"""Options of `[agent.environment]` and of a scenario's `metadata.env`, as frozen
dataclasses checked once when they are built. Key names and defaults follow
retrograd (notes §3 and §5); `type = "sandbox"` (Linux namespaces) is ours."""

from __future__ import annotations

import itertools
import math
import os
import posixpath
import re
import stat
from dataclasses import dataclass, field, fields

from retrograd.errors import ConfigError

DEFAULT_IMAGE = "retrograd-sandbox:bookworm"  # built by bin/build-sandbox-image
ENVIRONMENT_TYPES = ("container", "sandbox", "local")
REUSE_MODES = ("never", "workspace")
WHERE = "[agent.environment]"
VOLUME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # Docker's rule for volume names
SOCKET_DIRS = ("/run", "/var/run")  # where the host's daemons keep their sockets (docker.sock among them)
NETWORK_WARNING = (f"{WHERE}.allow_network = true: sandboxed commands can reach this host's services, its "
                   f"network and cloud metadata addresses (169.254.169.254)")


@dataclass(frozen=True)
class Limits:
    cpus: float = 1.0
    memory_mb: int = 1024  # everything the sandbox holds: its processes and its tmpfs files
    pids: int = 256
    exec_timeout_secs: float = 30.0
    max_output_bytes: int = 65536  # per stream of one exec, and per observation
    # tmpfs sizes, inside memory_mb: a full disk is an ENOSPC the model sees, not a kill
    workspace_mb: int | None = None  # /work; None: half of memory_mb
    tmp_mb: int | None = None  # /tmp; None: a quarter of memory_mb
    shm_mb: int | None = None  # /dev/shm; None: 64, or an eighth of memory_mb when that is less

    @property
    def workspace_size_mb(self) -> int:
        return self.memory_mb // 2 if self.workspace_mb is None else self.workspace_mb

    @property
    def tmp_size_mb(self) -> int:
        return self.memory_mb // 4 if self.tmp_mb is None else self.tmp_mb

    @property
    def shm_size_mb(self) -> int:
        return min(64, self.memory_mb // 8) if self.shm_mb is None else self.shm_mb

    def problems(self, where: str) -> list[str]:
        checks = [
            ("cpus", self.cpus > 0, "a number > 0"),
            ("memory_mb", self.memory_mb >= 64, "an integer >= 64"),
            ("pids", self.pids >= 8, "an integer >= 8"),
            ("exec_timeout_secs", self.exec_timeout_secs > 0, "a number > 0"),
            ("max_output_bytes", self.max_output_bytes >= 256, "an integer >= 256"),
            ("workspace_mb", self.workspace_mb is None or self.workspace_mb >= 1, "an integer >= 1"),
            ("tmp_mb", self.tmp_mb is None or self.tmp_mb >= 1, "an integer >= 1"),
            ("shm_mb", self.shm_mb is None or self.shm_mb >= 1, "an integer >= 1"),
        ]
        problems = [f"{where}.{key} = {getattr(self, key)!r}: expected {want}" for key, ok, want in checks if not ok]
        sizes = self.workspace_size_mb + self.tmp_size_mb + self.shm_size_mb
        if not problems and sizes > self.memory_mb:
            problems.append(f"{where}: workspace_mb + tmp_mb + shm_mb = {self.workspace_size_mb} + {self.tmp_size_mb}"
                            f" + {self.shm_size_mb} = {sizes}: expected at most memory_mb ({self.memory_mb}), "
                            f"which holds them")
        return problems


@dataclass(frozen=True)
class PoolOptions:
    max_live: int = 8  # live sandboxes (leased + idle + being created) never exceed this
    min_idle: int = 0  # sandboxes kept ready by prewarm()
    reuse: str = "never"  # "workspace": wipe /work and /tmp, kill leftovers, lease again
    max_leases_per_container: int = 32

    def problems(self, where: str) -> list[str]:
        problems = []
        if self.max_live < 1:
            problems.append(f"{where}.max_live = {self.max_live!r}: expected an integer >= 1")
        if not 0 <= self.min_idle <= self.max_live:
            problems.append(f"{where}.min_idle = {self.min_idle!r}: expected 0 <= min_idle <= max_live ({self.max_live})")
        if self.reuse not in REUSE_MODES:
            problems.append(f"{where}.reuse = {self.reuse!r}: expected one of {', '.join(REUSE_MODES)}")
        if self.max_leases_per_container < 1:
            problems.append(f"{where}.max_leases_per_container = {self.max_leases_per_container!r}: expected >= 1")
        return problems


@dataclass(frozen=True)
class EnvironmentOptions:
    """`allow_network` puts containers on Docker's default bridge: besides the internet they
    reach every service of this host (through the bridge's gateway) and cloud metadata
    addresses such as 169.254.169.254, which hand out the machine's credentials on many
    clouds; the backend prints NETWORK_WARNING when it starts. `cache_volume` is a Docker
    volume name, or a host path under one of `cache_volume_roots` that holds no socket."""

    type: str
    image: str = DEFAULT_IMAGE
    user: str = "65534:65534"  # numeric UID:GID; root is refused
    verify_user: str = "65533:65533"  # runs `verify` (container); not the policy's uid: it cannot edit what is checked
    runtime: str | None = None  # e.g. "runsc" for gVisor
    allow_network: bool = False
    cache_volume: str | None = None  # volume name or absolute host path, mounted read-only at /opt/cache
    cache_volume_roots: tuple[str, ...] = ()  # host folders a cache_volume path may lie in
    setup_timeout_secs: float = 300.0
    verify_timeout_secs: float | None = None  # None: the exec timeout
    run_id: str | None = None  # None: derived from the owner pid
    allow_unsandboxed: bool = False
    limits: Limits = field(default_factory=Limits)
    pool: PoolOptions = field(default_factory=PoolOptions)

    def __post_init__(self):
        problems = self.problems(WHERE)
        if problems:
            raise ConfigError("; ".join(problems))

    def problems(self, where: str) -> list[str]:
        if self.type not in ENVIRONMENT_TYPES:
            return [f"{where}.type = {self.type!r}: expected one of {', '.join(ENVIRONMENT_TYPES)}"]
        problems = self.limits.problems(f"{where}.limits") + self.pool.problems(f"{where}.pool")
        problems += [f"{where}.{key} = {value!r}: only applies to type = {applies!r}"
                     for key, value, applies in self._misplaced_keys()]
        if self.type == "local" and not self.allow_unsandboxed:
            problems.append(f"{where}.type = 'local' runs tool calls on this host without isolation; "
                            f"set allow_unsandboxed = true to accept that, or use type = 'container' or 'sandbox'")
        for key in ("user", "verify_user"):
            if not _is_non_root_user(getattr(self, key)):
                problems.append(f"{where}.{key} = {getattr(self, key)!r}: expected numeric 'UID:GID' with both "
                                f"non-zero (running as root is refused)")
        if self.verify_user.split(":")[0] == self.user.split(":")[0]:
            problems.append(f"{where}.verify_user = {self.verify_user!r}: expected another UID than user's "
                            f"({self.user!r}), so that verify cannot be edited by the policy's commands")
        problems += _cache_volume_problems(self.cache_volume, self.cache_volume_roots, where)
        if self.setup_timeout_secs <= 0:
            problems.append(f"{where}.setup_timeout_secs = {self.setup_timeout_secs!r}: expected a number > 0")
        if self.verify_timeout_secs is not None and self.verify_timeout_secs <= 0:
            problems.append(f"{where}.verify_timeout_secs = {self.verify_timeout_secs!r}: expected a number > 0")
        return problems

    def _misplaced_keys(self):
        defaults = EnvironmentOptions.__dataclass_fields__
        only_for = {"image": "container", "user": "container", "verify_user": "container", "runtime": "container",
                    "allow_network": "container", "cache_volume": "container", "cache_volume_roots": "container",
                    "run_id": "container", "allow_unsandboxed": "local"}
        for key, applies in only_for.items():
            value = getattr(self, key)
            if applies != self.type and value != defaults[key].default:
                yield key, value, applies

    @property
    def uid_gid(self) -> tuple[int, int]:
        uid, gid = self.user.split(":")
        return int(uid), int(gid)

    @property
    def cache_volume_source(self) -> str | None:
        """What Docker mounts: the volume name, or the checked host path with its links resolved."""
        if self.cache_volume is None or not self.cache_volume.startswith("/"):
            return self.cache_volume
        return os.path.realpath(self.cache_volume)

    @property
    def verify_timeout(self) -> float:
        return self.limits.exec_timeout_secs if self.verify_timeout_secs is None else self.verify_timeout_secs

    @classmethod
    def from_table(cls, table: dict) -> EnvironmentOptions:
        """Build from the parsed TOML table, reporting every problem at once. `tools`
        is skipped here: retrograd.rollouts.tools.ToolCatalog.from_table reads it."""
        problems: list[str] = []
        limits = _build(Limits, table.get("limits", {}), f"{WHERE}.limits", problems)
        pool = _build(PoolOptions, table.get("pool", {}), f"{WHERE}.pool", problems)
        rest = {key: value for key, value in table.items() if key not in ("limits", "pool", "tools")}
        kwargs = {"type": None} | checked_kwargs(cls, rest, WHERE, problems)
        try:
            options = cls(**kwargs, limits=limits, pool=pool)
        except ConfigError as error:
            problems.append(str(error))
        if problems:
            raise ConfigError("; ".join(problems))
        return options


def _is_non_root_user(user: str) -> bool:
    parts = user.split(":")
    return len(parts) == 2 and all(part.isdigit() and int(part) > 0 for part in parts)


def _cache_volume_problems(volume: str | None, roots: tuple[str, ...], where: str) -> list[str]:
    """A host path is shared only when it lies under a root the user listed, is not `/` nor
    under /run or /var/run, and holds no socket: a daemon's socket inside a sandbox hands
    it the daemon (docker.sock: the host's root)."""
    problems = [f"{where}.cache_volume_roots: {root!r} is not an absolute path" for root in roots
                if not posixpath.isabs(root)]
    key = f"{where}.cache_volume = {volume!r}"
    if volume is None:
        return problems
    if "docker.sock" in volume:
        return problems + [f"{key}: mounting the Docker socket is refused"]
    if not volume.startswith("/"):
        named = VOLUME_NAME.fullmatch(volume)
        return problems + ([] if named else [f"{key}: expected a Docker volume name or an absolute host path"])
    problem = host_path_problem(volume, roots, where)
    return problems + ([f"{key}: {problem}"] if problem else [])


def host_path_problem(path: str, roots: tuple[str, ...], where: str = WHERE) -> str | None:
    """Why the host path `path` may not be shared with sandboxes, or None."""
    resolved = os.path.realpath(path)
    if ":" in path or "," in path:
        return "a host path with ':' or ',' cannot be mounted"
    if resolved == "/" or any(_is_within(resolved, os.path.realpath(folder)) for folder in SOCKET_DIRS):
        return f"sharing {resolved} is refused ('/', /run and /var/run hold the host's daemon sockets)"
    if not any(_is_within(resolved, os.path.realpath(root)) for root in roots if posixpath.isabs(root)):
        return (f"{resolved} is not under any of {where}.cache_volume_roots ({', '.join(roots) or 'none set'}); "
                f"add the folder you mean to share there")
    if not os.path.exists(resolved):
        return f"{resolved} does not exist"
    return _socket_problem(resolved)


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _socket_problem(path: str) -> str | None:
    """Why `path` must not be shared: a socket at or below it (links are not followed:
    inside the container they resolve there), or a folder that cannot be searched."""
    unreadable: list[str] = []
    walk = os.walk(path, onerror=lambda error: unreadable.append(error.filename))
    below = (os.path.join(folder, name) for folder, _, names in walk for name in names)
    for candidate in itertools.chain([path], below):
        if _is_socket(candidate):
            return f"{candidate} is a socket; a path holding sockets is refused"
    return f"{unreadable[0]} cannot be searched for sockets" if unreadable else None


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:  # gone meanwhile
        return False


# --- table -> dataclass plumbing ---------------------------------------------------------------

_KINDS = {  # field annotation -> (accepts, description)
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), "a number"),
    "float | None": (lambda v: _KINDS["float"][0](v), "a number"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "int | None": (lambda v: _KINDS["int"][0](v), "an integer"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "str | None": (lambda v: isinstance(v, str), "a string"),
    "tuple[str, ...]": (lambda v: isinstance(v, list) and all(isinstance(item, str) for item in v),
                        "a list of strings"),
}


def checked_kwargs(cls, table: dict, where: str, problems: list[str]) -> dict:
    kinds = {f.name: f.type for f in fields(cls) if f.type in _KINDS}
    kwargs = {}
    for key, value in table.items():
        if key not in kinds:
            problems.append(f"{where}.{key}: unknown key (known: {', '.join(sorted(kinds))})")
            continue
        accepts, description = _KINDS[kinds[key]]
        if not accepts(value):
            problems.append(f"{where}.{key} = {value!r}: expected {description}")
            continue
        kind = kinds[key]
        kwargs[key] = float(value) if kind.startswith("float") else tuple(value) if kind.startswith("tuple") else value
    return kwargs


def _build(cls, table, where: str, problems: list[str]):
    if not isinstance(table, dict):
        problems.append(f"{where} = {table!r}: expected a table")
        return cls()
    return cls(**checked_kwargs(cls, table, where, problems))


# --- a scenario's metadata.env ------------------------------------------------------------------

@dataclass(frozen=True)
class VerifySpec:
    """`check_files` name entries of `files` that the command relies on (its tests): they are
    written afresh just before the command runs, so the policy's edits to them do not count."""

    command: tuple[str, ...]  # argv; a string command in the JSON becomes ("sh", "-c", command)
    reward_on_success: float = 1.0
    check_files: tuple[tuple[str, str], ...] = ()  # (path relative to /work, text), from `files`


@dataclass(frozen=True)
class ScenarioEnv:
    files: tuple[tuple[str, str], ...] = ()  # (path relative to /work, text), sorted by path
    setup: tuple[tuple[str, ...], ...] = ()  # argvs run in order; any failure is an error
    verify: VerifySpec | None = None
    summary: tuple[str, ...] | None = None  # argv whose output the judge sees, e.g. ("git", "diff")
    toolset: str | None = None

    @classmethod
    def from_json(cls, env: object, where: str) -> ScenarioEnv:
        """`where` names the scenario for messages, e.g. "scenarios.jsonl:3 metadata.env"."""
        if not isinstance(env, dict):
            raise ConfigError(f"{where} = {env!r}: expected an object")
        problems = [f"{where}.{key}: unknown key (known: files, setup, summary, toolset, verify)"
                    for key in env if key not in ("files", "setup", "summary", "toolset", "verify")]
        files = env.get("files", {})
        if not isinstance(files, dict) or not all(isinstance(text, str) for text in files.values()):
            problems.append(f"{where}.files: expected an object mapping paths to text")
            files = {}
        problems += [f"{where}.files: path {path!r} must be relative to /work and stay inside it"
                     for path in files if not _is_workspace_path(path)]
        setup = env.get("setup", [])
        if not isinstance(setup, list):
            problems.append(f"{where}.setup = {setup!r}: expected a list of commands")
            setup = []
        setup = [_command(command, f"{where}.setup[{i}]", problems) for i, command in enumerate(setup)]
        verify = env.get("verify")
        if verify is not None:
            verify = _verify(verify, files, f"{where}.verify", problems)
        summary = env.get("summary")
        if summary is not None and not (isinstance(summary, list) and summary and all(isinstance(a, str) for a in summary)):
            problems.append(f"{where}.summary = {summary!r}: expected an argv list of strings")
        toolset = env.get("toolset")
        if toolset is not None and not isinstance(toolset, str):
            problems.append(f"{where}.toolset = {toolset!r}: expected a toolset name")
        if problems:
            raise ConfigError("; ".join(problems))
        return cls(files=tuple(sorted(files.items())), setup=tuple(setup), verify=verify,
                   summary=tuple(summary) if summary else None, toolset=toolset)


def _is_workspace_path(path: str) -> bool:
    normal = posixpath.normpath(path)
    return bool(path) and not posixpath.isabs(path) and normal != ".." and not normal.startswith("../")


def _command(command, where: str, problems: list[str]) -> tuple[str, ...]:
    if isinstance(command, str) and command:
        return ("sh", "-c", command)
    if isinstance(command, list) and command and all(isinstance(arg, str) for arg in command):
        return tuple(command)
    problems.append(f"{where} = {command!r}: expected a shell command string or an argv list of strings")
    return ()


def _verify(verify, files: dict, where: str, problems: list[str]) -> VerifySpec | None:
    if not isinstance(verify, dict) or "command" not in verify:
        problems.append(f"{where} = {verify!r}: expected {{\"command\": ..., \"reward_on_success\": number}}")
        return None
    problems += [f"{where}.{key}: unknown key (known: check_files, command, reward_on_success)"
                 for key in verify if key not in ("command", "reward_on_success", "check_files")]
    reward = verify.get("reward_on_success", 1.0)
    if not _KINDS["float"][0](reward):
        problems.append(f"{where}.reward_on_success = {reward!r}: expected a finite number")
        reward = 1.0
    check_files = verify.get("check_files", [])
    if not _KINDS["tuple[str, ...]"][0](check_files):
        problems.append(f"{where}.check_files = {check_files!r}: expected a list of paths from metadata.env.files")
        check_files = []
    problems += [f"{where}.check_files: {path!r} is not one of metadata.env.files" for path in check_files
                 if path not in files]
    return VerifySpec(command=_command(verify["command"], f"{where}.command", problems),
                      reward_on_success=float(reward),
                      check_files=tuple(sorted((path, files[path]) for path in set(check_files) if path in files)))
