"""What both distillation modes share: the teacher and its checks, the resume signature and
the optimizer-step helper; and the offline mode's result (on_policy returns the rollout
loop's)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from retrograd.config import Config
from retrograd.data import ChatFormat, resolve_chat_template
from retrograd.errors import ConfigError
from retrograd.gguf.file import GGUFFile
from retrograd.gguf.spec import read_spec
from retrograd.kernels.optim import Optimizer
from retrograd.model.tokenizer import Tokenizer
from retrograd.recipes.common import (
    Setup,
    signature,
)
from retrograd.runtime.bundled import default_model_path
from retrograd.teacher import (
    TeacherOptions,
)
from retrograd.training.batches import LogprobOptions
from retrograd.training.checkpoint import file_fingerprint
from retrograd.training.optim import clip_gradients

TEACHER_MICRO_BATCH = 1024  # tokens per torch teacher forward at least: no gradients, and a quantized
# model dequantizes its weights once per forward (measured 3x faster than 256)


@dataclass
class DistillResult:
    """A topk_offline run's outcome."""

    output: Path
    mode: str
    done: int  # epochs
    planned: int
    steps: int
    train_loss: float
    tokens_per_second: float
    records: list[dict] = field(default_factory=list)  # per step
    memory: dict = field(default_factory=dict)  # rss baseline / after load / peak

    def summary(self) -> str:
        return (
            f"done epoch={self.done}/{self.planned} step={self.steps} train_loss={self.train_loss:.4f} "
            f"tok/s={self.tokens_per_second:.0f} out={self.output}"
        )


def student_path(cfg: Config) -> Path:
    return cfg.model.path or default_model_path()


def require_teacher(cfg: Config) -> Path:
    """The teacher GGUF, checked to exist and to share the student's tokenizer."""
    teacher = cfg.distill.teacher_path
    if not teacher.is_file():
        raise ConfigError(f"distill.teacher_path = {str(teacher)!r}: no such file (the teacher GGUF)")
    return teacher


def teacher_options(cfg: Config, device: torch.device, precision: str, group: int, n_vocab: int,
                    temperature: float = 1.0) -> TeacherOptions:
    """How the teacher scores: on-policy at the student's sampling temperature, a sidecar at 1."""
    t = cfg.training
    return TeacherOptions(
        n_ctx=t.ctx,
        group=group,
        threads=t.threads or 0,
        weights=cfg.model.weights,
        compute_dtype=precision,
        device=device,
        micro_batch=max(t.micro_batch, TEACHER_MICRO_BATCH),
        logprobs=LogprobOptions.from_training(t, n_vocab, temperature),
    )


def teacher_chat(teacher: Path, student: ChatFormat) -> ChatFormat:
    """The teacher's own chat format (its tokenizer is the student's, its template may not be);
    the student's when the teacher GGUF has no template."""
    template = resolve_chat_template(read_spec(GGUFFile(teacher)).chat_template)
    if template is None:
        return student
    return ChatFormat(Tokenizer(teacher), template, origin=str(teacher))


def distill_signature(setup: Setup, data_files: dict[str, Path]) -> dict:
    """The resume signature: the common one, the [distill] settings and the teacher's fingerprint."""
    d = setup.cfg.distill
    unsigned = ("teacher_path", "prompts", "data", "sidecar") + (
        ("teacher_backend",) if d.mode == "topk_offline" else ()
    )
    settings = {k: v for k, v in dataclasses.asdict(d).items()
                if k not in unsigned and not (k == "tis_cap" and v is None)}  # unset: signed as before the key existed
    extra = {
        "distill": settings,
        "distill.teacher": file_fingerprint(d.teacher_path) if d.teacher_path.is_file() else None,
    }
    return signature(setup, data_files) | json.loads(json.dumps(extra, default=str))


def apply_step(setup: Setup, optimizer: Optimizer, params, loss: float, step: int, max_grad_norm: float) -> float:
    """Clip and step (the gradients are accumulated); a non-finite loss stops the run first."""
    if not math.isfinite(loss):
        raise setup.diverged(
            f"step {step + 1}: the loss is {loss} (not finite); stopped without updating the adapter — try a lower training.lr"
        )
    grad_norm = clip_gradients(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
