"""NAME.timeline.jsonl (beside the output NAME.gguf): every timed phase of every update as
a start/end event, and one line of counters per update, so a run can be read afterwards the
way the seed's tuning guide reads one (which side waits for which).

Lines, all JSON objects:
- `{"event": "start", "time": UNIX_SECONDS, "resumed_at": UPDATE | null}` when a run (or a
  resumed run) opens the file; event times below count seconds from that line.
- `{"update": U, "worker": W, "phase": P, "start": S, "end": E}`: one span. U counts from 1
  (as in rollouts.jsonl and metrics.jsonl); W names who did it: "trainer" for the optimizer
  side, "sampler" for the side that produces rollouts.
- `{"update": U, "counters": {...}}`: after update U, the numbers of TIMELINE_COUNTERS.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retrograd.errors import DataError

TIMELINE_COUNTERS = (
    "waiting_for_batch_seconds",  # the trainer idle until the update's rollouts were ready
    "waiting_for_adapter_seconds",  # the sampler idle because it may not run further ahead
    "discarded_groups",  # groups that carried no learning signal (equal rewards, too few members)
    "canceled_rollouts",  # rollouts sampled by an adapter too many updates old, thrown away
    "truncated_rollouts",  # completions or trajectories cut by the token budget
    "queued_rollouts",  # rollouts already sampled for later updates when this one started training
    "in_flight_rollouts",  # rollouts being sampled when this one started training
)


class Timeline:
    """Appends timeline.jsonl; safe to call from the trainer and the producer threads."""

    def __init__(self, path: Path | None, *, resumed_at: int | None = None):
        """path None: a timeline that writes nothing (torchrun ranks other than 0)."""
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if resumed_at is not None else "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()
        self.origin = time.perf_counter()
        self._write({"event": "start", "time": time.time(), "resumed_at": resumed_at})

    def span(self, update: int, worker: str, phase: str, start: float, end: float) -> None:
        """A phase of update `update` (0-based here) between two perf_counter readings."""
        self._write({"update": update + 1, "worker": worker, "phase": phase,
                     "start": round(start - self.origin, 6), "end": round(end - self.origin, 6)})

    def counters(self, update: int, values: dict) -> None:
        self._write({"update": update + 1, "counters": {k: round(values.get(k, 0), 6) for k in TIMELINE_COUNTERS}})

    def _write(self, record: dict) -> None:
        if self._file is None:
            return
        line = json.dumps(record) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PhaseClock(dict):
    """Seconds per phase of one update (phase -> seconds, as metrics and the profile read
    them); each span timed through `phase` is also written to the timeline."""

    def __init__(self, phases=(), *, timeline: Timeline | None = None, update: int = 0, worker: str = "trainer"):
        super().__init__(dict.fromkeys(phases, 0.0))
        self.timeline, self.update, self.worker = timeline, update, worker

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self[name] = self.get(name, 0.0) + end - start
            if self.timeline is not None:
                self.timeline.span(self.update, self.worker, name, start, end)


def read_timeline(path: Path) -> tuple[list[dict], dict[int, dict]]:
    """The spans and the counters per update of a NAME.timeline.jsonl. A resumed run appends its
    own lines after a new start line: its span times are shifted to follow the earlier
    run's, and counters of an update done twice keep the later."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the timeline ({getattr(e, 'strerror', None) or e})") from None
    spans: list[dict] = []
    counters: dict[int, dict] = {}
    offset = end = 0.0
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if record.get("event") == "start":
                offset = end
            elif "phase" in record:
                if not (isinstance(record["worker"], str) and isinstance(record["phase"], str)):
                    raise TypeError
                span = record | {"start": float(record["start"]) + offset, "end": float(record["end"]) + offset}
                spans.append(span)
                end = max(end, span["end"])
            elif "counters" in record:
                counters[int(record["update"])] = {k: float(v) for k, v in dict(record["counters"]).items()}
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
            raise DataError(f"{path}:{number}: not a timeline.jsonl line (expected a JSON object with a start event, "
                            "a phase span or counters)") from None
    return spans, counters
