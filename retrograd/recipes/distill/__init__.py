"""Distillation from a teacher GGUF that shares the student's tokenizer (retrograd notes 4.4,
peers notes 3.2), in one of two modes picked by `distill.mode`, each in its own module:

on_policy (on_policy.py), per update:
1. prompts_per_update prompts (in order or shuffled), samples_per_prompt completions each,
   sampled by llama.cpp from the student plus its live adapter;
2. the teacher scores the sampled tokens after its own rendering of the prompt (the chat
   templates may differ): log p_T of each token, and its top-k there for the JSD loss;
3. with mask_truncated, completions that used the whole budget are left out;
4. reverse_kl: per-token advantages A_t = clamp(log p_T - log p_S, +-weight_clip), with
   log p_S torch's log-probs under the adapter before the update (the proximal policy,
   not the sampler's: see objectives/distill.teacher_advantages), trained by the shared
   policy-gradient update (rollout_step.py; clipped surrogate when distill_epochs > 1,
   k3 KL to the base when kl_coefficient > 0, budget normalization);
   jsd: GKD's generalized JSD between the teacher's top-k and the student's log-probs at
   those ids (chunked gather), plus the same k3 KL, budget-normalized, one step per epoch;
5. llama.cpp gets the new adapter.
Steps 1-2 are the rollout loop's `produce`, 3-4 its `plan` and the loss's `train`; the loop
(retrograd/training/rollout_loop.py) does the rest, as for grpo and agent_grpo.
Evaluation samples one completion per held-out prompt (fixed seeds) and reports the mean
log p_S - log p_T of its tokens (lower is better).

topk_offline (offline.py): an SFT loop over the corpus (epoch plan and packing as in sft.py) whose loss
is the cross-entropy against the teacher's renormalised top-k, read from the `.topk`
sidecar that `retrograd distill-teacher` wrote (`offline.write_teacher_topk`). The teacher is
never loaded; a sidecar for other data or another tokenizer is refused.

Checkpoints sit at update (on_policy) or step (offline) boundaries; every random choice is a
function of (seed, update or epoch), so a resumed run repeats the rest exactly.
"""

from __future__ import annotations

from pathlib import Path

from retrograd.config import Config
from retrograd.recipes.distill.common import (
    DistillResult,
    require_teacher,
    student_path,
    teacher_chat,
    teacher_options,
)
from retrograd.recipes.distill.offline import TopkOptions, TopkReport, run_offline, write_teacher_topk
from retrograd.recipes.distill.on_policy import PHASES, run_on_policy, sampler_options
from retrograd.training.report import Reporter
from retrograd.training.rollout_loop import RolloutResult

MODES = {"on_policy": run_on_policy, "topk_offline": run_offline}


def run(cfg: Config, reporter: Reporter, *, resume: Path | bool | None = None) -> RolloutResult | DistillResult:
    """on_policy returns the rollout loop's result, topk_offline a DistillResult."""
    return MODES[cfg.distill.mode](cfg, reporter, resume)


__all__ = [
    "PHASES",
    "DistillResult",
    "TopkOptions",
    "TopkReport",
    "require_teacher",
    "run",
    "sampler_options",
    "student_path",
    "teacher_chat",
    "teacher_options",
    "write_teacher_topk",
]
