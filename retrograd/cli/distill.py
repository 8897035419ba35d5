"""`retrograd distill-teacher CONFIG.toml`: write the teacher's top-k sidecar for offline
distillation (the work is retrograd.recipes.distill.offline.write_teacher_topk; this only wires it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from retrograd.cli.app import app
from retrograd.cli.options import ModelOpt
from retrograd.cli.progress import ConsoleReporter


@app.command(
    "distill-teacher",
    context_settings={"allow_extra_args": False},
    epilog="Examples: retrograd distill-teacher run.toml | retrograd distill-teacher run.toml --data chats.jsonl --out chats.topk --k 32",
)
def distill_teacher(
    config: Annotated[
        Path, typer.Argument(help="A distill run's TOML file (its \\[distill].teacher_path is the teacher).")
    ],
    data: Annotated[Path | None, typer.Option("--data", help="SFT-style corpus (default: \\[distill].data).")] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Sidecar to write (default: \\[distill].sidecar, else DATA with suffix .topk)."),
    ] = None,
    k: Annotated[
        int | None, typer.Option("--k", min=1, help="Teacher tokens kept per position (default: \\[distill].topk).")
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            "--backend", help="llama.cpp (light, quantized) or torch (exact); default: \\[distill].teacher_backend."
        ),
    ] = None,
    model: ModelOpt = None,
    device: Annotated[
        str | None, typer.Option("--device", help="auto, cpu or gpu (overrides \\[model].device).")
    ] = None,
) -> None:
    """Score a corpus with the teacher and write its top-k (id, log-prob) at every supervised position."""
    from retrograd.config import load_config
    from retrograd.errors import ConfigError
    from retrograd.recipes.distill import TopkOptions, write_teacher_topk

    cfg = load_config(config).with_overrides(model=model, device=device)
    if cfg.distill is None:
        raise ConfigError(f"{cfg.path}: run.algorithm = {cfg.run.algorithm!r}; distill-teacher needs a distill config")
    reporter = ConsoleReporter()
    reporter.message("distill-teacher")
    reporter.message(f"  config:  {cfg.path}")
    reporter.message(f"  teacher: {cfg.distill.teacher_path}")
    report = write_teacher_topk(cfg, reporter, TopkOptions(data=data, out=out, k=k, backend=backend))
    reporter.message(report.summary())
