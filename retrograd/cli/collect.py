"""`retrograd collect CONFIG.toml --out FILE.jsonl`: an agent_grpo config's scenarios rolled
out without training, the good traces written as SFT tool records or preference pairs (the
work is retrograd.evaluation.collect; this only wires it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from retrograd.cli.app import app
from retrograd.cli.options import ModelOpt
from retrograd.cli.progress import ConsoleReporter


@app.command(
    context_settings={"allow_extra_args": False},
    epilog=(
        "Examples: retrograd collect agent.toml --out traces.jsonl --k 8 --report pass.json"
        " | retrograd collect agent.toml --out pairs.jsonl --pairs --min-gap 0.5"
    ),
)
def collect(
    config: Annotated[Path, typer.Argument(help="An agent_grpo run's TOML file.")],
    out: Annotated[Path, typer.Option("--out", help="JSON Lines to write (via OUT.tmp, renamed when complete).")],
    k: Annotated[int | None, typer.Option("--k", min=1, help="Trajectories per scenario (default: \\[agent].group_size).")] = None,
    keep: Annotated[int, typer.Option("--keep", min=1, help="Records per scenario: highest reward first, shortest on ties, no exact duplicates.")] = 1,
    min_reward: Annotated[
        float | None,
        typer.Option("--min-reward", help="Keep traces with at least this reward (default: successful traces only: "
                                          "verify passed, or a reward of at least 1)."),
    ] = None,
    require_verified: Annotated[
        bool,
        typer.Option("--require-verified/--allow-unverified",
                     help="Keep only traces whose scenario's verify command passed (not those a judge or step rewards scored)."),
    ] = False,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N scenarios.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Scenario i uses seeds SEED + i*k + j (default: \\[agent].seed).")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Write per-scenario attempts, passes, kept and pass rate as JSON.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out.")] = False,
    pairs: Annotated[
        bool,
        typer.Option("--pairs", help="Write one preference pair per scenario instead: the best kept trace (chosen) against "
                                     "the worst complete one (rejected), as \\[preference] reads them."),
    ] = False,
    min_gap: Annotated[float | None, typer.Option("--min-gap", min=0.0, help="--pairs: skip a scenario whose reward gap is below this (default 0.5).")] = None,
    adapter: Annotated[Path | None, typer.Option("--adapter", help="LoRA GGUF to sample with (default: \\[lora].init_adapter, else the base model).")] = None,
    api: Annotated[
        bool,
        typer.Option("--api", help="Roll out with \\[agent.collect_api]'s OpenAI-compatible endpoint instead of the local model "
                                   "(records are structured)."),
    ] = False,
    structured: Annotated[
        bool | None,
        typer.Option("--structured/--raw",
                     help="Turns as content + tool_calls, which any model's template renders (default with --api), or as the "
                          "exact text sampled, which re-tokenizes as the rollout did (default for the local model)."),
    ] = None,
    model: ModelOpt = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or gpu (overrides \\[model].device).")] = None,
) -> None:
    """Roll out an agent_grpo config's scenarios (nothing is trained) and write the successful traces as SFT tool records."""
    from retrograd.config import load_config
    from retrograd.errors import ConfigError
    from retrograd.evaluation.collect_request import CollectOptions, check_request

    if api and device is not None:
        raise ConfigError("--device applies to the local model, not to --api (whose --model only renders and counts the records)")
    cfg = load_config(config).with_overrides(model=model, device=device)
    options = CollectOptions(out=out, k=k, keep=keep, min_reward=min_reward, require_verified=require_verified, limit=limit, seed=seed, report=report,
                             force=force, pairs=pairs, min_gap=min_gap, adapter=adapter, api=api, structured=structured)
    check_request(cfg, options)  # before the collector's imports (torch: about 2 s)
    from retrograd.evaluation.collect import collect as run_collect

    reporter = ConsoleReporter()
    reporter.message("collect")
    reporter.message(f"  config: {cfg.path}")
    reporter.message(f"  model:  {cfg.model.path or 'bundled SmolLM2-135M-Instruct Q4_1'}")
    result = run_collect(cfg, options, reporter)
    for line in result.summary():
        reporter.message(line)
