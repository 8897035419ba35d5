"""`retrograd inspect` and `retrograd preflight`: look at a model before training on it."""

from __future__ import annotations

import typer

from retrograd.cli.app import app
from retrograd.cli.options import ComputeOpt, DeviceOpt, ModelOpt, WeightsOpt
from retrograd.runtime.bundled import default_model_path


@app.command(epilog="Example: retrograd inspect --model ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf")
def inspect(model: ModelOpt = None, device: DeviceOpt = "auto") -> None:
    """Architecture, sizes, tensor types, chat template, LoRA targets and device of a GGUF model."""
    from retrograd.model.capabilities import inspect_model
    from retrograd.runtime.device import resolve_device

    report = inspect_model(model or default_model_path(), resolve_device(device))
    typer.echo("\n".join(report.lines()))


@app.command(epilog="Example: retrograd preflight --model base.gguf --targets q,v --ctx 512 --micro-batch 128 --strict")
def preflight(
    model: ModelOpt = None,
    targets: str = typer.Option("auto", "--targets", help="Comma-separated LoRA targets (q,k,v,o,ffn_up,ffn_down,ffn_gate, auto, or GGUF patterns)."),
    strict: bool = typer.Option(False, "--strict", help="Exit with status 1 when anything would run off the device."),
    device: DeviceOpt = "auto",
    ctx: int = typer.Option(128, "--ctx", min=1, help="Training window in tokens, for the memory estimate."),
    micro_batch: int = typer.Option(32, "--micro-batch", min=1, help="Tokens per forward/backward, for the memory estimate."),
    rank: int = typer.Option(2, "--rank", min=1, help="LoRA rank of the probe adapter."),
    weights: WeightsOpt = "auto",
    compute_dtype: ComputeOpt = "f32",
) -> None:
    """Run one real forward+backward with a throwaway LoRA and report device fallbacks and memory."""
    from retrograd.evaluation.preflight import run_preflight
    from retrograd.runtime.device import resolve_device

    report = run_preflight(
        model,
        resolve_device(device),
        targets=[t.strip() for t in targets.split(",") if t.strip()],
        rank=rank,
        alpha=2.0 * rank,
        ctx=ctx,
        micro_batch=micro_batch,
        weights=weights,
        compute_dtype=compute_dtype,
    )
    typer.echo("\n".join(report.lines()))
    if not report.ok or (strict and report.off_device):
        raise typer.Exit(1)
