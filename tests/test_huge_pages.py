"""Importing retrograd puts torch's large CPU tensors on transparent huge pages (the kernel's
AnonHugePages count grows), and a user's THP_MEM_ALLOC_ENABLE=0 still turns it off. Each case
runs in a fresh interpreter: torch reads the setting once, at its first large allocation."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

PROBE = """
import re, retrograd, torch
def huge():
    return int(re.search(r"AnonHugePages:\\s+(\\d+) kB", open("/proc/self/smaps_rollup").read()).group(1))
before = huge()
x = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB, touched
print(huge() - before)
"""


def huge_kib(setting: str | None) -> int:
    """KiB of the probe's tensor on huge pages, with THP_MEM_ALLOC_ENABLE unset or set."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(),
                    reason="transparent huge pages are not in madvise mode here (only then does asking matter)")
def test_large_tensors_use_huge_pages_unless_the_user_says_no():
    by_default = huge_kib(None)
    assert by_default >= 128 << 10, f"only {by_default} KiB of a 256 MiB tensor on huge pages"
    assert huge_kib("0") < 16 << 10
