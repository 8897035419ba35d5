"""`retrograd judge eval CONFIG.toml --fixtures FILE.jsonl`: the run's judge on labelled
groups (retrograd.evaluation.judge_eval); no model is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from retrograd.cli.app import app

judge_app = typer.Typer(help="The LLM or command judge of a grpo or agent_grpo run.", no_args_is_help=True)
app.add_typer(judge_app, name="judge")


@judge_app.command("eval", epilog="Example: retrograd judge eval grpo.toml --fixtures labelled.jsonl --out agreement.json")
def judge_eval(
    config: Annotated[Path, typer.Argument(help="A grpo or agent_grpo run's TOML file with [grpo.judge] or [agent.judge].")],
    fixtures: Annotated[Path, typer.Option("--fixtures", help="JSONL: {\"prompt\", \"completions\": [...], \"labels\": [a number each, higher is better], \"rubric\"?}.")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the verdicts of both passes per fixture and the correlations as JSON.")] = None,
) -> None:
    """Judge each labelled group twice, without the verdict cache, and report Kendall's tau
    and Spearman's rho (mean over groups) of the verdicts against the labels and of the second
    pass against the first (self-consistency)."""
    from retrograd.config import load_config
    from retrograd.data.files import write_json
    from retrograd.errors import ConfigError
    from retrograd.evaluation.judge_eval import evaluate_judge, load_fixtures

    cfg = load_config(config)
    section = next((s.judge for s in (cfg.grpo, cfg.agent) if s is not None and s.judge is not None), None)
    if section is None:
        raise ConfigError(f"{cfg.path}: no [grpo.judge] or [agent.judge] to evaluate")
    loaded = load_fixtures(fixtures)
    console = Console(highlight=False)
    described = (f"ruler {(section.strategy.mode if section.strategy else 'auto')}, model {section.model} at {section.base_url}"
                 if section.type == "ruler" else f"command {' '.join(section.command)}")
    console.print(f"judge eval: {len(loaded)} group(s) from {fixtures}; judge: {described}; no verdict cache", markup=False)
    with Progress(TextColumn("judging"), BarColumn(), MofNCompleteColumn(), TextColumn("groups"), TimeRemainingColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        bar = progress.add_task("judge", total=2 * len(loaded))
        result = evaluate_judge(section, loaded, lambda n: progress.advance(bar, n))
    table = Table(box=box.ROUNDED)
    for name in ("comparison", "Kendall tau", "Spearman rho", "groups"):
        table.add_column(name, justify="left" if name == "comparison" else "right")
    for name, a in (("verdicts vs labels", result.labels), ("pass 2 vs pass 1", result.consistency)):
        table.add_row(name, *("-" if v is None else f"{v:+.3f}" for v in (a.kendall, a.spearman)), str(a.groups))
    console.print(table)
    if result.failed:
        console.print(f"the judge gave no verdicts for {result.failed} of {result.fixtures} group(s) (left out)", markup=False)
    untied = len(loaded) - result.failed - result.labels.groups
    if untied:
        console.print(f"{untied} group(s) left out of a row: all labels or all verdicts equal (no ranking)", markup=False)
    if out is not None:
        write_json(result.to_json(loaded), out)
        console.print(f"results: {out}", markup=False)
