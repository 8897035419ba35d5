"""Names the process that owns leftovers (sandboxes, cgroup leaves, checkpoint temp
folders), so that a later run can tell those of a process that died without cleaning
up (SIGKILL) from those of one still running."""

from __future__ import annotations

import os
import socket

import psutil


def process_tag(pid: int | None = None) -> str:
    """"<pid>-<start time in centiseconds>": the start time tells a reused pid apart."""
    process = psutil.Process(pid or os.getpid())
    return f"{process.pid}-{round(process.create_time() * 100)}"


def host_name() -> str:
    return socket.gethostname()


def is_dead(tag: str) -> bool:
    """True when the process named by `tag` (from this host) no longer runs."""
    pid, _, started = tag.partition("-")
    if not (pid.isdigit() and started.isdigit()):
        return False  # not ours to judge
    try:
        return process_tag(int(pid)) != tag
    except psutil.NoSuchProcess:
        return True
