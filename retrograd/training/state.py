"""What every recipe's loop shares around the optimizer: saving and restoring the training
state in a checkpoint, and the best-evaluation / patience bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from retrograd.training.checkpoint import Checkpoint, CheckpointError, restore_rng, save_checkpoint, step_name


def save_state(setup, optimizer: torch.optim.Optimizer, progress: dict, signature: dict, name: str) -> Path:
    """A checkpoint of the adapter (exact float32 and as a llama.cpp GGUF), optimizer, RNG
    and `progress` (the recipe's counters and data cursor)."""
    lora = {f"{n}.{part}": getattr(layer, f"lora_{part}") for n, layer in setup.adapter.layers.items() for part in "ab"}
    return save_checkpoint(
        setup.cfg.checkpoint.directory, name, write_adapter=setup.export, lora=lora,
        optimizer=optimizer.state_dict(), progress=progress, signature=signature,
    )


def restore_state(checkpoint: Checkpoint, setup, optimizer: torch.optim.Optimizer) -> dict:
    """Put the adapter, optimizer and RNG back as saved; returns the saved progress. Files that
    pass their checksums but do not fit this run (hand-made ones) stop with one line."""
    try:
        lora = checkpoint.tensors("lora.safetensors")
        with torch.no_grad():
            for name, layer in setup.adapter.layers.items():
                for part, param in (("a", layer.lora_a), ("b", layer.lora_b)):
                    saved = lora[f"{name}.{part}"]
                    if saved.shape != param.shape:  # copy_ would broadcast, e.g. one pair into every expert
                        raise ValueError(f"{name}.{part} has shape {list(saved.shape)}, expected {list(param.shape)}")
                    param.copy_(saved)
        optimizer.load_state_dict(checkpoint.optimizer_state(optimizer))
        restore_rng(checkpoint.document("rng.json"))
    except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{checkpoint.path}: does not fit this run ({type(e).__name__}: {detail})") from None
    return dict(checkpoint.progress)


@dataclass(frozen=True)
class EvalOutcome:
    improved: bool
    best: float
    stale: int
    stop: bool  # patience ran out


def track_evaluation(progress: dict, value: float, *, higher_is_better: bool, min_delta: float, patience: int | None) -> EvalOutcome:
    """Update progress["best_eval"] / ["stale_evals"] with a new held-out value."""
    best = progress.get("best_eval")
    gain = value - best if best is not None and higher_is_better else (best - value if best is not None else None)
    if gain is None or gain > min_delta:
        progress.update(best_eval=value, stale_evals=0)
        return EvalOutcome(True, value, 0, False)
    progress["stale_evals"] = progress.get("stale_evals", 0) + 1
    stale = progress["stale_evals"]
    return EvalOutcome(False, best, stale, patience is not None and stale >= patience)


class RecipeLoop:
    """What the recipe loops share on top of the functions above. A loop sets cfg, setup,
    optimizer, progress, signature and reporter before calling these."""

    def save(self, name: str) -> None:
        path = save_state(self.setup, self.optimizer, self.progress, self.signature, name)
        self.reporter.checkpoint(path)

    def account(self, update: int, metrics: dict, timing: dict) -> dict:
        """The rollout loops' per-update bookkeeping (RunTotals.account), and with
        run.verbose one line of where the update's time went."""
        metrics = self.totals.account(metrics, timing)
        phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in timing.items())
        self.setup.detail(f"update {update + 1} phases: {phases} (update {self.totals.elapsed:.2f} s)")
        return metrics

    def save_if_crossed(self, steps: int) -> None:
        """A step-N checkpoint when the update's `steps` optimizer steps, ending at the current
        global step, passed a multiple of checkpoint.every_steps."""
        every, after = self.cfg.checkpoint and self.cfg.checkpoint.every_steps, self.progress["global_step"]
        if every and after // every > (after - steps) // every:
            self.save(step_name(after))

    def held_out_reward(self, update: int, planned: int, rewards: list[float], metrics, extra: dict | None = None) -> bool:
        """Log a held-out evaluation's rewards (higher is better), keep the best checkpoint
        when asked, say so in one line. Returns True when patience has run out."""
        ev, step = self.cfg.evaluation, self.progress["global_step"]
        mean, low, high = float(sum(rewards) / len(rewards)), float(min(rewards)), float(max(rewards))
        metrics.log(step, {"eval/mean_reward": mean, "eval/reward_min": low, "eval/reward_max": high,
                           "train/update": update + 1} | (extra or {}))
        line = f"eval update {update + 1}/{planned}: mean {mean:.4f}  range [{low:.3f}, {high:.3f}]  n={len(rewards)}"
        outcome = track_evaluation(self.progress, mean, higher_is_better=True, min_delta=ev.min_delta, patience=ev.patience)
        if outcome.improved:
            saved = ""
            if self.cfg.checkpoint and "best_eval" in self.cfg.checkpoint.mode:
                self.save("best")
                saved = " (saved best.gguf)"
            self.reporter.message(f"{line}  best {mean:.4f} ↑{saved}")
        else:
            self.reporter.message(f"{line}  best {outcome.best:.4f}, stale {outcome.stale}/{ev.patience or '∞'}")
        return outcome.stop
