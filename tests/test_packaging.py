"""The wheel carries every subpackage: pyproject.toml lists them by hand (kernels/ is
installed as retrograd.kernels), so a new folder must be added there too."""

from pathlib import Path

import tomli

REPO = Path(__file__).parents[1]


def test_every_subpackage_is_declared():
    declared = set(tomli.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "retrograd").rglob("__init__.py")}
    found |= {"retrograd.kernels"} if (REPO / "kernels/__init__.py").is_file() else set()
    assert declared == found
