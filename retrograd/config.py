"""One strict TOML file per run -> frozen dataclasses, validated once.

Key names, defaults and meanings follow the Rust retrograd where the feature exists (see
README "Configuration"). The file is strict: an unknown key is an error naming the closest
valid key, a wrong type or range names `section.key`, the value and what is expected, and
a section that does not belong to `[run].algorithm` is refused. Every problem found is
reported at once, on one line. Relative paths resolve against the TOML file's folder.
Nothing downstream re-checks these values.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli

from retrograd.errors import ConfigError
from retrograd.gguf.merge import MERGE_TYPES

_REQUIRED = object()
section = dataclass(frozen=True, kw_only=True)  # one TOML table; required keys may follow defaulted ones


def key(default: Any = _REQUIRED, *, choices=None, gt=None, ge=None, le=None, lt=None):
    """A config key: its default (or required) and the values it accepts."""
    meta = {"choices": choices, "gt": gt, "ge": ge, "le": le, "lt": lt}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    if default is _REQUIRED:
        return field(metadata=meta | {"required": True})
    return field(default=default, metadata=meta)


# ----------------------------------------------------------------------------- sections


@section
class RunSection:
    algorithm: str = key(choices=("sft", "ppo", "grpo", "agent_grpo", "distill", "preference"))
    verbose: bool = key(False)


@section
class ModelSection:
    path: Path | None = key(None)  # None: --model, else the bundled SmolLM2
    device: str = key("auto", choices=("auto", "cpu", "gpu"))
    weights: str = key("auto", choices=("auto", "quantized", "bf16", "f32"))  # auto: dense in the compute dtype when it fits memory
    chat_template: str | None = key(None)  # a built-in name (chatml, gemma) or a Jinja file, when the GGUF has none


@section
class OutputSection:
    path: Path = key()  # the adapter, or with kind = "model" the merged model
    kind: str = key("adapter", choices=("adapter", "model"))
    merge_type: str = key("f16", choices=tuple(MERGE_TYPES))  # kind = "model": type of the merged weights (retrograd merge --type)

    @property
    def adapter_path(self) -> Path:
        """Where the adapter goes: `path` itself, or beside the merged model as NAME.lora.gguf."""
        return self.path if self.kind == "adapter" else self.path.with_suffix(".lora.gguf")


@section
class LoraSection:
    rank: int = key(8, ge=1)
    alpha: float = key(16.0, gt=0)
    seed: int = key(42, ge=0)
    targets: tuple[str, ...] = key(("q", "k", "v", "o", "ffn_up", "ffn_down", "ffn_gate"))
    dtype: str = key("f16", choices=("f16", "f32"))  # tensor type of the exported adapter
    init_adapter: Path | None = key(None)


@section
class TrainingSection:
    trainable: str = key("lora", choices=("lora",))
    optimizer: str = key("adamw", choices=("adamw", "sgd"))
    lr: float = key(1e-4, gt=0)
    lr_scheduler: str = key("constant", choices=("constant", "linear", "cosine"))
    warmup_steps: int = key(0, ge=0)
    weight_decay: float = key(0.0, ge=0)
    max_grad_norm: float = key(1.0, ge=0)  # 0 turns clipping off
    epochs: int = key(1, ge=1)
    ctx: int = key(128, ge=2)
    micro_batch: int = key(32, ge=1)
    gradient_accumulation: int = key(1, ge=1)
    threads: int | None = key(None, ge=1)
    threads_follow_load: bool = key(True)  # fewer torch threads while other programs busy the cores (runtime/cpu_share.py)
    compute_dtype: str = key("auto", choices=("auto", "f32", "bf16"))
    gradient_checkpointing: bool = key(False)
    checkpoint_every_n_layers: int = key(1, ge=1)  # retrograd: 4; a layer keeps 25-50x a checkpoint here (README, Configuration)
    checkpoint_dtype: str = key("f32", choices=("f32", "f16", "bf16"))
    chunked_cross_entropy: bool = key(True)
    chunked_ce_tiles: int | None = key(None, ge=1)  # None: tiles sized by a 64 MiB budget
    chunked_ce_seq_chunk: int = key(512, ge=0)
    require_gpu_resident: bool = key(False)
    max_gpu_duty_cycle: float = key(1.0, gt=0, le=1)
    # rollout algorithms only
    generation_concurrency: int | None = key(None, ge=1)
    generation_batch: int = key(0, ge=0)
    generation_threads: int | None = key(None, ge=1)  # llama.cpp's CPU threads; None: training.threads
    max_async_rollout: int = key(0, ge=0)  # updates the sampler may run ahead of the trainer
    fast_sampling_context: bool = key(True)
    kv_dtype: str = key("f16", choices=("f16", "f32"))


@section
class SFTSection:
    data: Path = key()
    data_format: str | None = key(None, choices=("text", "txt", "jsonl", "json", "chat", "chat-jsonl", "csv", "parquet"))
    shuffle: bool = key(True)
    template_variables: dict = key({})


PREFERENCE_LOSSES = ("dpo", "ipo", "simpo", "orpo", "kto")
# The keys each loss reads beyond the common ones (data, loss, shuffle, pairs_per_step, logps_drop_warn).
PREFERENCE_LOSS_KEYS = {
    "dpo": ("beta", "reference", "label_smoothing"),
    "ipo": ("beta", "reference"),
    "simpo": ("beta", "gamma_beta_ratio"),
    "orpo": ("beta",),
    "kto": ("beta", "reference", "desirable_weight", "undesirable_weight"),
}


@section
class PreferenceSection:
    data: Path = key()
    data_format: str | None = key(None, choices=("jsonl", "json", "csv", "parquet"))
    loss: str = key("dpo", choices=PREFERENCE_LOSSES)
    beta: float | None = key(None, gt=0)  # None: 0.1, or 2.0 for simpo
    reference: str = key("initial", choices=("initial", "base"))  # initial: the adapter as the run starts (init_adapter)
    label_smoothing: float = key(0.0, ge=0, lt=0.5)
    gamma_beta_ratio: float = key(0.5, ge=0)
    desirable_weight: float = key(1.0, gt=0)
    undesirable_weight: float = key(1.0, gt=0)
    shuffle: bool = key(True)
    pairs_per_step: int | None = key(None, ge=1)
    logps_drop_warn: float = key(2.0, gt=0)

    @property
    def strength(self) -> float:
        """beta as the loss reads it (its default depends on the loss)."""
        return self.beta if self.beta is not None else 2.0 if self.loss == "simpo" else 0.1


@section
class EvaluationSection:
    data: Path = key()
    tasks: tuple[Path, ...] | None = key(None)  # `retrograd eval` task files or folders, run on the final adapter
    every_iterations: int = key(1, ge=1)
    max_examples: int | None = key(None, ge=1)
    patience: int | None = key(None, ge=1)
    min_delta: float = key(0.0, ge=0)


@section
class CheckpointSection:
    directory: Path = key()
    mode: str = key(choices=("steps", "best_eval", "steps_and_best_eval"))
    every_steps: int | None = key(None, ge=1)
    resume_from: Path | None = key(None)


@section
class MetricsSection:
    tensorboard_dir: Path | None = key(None)


@section
class SamplingSection:
    temperature: float = key(1.0, gt=0, le=10)
    top_p: float = key(1.0, gt=0, le=1)
    max_new_tokens: int = key(ge=1)
    seed: int = key(0, ge=0)


@section
class OverlongPenaltySection:
    buffer_tokens: int = key(ge=1)
    max_penalty: float = key(gt=0)


@section
class KLScheduleSection:
    warmup_updates: int = key(0, ge=0)
    target: float | None = key(None, gt=0)


@section
class DynamicSamplingSection:
    max_resample_factor: int = key(ge=2)


@section
class RewardedPrompts:
    """What [grpo] and [ppo] share: the prompts, and the reward program over the reward
    protocol (reward_command) or an in-process function that scores their completions."""

    prompts: Path = key()
    reward_command: list[str] | None = key(None)
    reward_function: str | None = key(None)  # "module:function" or "file.py:function"
    reward_mode: str = key("persistent", choices=("persistent", "oneshot"))
    reward_timeout_seconds: float = key(300.0, gt=0)

    def reward_problems(self, name: str) -> list[str]:
        problems = []
        if (self.reward_command is None) == (self.reward_function is None):
            problems.append(f"[{name}] needs exactly one of reward_command (a program) or reward_function (module:function)")
        if self.reward_mode != "persistent" and self.reward_function is not None:
            problems.append(f"{name}.reward_mode applies to reward_command, not reward_function")
        return problems


@section
class GRPOSection(RewardedPrompts):
    updates: int = key(ge=1)
    prompts_per_update: int = key(ge=1)
    group_size: int = key(ge=2, le=256)
    grpo_epochs: int = key(ge=1)
    minibatches: int = key(1, ge=1)
    clip_range_low: float = key(gt=0, lt=1)
    clip_range_high: float = key(gt=0, lt=1)
    kl_coefficient: float = key(ge=0)
    mask_truncated: bool = key(False)
    baseline: str = key("mean", choices=("mean", "leave_one_out", "rloo"))
    scale_rewards: str = key("none", choices=("none", "group", "batch"))
    loss_normalization: str = key("budget", choices=("budget", "token", "sequence"))
    importance_sampling_level: str = key("token", choices=("token", "sequence"))
    tis_cap: float | None = key(None, ge=1)
    prompt_order: str = key("sequential", choices=("sequential", "shuffled", "shuffle"))
    max_stalled_updates: int = key(25, ge=0)
    sampling: SamplingSection = key()
    overlong_penalty: OverlongPenaltySection | None = key(None)
    kl_schedule: KLScheduleSection | None = key(None)
    dynamic_sampling: DynamicSamplingSection | None = key(None)
    judge: JudgeSection | None = key(None)
    judge_weight: float | None = key(None, ge=0)  # r = reward + judge_weight x verdict (verdict in [0, 1])
    judge_failure: str = key("drop_group", choices=("drop_group", "fail"))
    max_judge_dropped_fraction: float = key(0.5, ge=0, le=1)


@section
class CriticSection:
    enabled: bool = key(True)  # false: REINFORCE with a KL penalty, the batch-whitened reward on every token
    gamma: float = key(1.0, gt=0, le=1)
    gae_lambda: float = key(0.95, ge=0, le=1)
    value_lr: float = key(0.01, gt=0)
    value_epochs: int = key(8, ge=1)
    feature_dtype: str = key("f32", choices=("f32", "f16", "bf16"))  # the update's feature matrix


@section
class PPOSection(RewardedPrompts):
    updates: int = key(ge=1)
    rollout_batch_size: int = key(ge=1)  # prompts per update, one completion each
    ppo_epochs: int = key(ge=1)
    minibatches: int = key(1, ge=1)
    clip_range: float = key(gt=0, lt=1)
    kl_coefficient: float = key(ge=0)  # k3 penalty toward the policy that sampled the batch
    prompt_order: str = key("sequential", choices=("sequential", "shuffled", "shuffle"))
    critic: CriticSection = key(CriticSection())
    sampling: SamplingSection = key()


@section
class JudgeStrategySection:
    mode: str = key("auto", choices=("auto", "listwise", "chunked", "pairwise"))  # auto: listwise, chunked when too long
    anchor: bool = key(True)  # chunked: the first member in every chunk, scores shifted to agree on it
    max_pairs: int | None = key(None, ge=1)  # pairwise: None = every pair; at least the group size
    both_orders: bool = key(True)  # pairwise: ask A-B and B-A; disagreement is a tie
    aggregation: str = key("win_rate", choices=("win_rate", "bradley_terry"))


@section
class JudgeContextSection:
    """Character budgets of what the judge reads; a text over its budget keeps its head and
    tail and says how much of the middle was left out."""

    max_request_chars: int = key(60000, ge=1000)
    max_trajectory_chars: int = key(8000, ge=100)
    max_message_chars: int = key(2000, ge=100)
    head_ratio: float = key(0.4, ge=0, le=1)


@section
class JudgeCompactionSection:
    """Long agent transcripts summarised before judging: when a group's longest member is over
    `trigger_chars`, each member's parts (its turns, then the environment's state) but the last
    `keep_last` become a summary of at most `target_chars` (asked of the judge's model at
    temperature 0, cached)."""

    trigger_chars: int = key(ge=200)
    target_chars: int = key(ge=100)
    keep_last: int = key(ge=1)


@section
class JudgeSection:
    """`[grpo.judge]` / `[agent.judge]`: a command, or an OpenAI-compatible LLM (`ruler`)."""

    type: str = key("command", choices=("command", "ruler"))
    command: list[str] | None = key(None)  # command
    timeout_secs: float | None = key(None, gt=0)  # per request; None: 30 s for a command, 120 s for an LLM
    base_url: str | None = key(None)  # ruler: e.g. http://127.0.0.1:8080/v1 (retrograd serve)
    model: str | None = key(None)
    api_key_env: str = key("OPENAI_API_KEY")  # the key's environment variable (the key never goes in TOML)
    rubric: str | None = key(None)  # None: the built-in rubric; a prompt's or scenario's own rubric wins
    pairwise_rubric: str | None = key(None)
    temperature: float | None = key(None, ge=0)  # None: the endpoint's default
    max_concurrency: int = key(4, ge=1)
    max_retries: int = key(2, ge=0)
    cache_path: Path | None = key(None)  # verdicts by content: a rerun asks nothing twice
    strategy: JudgeStrategySection | None = key(None)
    context: JudgeContextSection | None = key(None)
    compaction: JudgeCompactionSection | None = key(None)

    @property
    def timeout(self) -> float:
        return self.timeout_secs or (30.0 if self.type == "command" else 120.0)


@section
class CollectApiSection:
    """`[agent.collect_api]`: an OpenAI-compatible chat endpoint that `collect --api` rolls
    out with instead of the local model (its tool calls come back structured)."""

    base_url: str = key()  # e.g. http://127.0.0.1:8080/v1 (retrograd serve)
    model: str = key()
    api_key_env: str = key("OPENAI_API_KEY")  # the key's environment variable; unset: no key is sent
    timeout_secs: float = key(120.0, gt=0)  # per request
    temperature: float | None = key(None, ge=0)  # None: the endpoint's default
    max_retries: int = key(2, ge=0)  # a request that fails this many more times breaks that trajectory


@section
class AgentSection:
    scenarios: Path = key()
    updates: int = key(1, ge=1)
    scenarios_per_update: int = key(1, ge=1)
    group_size: int = key(8, ge=2, le=256)
    epochs_per_update: int = key(4, ge=1)
    minibatches: int = key(1, ge=1)
    max_turns: int = key(6, ge=1)
    max_new_tokens_per_turn: int = key(512, ge=1)
    max_trajectory_tokens: int | None = key(None, ge=2)  # None: training.ctx
    max_rollout_secs: float = key(300.0, ge=0)  # 0 disables
    end_on_no_tool_call: bool = key(True)
    max_failed_turns: int = key(0, ge=0)
    truncation: str = key("drop", choices=("drop", "min_reward"))
    max_dropped_fraction: float = key(0.5, ge=0, le=1)
    skip_empty_updates: bool = key(False)
    judge_failure: str = key("drop_group", choices=("drop_group", "fail"))
    drop_degenerate_groups: bool = key(False)  # a group the judge scored identically is not trained
    clip_range_low: float = key(0.2, gt=0, lt=1)
    clip_range_high: float = key(0.28, gt=0, lt=1)
    kl_coefficient: float = key(0.0, ge=0)
    baseline: str = key("mean", choices=("mean", "leave_one_out", "rloo"))
    scale_rewards: str = key("none", choices=("none", "group", "batch"))
    loss_normalization: str = key("budget", choices=("budget", "token", "sequence"))
    tis_cap: float | None = key(None, ge=1)  # truncated importance sampling against llama.cpp's log-probs
    temperature: float = key(1.0, gt=0, le=10)
    top_p: float = key(1.0, gt=0, le=1)
    system_suffix: str = key("")
    template_variables: dict = key({})
    seed: int = key(42, ge=0)
    environment: dict = key({})  # [agent.environment]: validated by retrograd.rollouts.sandbox.EnvironmentOptions (http: rollouts.http_env)
    mcp_servers: tuple = key(())  # [[agent.mcp_servers]] tables: validated by retrograd.rollouts.mcp_tools
    mcp_config: object = key(None)  # an mcp.json path or a list of them: validated by retrograd.rollouts.mcp_tools
    judge: JudgeSection | None = key(None)
    collect_api: CollectApiSection | None = key(None)


@section
class DistillSection:
    mode: str = key("on_policy", choices=("on_policy", "topk_offline"))
    teacher_path: Path = key()
    teacher_backend: str = key("llama.cpp", choices=("llama.cpp", "torch"))  # scoring (on-policy, distill-teacher): light or exact
    loss: str = key("reverse_kl", choices=("reverse_kl", "jsd"))  # jsd: TRL's generalized JSD over the teacher's top-k
    jsd_beta: float = key(0.5, ge=0, le=1)
    topk: int = key(16, ge=1)
    # on-policy
    prompts: Path | None = key(None)
    updates: int | None = key(None, ge=1)
    prompts_per_update: int | None = key(None, ge=1)
    samples_per_prompt: int = key(1, ge=1, le=256)
    distill_epochs: int = key(1, ge=1)
    clip_range_low: float = key(0.2, gt=0, lt=1)
    clip_range_high: float = key(0.28, gt=0, lt=1)
    weight_clip: float = key(5.0, gt=0)
    kl_coefficient: float = key(0.0, ge=0)
    tis_cap: float | None = key(None, ge=1)  # reverse_kl: truncated importance sampling against llama.cpp's log-probs
    mask_truncated: bool = key(False)
    prompt_order: str = key("sequential", choices=("sequential", "shuffled", "shuffle"))
    sampling: SamplingSection | None = key(None)
    # offline top-k
    data: Path | None = key(None)
    sidecar: Path | None = key(None)
    offline_epochs: int = key(1, ge=1)


ON_POLICY_ONLY = ("prompts", "updates", "prompts_per_update", "samples_per_prompt", "distill_epochs", "clip_range_low",
                  "clip_range_high", "weight_clip", "kl_coefficient", "tis_cap", "mask_truncated", "prompt_order",
                  "sampling", "loss", "jsd_beta")
OFFLINE_ONLY = ("data", "sidecar", "offline_epochs")


@section
class ObserveSection:
    directory: Path = key()
    every: int = key(1, ge=1)
    max_text_chars: int = key(0, ge=0)


@section
class ReferenceSection:
    model: Path = key()  # a GGUF with the base's tokenizer: the preference reference instead of the base itself
    ctx: int | None = key(None, ge=2)  # the Rust retrograd's key: at least training.ctx (one forward per record here)


@section
class RolloutSection:
    workers: tuple[str, ...] = key(())  # URLs of `retrograd rollout-worker` processes
    local_workers: int = key(0, ge=0)  # worker processes the trainer starts on this machine
    api_key_env: str = key("RETROGRAD_API_KEY")  # the environment variable holding the workers' API key (never the key)


SECTION_TYPES: dict[str, type] = {
    "run": RunSection,
    "model": ModelSection,
    "output": OutputSection,
    "lora": LoraSection,
    "training": TrainingSection,
    "sft": SFTSection,
    "evaluation": EvaluationSection,
    "checkpoint": CheckpointSection,
    "metrics": MetricsSection,
    "ppo": PPOSection,
    "grpo": GRPOSection,
    "agent": AgentSection,
    "distill": DistillSection,
    "observe": ObserveSection,
    "rollout": RolloutSection,
    "preference": PreferenceSection,
    "reference": ReferenceSection,
}
COMMON_SECTIONS = ("run", "model", "output", "lora", "training", "evaluation", "checkpoint", "metrics")
ALGORITHM_SECTIONS = {"sft": ("sft",), "ppo": ("ppo", "observe"), "grpo": ("grpo", "observe", "rollout"), "agent_grpo": ("agent", "observe"),
                      "distill": ("distill", "rollout"), "preference": ("preference", "reference")}
REQUIRED_SECTIONS = ("run", "output")
DEFAULTED_SECTIONS = ("model", "lora", "training", "metrics")
ROLLOUT_ONLY_TRAINING_KEYS = ("generation_concurrency", "generation_batch", "generation_threads", "fast_sampling_context",
                              "kv_dtype", "max_async_rollout")
# Passes over the data of one update, per rollout algorithm: training.epochs is SFT's.
ROLLOUT_EPOCH_KEYS = {"ppo": "ppo.ppo_epochs", "grpo": "grpo.grpo_epochs", "agent_grpo": "agent.epochs_per_update",
                      "distill": "distill.distill_epochs (on_policy) or distill.offline_epochs (topk_offline)"}
ASYNC_TIS_CAP = 2.0  # the tis_cap of an asynchronous run that sets none (a note says so at start-up)
# Rust retrograd keys that have nothing to do here: accepted, so its configs run unchanged, with a note.
ACCEPTED_WITH_NOTE = {
    "training.master_weights": "the LoRA weights are always float32 and the base stays frozen, so there is no master copy to keep",
    "training.shared_prefix_fanout": "a group's prompt is always packed once and shared by its completions",
}


@dataclass(frozen=True)
class Config:
    path: Path
    run: RunSection
    model: ModelSection
    output: OutputSection
    lora: LoraSection
    training: TrainingSection
    metrics: MetricsSection
    sft: SFTSection | None = None
    ppo: PPOSection | None = None
    grpo: GRPOSection | None = None
    agent: AgentSection | None = None
    distill: DistillSection | None = None
    preference: PreferenceSection | None = None
    reference: ReferenceSection | None = None
    observe: ObserveSection | None = None
    rollout: RolloutSection | None = None
    evaluation: EvaluationSection | None = None
    checkpoint: CheckpointSection | None = None
    explicit: frozenset[str] = frozenset()  # "section.key" names the file set
    notes: tuple[str, ...] = ()  # one line per key accepted but ignored (ACCEPTED_WITH_NOTE)

    def scratch_run(self, output: Path) -> Config:
        """This run writing only `output` and its records beside it: no evaluation, checkpoints,
        observation or TensorBoard (profile's and preflight's short runs)."""
        return dataclasses.replace(
            self,
            output=dataclasses.replace(self.output, path=output),
            evaluation=None,
            checkpoint=None,
            observe=None,
            metrics=dataclasses.replace(self.metrics, tensorboard_dir=None),
        )

    def with_overrides(self, *, model: Path | None = None, device: str | None = None) -> Config:
        """`--model` / `--device` win over the file (CLI paths are relative to the cwd)."""
        section = self.model
        if model is not None:
            section = dataclasses.replace(section, path=Path(model).resolve())
        if device is not None:
            if device not in ("auto", "cpu", "gpu"):
                raise ConfigError(f"--device {device!r}: expected auto, cpu or gpu")
            section = dataclasses.replace(section, device=device)
        return dataclasses.replace(self, model=section)


# ----------------------------------------------------------------------------- parsing


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a .toml file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        doc = tomli.loads(text)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    return parse_config(doc, path)


def parse_config(doc: dict, path: Path) -> Config:
    problems: list[str] = []
    base = path.resolve().parent
    run = doc.get("run")
    algorithm = run.get("algorithm") if isinstance(run, dict) else None
    own = ALGORITHM_SECTIONS.get(algorithm, ())
    known = set(COMMON_SECTIONS) | {s for v in ALGORITHM_SECTIONS.values() for s in v}
    for name, value in doc.items():
        if name not in known:
            problems.append(f"[{name}]: unknown section{_did_you_mean(name, known, '[{}]')}")
        elif algorithm in ALGORITHM_SECTIONS and name not in COMMON_SECTIONS + own:
            problems.append(f"[{name}] does not belong to algorithm {algorithm!r}")
        elif not isinstance(value, dict):
            problems.append(f"{name}: expected a [{name}] table")

    explicit: set[str] = set()
    notes: list[str] = []
    sections: dict[str, Any] = {}
    for name in COMMON_SECTIONS + own:
        table = doc.get(name)
        if table is None:
            if name in REQUIRED_SECTIONS or name in own[:1]:
                problems.append(f"[{name}] is required")
                continue
            if name not in DEFAULTED_SECTIONS:
                continue
            table = {}
        if isinstance(table, dict):
            ignored = {k for k in table if f"{name}.{k}" in ACCEPTED_WITH_NOTE}
            notes += [f"{name}.{k} is accepted and ignored: {ACCEPTED_WITH_NOTE[f'{name}.{k}']}" for k in sorted(ignored)]
            table = {k: v for k, v in table.items() if k not in ignored}
            sections[name] = _parse_section(SECTION_TYPES[name], table, name, base, problems, explicit)

    if not problems:
        _cross_checks(sections, algorithm, explicit, problems)
    if not problems and sections["training"].max_async_rollout:
        _default_tis_cap(sections, algorithm, notes)
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems))
    return Config(path=path.resolve(), explicit=frozenset(explicit), notes=tuple(notes), **sections)


def _cross_checks(s: dict, algorithm: str, explicit: set[str], problems: list[str]) -> None:
    training: TrainingSection = s["training"]
    if "output.merge_type" in explicit and s["output"].kind != "model":
        problems.append("output.merge_type applies to kind = 'model' (the merged model), not kind = 'adapter'")
    if algorithm in ("sft", "preference"):
        for k in ROLLOUT_ONLY_TRAINING_KEYS:
            if f"training.{k}" in explicit:
                problems.append(f"training.{k} applies to rollout algorithms (ppo, grpo, agent_grpo, distill), not {algorithm}")
    preference: PreferenceSection | None = s.get("preference")
    if preference is not None:
        reads = PREFERENCE_LOSS_KEYS[preference.loss]
        for k in sorted({k for keys in PREFERENCE_LOSS_KEYS.values() for k in keys} - set(reads)):
            if f"preference.{k}" in explicit:
                users = [loss for loss, keys in PREFERENCE_LOSS_KEYS.items() if k in keys]
                problems.append(f"preference.{k} is not read by loss = {preference.loss!r} (it applies to {', '.join(users)})")
        if preference.pairs_per_step is not None and "training.gradient_accumulation" in explicit:
            problems.append("preference.pairs_per_step and training.gradient_accumulation both size a step; keep one")
        reference: ReferenceSection | None = s.get("reference")
        if reference is not None and "reference" not in reads:
            problems.append(f"[reference] applies to the losses with a reference (dpo, ipo, kto), not {preference.loss!r}")
        elif reference is not None and "preference.reference" in explicit:
            problems.append("preference.reference: leave it out when [reference] names the reference model")
        if reference is not None and reference.ctx is not None and reference.ctx < training.ctx:
            problems.append(f"reference.ctx = {reference.ctx} must be >= training.ctx = {training.ctx}")
    if "training.checkpoint_dtype" in explicit and not training.gradient_checkpointing:
        problems.append("training.checkpoint_dtype needs training.gradient_checkpointing = true")
    distill: DistillSection | None = s.get("distill")
    offline = distill is not None and distill.mode == "topk_offline"
    rollout: RolloutSection | None = s.get("rollout")
    if rollout is not None and rollout.workers and rollout.local_workers:
        problems.append("[rollout]: workers and local_workers both given; list the workers or let the trainer start local ones")
    if rollout is not None and offline and (rollout.workers or rollout.local_workers):
        problems.append("[rollout] applies to rollout algorithms; distill mode 'topk_offline' samples nothing")
    for url in rollout.workers if rollout is not None else ():
        if not url.startswith("http://"):
            problems.append(f"rollout.workers: {url!r} is not an http:// URL")
    if rollout is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rollout.api_key_env):
        problems.append("rollout.api_key_env: not the name of an environment variable (letters, digits and _): it "
                        "names the variable holding the workers' API key, never the key itself")
    if training.max_async_rollout and training.max_gpu_duty_cycle < 1:
        problems.append("training.max_gpu_duty_cycle < 1 with max_async_rollout > 0: the duty cycle paces one side at a "
                        "time; keep one of them")
    if offline and training.max_async_rollout:
        problems.append("training.max_async_rollout applies to rollout algorithms; distill mode 'topk_offline' samples nothing")
    if algorithm in ROLLOUT_EPOCH_KEYS and "training.epochs" in explicit:
        problems.append(f"training.epochs does not apply to {algorithm}: set {ROLLOUT_EPOCH_KEYS[algorithm]}")
    if algorithm in ("ppo", "grpo", "agent_grpo", "distill") and not offline and "training.gradient_accumulation" in explicit:
        where = {"ppo": " (ppo.minibatches)", "grpo": " (grpo.minibatches)", "agent_grpo": " (agent.minibatches)"}.get(algorithm, "")
        problems.append(f"training.gradient_accumulation does not apply to {algorithm}: one optimizer step per minibatch{where}")
    if training.require_gpu_resident and s["model"].device == "cpu":
        problems.append("training.require_gpu_resident = true with model.device = 'cpu': nothing would run on a GPU")
    grpo: GRPOSection | None = s.get("grpo")
    if grpo is not None:
        problems += grpo.reward_problems("grpo")
        if grpo.clip_range_high < grpo.clip_range_low:
            problems.append(f"grpo.clip_range_high = {grpo.clip_range_high} must be >= grpo.clip_range_low = {grpo.clip_range_low}")
        if grpo.sampling.max_new_tokens >= training.ctx:
            problems.append(f"grpo.sampling.max_new_tokens = {grpo.sampling.max_new_tokens} leaves no room for a prompt in training.ctx = {training.ctx}")
        if grpo.kl_schedule is not None and grpo.kl_coefficient == 0:
            problems.append("[grpo.kl_schedule] needs grpo.kl_coefficient > 0")
        if grpo.overlong_penalty and grpo.overlong_penalty.buffer_tokens > grpo.sampling.max_new_tokens:
            problems.append("grpo.overlong_penalty.buffer_tokens must be <= grpo.sampling.max_new_tokens")
        if grpo.minibatches > grpo.prompts_per_update * grpo.group_size:
            problems.append(f"grpo.minibatches = {grpo.minibatches} is more than the {grpo.prompts_per_update * grpo.group_size} completions of an update")
        if grpo.sampling.top_p < 1 and grpo.tis_cap is None:
            problems.append(_truncated_sampling("grpo.sampling.top_p", grpo.sampling.top_p, "set grpo.tis_cap (e.g. 2) to correct for the truncation"))
        if grpo.judge is not None:
            _judge_checks(grpo.judge, "grpo.judge", problems)
            if grpo.judge_weight is None:
                problems.append("grpo.judge_weight is required with [grpo.judge] (r = reward + judge_weight x verdict)")
        elif grpo.judge_weight is not None:
            problems.append("grpo.judge_weight needs a [grpo.judge]")
    ppo: PPOSection | None = s.get("ppo")
    if ppo is not None:
        problems += ppo.reward_problems("ppo")
        if ppo.sampling.max_new_tokens >= training.ctx:
            problems.append(f"ppo.sampling.max_new_tokens = {ppo.sampling.max_new_tokens} leaves no room for a prompt in training.ctx = {training.ctx}")
        if ppo.minibatches > ppo.rollout_batch_size:
            problems.append(f"ppo.minibatches = {ppo.minibatches} is more than the {ppo.rollout_batch_size} completions of an update")
        if ppo.sampling.top_p < 1:
            problems.append(_truncated_sampling("ppo.sampling.top_p", ppo.sampling.top_p))
        if not ppo.critic.enabled and ppo.critic.feature_dtype != "f32":
            problems.append("ppo.critic.feature_dtype applies to an enabled critic (ppo.critic.enabled = false)")
        if training.max_async_rollout:
            problems.append("training.max_async_rollout applies to grpo, agent_grpo and distill: ppo's critic reads the "
                            "trunk that sampled each batch")
    if distill is not None:
        on_policy = distill.mode == "on_policy"
        for k in OFFLINE_ONLY if on_policy else ON_POLICY_ONLY:
            if f"distill.{k}" in explicit:
                problems.append(f"distill.{k} applies to mode = {'topk_offline' if on_policy else 'on_policy'}, not {distill.mode}")
        needed = ("prompts", "updates", "prompts_per_update", "sampling") if on_policy else ("data",)
        for k in needed:
            if getattr(distill, k) is None:
                problems.append(f"distill.{k} is required with mode = {distill.mode!r}")
        if on_policy and distill.loss == "reverse_kl":
            for k in ("topk", "jsd_beta"):
                if f"distill.{k}" in explicit:
                    problems.append(f"distill.{k} applies to loss = 'jsd' (the reverse KL scores the sampled token only), not {distill.loss!r}")
        if on_policy and distill.loss == "jsd" and distill.tis_cap is not None:
            problems.append("distill.tis_cap applies to loss = 'reverse_kl' (a ratio objective), not 'jsd'")
        if on_policy and distill.sampling and distill.sampling.max_new_tokens >= training.ctx:
            problems.append(f"distill.sampling.max_new_tokens = {distill.sampling.max_new_tokens} leaves no room for a prompt in training.ctx = {training.ctx}")
        if on_policy and distill.sampling and distill.sampling.top_p < 1:
            problems.append(_truncated_sampling("distill.sampling.top_p", distill.sampling.top_p))
        if not on_policy and distill.sidecar is None and distill.data is not None:
            s["distill"] = dataclasses.replace(distill, sidecar=distill.data.with_suffix(".topk"))
    agent: AgentSection | None = s.get("agent")
    if agent is not None:
        if agent.clip_range_high < agent.clip_range_low:
            problems.append(f"agent.clip_range_high = {agent.clip_range_high} must be >= agent.clip_range_low = {agent.clip_range_low}")
        if agent.max_trajectory_tokens is not None and agent.max_trajectory_tokens > training.ctx:
            problems.append(f"agent.max_trajectory_tokens = {agent.max_trajectory_tokens} is more than training.ctx = {training.ctx}")
        if not agent.environment and agent.judge is None:
            problems.append("[agent] needs [agent.environment], [agent.judge] or both")
        if agent.judge is not None:
            _judge_checks(agent.judge, "agent.judge", problems)
        if agent.collect_api is not None:
            _endpoint_checks(agent.collect_api, "agent.collect_api", problems)
        if agent.top_p < 1:
            problems.append(_truncated_sampling("agent.top_p", agent.top_p))
    ckpt: CheckpointSection | None = s.get("checkpoint")
    if ckpt is not None:
        steps_mode = ckpt.mode in ("steps", "steps_and_best_eval")
        if steps_mode and ckpt.every_steps is None:
            problems.append(f"checkpoint.every_steps is required with checkpoint.mode = {ckpt.mode!r}")
        if not steps_mode and ckpt.every_steps is not None:
            problems.append("checkpoint.every_steps applies only to the step modes (steps, steps_and_best_eval)")
        if "best_eval" in ckpt.mode and s.get("evaluation") is None:
            problems.append(f"checkpoint.mode = {ckpt.mode!r} needs an [evaluation] section")
        if ckpt.resume_from is not None and s["lora"].init_adapter is not None:
            problems.append("checkpoint.resume_from and lora.init_adapter exclude each other")
    init = s["lora"].init_adapter
    if init is not None and not init.is_file():
        problems.append(f"lora.init_adapter = {str(init)!r}: no such file (a LoRA GGUF to start from)")


def _default_tis_cap(s: dict, algorithm: str, notes: list[str]) -> None:
    """An asynchronous run samples with an adapter older than the one it trains: without
    truncated importance sampling its updates would be off-policy and uncorrected, so one
    that sets no tis_cap gets ASYNC_TIS_CAP, said in a note. GKD's JSD needs none: it compares
    whole top-k distributions at each sampled position, and an older sampler only changes
    which positions those are (README: Scaling out)."""
    name = {"grpo": "grpo", "agent_grpo": "agent", "distill": "distill"}[algorithm]
    section = s[name]
    if section.tis_cap is not None or (name == "distill" and section.loss != "reverse_kl"):
        return
    s[name] = dataclasses.replace(section, tis_cap=ASYNC_TIS_CAP)
    notes.append(f"training.max_async_rollout = {s['training'].max_async_rollout} without {name}.tis_cap: using "
                 f"{name}.tis_cap = {ASYNC_TIS_CAP:g} to correct for the older adapter that sampled each batch "
                 f"(set {name}.tis_cap to choose the cap)")


def _truncated_sampling(key: str, value: float, remedy: str = "") -> str:
    """A nucleus-truncated rollout is sampled from a policy other than the one trained (README: sampling rule)."""
    return (f"{key} = {value}: training rollouts must be sampled from the whole tempered distribution, the policy "
            f"being trained; set {key} = 1 (lower the temperature instead){' or ' + remedy if remedy else ''}")


def _parse_section(cls, table: dict, section: str, base: Path, problems: list[str], explicit: set[str]):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for k, v in table.items():
        where = f"{section}.{k}"
        if k not in fields:
            problems.append(f"{where}: unknown key{_did_you_mean(k, fields, section + '.{}')}")
            continue
        f = fields[k]
        checked = _check_value(v, hints[k], f.metadata, where, base, problems)
        if checked is not _INVALID:
            values[k] = checked
            explicit.add(where)
    for name, f in fields.items():
        if f.metadata.get("required") and name not in table:
            problems.append(f"{section}.{name} is required")
    try:
        return cls(**values)
    except TypeError:
        return None  # a required key is missing: already reported


_INVALID = object()


def _check_value(value, annotation, meta, where, base: Path, problems: list[str]):
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # X | None
        inner = [a for a in args if a is not type(None)][0]
        return _check_value(value, inner, meta, where, base, problems)

    def bad(expected: str):
        problems.append(f"{where} = {_show(value)}: expected {expected}")
        return _INVALID

    if dataclasses.is_dataclass(annotation):  # a sub-table such as [grpo.sampling]
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a [{where}] table")
            return _INVALID
        return _parse_section(annotation, value, where, base, problems, set()) or _INVALID
    if annotation is bool:
        if not isinstance(value, bool):
            return bad("true or false")
    elif annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return bad("an integer" + _range_text(meta))
    elif annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return bad("a finite number" + _range_text(meta))
        value = float(value)
    elif annotation is str:
        if not isinstance(value, str):
            return bad("a string" + (f" ({_choices_text(meta['choices'])})" if meta.get("choices") else ""))
    elif annotation is Path:
        if not isinstance(value, str) or not value:
            return bad("a path string")
        value = (base / Path(value).expanduser()).resolve()
    elif origin in (list, tuple):
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value) or not value:
            return bad("a non-empty list of " + ("paths" if args[0] is Path else "strings"))
        value = tuple((base / Path(x).expanduser()).resolve() for x in value) if args[0] is Path else tuple(value)
    elif annotation is dict:
        if not isinstance(value, dict):
            return bad("a table")
    if meta.get("choices") and value not in meta["choices"]:
        return bad(_choices_text(meta["choices"]))
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not _in_range(value, meta):
        return bad(("an integer" if annotation is int else "a number") + _range_text(meta))
    return value


def _judge_checks(judge: JudgeSection, where: str, problems: list[str]) -> None:
    if judge.type == "command":
        if judge.command is None:
            problems.append(f"{where}.command is required with type = 'command'")
        llm = [k for k in ("base_url", "model", "rubric", "pairwise_rubric", "temperature", "cache_path", "strategy", "context",
                           "compaction")
               if getattr(judge, k) is not None]
        if llm:
            problems.append(f"{where}.{llm[0]} applies to type = 'ruler' (an LLM judge), not 'command'")
        return
    if judge.command is not None:
        problems.append(f"{where}.command applies to type = 'command', not 'ruler'")
    for k in ("base_url", "model"):
        if getattr(judge, k) is None:
            problems.append(f"{where}.{k} is required with type = 'ruler'")
    _endpoint_checks(judge, where, problems)
    c = judge.context
    if c is not None and not c.max_message_chars <= c.max_trajectory_chars <= c.max_request_chars:
        problems.append(f"{where}.context: budgets must nest: max_message_chars <= max_trajectory_chars <= max_request_chars")
    k = judge.compaction
    if k is not None and not k.target_chars < k.trigger_chars:
        problems.append(f"{where}.compaction: target_chars ({k.target_chars}) must be below trigger_chars ({k.trigger_chars})")


def _endpoint_checks(section: JudgeSection | CollectApiSection, where: str, problems: list[str]) -> None:
    if section.base_url is not None and not re.match(r"^https?://[^/\s]+", section.base_url):
        problems.append(f"{where}.base_url: {section.base_url!r} is not an http(s):// URL")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", section.api_key_env):
        problems.append(f"{where}.api_key_env: not the name of an environment variable (letters, digits and _)")


def _in_range(v, meta) -> bool:
    return all(
        bound is None or ok
        for bound, ok in (
            (meta.get("gt"), meta.get("gt") is not None and v > meta["gt"]),
            (meta.get("ge"), meta.get("ge") is not None and v >= meta["ge"]),
            (meta.get("lt"), meta.get("lt") is not None and v < meta["lt"]),
            (meta.get("le"), meta.get("le") is not None and v <= meta["le"]),
        )
    )


def _range_text(meta) -> str:
    parts = [f"{op} {meta[k]}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if meta.get(k) is not None]
    return (" " + " and ".join(parts)) if parts else ""


def _choices_text(choices) -> str:
    return "one of " + ", ".join(repr(c) for c in choices)


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def _did_you_mean(name: str, candidates, fmt: str) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {fmt.format(match[0])}?)" if match else ""
