"""What a run tells its user, as events: the CLI renders them (a live table and a
progress bar); library callers can pass SilentReporter or their own."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Reporter(Protocol):
    def message(self, text: str) -> None:
        """An informational line (plan, checkpoint written, evaluation result)."""

    def start(self, total: int, columns: list[str], unit: str) -> None:
        """A table with these columns and a bar counting `total` units (steps, updates) begins."""

    def row(self, values: dict) -> None:
        """One row of the table."""

    def advance(self, done: int, status: str) -> None:
        """The bar reached `done` units; `status` is a short line of current numbers."""

    def finish(self) -> None:
        """The table and bar are complete."""

    def checkpoint(self, path: Path) -> None:
        """A checkpoint was written at `path` (the CLI says so and refreshes NAME.report.html)."""


class SilentReporter:
    def message(self, text: str) -> None:
        pass

    def start(self, total: int, columns: list[str], unit: str) -> None:
        pass

    def row(self, values: dict) -> None:
        pass

    def advance(self, done: int, status: str) -> None:
        pass

    def finish(self) -> None:
        pass

    def checkpoint(self, path: Path) -> None:
        self.message(f"checkpoint {path}")  # a message, so subclasses that collect messages see it
