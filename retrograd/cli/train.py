"""`retrograd train CONFIG.toml`: run the configured algorithm and write the adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from retrograd.cli import app
from retrograd.cli.options import ModelOpt
from retrograd.cli.progress import ConsoleReporter


@app.command(
    context_settings={"allow_extra_args": False},
    epilog="Examples: retrograd train examples/smoke_tiny_sft.toml | retrograd train run.toml --resume | retrograd train run.toml --resume checkpoints/step-000000000020.state",
)
def train(
    config: Path = typer.Argument(..., help="The run's TOML file."),
    resume: Optional[str] = typer.Option(
        None, "--resume", metavar="[CKPT]",
        help="Continue from a checkpoint: a .state directory; alone, the newest in \\[checkpoint].directory.",
    ),
    model: ModelOpt = None,
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu or gpu (overrides \\[model].device)."),
) -> None:
    """Train a LoRA on the frozen GGUF base as \\[run].algorithm says, and export it for llama.cpp."""
    from retrograd.config import load_config
    from retrograd.recipes import RECIPES

    cfg = load_config(config).with_overrides(model=model, device=device)
    reporter = ConsoleReporter()
    reporter.message("train")
    reporter.message(f"  config: {cfg.path}")
    reporter.message(f"  model:  {cfg.model.path or 'bundled SmolLM2-135M-Instruct Q4_1'}")
    reporter.message(f"  output: {cfg.output.path}")
    resume_arg = None if resume is None else True if resume == "latest" else Path(resume)
    result = RECIPES[cfg.run.algorithm](cfg, reporter, resume=resume_arg)
    reporter.message(result.summary())
