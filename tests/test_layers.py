"""The package's layering, read from its source: every import (also those inside functions)
runs down a floor, and no modules import each other in a circle. README's "Where things
are" describes the same floors."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]

# Bottom first. A room may import the rooms on the floors below its own, not those beside it
# or above it. A room is a folder of retrograd/ (kernels/ is installed as retrograd.kernels)
# or one of the two modules every floor uses.
FLOORS = [
    ["errors"],
    ["runtime"],
    ["kernels", "gguf"],
    ["config", "objectives"],
    ["model"],
    ["data"],
    ["training"],
    ["sampler", "teacher"],
    ["rollouts"],
    ["recipes"],
    ["evaluation", "reports", "serving"],
    ["cli"],
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
TOP_LEVEL = {"__init__", "__main__"}  # retrograd.load_model and `python -m retrograd`: the public doors, not rooms


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module the package installs."""
    found = {}
    for folder, package in ((ROOT / "retrograd", "retrograd"), (ROOT / "kernels", "retrograd.kernels")):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `path` imports, anywhere in it; `from package import name` counts
    as importing the module `name` when there is one, else the package."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known and n != "retrograd"}
    return out


def room(module: str) -> str:
    return module.split(".")[1]


GRAPH = {name: imports(path, modules()) for name, path in modules().items()}


def test_every_room_has_a_floor():
    rooms = {room(m) for m in GRAPH if m != "retrograd"} - TOP_LEVEL
    assert rooms == set(FLOOR), "add the new room to FLOORS here and to README's 'Where things are'"


def test_imports_run_down_a_floor():
    wrong = sorted(
        f"{a} -> {b} ({room(a)} is on floor {FLOOR[room(a)]}, {room(b)} on floor {FLOOR[room(b)]})"
        for a, targets in GRAPH.items()
        if a != "retrograd" and room(a) not in TOP_LEVEL
        for b in targets
        if room(a) != room(b) and FLOOR[room(b)] >= FLOOR[room(a)]
    )
    assert not wrong, "\n".join(wrong)


def test_no_circles():
    """Tarjan's strongly connected components: each must be one module."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_checks_see_a_wrong_arrow(tmp_path):
    """The parser finds imports inside functions too, which is where a circle hides."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from retrograd.cli import app\n    import retrograd.errors\n")
    assert imports(source, modules()) == {"retrograd.cli.app", "retrograd.errors"}


def test_readme_shows_these_floors():
    rows = re.findall(r"^\| (\d+) \| (.+?) \| .+ \|$", (ROOT / "README.md").read_text(), re.M)
    shown = [sorted(re.sub(r"[/.].*", "", name) for name in re.findall(r"`([a-z_]+(?:/|\.py))`", rooms)) for _, rooms in rows]
    assert [int(n) for n, _ in rows] == list(range(len(FLOORS)))
    assert shown == [sorted(rooms) for rooms in FLOORS]
