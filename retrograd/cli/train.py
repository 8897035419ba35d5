"""`retrograd train CONFIG.toml`: run the configured algorithm and write the adapter."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer

from retrograd.cli.app import app
from retrograd.cli.options import ModelOpt
from retrograd.cli.progress import ConsoleReporter
from retrograd.errors import RetrogradError


@app.command(
    # extra arguments reach the command only to word the error for `--resume CKPT`
    context_settings={"allow_extra_args": True},
    epilog="Examples: retrograd train examples/smoke_tiny_sft.toml | retrograd train run.toml --resume | retrograd train run.toml --resume-from checkpoints/step-000000000020.state",
)
def train(
    ctx: typer.Context,
    config: Path = typer.Argument(..., help="The run's TOML file."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the newest checkpoint in \\[checkpoint].directory."
    ),
    resume_from: Optional[Path] = typer.Option(
        None, "--resume-from", metavar="CKPT",
        help="Continue from this checkpoint: a step-….state or best.state directory (or the .gguf beside it).",
    ),
    model: ModelOpt = None,
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu or gpu (overrides \\[model].device)."),
) -> None:
    """Train a LoRA on the frozen GGUF base as \\[run].algorithm says, and export it for llama.cpp."""
    from retrograd.config import load_config

    # the arguments and the config are checked before torch is imported (about 2 s; [evaluation] tasks import it)
    resume_arg = resume_choice(resume, resume_from, ctx.args)
    cfg = load_config(config).with_overrides(model=model, device=device)
    tasks = evaluation_tasks(cfg)  # checked now, not after the run
    from retrograd.recipes import RECIPES
    from retrograd.training.distributed import launched_as_rank_zero
    from retrograd.training.report import SilentReporter

    if not launched_as_rank_zero():  # under torchrun rank 0 reports for every rank
        RECIPES[cfg.run.algorithm](cfg, SilentReporter(), resume=resume_arg)
        return
    reporter = ReportingConsole(cfg)
    reporter.message("train")
    reporter.message(f"  config: {cfg.path}")
    reporter.message(f"  model:  {cfg.model.path or 'bundled SmolLM2-135M-Instruct Q4_1'}")
    reporter.message(f"  output: {cfg.output.path}")
    warning = sampler_warning(cfg)
    if warning:
        reporter.message(warning)
    result = RECIPES[cfg.run.algorithm](cfg, reporter, resume=resume_arg)
    reporter.message(result.summary())
    if tasks:
        evaluate_final_adapter(cfg, tasks, reporter)
    written = reporter.refresh_report()
    if written:
        reporter.message(f"report: {written}")


def evaluation_tasks(cfg) -> tuple:
    """[evaluation] tasks, loaded (a malformed record stops the run before it starts).
    Generation tasks are scored by the run's own reward, so only grpo and ppo runs take them."""
    ev = cfg.evaluation
    if not (ev and ev.tasks):
        return ()
    from retrograd.errors import ConfigError
    from retrograd.evaluation.tasks import load_tasks
    from retrograd.recipes.common import open_chat

    chat = open_chat(cfg)
    tasks = tuple(task for path in ev.tasks for task in load_tasks(path, chat))
    generation = [t.name for t in tasks if t.kind == "generation"]
    if generation and (cfg.grpo or cfg.ppo) is None:
        raise ConfigError(f"{cfg.path}: evaluation.tasks: {generation[0]} is a generation task, scored by a reward program, "
                          f"and a {cfg.run.algorithm} run has none (after the run: retrograd eval --reward-function ...)")
    return tasks


def evaluate_final_adapter(cfg, tasks: tuple, reporter) -> None:
    """`retrograd eval` of the base and the run's adapter on [evaluation] tasks: the paired
    table, and NAME.eval.json beside the output."""
    from retrograd.cli.eval import results_table, run_with_bar, write_results
    from retrograd.evaluation.tasks import Answering, loader
    from retrograd.recipes.common import open_chat
    from retrograd.rollouts.rewards import make_reward
    from retrograd.runtime.bundled import default_model_path
    from retrograd.runtime.device import resolve_device
    from retrograd.sampler import Sampling
    from retrograd.training.metrics import run_record

    reporter.message(f"evaluation tasks: {', '.join(t.name for t in tasks)}, base and adapter")
    base = cfg.model.path or default_model_path()
    load = loader(base, weights=cfg.model.weights, device=resolve_device(cfg.model.device))
    rewarded = cfg.grpo or cfg.ppo  # generation tasks: answered as training sampled, scored by its reward
    reward = answering = None
    if rewarded is not None and any(t.kind == "generation" for t in tasks):
        reward = make_reward(command=rewarded.reward_command, mode=rewarded.reward_mode,
                             timeout_seconds=rewarded.reward_timeout_seconds, function=rewarded.reward_function)
        s = rewarded.sampling
        answering = Answering(reward, Sampling(s.max_new_tokens, s.temperature, s.top_p), seed=s.seed + 1)
    with reward or contextlib.nullcontext():
        results = run_with_bar(reporter.console, load, {"adapter": cfg.output.adapter_path}, tasks, cfg.training.micro_batch,
                               base, answering, open_chat(cfg).tokenizer)
    reporter.console.print(results_table(results, ["adapter"]))
    out = run_record(cfg, "eval.json")
    write_results(results, out)
    reporter.message(f"evaluation results: {out}")


class ReportingConsole(ConsoleReporter):
    """The console, and the run's NAME.report.html rewritten at every checkpoint."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.report = None  # a RunReport once the run has written its metrics

    def checkpoint(self, path: Path) -> None:
        super().checkpoint(path)
        self.refresh_report()

    def refresh_report(self) -> Path | None:
        """The report written, or None with a note: a report must never stop the training
        it describes, whatever it meets in the records."""
        from retrograd.reports.run_report import RunReport, run_files

        try:
            self.report = self.report or RunReport(run_files(self.cfg))
            return self.report.write()
        except Exception as e:  # noqa: BLE001 (see the docstring)
            super().message(f"note: the report was not written ({type(e).__name__}: {e})")
            return None


def sampler_warning(cfg) -> str | None:
    """The line that says llama.cpp would sample on the CPU while torch trains on a CUDA GPU
    (every algorithm but sft and preference runs llama.cpp)."""
    if cfg.run.algorithm in ("sft", "preference"):
        return None
    from retrograd.runtime.device import resolve_device
    from retrograd.runtime.llamacpp import gpu_offload_warning

    return gpu_offload_warning(resolve_device(cfg.model.device).type == "cuda")


def resume_choice(resume: bool, resume_from: Path | None, extra: list[str]) -> Path | bool | None:
    """What the recipes' `resume=` gets: True (--resume: the newest checkpoint), the checkpoint
    named by --resume-from, or None (a fresh run, or [checkpoint].resume_from)."""
    if extra:
        if resume:
            raise RetrogradError(f"--resume takes no value: to continue from {extra[0]}, use --resume-from {extra[0]}")
        raise RetrogradError(f"unexpected argument {extra[0]!r}: train takes one config file")
    if resume and resume_from is not None:
        raise RetrogradError(
            "--resume and --resume-from exclude each other: --resume takes the newest checkpoint, "
            "--resume-from CKPT the one named"
        )
    if resume_from is None:
        return True if resume else None
    if not resume_from.exists():
        raise RetrogradError(f"--resume-from {resume_from}: no such file or directory")
    from retrograd.training.checkpoint import load_checkpoint

    hint = "give a step-….state or best.state directory from [checkpoint].directory"
    try:
        load_checkpoint(resume_from)
    except RetrogradError as e:  # "PATH: not a complete checkpoint (no manifest.json)", another format
        raise RetrogradError(f"--resume-from {e}; {hint}") from None
    except (OSError, ValueError) as e:  # unreadable, or a manifest that is not JSON
        raise RetrogradError(f"--resume-from {resume_from}: not a readable checkpoint ({e}); {hint}") from None
    return resume_from
