"""Run a retrograd command in this interpreter's executable, in one process (the allocator
restart off), and learn whether the command imported a given module."""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = """import runpy, sys
module, sys.argv = sys.argv[1], ["retrograd", *sys.argv[2:]]
try:
    runpy.run_module("retrograd", run_name="__main__")
except SystemExit as e:
    print(f"exit {e.code}, {module} imported: {module in sys.modules}")
"""


def run_noting_import(module: str, *args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`retrograd ARGS`; its stdout ends with "exit CODE, MODULE imported: True|False"."""
    return subprocess.run([sys.executable, "-c", _SCRIPT, module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"RETROGRAD_ALLOCATOR": "system"})
