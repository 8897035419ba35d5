"""Recipes stand alone: no recipe imports another, and nothing outside the recipes reaches
for a recipe's private names (issue 14). Read from the source with `ast`, nothing imported.

A recipe is what recipes/__init__.py registers in RECIPES, one module or package each under
retrograd/recipes/: sft.py, grpo.py, agent_grpo.py and distill/ (whose modules, common.py
included, are the two modes of one recipe and import each other freely). recipes/common.py
is not a recipe but the setup every recipe builds on (model, adapter, sampler options,
resume), so any recipe may import it and it may import none. recipes/__init__.py is the
registry, which imports every recipe by design. What two recipes both need lives outside
retrograd/recipes/ (data/, objectives/, rollouts/, training/).
"""

from __future__ import annotations

import ast
from pathlib import Path

from retrograd.recipes import RECIPES

ROOT = Path(__file__).resolve().parents[1]
RECIPE_DIR = ROOT / "retrograd" / "recipes"
SHARED = {"common"}  # recipes/common.py: infrastructure, not a recipe
SOURCE_DIRS = ("retrograd", "benchmarks", "tests", "examples", "kernels")  # every tracked Python folder


def recipe_names() -> set[str]:
    """The recipes on disk: each module or package under retrograd/recipes/ but the shared one."""
    names = {p.stem for p in RECIPE_DIR.glob("*.py")} | {p.parent.name for p in RECIPE_DIR.glob("*/__init__.py")}
    return names - {"__init__"} - SHARED


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def under_recipes(module: str) -> bool:
    return module == "retrograd.recipes" or module.startswith("retrograd.recipes.")


def is_module(name: str) -> bool:
    """Whether a dotted name under retrograd.recipes is a module or package (not a function)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def recipe_of(module: str) -> str | None:
    """retrograd.recipes.distill.on_policy -> "distill"; None outside the recipes and for the shared module."""
    parts = module.split(".")
    if parts[:2] != ["retrograd", "recipes"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in recipe_names() else None


def imports(path: Path) -> list[tuple[int, str, str | None, str]]:
    """(line, module, name, bound as) per imported name: `from m import n as k` gives (m, n, k),
    `import m as k` gives (m, None, k); relative imports are resolved against the package."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None, a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(node.lineno, base, a.name, a.asname or a.name) for a in node.names]
    return found


def target(module: str, name: str | None) -> str:
    """The module an import refers to: `from retrograd.recipes import grpo` is the module grpo."""
    return f"{module}.{name}" if name is not None and is_module(f"{module}.{name}") else module


def recipe_sources() -> list[Path]:
    return sorted(p for p in RECIPE_DIR.rglob("*.py") if p != RECIPE_DIR / "__init__.py")


def outside_sources() -> list[Path]:
    files = (p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))
    return sorted(p for p in files if RECIPE_DIR not in p.parents and "__pycache__" not in p.parts)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_recipes_on_disk_are_the_registered_ones():
    assert recipe_names() == set(RECIPES)


def test_no_recipe_imports_another():
    crossings = []
    for path in recipe_sources():
        own = recipe_of(module_name(path))
        for line, module, name, _ in imports(path):
            other = recipe_of(target(module, name))
            if other is not None and other != own:
                what = f"{module}.{name}" if name is not None else module
                crossings.append(f"{path.relative_to(ROOT)}:{line}: imports {what} (recipe {other})")
    assert not crossings, "recipes import other recipes:\n" + "\n".join(crossings)


def test_nothing_outside_the_recipes_uses_their_private_names():
    reaching = []
    for path in outside_sources():
        bound = {}  # local name -> the recipe module it stands for
        for line, module, name, local in imports(path):
            if not under_recipes(module):
                continue
            if name is not None and private(name):
                reaching.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {name}")
            full = f"{module}.{name}" if name is not None else module
            if is_module(full):
                bound[local] = full
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Attribute) and private(node.attr):
                owner = ast.unparse(node.value)  # a bound name, or a dotted retrograd.recipes.x
                owner = bound.get(owner, owner)
                if under_recipes(owner) and is_module(owner):
                    reaching.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner}.{node.attr}")
    assert not reaching, "private names of recipes used outside them:\n" + "\n".join(reaching)
