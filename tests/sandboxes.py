"""What the container and namespace sandbox tests need, and what happens when it is missing.

Tests that run commands in a real sandbox carry a marker (pyproject.toml):
`@pytest.mark.container` (a Docker daemon and the sandbox image) or `@pytest.mark.namespace`
(bubblewrap able to create user namespaces). conftest.py checks the requirement before each
such test: missing, the test skips with the reason on a developer's machine, and FAILS under
`CI=true`, where `.ci/run` has installed everything and a skip would hide an untested sandbox.
conftest.py also prints how many of each kind ran."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

KINDS = ("container", "namespace")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str):
    """Skip (developer machine) or fail (CI=true) the current marked test."""
    if in_ci():
        pytest.fail(f"CI=true but {reason}: the marked tests must run in CI (.ci/run installs what they need)",
                    pytrace=False)
    pytest.skip(reason)


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """None when bubblewrap runs here, else why not (one line)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install -y bubblewrap)"
    from retrograd.rollouts.sandbox.base import SandboxError
    from retrograd.rollouts.sandbox.syscall_filter import compile_filter

    try:
        compile_filter()  # the seccomp program every namespace sandbox loads
    except SandboxError as error:
        return str(error)
    probe = subprocess.run([bwrap, "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True, text=True,
                           timeout=30, check=False)
    if probe.returncode != 0:
        first = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[0]
        return f"bwrap cannot create namespaces here ({first[:120]}; unprivileged user namespaces may be disabled)"
    return None


@functools.lru_cache(maxsize=1)
def docker_problem() -> str | None:
    """None when a Docker daemon answers (DOCKER_HOST honoured) and holds the sandbox image,
    else why not (one line)."""
    try:
        import docker
        import docker.errors
    except ImportError:
        return "the docker Python package is not installed"
    from retrograd.rollouts.sandbox.options import DEFAULT_IMAGE

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as error:
        return f"no Docker daemon reachable ({str(error).splitlines()[0][:100]}); .ci/run starts dockerd"
    try:
        client.images.get(DEFAULT_IMAGE)
    except docker.errors.ImageNotFound:
        return f"the sandbox image {DEFAULT_IMAGE} is not on the Docker daemon (build it: bin/build-sandbox-image)"
    except docker.errors.DockerException as error:
        return f"cannot inspect the sandbox image {DEFAULT_IMAGE} ({str(error).splitlines()[0][:100]})"
    return None


def require(kind: str) -> None:
    """Skip or fail (see `unavailable`) unless the `kind` sandbox can run here."""
    problem = docker_problem() if kind == "container" else bwrap_problem()
    if problem is not None:
        unavailable(problem)


def require_bwrap() -> None:
    require("namespace")
