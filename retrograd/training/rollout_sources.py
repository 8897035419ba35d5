"""Where the rollout loop's batches come from (training/rollout_loop.py): the trainer's own
turn (SyncSource), a producer thread running up to max_async_rollout updates ahead
(AsyncSource), or rank 0 under torchrun (RankSource). Each hands the loop one Delivery per
update, takes each new adapter (`push`) and runs held-out evaluations where the sampler is
(`call`)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from retrograd.errors import RetrogradError
from retrograd.gguf.adapter import LoRAWeights, adapter_tensors
from retrograd.training.distributed import Ranks
from retrograd.training.rollout_recipe import Batch, RolloutRecipe
from retrograd.training.timeline import PhaseClock, Timeline


@dataclass(frozen=True)
class Delivery:
    """A batch as the trainer receives it, with what its production cost the trainer."""

    batch: Batch
    timing: dict  # the producer's phases of this batch (async: timed in its own thread)
    counters: dict  # timeline counters measured at delivery
    metrics: dict  # the producer's own (async: the adapter refresh before this batch)
    adapter_version: int  # updates trained into the adapter that sampled the batch


class SyncSource:
    """max_async_rollout = 0: the trainer samples each update's batch itself, then trains
    it, then hands the sampler the new adapter. Sampler and trainer take turns."""

    def __init__(self, recipe: RolloutRecipe, sampler, timeline: Timeline):
        self.recipe, self.sampler, self.timeline = recipe, sampler, timeline

    def next(self, update: int, cursor: int, clock: PhaseClock) -> Delivery:
        produced = PhaseClock(timeline=self.timeline, update=update, worker="sampler")
        batch = self.recipe.produce(update, cursor, produced)
        return Delivery(batch, dict(produced), {}, {}, update)

    def push(self, adapter, version: int, clock: PhaseClock) -> dict:
        produced = PhaseClock(timeline=self.timeline, update=version - 1, worker="sampler")
        with produced.phase("adapter_refresh"):
            refresh = self.sampler.set_adapter(adapter)
        clock["adapter_refresh"] = clock.get("adapter_refresh", 0.0) + produced["adapter_refresh"]
        return {"sampler/adapter_refresh_seconds": refresh.total_s}

    def unchanged(self, version: int) -> None:
        pass  # the sampler holds the adapter already

    def call(self, work: Callable):
        return work()

    def close(self) -> None:
        pass


class AsyncSource:
    """max_async_rollout = N > 0: a producer thread samples update u's batch while the
    trainer trains earlier ones, as soon as the newest adapter is at most N updates older
    than update u (it waits for the adapter otherwise, so no batch is ever staler than N).

    The producer thread alone touches the sampler (llama.cpp contexts are not thread-safe):
    the trainer hands it a copy of each new adapter, applied between batches, and runs
    held-out evaluations through `call`, between batches too."""

    def __init__(self, recipe: RolloutRecipe, sampler, timeline: Timeline, *, start: int, cursor: int, ahead: int):
        self.recipe, self.sampler, self.timeline, self.ahead = recipe, sampler, timeline, ahead
        self._cond = threading.Condition()
        self._ready: dict[int, Delivery] = {}
        self._pushed = start  # updates trained into the newest adapter the trainer handed over
        self._pending = None  # (tensors, alpha, version) not yet applied; tensors None: the held ones
        self._applied = start  # updates trained into the adapter the sampler holds
        self._tasks: list[tuple[Callable, list]] = []
        self._producing: int | None = None
        self._last_size = 0
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._produce_all, args=(start, cursor), name="rollout-producer", daemon=True)
        self._thread.start()

    # ------------------------------------------------ the trainer's side

    def next(self, update: int, cursor: int, clock: PhaseClock) -> Delivery:
        start = time.perf_counter()
        with self._cond:
            while update not in self._ready and self._error is None:
                self._cond.wait()
            self._raise_error()
            delivery = self._ready.pop(update)
            queued = sum(len(d.batch.rollouts) for d in self._ready.values())
            in_flight = self._last_size if self._producing is not None else 0
        end = time.perf_counter()
        self.timeline.span(update, "trainer", "waiting_for_batch", start, end)
        clock["waiting_for_batch"] = end - start
        counters = delivery.counters | {"waiting_for_batch_seconds": end - start, "queued_rollouts": queued,
                                        "in_flight_rollouts": in_flight}
        return replace(delivery, counters=counters)

    def push(self, adapter, version: int, clock: PhaseClock) -> dict:
        """A copy of the adapter after `version` updates, for the producer's next batch."""
        with clock.phase("adapter_push"):  # a copy: on the CPU the numpy arrays would share the live weights
            tensors = {name: LoRAWeights(w.a.copy(), w.b.copy()) for name, w in adapter_tensors(adapter).items()}
        with self._cond:
            self._pending, self._pushed = (tensors, float(adapter.alpha), version), version
            self._cond.notify_all()
        return {}

    def unchanged(self, version: int) -> None:
        """An update trained nothing: the adapter of `version` is the one already handed over,
        and the producer may go on as if it had been pushed."""
        with self._cond:
            tensors, alpha = self._pending[:2] if self._pending is not None else (None, None)
            self._pending, self._pushed = (tensors, alpha, version), version  # tensors None: nothing to load
            self._cond.notify_all()

    def call(self, work: Callable):
        """Run `work` in the producer thread between batches, with the newest adapter."""
        box: list = []
        with self._cond:
            self._tasks.append((work, box))
            self._cond.notify_all()
            while not box and self._error is None:
                self._cond.wait()
            self._raise_error()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop the producer after the batch it is sampling (llama.cpp cannot be cut off
        mid-call, and the sampler must outlive it); a second Ctrl-C quits at once."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        try:
            self._thread.join()
        except KeyboardInterrupt:
            print("interrupted again while the rollout producer finished its batch: quitting at once", file=sys.stderr)
            os._exit(130)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # ------------------------------------------------ the producer thread

    def _produce_all(self, update: int, cursor: int) -> None:
        try:
            while update < self.recipe.updates:
                waited = self._wait_for_adapter(update)
                if waited is None:
                    return
                clock = PhaseClock(self.recipe.phases, timeline=self.timeline, update=update, worker="sampler")
                refresh = self._apply_adapter(clock)
                batch = self.recipe.produce(update, cursor, clock)
                delivery = Delivery(batch, dict(clock), {"waiting_for_adapter_seconds": waited}, refresh, self._applied)
                with self._cond:
                    self._ready[update] = delivery
                    self._producing, self._last_size = None, len(batch.rollouts)
                    self._cond.notify_all()
                update, cursor = update + 1, batch.cursor
            while self._wait_for_adapter(None) is not None:  # serve evaluations until closed
                pass
        except BaseException as error:  # noqa: BLE001 (handed to the trainer, which raises it)
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _wait_for_adapter(self, update: int | None) -> float | None:
        """Serve evaluations while update `update` may not start yet (its adapter would be
        more than `ahead` updates old); the seconds waited, or None once closed."""
        start = time.perf_counter()
        while True:
            with self._cond:
                while not (self._stopping or self._tasks or (update is not None and update - self._pushed <= self.ahead)):
                    self._cond.wait()
                if self._stopping:
                    return None
                tasks, self._tasks = self._tasks, []
                if not tasks:
                    self._producing = update
                    break
            self._apply_adapter(PhaseClock())
            for work, box in tasks:
                try:
                    box.append((True, work()))
                except Exception as error:  # noqa: BLE001 (raised again in the trainer's thread)
                    box.append((False, error))
            with self._cond:
                self._cond.notify_all()
            if update is None:
                return 0.0
        end = time.perf_counter()
        if update is not None and end - start > 1e-3:
            self.timeline.span(update, "sampler", "waiting_for_adapter", start, end)
        return end - start

    def _apply_adapter(self, clock: PhaseClock) -> dict:
        with self._cond:
            pending, self._pending = self._pending, None
        if pending is None:
            return {}
        tensors, alpha, version = pending
        self._applied = version
        if tensors is None:  # updates that trained nothing: the sampler holds this adapter already
            return {}
        with clock.phase("adapter_refresh"):
            refresh = self.sampler.set_adapter(tensors, alpha=alpha)
        return {"sampler/adapter_refresh_seconds": refresh.total_s}


class RankSource:
    """Under torchrun: rank 0 samples (through `inner`) and every rank trains on what rank 0
    broadcasts; rank 0 alone pushes adapters and runs held-out evaluations."""

    def __init__(self, inner, ranks: Ranks):
        self.inner, self.ranks = inner, ranks  # inner: None on ranks other than 0

    def next(self, update: int, cursor: int, clock: PhaseClock) -> Delivery:
        return self._shared(lambda: self.inner.next(update, cursor, clock))

    def push(self, adapter, version: int, clock: PhaseClock) -> dict:
        return self.inner.push(adapter, version, clock) if self.inner is not None else {}

    def unchanged(self, version: int) -> None:
        if self.inner is not None:
            self.inner.unchanged(version)

    def call(self, work: Callable):
        return self._shared(lambda: self.inner.call(work))

    def _shared(self, work: Callable):
        """Rank 0's result on every rank; when rank 0 fails, every rank stops with its message
        instead of waiting at the broadcast."""
        outcome = None
        if self.inner is not None:
            try:
                outcome = (True, work())
            except BaseException as error:
                self.ranks.broadcast((False, f"{type(error).__name__}: {error}"))
                raise
        ok, value = self.ranks.broadcast(outcome)
        if not ok:
            raise RetrogradError(f"rank 0 stopped ({value})")
        return value

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
