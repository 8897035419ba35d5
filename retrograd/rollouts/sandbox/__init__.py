"""Sandboxes for agentic GRPO: one private machine per trajectory, leased from a pool.

    pool = open_environment(EnvironmentOptions.from_table(cfg["agent"]["environment"]))
    sandbox = pool.acquire()                       # blocks while max_live sandboxes are leased
    sandbox.prepare(scenario_env, options.setup_timeout_secs, where="scenarios.jsonl:3")
    result = sandbox.exec(["python3", "-c", "print(1)"])   # ExecResult
    reward = sandbox.verify(scenario_env.verify, options.verify_timeout)
    sandbox.close()                                # back to the pool (or destroyed)
    pool.prewarm()                                 # during the optimizer step
    pool.close()                                   # also runs at exit and on Ctrl-C

Backends: "container" (Docker, container.py), "sandbox" (bubblewrap namespaces,
namespace.py) and "local" (a temp dir, opt-in, local.py)."""

import importlib

from retrograd.rollouts.sandbox.base import ExecResult, Sandbox, SandboxBroken, SandboxError
from retrograd.rollouts.sandbox.options import (
    DEFAULT_IMAGE,
    EnvironmentOptions,
    Limits,
    PoolOptions,
    ScenarioEnv,
    VerifySpec,
)
from retrograd.rollouts.sandbox.pool import SandboxPool

# type -> (module, class); imported on use, so that `import retrograd` does not pull in docker.
BACKENDS = {"container": ("container", "DockerBackend"), "sandbox": ("namespace", "NamespaceBackend"),
            "local": ("local", "LocalBackend")}


def open_environment(options: EnvironmentOptions) -> SandboxPool:
    """Checks the backend (daemon, image, bwrap), reaps what dead runs left behind,
    and starts pre-warming `min_idle` sandboxes in the background."""
    module, name = BACKENDS[options.type]
    backend = getattr(importlib.import_module(f"{__name__}.{module}"), name)(options)
    pool = SandboxPool(backend, options.pool)
    pool.prewarm()
    return pool


__all__ = ["DEFAULT_IMAGE", "EnvironmentOptions", "ExecResult", "Limits", "PoolOptions", "Sandbox", "SandboxBroken",
           "SandboxError", "SandboxPool", "ScenarioEnv", "VerifySpec", "open_environment"]
