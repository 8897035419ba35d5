"""`retrograd eval`: the base and each adapter on local tasks (retrograd.evaluation.tasks),
paired, with a bootstrap interval and a verdict per difference."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from retrograd.cli.app import app
from retrograd.cli.options import DeviceOpt, ModelOpt, WeightsOpt
from retrograd.errors import DataError


@app.command("eval", epilog="Example: retrograd eval --adapter out/run.gguf --tasks examples/eval/ --out eval.json")
def eval_command(
    tasks: Annotated[Path, typer.Option("--tasks", help="A JSONL task file, or a folder of them (one task per file).")],
    adapter: Annotated[Optional[list[Path]], typer.Option("--adapter", help="A LoRA GGUF to compare with the base (repeat for more).")] = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    weights: WeightsOpt = "auto",
    micro_batch: Annotated[int, typer.Option("--micro-batch", min=16, help="Tokens per forward pass.")] = 2048,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the results (per task, model and item) as JSON.")] = None,
    run: Annotated[Optional[Path], typer.Option("--run", help="Also show the results in this run's report (its config .toml, output .gguf or records folder): written as its NAME.eval.json, replacing an earlier evaluation, and NAME.report.html rewritten.")] = None,
    reward_function: Annotated[Optional[str], typer.Option("--reward-function", help="Generation tasks: score answers with this Python function (module:function or file.py:function).")] = None,
    reward_command: Annotated[Optional[str], typer.Option("--reward-command", help="Generation tasks: score answers with this program over the reward protocol (a command line).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Generation tasks: the longest answer.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", min=0.01, max=2.0, help="Generation tasks: sampling temperature.")] = 1.0,
    samples: Annotated[int, typer.Option("--samples", min=1, max=64, help="Generation tasks: answers per prompt (the same seeds for every model).")] = 1,
) -> None:
    """Score the base and each adapter on the same items: multiple-choice accuracy (summed and
    length-normalised log-prob), perplexity and, for generation tasks, the mean reward of
    sampled answers; each adapter's difference with a 95% paired bootstrap interval and a
    verdict (better / worse / no detectable change)."""
    import shlex

    from retrograd.evaluation.tasks import Answering, load_tasks, loader
    from retrograd.recipes.common import model_chat
    from retrograd.reports.run_report import RunReport, locate
    from retrograd.rollouts.rewards import make_reward
    from retrograd.runtime.bundled import default_model_path
    from retrograd.runtime.device import resolve_device
    from retrograd.sampler import Sampling

    files = locate(run) if run is not None else None  # a run that is not one stops before any scoring
    base = model or default_model_path()
    chat = model_chat(base)
    loaded = load_tasks(tasks, chat)
    reward = None
    if reward_function is not None or reward_command is not None:
        reward = make_reward(command=shlex.split(reward_command) if reward_command else None, function=reward_function)
    adapters = {}
    for path in adapter or []:
        if not path.is_file():
            raise DataError(f"--adapter {path}: no such file")
        if path.stem in adapters or path.stem == "base":
            raise DataError(f"--adapter {path}: another model is already named {path.stem!r}")
        adapters[path.stem] = path
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 200
    console.print(f"eval: {len(loaded)} task(s) from {tasks}, models: base{''.join(', ' + n for n in adapters)}", markup=False)
    load = loader(base, weights=weights, device=resolve_device(device))
    answering = None if reward is None else Answering(reward, Sampling(max_new_tokens, temperature), samples)
    with reward or contextlib.nullcontext():
        results = run_with_bar(console, load, adapters, loaded, micro_batch, base, answering, chat.tokenizer)
    console.print(results_table(results, list(adapters)))
    if out is not None:
        write_results(results, out)
        console.print(f"results: {out}", markup=False)
    if files is not None:
        write_results(results, files.evaluation)
        console.print(f"results: {files.evaluation}\nreport: {RunReport(files).write()}", markup=False)


def run_with_bar(console: Console, load, adapters: dict[str, Path], tasks, micro_batch: int, base: Path,
                 answering=None, tokenizer=None):
    """evaluation.tasks.evaluate under a progress bar of scored answers (generation tasks
    answered by llama.cpp on `base`, as `answering` says)."""
    from retrograd.evaluation.tasks import evaluate, n_rollouts, open_answerer

    total = sum(n_rollouts(t, answering.samples if answering else 1) for t in tasks) * (1 + len(adapters))
    with open_answerer(base, tasks, answering, tokenizer) as answerer, \
            Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TextColumn("answers"), TimeRemainingColumn(),
                     console=console, transient=True, disable=not console.is_terminal) as progress:
        bar = progress.add_task("eval", total=total)
        return evaluate(load, adapters, tasks, micro_batch, lambda n: progress.advance(bar, n), answerer)


def write_results(results, out: Path) -> None:
    """The results as JSON, written whole or not at all."""
    from retrograd.data.files import write_json

    write_json({r.task.name: r.to_json() for r in results}, out)


def results_table(results, adapters: list[str]) -> Table:
    t = Table(box=box.ROUNDED)
    for name in ("task", "metric", "base", *adapters):
        t.add_column(name, justify="left" if name in ("task", "metric") else "right")
    for result in results:
        for k, metric in enumerate(result.scores["base"].metrics):
            cells = [result.task.name if k == 0 else "", metric]
            cells += [f"{result.scores[name].metrics[metric]:.4f}" for name in ("base", *adapters)]
            t.add_row(*cells)
        if adapters:
            unit = {"multiple_choice": "correct", "perplexity": "log-prob/token", "generation": "reward"}[result.task.kind]
            cells = ["", f"Δ per item ({unit}), 95% CI", ""]
            for name in adapters:
                d = result.differences[name]
                colour = {"better": "green", "worse": "red"}.get(d.verdict, "default")
                cells.append(f"[{colour}]{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}] {d.verdict}[/]")
            t.add_row(*cells)
        t.add_section()
    return t
