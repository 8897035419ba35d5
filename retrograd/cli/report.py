"""`retrograd report RUN`: write the run's report.html (the building is retrograd.run_report)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from retrograd.cli import app


@app.command(
    epilog="Examples: retrograd report out/ | retrograd report examples/smoke_tiny_grpo.toml | retrograd report out/ --out /tmp/run.html",
)
def report(
    run: Annotated[Path, typer.Argument(help="The run's folder (where metrics.jsonl is), or its config .toml.")],
    out: Annotated[Path | None, typer.Option("--out", help="Where to write the page (default: RUN/report.html).")] = None,
) -> None:
    """Write one self-contained report.html (curves, update timeline, rollouts, checkpoints) that opens offline."""
    from retrograd.run_report import RunReport, locate

    print(f"report: {RunReport(locate(run)).write(out)}")
