"""A pool that leases one sandbox per trajectory, whatever the backend.

`max_live` bounds live sandboxes (leased + idle + being created), so a group
larger than it waits for leases. `prewarm()` tops the idle list up to
`min_idle` in the background; the recipe calls it while the optimizer runs.
With `reuse = "workspace"` a returned sandbox is wiped and leased again, up to
`max_leases_per_container` times; a failed wipe destroys it (notes §5)."""

from __future__ import annotations

import atexit
import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from retrograd.rollouts.sandbox.base import Sandbox, SandboxBroken, SandboxError
from retrograd.rollouts.sandbox.options import PoolOptions


class Backend(Protocol):
    def create(self) -> Sandbox: ...

    def close(self) -> None:
        """Removes everything this run still owns, leased sandboxes included."""


class SandboxPool:
    def __init__(self, backend: Backend, options: PoolOptions):
        self.backend = backend
        self.options = options
        self._cond = threading.Condition()
        self._idle: collections.deque[Sandbox] = collections.deque()
        self._leased = 0
        self._creating_idle = 0
        self._closed = False
        # Every sandbox is created on these threads, which live as long as the pool: bwrap's
        # --die-with-parent (PR_SET_PDEATHSIG) fires when the *thread* that started it ends, and
        # an episode's thread ends with the episode, while its sandbox waits for reuse.
        self._workers = ThreadPoolExecutor(max_workers=min(4, options.max_live), thread_name_prefix="retrograd-pool")
        self._stats = collections.Counter()
        atexit.register(self.close)  # a normal end and Ctrl-C (KeyboardInterrupt) remove this run's sandboxes

    # --- leases -------------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> Sandbox:
        """A sandbox for one trajectory; `close()` it when the trajectory ends."""
        start = time.monotonic()
        with self._cond:
            ready = self._cond.wait_for(lambda: self._closed or self._idle or self._live() < self.options.max_live,
                                        timeout)
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            if not ready:
                raise SandboxError(f"no sandbox became free within {timeout:g} s "
                                   f"([agent.environment.pool].max_live = {self.options.max_live})")
            self._leased += 1
            sandbox = self._idle.popleft() if self._idle else None
            self._note_live()
        if sandbox is None:
            try:
                sandbox = self._in_background(self._create).result()  # on a worker (see _workers)
            except BaseException:
                with self._cond:
                    self._leased -= 1
                    self._cond.notify_all()
                raise
        with self._cond:
            self._stats["leases"] += 1
            self._stats["reused"] += sandbox.leases > 0
            self._stats["acquire_secs"] += time.monotonic() - start
        sandbox.leases += 1
        sandbox.release = self._release
        return sandbox

    def _release(self, sandbox: Sandbox) -> None:
        with self._cond:
            self._stats["released"] += 1
            self._stats["broken"] += sandbox.broken
            self._stats["execs"] += sandbox.exec_count
            self._stats["timeouts"] += sandbox.timeout_count
        keep = (self.options.reuse == "workspace" and not sandbox.broken and not self._closed
                and sandbox.leases < self.options.max_leases_per_container)
        if keep:
            try:
                keep = sandbox.reset()
            except SandboxBroken:
                keep = False
        sandbox.exec_count = sandbox.timeout_count = 0
        with self._cond:
            self._leased -= 1
            keep = keep and not self._closed
            if keep:
                self._idle.append(sandbox)
            self._cond.notify_all()
        if not keep:
            self._in_background(sandbox.destroy_quietly)

    # --- warm-up ------------------------------------------------------------------------------

    def prewarm(self, wait: bool = False) -> None:
        """Starts creating sandboxes until `min_idle` are idle (never past `max_live`);
        returns at once unless `wait`, which also waits for earlier warm-ups."""
        with self._cond:
            wanted = 0 if self._closed else min(self.options.min_idle - len(self._idle) - self._creating_idle,
                                                self.options.max_live - self._live())
            self._creating_idle += max(wanted, 0)
            self._note_live()
        futures = [self._in_background(self._create_idle) for _ in range(wanted)]
        if wait:
            for future in futures:
                future.result()
            with self._cond:  # and those an earlier prewarm() started
                self._cond.wait_for(lambda: self._closed or self._creating_idle == 0)

    def _in_background(self, work):
        try:
            return self._workers.submit(work)
        except RuntimeError:  # closing: the workers are gone, do it here
            future = Future()
            future.set_result(work())
            return future

    def _create_idle(self) -> None:
        sandbox = None
        try:
            sandbox = self._create()
        finally:
            with self._cond:
                self._creating_idle -= 1
                keep = sandbox is not None and not self._closed
                if keep:
                    self._idle.append(sandbox)
                self._cond.notify_all()
            if sandbox is not None and not keep:
                sandbox.destroy_quietly()

    def _create(self) -> Sandbox:
        start = time.monotonic()
        sandbox = self.backend.create()
        with self._cond:
            self._stats["creates"] += 1
            self._stats["create_secs"] += time.monotonic() - start
        return sandbox

    def _live(self) -> int:
        return self._leased + len(self._idle) + self._creating_idle

    def _note_live(self) -> None:
        self._stats["live_max"] = max(self._stats["live_max"], self._live())

    @property
    def idle_count(self) -> int:
        with self._cond:
            return len(self._idle)

    # --- metrics and shutdown -----------------------------------------------------------------

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """notes §5 env/* metrics over the leases released since the last reset."""
        with self._cond:
            s = self._stats
            values = {
                "env/container_create_ms": 1000 * s["create_secs"] / max(s["creates"], 1),
                "env/acquire_ms_mean": 1000 * s["acquire_secs"] / max(s["leases"], 1),
                "env/pool_reuse_fraction": s["reused"] / max(s["leases"], 1),
                "env/live_containers_max": float(s["live_max"]),
                "env/exec_timeout_fraction": s["timeouts"] / max(s["execs"], 1),
                "env/sandbox_broken_fraction": s["broken"] / max(s["released"], 1),
            }
            if reset:
                s.clear()
                s["live_max"] = self._live()
            return values

    def close(self) -> None:
        """Destroys every sandbox of this run, leased ones included. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = list(self._idle), collections.deque()
            self._cond.notify_all()
        atexit.unregister(self.close)
        self._workers.shutdown(wait=True, cancel_futures=True)
        for sandbox in idle:
            sandbox.destroy_quietly()
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
