"""`retrograd report RUN`: write the run's NAME.report.html (the building is retrograd.reports.run_report)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from retrograd.cli.app import app


@app.command(
    epilog="Examples: retrograd report examples/smoke_tiny_grpo.toml | retrograd report out/smoke_grpo/smoke_grpo.gguf | "
           "retrograd report out/smoke_grpo/ --out /tmp/run.html",
)
def report(
    run: Annotated[Path, typer.Argument(help="The run's config .toml, its output .gguf, its NAME.metrics.jsonl, or the folder "
                                             "holding that (when it holds one run's).")],
    out: Annotated[Path | None, typer.Option("--out", help="Where to write the page (default: NAME.report.html beside "
                                                           "NAME.metrics.jsonl).")] = None,
) -> None:
    """Write one self-contained NAME.report.html (curves, update timeline, rollouts, checkpoints) that opens offline."""
    from retrograd.reports.run_report import RunReport, locate

    report = RunReport(locate(run))
    written = report.write(out)
    if report.skipped:
        typer.echo(f"note: left out as malformed: {'; '.join(report.skipped)}", err=True)
    print(f"report: {written}")
