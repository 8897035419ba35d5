"""Sandbox latency per backend: what a trajectory waits for before and during its turns.

    python benchmarks/sandbox.py [--backends container,sandbox,local] [--repeats 10]

Columns (median milliseconds over --repeats):
  cold acquire   acquire() from an empty pool, so creation is included
  warm acquire   acquire() with the sandboxes pre-warmed by prewarm(); the goal is <= 50 ms
  reuse cycle    close() with reuse = "workspace" (wipe a written file, kill leftovers), then acquire()
  bash / read_file / write_file   one tool call's round trip through the Toolset, small payloads
A backend that cannot start here (no daemon, no bwrap) is listed with the reason.
"""

from __future__ import annotations

import argparse
import statistics
import time

from retrograd.rollouts.sandbox import EnvironmentOptions, PoolOptions, SandboxError, open_environment
from retrograd.rollouts.tools import ToolCatalog

COLUMNS = ["cold acquire", "warm acquire", "reuse cycle", "bash", "read_file", "write_file"]


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def options(kind: str, **pool) -> EnvironmentOptions:
    return EnvironmentOptions(type=kind, allow_unsandboxed=kind == "local", pool=PoolOptions(**pool))


def acquire_times(kind: str, repeats: int, prewarmed: bool) -> list[float]:
    with open_environment(options(kind, max_live=repeats, min_idle=repeats if prewarmed else 0)) as pool:
        pool.prewarm(wait=True)
        leased, samples = [], []
        for _ in range(repeats):
            samples.append(timed(lambda: leased.append(pool.acquire())))
        for sandbox in leased:
            sandbox.close()
    return samples


def reuse_times(kind: str, repeats: int) -> list[float]:
    with open_environment(options(kind, max_live=1, reuse="workspace", max_leases_per_container=repeats + 1)) as pool:
        sandbox, samples = pool.acquire(), []
        for _ in range(repeats):
            sandbox.exec(["sh", "-c", "echo data > f.txt"])  # something to wipe
            start = time.perf_counter()
            sandbox.close()
            sandbox = pool.acquire()
            samples.append(time.perf_counter() - start)
        sandbox.close()
    return samples


def tool_times(kind: str, repeats: int) -> dict[str, list[float]]:
    tools = ToolCatalog.builtin().toolset()
    calls = {"bash": {"command": "true"}, "read_file": {"path": "notes.txt"},
             "write_file": {"path": "notes.txt", "content": "hello\n" * 100}}
    with open_environment(options(kind, max_live=1)) as pool:
        sandbox = pool.acquire()
        tools.call(sandbox, "write_file", calls["write_file"])
        samples = {name: [timed(lambda name=name, args=args: tools.call(sandbox, name, args))
                          for _ in range(repeats)] for name, args in calls.items()}
        sandbox.close()
    return samples


def measure(kind: str, repeats: int) -> dict[str, float]:
    row = {"cold acquire": median_ms(acquire_times(kind, repeats, prewarmed=False)),
           "warm acquire": median_ms(acquire_times(kind, repeats, prewarmed=True)),
           "reuse cycle": median_ms(reuse_times(kind, repeats))}
    row.update({name: median_ms(samples) for name, samples in tool_times(kind, repeats).items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="container,sandbox,local")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"{'backend':<10}" + "".join(f"{column:>14}" for column in COLUMNS) + "   (median ms)")
    for kind in args.backends.split(","):
        try:
            row = measure(kind, args.repeats)
        except SandboxError as error:
            print(f"{kind:<10}  unavailable: {error}")
            continue
        print(f"{kind:<10}" + "".join(f"{row[column]:>14.2f}" for column in COLUMNS))


if __name__ == "__main__":
    main()
