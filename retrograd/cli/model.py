"""`retrograd inspect` and `retrograd preflight`: look at a model before training on it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from retrograd.cli.app import app
from retrograd.cli.options import DeviceOpt, ModelOpt
from retrograd.runtime import allocator
from retrograd.runtime.bundled import default_model_path


@app.command(epilog="Example: retrograd inspect --model ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf")
def inspect(model: ModelOpt = None, device: DeviceOpt = "auto") -> None:
    """Architecture, sizes, tensor types, chat template, LoRA targets and device of a GGUF model."""
    path = checked_model(model)
    from retrograd.model.capabilities import inspect_model
    from retrograd.runtime.device import resolve_device

    report = inspect_model(path, resolve_device(device))
    typer.echo("\n".join(report.lines()))


@app.command(epilog="Examples: retrograd preflight run.toml | retrograd preflight run.toml --memory 6GiB | "
                    "retrograd preflight --model base.gguf --targets q,v --ctx 512 --micro-batch 128 --strict")
def preflight(
    config: Optional[Path] = typer.Argument(None, help="A run's TOML file: probe that run and say whether it fits and how long a step takes."),
    model: ModelOpt = None,
    memory: Optional[str] = typer.Option(None, "--memory", metavar="SIZE", help="With CONFIG: the memory the run may use, e.g. 6GiB (default: what the system has available)."),
    probe_steps: Optional[int] = typer.Option(None, "--probe-steps", min=2, help="With CONFIG: steps (updates) the probe runs; the first is not timed (default: 4 steps or 2 updates, and on until 6 s were timed)."),
    targets: Optional[str] = typer.Option(None, "--targets", help="Comma-separated LoRA targets (q,k,v,o,ffn_up,ffn_down,ffn_gate, auto, or GGUF patterns; default auto)."),
    strict: bool = typer.Option(False, "--strict", help="Exit with status 1 when anything would run off the device."),
    device: Optional[str] = typer.Option(None, "--device", help="auto (a CUDA GPU if torch sees one), cpu or gpu."),
    ctx: Optional[int] = typer.Option(None, "--ctx", min=1, help="Training window in tokens, for the memory estimate (default 128)."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", min=1, help="Tokens per forward/backward, for the memory estimate (default 32)."),
    rank: Optional[int] = typer.Option(None, "--rank", min=1, help="LoRA rank of the probe adapter (default 2)."),
    weights: Optional[str] = typer.Option(None, "--weights", help="auto, quantized, bf16 or f32 (see `retrograd train --help`; default auto)."),
    compute_dtype: Optional[str] = typer.Option(None, "--compute-dtype", help="Matmul precision: f32 or bf16 (default f32)."),
) -> None:
    """Probe a run (CONFIG): will it fit in memory, how long per step, and what to change if it
    does not. Or, with --model alone: one forward+backward with a throwaway LoRA, device
    fallbacks and a memory estimate."""
    from retrograd.errors import ConfigError

    model_only = {"--targets": targets, "--ctx": ctx, "--micro-batch": micro_batch, "--rank": rank, "--weights": weights,
                  "--compute-dtype": compute_dtype}
    if config is not None:
        given = [name for name, value in model_only.items() if value is not None] + (["--strict"] if strict else [])
        if given:
            raise ConfigError(f"preflight {config}: {', '.join(given)} apply to --model probes; the run's file sets them")
        _plan(config, model, device, memory, probe_steps)
        return
    if memory is not None or probe_steps is not None:
        raise ConfigError("preflight: --memory and --probe-steps need a run's CONFIG.toml")
    path = checked_model(model)
    from retrograd.evaluation.preflight import run_preflight
    from retrograd.runtime.device import resolve_device

    report = run_preflight(
        path,
        resolve_device(device or "auto"),
        targets=[t.strip() for t in (targets or "auto").split(",") if t.strip()],
        rank=rank or 2,
        alpha=2.0 * (rank or 2),
        ctx=ctx or 128,
        micro_batch=micro_batch or 32,
        weights=weights or "auto",
        compute_dtype=compute_dtype or "f32",
    )
    typer.echo("\n".join(report.lines()))
    if not report.ok or (strict and report.off_device):
        raise typer.Exit(1)


def checked_model(model: Optional[Path]) -> Path:
    """The model's path (default: the bundled one), once its header reads as a GGUF of a
    supported architecture: a missing, damaged or hostile file stops here in one line, before
    torch is imported (about 2 s of every command that loads it)."""
    from retrograd.gguf.file import GGUFFile
    from retrograd.gguf.spec import read_spec

    path = model or default_model_path()
    read_spec(GGUFFile(path))
    return path


def _plan(config: Path, model: Optional[Path], device: Optional[str], memory: Optional[str], probe_steps: Optional[int]) -> None:
    from rich.console import Console

    from retrograd.config import load_config
    from retrograd.errors import ConfigError

    cfg = load_config(config).with_overrides(model=model, device=device)  # checked before torch is imported
    from retrograd.evaluation import plan as planner

    try:
        budget = planner.parse_size(memory) if memory is not None else planner.default_budget()
    except ValueError as e:
        raise ConfigError(f"--memory {e}") from None
    t = cfg.training
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"run            {config} ({cfg.run.algorithm}): ctx {t.ctx}, micro_batch {t.micro_batch}, "
               f"LoRA rank {cfg.lora.rank}, compute {t.compute_dtype}, checkpointing {'on' if t.gradient_checkpointing else 'off'}", markup=False)
    console.print(f"budget         {budget / 2**30:.2f} GiB of host memory", markup=False)
    console.print(f"allocator      {allocator.current()}", markup=False)
    with console.status("probing: loading") as status:
        unit = ["step"]

        def on_event(event):
            if event["kind"] == "start":
                unit[0] = event["unit"][:-1]
            if event["kind"] in ("start", "step"):
                status.update(f"probing: {unit[0]} {event.get('done', 0) + 1}")

        weights = [""]

        def on_probe(probe):
            console.print(planner.probe_line(probe, budget), markup=False)
            if probe.weights and probe.weights != weights[0]:
                console.print(f"{'':14} weights {probe.weights}", markup=False)
                weights[0] = probe.weights
            status.update("probing: loading")
        try:
            result = planner.plan(cfg, budget, units=probe_steps, on_probe=on_probe, on_event=on_event)
        except planner.ProbeFailed as e:
            raise ConfigError(f"preflight {config}: the probe run failed: {e}") from None
    console.print("\n".join(planner.verdict(cfg, result)), markup=False)
    if not result.configured.fits:
        raise typer.Exit(1)
