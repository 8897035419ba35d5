"""`bin/profile CONFIG.toml` (also `retrograd profile`): where a GRPO run's time and memory go.

It runs a short version of the configured workload (1 update, groups of 4, 1 epoch, 3
prompts unless told otherwise; --full runs the file as written), without evaluation,
checkpoints or the real output path, and reports start-up, phases, updates, memory and the
duty cycle.
"""

from __future__ import annotations

import dataclasses
import resource
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from retrograd.config import Config
from retrograd.errors import ConfigError
from retrograd.device import resolve_device
from retrograd.recipes import grpo
from retrograd.recipes.common import compute_dtype
from retrograd.training.report import SilentReporter

PHASE_LABELS = {
    "generation": "generation (llama.cpp decode)",
    "behavior_scoring": "behaviour scoring (teacher forcing)",
    "reward": "reward",
    "reference": "reference KL (adapter off)",
    "optimizer": "optimizer (fwd + bwd + step)",
    "adapter_refresh": "adapter refresh",
}


@dataclass(frozen=True)
class Workload:
    updates: int | None = None
    group_size: int | None = None
    epochs: int | None = None
    prompts: int | None = None
    max_new_tokens: int | None = None
    full: bool = False


def shortened(cfg: Config, w: Workload, out_dir: Path) -> Config:
    """The config with the profile's workload, writing only to a scratch folder."""
    if cfg.run.algorithm != "grpo":
        raise ConfigError(f"{cfg.path}: profile runs grpo configs; this one is {cfg.run.algorithm!r}")
    g = cfg.grpo
    defaults = Workload() if w.full else Workload(updates=1, group_size=4, epochs=1, prompts=3)
    pick = lambda ours, short, configured: ours if ours is not None else short if short is not None else configured  # noqa: E731
    sampling = dataclasses.replace(g.sampling, max_new_tokens=pick(w.max_new_tokens, None, g.sampling.max_new_tokens))
    g = dataclasses.replace(
        g,
        updates=pick(w.updates, defaults.updates, g.updates),
        group_size=pick(w.group_size, defaults.group_size, g.group_size),
        grpo_epochs=pick(w.epochs, defaults.epochs, g.grpo_epochs),
        prompts_per_update=pick(w.prompts, defaults.prompts, g.prompts_per_update),
        minibatches=min(g.minibatches, pick(w.prompts, defaults.prompts, g.prompts_per_update) * pick(w.group_size, defaults.group_size, g.group_size)),
        sampling=sampling,
    )
    if g.group_size < 2:
        raise ConfigError(f"--group-size {g.group_size}: a group needs at least 2 completions")
    if sampling.max_new_tokens >= cfg.training.ctx:
        raise ConfigError(f"--max-new-tokens {sampling.max_new_tokens} leaves no room for a prompt in training.ctx = {cfg.training.ctx}")
    return dataclasses.replace(
        cfg,
        grpo=g,
        output=dataclasses.replace(cfg.output, path=out_dir / "profile.gguf"),
        evaluation=None,
        checkpoint=None,
        observe=None,
        metrics=dataclasses.replace(cfg.metrics, tensorboard_dir=None),
    )


def profile(cfg: Config, workload: Workload) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="retrograd-profile-") as scratch:
        short = shortened(cfg, workload, Path(scratch))
        result = grpo.run(short, SilentReporter())
        return report(short, result)


def report(cfg: Config, result: grpo.GRPOResult) -> list[str]:
    g, t = cfg.grpo, cfg.training
    opts = grpo.sampler_options(cfg)
    records = result.records
    out = [
        "═══ retrograd training profiler ═══",
        f"config    {cfg.path}",
        f"model     {cfg.model.path or 'bundled SmolLM2-135M-Instruct Q4_1'} ({cfg.model.weights} weights)",
        f"device    {cfg.model.device} -> {'cuda' if torch.cuda.is_available() and cfg.model.device != 'cpu' else 'cpu'}, "
        f"{torch.get_num_threads()} torch threads",
        f"workload  updates={g.updates} prompts/upd={g.prompts_per_update} group={g.group_size} epochs/upd={g.grpo_epochs} "
        f"minibatches={g.minibatches} max_new_tokens={g.sampling.max_new_tokens}",
        f"context   ctx={t.ctx} micro_batch={t.micro_batch} generation_concurrency={opts.n_seq_max} kv={opts.kv_dtype} "
        f"compute={compute_dtype(t.compute_dtype, resolve_device(cfg.model.device))}",
        "",
        "Initialization                             time      Δ RSS",
    ]
    for name, (seconds, rss) in result.init_timing.items():
        out.append(f"  {name:<38} {seconds:7.2f} s {rss / 2**20:8.1f} MiB")

    phases = {k: sum(r.timing[k] for r in records) for k in grpo.PHASES}
    total = sum(r.metrics.get("timing/update_seconds", 0.0) for r in records)
    phases_sum = sum(phases.values())
    out += ["", "Phase (all updates)                         time     share"]
    for key, label in PHASE_LABELS.items():
        out.append(_phase_line(label, phases[key], total))
    out.append(_phase_line("other (prep, tokenization, overhead)", max(total - phases_sum, 0.0), total))
    out.append(f"  {'TOTAL training':<38} {total:7.2f} s")

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


def _phase_line(label: str, seconds: float, total: float) -> str:
    share = seconds / total if total else 0.0
    return f"  {label:<38} {seconds:7.2f} s {share:7.1%}  {'█' * round(share * 30)}"
