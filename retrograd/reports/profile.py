"""`bin/profile CONFIG.toml` (also `retrograd profile`): where a GRPO or agentic GRPO run's
time and memory go.

It runs a short version of the configured workload (1 update, groups of 4, 1 epoch, 3
prompts, or 2 scenarios, unless told otherwise; --full runs the file as written), without
evaluation, checkpoints or the real output path, and reports start-up, phases (for agentic
runs: sandboxes, generation, tool execution, reward, judge, optimizer), updates, memory
and the duty cycle.
"""

from __future__ import annotations

import dataclasses
import resource
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from retrograd.config import Config
from retrograd.errors import ConfigError
from retrograd.recipes import agent_grpo, grpo
from retrograd.recipes.common import compute_dtype
from retrograd.reports.timeline import timeline_summary
from retrograd.runtime.device import resolve_device
from retrograd.training.metrics import run_record
from retrograd.training.report import SilentReporter
from retrograd.training.rollout_loop import RolloutResult

PHASE_LABELS = {  # every phase a rollout recipe times, in report order; each recipe has some
    "environment": "sandboxes (acquire, setup, release)",
    "generation": "generation (llama.cpp decode)",
    "tools": "tool execution (in the sandboxes)",
    "behavior_scoring": "behaviour scoring (teacher forcing)",
    "reward": "reward",
    "judge": "judge",
    "reference": "reference KL (adapter off)",
    "optimizer": "optimizer (fwd + bwd + step)",
    "adapter_refresh": "adapter refresh",
    "adapter_push": "adapter copy for the sampler (async)",
    "waiting_for_batch": "trainer waiting for a batch (async)",
}


@dataclass(frozen=True)
class Workload:
    updates: int | None = None
    group_size: int | None = None
    epochs: int | None = None
    prompts: int | None = None
    max_new_tokens: int | None = None
    full: bool = False


@dataclass(frozen=True)
class Profiled:
    """What the profile needs of a recipe: its module (with run, PHASES and sampler_options)
    and where its section keeps the workload."""

    module: ModuleType
    section: str  # "grpo" or "agent"
    epochs: str  # the key of optimizer passes per update
    groups: str  # the key of prompts (scenarios) per update, shown as `label`
    label: str
    default_groups: int
    new_tokens: Callable  # section -> tokens sampled per completion, or per turn
    with_new_tokens: Callable  # (section, n) -> section
    tokens_text: Callable  # section -> the end of the workload line


PROFILED = {
    "grpo": Profiled(
        grpo, "grpo", "grpo_epochs", "prompts_per_update", "prompts/upd", 3,
        lambda g: g.sampling.max_new_tokens,
        lambda g, n: dataclasses.replace(g, sampling=dataclasses.replace(g.sampling, max_new_tokens=n)),
        lambda g: f"max_new_tokens={g.sampling.max_new_tokens}",
    ),
    "agent_grpo": Profiled(
        agent_grpo, "agent", "epochs_per_update", "scenarios_per_update", "scenarios/upd", 2,
        lambda a: a.max_new_tokens_per_turn,
        lambda a, n: dataclasses.replace(a, max_new_tokens_per_turn=n),
        lambda a: f"max_turns={a.max_turns} max_new_tokens_per_turn={a.max_new_tokens_per_turn}",
    ),
}


def shortened(cfg: Config, w: Workload, out_dir: Path) -> Config:
    """The config with the profile's workload, writing only to a scratch folder."""
    if cfg.run.algorithm not in PROFILED:
        raise ConfigError(f"{cfg.path}: profile runs grpo configs and agent_grpo configs; this one is {cfg.run.algorithm!r}")
    if w.group_size is not None and w.group_size < 2:
        raise ConfigError(f"--group-size {w.group_size}: a group needs at least 2 completions")
    recipe = PROFILED[cfg.run.algorithm]
    section = getattr(cfg, recipe.section)
    defaults = Workload() if w.full else Workload(updates=1, group_size=4, epochs=1, prompts=recipe.default_groups)
    groups = _pick(w.prompts, defaults.prompts, getattr(section, recipe.groups))
    group_size = _pick(w.group_size, defaults.group_size, section.group_size)
    section = dataclasses.replace(
        section,
        updates=_pick(w.updates, defaults.updates, section.updates),
        group_size=group_size,
        minibatches=min(section.minibatches, groups * group_size),
        **{recipe.epochs: _pick(w.epochs, defaults.epochs, getattr(section, recipe.epochs)), recipe.groups: groups},
    )
    if w.max_new_tokens is not None:
        section = recipe.with_new_tokens(section, w.max_new_tokens)
    if recipe.new_tokens(section) >= cfg.training.ctx:
        raise ConfigError(f"--max-new-tokens {recipe.new_tokens(section)} leaves no room for a prompt in training.ctx = {cfg.training.ctx}")
    return dataclasses.replace(cfg, **{recipe.section: section}).scratch_run(out_dir / "profile.gguf")


def _pick(ours, short, configured):
    return ours if ours is not None else short if short is not None else configured


def profile(cfg: Config, workload: Workload) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="retrograd-profile-") as scratch:
        short = shortened(cfg, workload, Path(scratch))
        result = PROFILED[short.run.algorithm].module.run(short, SilentReporter())
        return report(short, result) + ["", *timeline_summary(run_record(short, "timeline.jsonl"))]


def report(cfg: Config, result: RolloutResult) -> list[str]:
    t, recipe = cfg.training, PROFILED[cfg.run.algorithm]
    opts = recipe.module.sampler_options(cfg)
    records = result.records
    out = [
        "═══ retrograd training profiler ═══",
        f"config    {cfg.path}",
        f"model     {cfg.model.path or 'bundled SmolLM2-135M-Instruct Q4_1'} ({cfg.model.weights} weights)",
        f"device    {cfg.model.device} -> {'cuda' if torch.cuda.is_available() and cfg.model.device != 'cpu' else 'cpu'}, "
        f"{torch.get_num_threads()} torch threads",
        _workload(cfg, recipe),
        f"context   ctx={t.ctx} micro_batch={t.micro_batch} generation_concurrency={opts.n_seq_max} kv={opts.kv_dtype} "
        f"compute={compute_dtype(t.compute_dtype, resolve_device(cfg.model.device))}",
        "",
        "Initialization                             time      Δ RSS",
    ]
    for name, (seconds, rss) in result.init_timing.items():
        out.append(f"  {name:<38} {seconds:7.2f} s {rss / 2**20:8.1f} MiB")

    seen = set(recipe.module.PHASES) | {k for r in records for k in r.timing}
    phases = {k: sum(r.timing.get(k, 0.0) for r in records) for k in PHASE_LABELS if k in seen}
    total = sum(r.metrics.get("timing/update_seconds", 0.0) for r in records)
    phases_sum = sum(phases.values())
    out += ["", "Phase (all updates)                         time     share"]
    for key, seconds in phases.items():
        out.append(_phase_line(PHASE_LABELS[key], seconds, total))
    out.append(_phase_line("other (prep, tokenization, overhead)", max(total - phases_sum, 0.0), total))
    out.append(f"  {'TOTAL training':<38} {total:7.2f} s")
    if t.max_async_rollout:
        out.append(f"  (max_async_rollout = {t.max_async_rollout}: the sampler's phases ran beside the trainer's, "
                   "so the shares add up past 100%)")
    if "agent/turns_per_traj_mean" in records[0].metrics:
        out += _rollout_lines(records)

    duty = result.duty
    if t.max_gpu_duty_cycle < 1:
        if duty is not None and duty.busy > 0:
            wall = max(total, 1e-9)
            out.append(
                f"duty cycle requested={t.max_gpu_duty_cycle:.2f} observed={duty.observed():.2f} "
                f"(compute {duty.busy:.1f} s / idle {duty.idle:.1f} s)  wall share={duty.busy / wall:.2f} over {wall:.1f} s"
            )
        else:
            out.append(f"duty cycle requested={t.max_gpu_duty_cycle:.2f}: inactive on the CPU (use training.threads)")

    out += ["", "Per update   steps      loss    reward    tok/s   gen s  optim s  reward s"]
    for r in records:
        m = r.metrics
        loss = m.get("policy/total_loss")
        out.append(
            f"  {r.update + 1:>5} {r.steps:>7} {('%9.4f' % loss) if loss is not None else '        -'} {m['reward/mean']:9.4f} "
            f"{m.get('train/tokens_per_second', 0):8.1f} {r.timing['generation']:7.2f} {r.timing['optimizer']:8.2f} {r.timing['reward']:9.2f}"
        )
    mem = result.memory
    peak_life = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out += [
        "",
        "Memory (host RSS)",
        f"  baseline          {mem['baseline'] / 2**20:9.1f} MiB",
        f"  after load        {mem['after_load'] / 2**20:9.1f} MiB",
        f"  peak (updates)    {mem['peak'] / 2**20:9.1f} MiB",
        f"  peak (process)    {peak_life / 2**20:9.1f} MiB",
    ]
    if torch.cuda.is_available():
        out.append(f"  device peak       {torch.cuda.max_memory_allocated() / 2**20:9.1f} MiB (CUDA allocator)")
    refresh = [r.metrics["sampler/adapter_refresh_seconds"] for r in records if "sampler/adapter_refresh_seconds" in r.metrics]
    out += [
        "",
        f"Summary  loss={result.train_loss:.4f}  reward={records[-1].metrics['reward/mean']:.4f}  tok/s={result.tokens_per_second:.1f}  "
        f"steps={result.steps}  training={total:.1f} s"
        + (f"  adapter refresh={1000 * sum(refresh) / len(refresh):.0f} ms" if refresh else ""),
    ]
    if result.steps == 0:
        out.append("warning: the optimizer never ran (every group was dead); raise --prompts or --group-size")
    return out


def _workload(cfg: Config, recipe: Profiled) -> str:
    section = getattr(cfg, recipe.section)
    return (f"workload  updates={section.updates} {recipe.label}={getattr(section, recipe.groups)} group={section.group_size} "
            f"epochs/upd={getattr(section, recipe.epochs)} minibatches={section.minibatches} {recipe.tokens_text(section)}")


def _rollout_lines(records) -> list[str]:
    """Agentic runs: what the trajectories did and what the sandboxes and the KV cache cost."""
    mean = lambda key: sum(r.metrics.get(key, 0.0) for r in records) / len(records)
    prefilled = sum(r.metrics["generation/prefilled_tokens"] for r in records)
    return [
        "",
        "Rollouts (mean over updates)",
        (f"  turns/trajectory {mean('agent/turns_per_traj_mean'):.2f}  tool calls/turn {mean('agent/tool_calls_per_turn'):.2f}  "
         f"tool errors {mean('agent/tool_error_fraction'):.1%}  truncated {mean('agent/truncated_fraction'):.1%}  "
         f"failed {mean('agent/failed_fraction'):.1%}"),
        (f"  KV cache: {mean('generation/prefill_reuse_fraction'):.1%} of context tokens reused between turns, "
         f"{prefilled:.0f} prefilled"),
        (f"  sandboxes: acquire {mean('env/acquire_ms_mean'):.1f} ms, create {mean('env/container_create_ms'):.1f} ms, "
         f"reuse {mean('env/pool_reuse_fraction'):.1%}, "
         f"live max {max(r.metrics.get('env/live_containers_max', 0.0) for r in records):.0f}, "
         f"exec timeouts {mean('env/exec_timeout_fraction'):.1%}"),
    ]


def _phase_line(label: str, seconds: float, total: float) -> str:
    share = seconds / total if total else 0.0
    return f"  {label:<38} {seconds:7.2f} s {share:7.1%}  {'█' * round(share * 30)}"
