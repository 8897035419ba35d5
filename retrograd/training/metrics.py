"""Where numbers go: NAME.metrics.jsonl beside the output NAME.gguf (one JSON object per
record) and, when [metrics].tensorboard_dir is set, TensorBoard event files (one
subdirectory per run)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def run_record(cfg, record: str) -> Path:
    """Where `cfg`'s run keeps `record` (metrics.jsonl, rollouts.jsonl, timeline.jsonl,
    report.html): named after the output, beside it (rollouts.jsonl in [observe].directory
    when set), so out/a.gguf's metrics are out/a.metrics.jsonl. Runs sharing a folder keep
    their own records; a rerun of the same output starts them afresh, `--resume` appends."""
    directory = cfg.observe.directory if record == "rollouts.jsonl" and cfg.observe else cfg.output.path.parent
    return directory / f"{cfg.output.path.stem}.{record}"


class MetricsSink:
    def __init__(self, jsonl_path: Path, tensorboard_dir: Path | None = None, *, append: bool = False):
        jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(jsonl_path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._tb = None
        if tensorboard_dir is not None:
            from tensorboardX import SummaryWriter

            run_dir = Path(tensorboard_dir) / time.strftime("run-%Y%m%d-%H%M%S")
            self._tb = SummaryWriter(logdir=str(run_dir))
        self.path = jsonl_path

    def log(self, step: int, values: dict[str, float | int | str]) -> None:
        record = {"step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class NullMetrics:
    """What a rank other than 0 logs to under torchrun: nothing (rank 0 writes the run's files)."""

    def log(self, step: int, values: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
