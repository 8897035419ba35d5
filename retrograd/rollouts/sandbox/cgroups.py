"""A cgroup per namespace sandbox, where the host lets this process make one: the
kernel then bounds the sandbox's total memory (its processes and its tmpfs files,
no swap) and its number of processes, whatever they do.

Two layouts are recognised, each probed by really making (and removing) a leaf:
- cgroup v2: leaves beside this process's own cgroup, when its parent has the memory
  and pids controllers enabled for its children and this user may move processes
  there (a delegated subtree, e.g. systemd's user@UID.service, or root).
- cgroup v1: leaves below this process's own cgroups in writable `memory` and `pids`
  hierarchies (root on a v1 host).
Elsewhere `find_hierarchy()` returns None and the sandbox's launcher enforces the
memory bound itself (launcher.py's watchdog). Leaves are named
`retrograd-<owner tag>-<random>`, so that a later run removes those of a dead one."""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from retrograd.runtime import owner

PREFIX = "retrograd-"
V1_CONTROLLERS = ("memory", "pids")
EMPTY_WAIT_SECS = 5.0  # how long a leaf may take to empty after its sandbox was killed


@dataclass(frozen=True)
class Hierarchy:
    version: int
    parents: tuple[Path, ...]  # v2: one directory; v1: the memory one, then the pids one

    def make_leaf(self, memory_bytes: int, pids: int) -> Leaf:
        leaf = Leaf(tuple(parent / f"{PREFIX}{owner.process_tag()}-{uuid.uuid4().hex[:12]}"
                          for parent in self.parents))
        try:
            for directory in leaf.directories:
                directory.mkdir()
            for name, value in self._limits(memory_bytes, pids):
                for directory in leaf.directories:
                    if (directory / name).exists():
                        (directory / name).write_text(str(value))
        except OSError:
            leaf.remove()
            raise
        return leaf

    def _limits(self, memory_bytes: int, pids: int) -> list[tuple[str, int]]:
        """(file, value) in the order they must be written; a file that a leaf lacks
        (swap accounting off, or the other v1 controller's directory) is skipped."""
        if self.version == 2:
            return [("memory.max", memory_bytes), ("memory.swap.max", 0), ("pids.max", pids)]
        return [("memory.limit_in_bytes", memory_bytes), ("memory.memsw.limit_in_bytes", memory_bytes),
                ("pids.max", pids)]

    def reap_orphans(self) -> int:
        """Removes the leaves of runs that died without cleaning up."""
        reaped = 0
        for parent in self.parents:
            for directory in parent.glob(f"{PREFIX}*"):
                tag = "-".join(directory.name[len(PREFIX):].split("-")[:2])
                if owner.is_dead(tag):
                    Leaf((directory,)).remove()
                    reaped += 1
        return reaped


@dataclass(frozen=True)
class Leaf:
    directories: tuple[Path, ...]

    def add(self, pid: int) -> None:
        """Moves `pid` (and so everything it will start) into the leaf."""
        for directory in self.directories:
            (directory / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """SIGKILLs whatever is still inside, then removes the leaf (best effort)."""
        deadline = time.monotonic() + EMPTY_WAIT_SECS
        for directory in self.directories:
            while directory.exists():
                for pid in _pids(directory):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    directory.rmdir()
                except OSError as error:
                    if error.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)  # killed tasks are still exiting


def find_hierarchy() -> Hierarchy | None:
    """Where this process may make sandbox leaves, or None."""
    own, mounts = _own_cgroups(), _cgroup_mounts()
    candidates = []
    if "" in own and "cgroup2" in mounts and own[""] != "/":
        candidates.append(Hierarchy(2, (_directory(mounts["cgroup2"], own[""]).parent,)))
    if all(name in own and name in mounts for name in V1_CONTROLLERS):
        candidates.append(Hierarchy(1, tuple(_directory(mounts[name], own[name]) for name in V1_CONTROLLERS)))
    return next((hierarchy for hierarchy in candidates if _usable(hierarchy)), None)


def _directory(mount: tuple[Path, str], cgroup: str) -> Path:
    """The directory of `cgroup` (as /proc/self/cgroup names it) in a hierarchy mounted
    at mount[0] whose root is the cgroup mount[1] (not "/" inside some containers)."""
    where, root = mount
    return where / os.path.relpath(cgroup, root)


def _usable(hierarchy: Hierarchy) -> bool:
    if hierarchy.version == 2:
        parent = hierarchy.parents[0]
        try:
            enabled = (parent / "cgroup.subtree_control").read_text().split()
        except OSError:
            return False
        if not {"memory", "pids"} <= set(enabled) or not os.access(parent / "cgroup.procs", os.W_OK):
            return False
    try:
        hierarchy.make_leaf(64 << 20, 8).remove()
    except OSError:
        return False
    return True


def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path ("" is the v2 unified hierarchy)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(","):
            own[name] = path
    return own


def _cgroup_mounts() -> dict[str, tuple[Path, str]]:
    """"cgroup2" and each v1 controller -> (where its hierarchy is mounted, the cgroup at that place)."""
    mounts: dict[str, tuple[Path, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        fstype, super_options = fields[separator + 1], fields[separator + 3].split(",")
        mount = (Path(fields[4].replace("\\040", " ")), fields[3])
        if fstype == "cgroup2":
            mounts.setdefault("cgroup2", mount)
        elif fstype == "cgroup":
            for name in V1_CONTROLLERS:
                if name in super_options:
                    mounts.setdefault(name, mount)
    return mounts


def _pids(directory: Path) -> list[int]:
    try:
        return [int(pid) for pid in (directory / "cgroup.procs").read_text().split()]
    except OSError:
        return []
