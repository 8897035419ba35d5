"""The terminal side of a run: rows of a table printed as they come, under a live progress
bar (step/total, ETA, current numbers, RSS). Plain lines when stdout is not a terminal."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class ConsoleReporter:
    def __init__(self, console: Console | None = None):
        self.console = console or Console(highlight=False, soft_wrap=True)
        self._progress: Progress | None = None
        self._task = None
        self._columns: list[str] = []

    def message(self, text: str) -> None:
        self.console.print(text, markup=False)

    def checkpoint(self, path: Path) -> None:
        self.message(f"checkpoint {path}")

    def start(self, total: int, columns: list[str], unit: str) -> None:
        self._columns = columns
        self.console.print("  ".join(f"{c:>10}" for c in columns), markup=False, style="bold")
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(unit),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            transient=True,
            disable=not self.console.is_terminal,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, status="")

    def row(self, values: dict) -> None:
        cells = []
        for c in self._columns:
            v = values.get(c)
            cells.append(f"{'-':>10}" if v is None else f"{v:>10.4g}" if isinstance(v, float) else f"{v!s:>10}")
        self.console.print("  ".join(cells), markup=False)

    def advance(self, done: int, status: str) -> None:
        from retrograd.runtime.memory import (
            rss_bytes,  # here: importing it loads torch, which `retrograd --help` never needs
        )

        if self._progress is not None:
            self._progress.update(self._task, completed=done, status=f"{status} rss={rss_bytes() / 2**30:.2f}GiB")

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
