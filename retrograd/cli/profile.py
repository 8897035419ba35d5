"""`retrograd profile CONFIG.toml` (and `bin/profile`): phase timing of a short GRPO run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from retrograd.cli.app import app
from retrograd.cli.options import ModelOpt


@app.command(epilog="Examples: bin/profile examples/smoke_tiny_grpo.toml --group-size 8 --max-new-tokens 16 | "
                    "bin/profile --timeline out/smoke_grpo/smoke_grpo.timeline.jsonl")
def profile(
    config: Optional[Path] = typer.Argument(None, help="A grpo or agent_grpo run's TOML file."),
    model: ModelOpt = None,
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu or gpu (overrides [model].device)."),
    updates: Optional[int] = typer.Option(None, "--updates", min=1, help="Updates to run (default 1)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", min=2, help="Completions per prompt (default 4)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", min=1, help="Optimizer passes per update (default 1)."),
    prompts: Optional[int] = typer.Option(None, "--prompts", min=1, help="Prompts (grpo) or scenarios (agent_grpo) per update (default 3 / 2)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Per completion, or per turn for agent_grpo (default: as configured)."),
    full: bool = typer.Option(False, "--full", help="Run the workload as configured instead of the short default."),
    timeline: Optional[Path] = typer.Option(
        None, "--timeline", metavar="TIMELINE_JSONL",
        help="Run nothing: summarise a finished run's NAME.timeline.jsonl (busy and waiting time per side, the bottleneck)."),
) -> None:
    """Run a short GRPO or agentic GRPO workload and report where the time and memory go."""
    from retrograd.cli.train import sampler_warning
    from retrograd.config import load_config
    from retrograd.errors import ConfigError

    if timeline is not None:
        if config is not None:
            raise ConfigError("profile: give a CONFIG to run or --timeline to read, not both")
        from retrograd.reports.timeline import timeline_summary  # no torch: reading a file takes well under a second

        typer.echo("\n".join(timeline_summary(timeline)))
        return
    if config is None:
        raise ConfigError("profile: expected a CONFIG.toml to run (or --timeline TIMELINE_JSONL)")

    cfg = load_config(config).with_overrides(model=model, device=device)
    from retrograd.reports.profile import Workload, profile as run_profile  # imports torch: after the config is checked

    warning = sampler_warning(cfg)
    if warning:
        typer.echo(warning)
    lines = run_profile(cfg, Workload(updates, group_size, epochs, prompts, max_new_tokens, full))
    typer.echo("\n".join(lines))
