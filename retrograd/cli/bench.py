"""`retrograd bench CONFIG.toml`: base versus adapter on the same examples, as a table and
a verdict, and with --verbose one line per example or prompt (the measuring is
retrograd.evaluation.bench and retrograd.evaluation.bench_rollouts; this only formats)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from retrograd.cli.app import app
from retrograd.cli.options import ModelOpt
from retrograd.cli.progress import ConsoleReporter

if TYPE_CHECKING:
    from retrograd.evaluation.common import ItemRow, Row, Verdict


@app.command(
    context_settings={"allow_extra_args": False},
    epilog=(
        "Examples: retrograd bench run.toml | retrograd bench run.toml --adapter out/best.gguf --data held_out.jsonl --limit 200"
        " | retrograd bench grpo.toml --samples 8 --success-at 0.5 --verbose"
    ),
)
def bench(
    config: Annotated[Path, typer.Argument(help="The run's TOML file.")],
    adapter: Annotated[
        Path | None,
        typer.Option(
            "--adapter",
            help="LoRA GGUF to measure (default: \\[output].path; the base alone when that file is absent).",
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Examples to measure (default: \\[evaluation].data, else \\[sft].data; ppo, grpo and agent_grpo: held-out "
            "prompts or scenarios, \\[evaluation].data by default).",
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Measure only the first N examples.")] = None,
    samples: Annotated[
        int | None,
        typer.Option("--samples", min=1, help="ppo, grpo, agent_grpo: completions per prompt, same seeds for base and adapter (default 4)."),
    ] = None,
    success_at: Annotated[
        float | None,
        typer.Option("--success-at", help="ppo, grpo: a completion succeeds when its reward is at least this (default 1)."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Also print one line per example or prompt.")] = False,
    model: ModelOpt = None,
    device: Annotated[
        str | None, typer.Option("--device", help="auto, cpu or gpu (overrides \\[model].device).")
    ] = None,
) -> None:
    """Measure the base model and the adapter on the same examples; nothing is trained or written."""
    from retrograd.config import load_config
    from retrograd.evaluation import bench as benches

    cfg = load_config(config).with_overrides(model=model, device=device)
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 200  # a pipe or file: keep every table row and verdict line whole
    reporter = ConsoleReporter(console)
    reporter.message("bench")
    reporter.message(f"  config: {cfg.path}")
    reporter.message(f"  model:  {cfg.model.path or 'bundled SmolLM2-135M-Instruct Q4_1'}")
    options = benches.BenchOptions(data=data, adapter=adapter, limit=limit, samples=samples, success_at=success_at)
    result = benches.run(cfg, reporter, options)
    if verbose:
        console.print(item_table(result.item_label, result.items()))
    console.print(table(result.rows()))
    verdict = result.verdict()
    if verdict is not None:
        for line in verdict_lines(verdict):
            console.print(line, markup=False)


def table(rows: list[Row]) -> Table:
    with_adapter = rows[0].adapter is not None
    t = Table(box=box.ROUNDED)
    for name in ("metric", "base", "adapter", "Δ", "Δ%") if with_adapter else ("metric", "base"):
        t.add_column(name, justify="left" if name == "metric" else "right")
    group = None
    for row in rows:
        if row.group != group:
            if group is not None:
                t.add_section()
            t.add_row(f"[bold]{row.group}[/]")
            group = row.group
        cells = [f"  {row.metric}", f"{row.base:.{row.digits}f}"]
        if with_adapter:
            colour = _colour(row.delta * row.better)
            percent = "-" if row.delta_percent is None else f"{row.delta_percent:+.2f}%"
            cells += [
                f"{row.adapter:.{row.digits}f}",
                f"[{colour}]{row.delta:+.{row.digits}f}[/]",
                f"[{colour}]{percent}[/]",
            ]
        t.add_row(*cells)
    return t


def item_table(label: str, items: list[ItemRow]) -> Table:
    """One line per example or prompt: base, adapter and Δ, coloured like the main table."""
    with_adapter = bool(items) and items[0].adapter is not None
    t = Table(box=box.ROUNDED)
    for name in (label, "base", "adapter", "Δ") if with_adapter else (label, "base"):
        t.add_column(name, justify="left" if name == label else "right")
    for item in items:
        cells = [item.name, f"{item.base:.4f}"]
        if with_adapter:
            cells += [f"{item.adapter:.4f}", f"[{_colour(item.delta)}]{item.delta:+.4f}[/]"]
        t.add_row(*cells)
    return t


def verdict_lines(v: Verdict) -> list[str]:
    c = v.changes
    unit = f" {v.unit}" if v.unit else ""
    overall = "" if v.loss_percent is None else f"   {v.percent_of} {v.loss_percent:+.2f}%"
    share = 100.0 * v.improved / v.total
    return [
        f"verdict    {v.label}   {v.metric} Δ{v.mean_delta:+.4f}{unit}{overall}",
        (
            f"{v.items:<10} ↑ {v.improved}/{v.total} improved ({share:.1f}%)  ↓ {v.degraded} degraded  "
            f"= {v.unchanged} unchanged (|Δ| ≤ {v.tolerance:g}{unit})"
        ),
        f"change/ex  mean Δ{c.mean:+.4f}  stddev {c.stddev:.4f}  best Δ{c.high:+.4f}  worst Δ{c.low:+.4f}",
    ]


def _colour(signed_gain: float) -> str:
    return "green" if signed_gain > 0 else "red" if signed_gain < 0 else "default"
