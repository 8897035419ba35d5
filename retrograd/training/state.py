"""What every recipe's loop shares around the optimizer: saving and restoring the training
state in a checkpoint, and the best-evaluation / patience bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from retrograd.kernels.optim import Optimizer
from retrograd.training.checkpoint import Checkpoint, CheckpointError, restore_rng, save_checkpoint, step_name


def save_state(setup, optimizer: Optimizer, progress: dict, signature: dict, name: str) -> Path:
    """A checkpoint of the adapter (exact float32 and as a llama.cpp GGUF), optimizer, RNG
    and `progress` (the recipe's counters and data cursor)."""
    lora = {f"{n}.{part}": getattr(layer, f"lora_{part}") for n, layer in setup.adapter.layers.items() for part in "ab"}
    return save_checkpoint(
        setup.cfg.checkpoint.directory, name, write_adapter=setup.export, lora=lora,
        optimizer=optimizer.state_dict(), progress=progress, signature=signature,
    )


def restore_state(checkpoint: Checkpoint, setup, optimizer: Optimizer) -> dict:
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


def keep_best(cfg, progress: dict, value: float, line: str, message, save, *, higher_is_better: bool = False) -> bool:
    """After a held-out evaluation: update best/stale in `progress`, save best.gguf when the
    checkpoint mode asks and this is the best so far, say `line` with the best and staleness.
    Returns True when patience has run out."""
    ev = cfg.evaluation
    outcome = track_evaluation(progress, value, higher_is_better=higher_is_better, min_delta=ev.min_delta, patience=ev.patience)
    if outcome.improved:
        saved = ""
        if cfg.checkpoint and "best_eval" in cfg.checkpoint.mode:
            save("best")
            saved = " (saved best.gguf)"
        message(f"{line}  best {value:.4f} {'↑' if higher_is_better else '↓'}{saved}")
    else:
        message(f"{line}  best {outcome.best:.4f}, stale {outcome.stale}/{ev.patience or '∞'}")
    return outcome.stop


class RecipeLoop:
    """Checkpoint saving for a loop object (offline distillation) that sets cfg, setup,
    optimizer, progress, signature and reporter; the rollout recipes' loop is
    training/rollout_loop.py."""

    def save(self, name: str) -> None:
        path = save_state(self.setup, self.optimizer, self.progress, self.signature, name)
        self.reporter.checkpoint(path)

    def save_if_crossed(self, steps: int) -> None:
        if step_checkpoint_due(self.cfg, self.progress["global_step"], steps):
            self.save(step_name(self.progress["global_step"]))


def step_checkpoint_due(cfg, global_step: int, steps: int) -> bool:
    """The last `steps` optimizer steps, ending at `global_step`, passed a multiple of
    checkpoint.every_steps (an update can take several steps)."""
    every = cfg.checkpoint and cfg.checkpoint.every_steps
    return bool(every) and global_step // every > (global_step - steps) // every
