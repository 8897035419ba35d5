"""Pieces every recipe composes: device and precision, the base model with its LoRA, the
chat format, the adapter export, and the resume signature."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from retrograd.config import Config
from retrograd.data import ChatFormat, Prompts, completion_seed, evenly_spaced, load_prompts, resolve_chat_template
from retrograd.errors import ConfigError, DeviceError, TrainingDiverged
from retrograd.gguf.adapter import LoRAWeights, adapter_tensors, read_adapter, write_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.gguf.merge import check_out, merge
from retrograd.gguf.spec import read_spec
from retrograd.model.activation_memory import PASS_TOKENS_GLIBC, PASS_TOKENS_JEMALLOC, Merging, merging
from retrograd.model.base import BaseModel, load_model
from retrograd.model.lora import Adapter, attach_lora
from retrograd.model.tokenizer import Tokenizer
from retrograd.runtime import allocator
from retrograd.runtime.bundled import default_model_path
from retrograd.runtime.cpu_share import CpuShare
from retrograd.runtime.device import off_device, resolve_device
from retrograd.runtime.memory import rss_bytes
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions
from retrograd.training.checkpoint import content_hash, file_fingerprint, latest_checkpoint
from retrograd.training.distributed import rank_device
from retrograd.training.report import Reporter
from retrograd.training.rollout_loop import cut_text
from retrograd.training.rollout_recipe import Decision

# settings that never change what is computed, left out of the resume signature
UNSIGNED_TRAINING_KEYS = ("threads", "threads_follow_load", "generation_threads", "max_gpu_duty_cycle", "require_gpu_resident")
SAME_NUMBERS = {"auto": "quantized"}  # weight modes that compute the same bits sign alike


def compute_dtype(name: str, device: torch.device) -> str:
    """`auto` picks bf16 where matmuls have native bf16 (CUDA with bf16, CPUs with
    AVX512-BF16/AMX: 2x faster than f32 on our Xeon), f32 elsewhere."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "f32"
    return "bf16" if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() else "f32"


@dataclass
class Setup:
    cfg: Config
    device: torch.device
    model: BaseModel
    adapter: Adapter
    chat: ChatFormat
    precision: str  # resolved compute dtype name
    timings: dict = field(default_factory=dict)  # start-up phase -> (seconds, Δ host RSS bytes)
    cpu: CpuShare = field(default_factory=lambda: CpuShare(torch.get_num_threads(), adaptive=False))
    detail: Callable[[str], None] = field(default=lambda text: None)  # run.verbose's lines; reporter.message when on
    message: Callable[[str], None] = field(default=lambda text: None)  # lines the run always shows (reporter.message)

    def diverged(self, reason: str) -> TrainingDiverged:
        """The one way every recipe stops on a NaN loss or a runaway KL: the reason, and
        where the run can be picked up again."""
        last = latest_checkpoint(self.cfg.checkpoint.directory) if self.cfg.checkpoint else None
        where = f"; the last good checkpoint is {last.path} (resume with --resume)" if last else "; no checkpoint was written"
        return TrainingDiverged(reason + where)

    def merging(self, spread: bool = False, *, rollouts: bool = False) -> Merging | None:
        """How small micro-batches merge into fewer passes in the same activation memory
        (activation_memory.merging): an update's (`rollouts`) or an optimizer step's. None under
        torchrun (`spread`), whose ranks deal out the micro-batches. On jemalloc passes hold up to
        PASS_TOKENS_JEMALLOC tokens. On glibc's malloc, whose heap keeps what larger passes
        free, up to PASS_TOKENS_GLIBC, and only rollout updates merge: merged, the smoke GRPO
        shape read 5% more RSS, an SFT step of 47-token micro-batches 36% more (1482 against
        1093 MiB, SmolLM2)."""
        t, transformer = self.cfg.training, self.model.transformer
        jemalloc = allocator.hands_back_freed_memory()
        if spread or not (jemalloc or rollouts):
            return None
        return merging(self.model.spec, t.micro_batch, transformer.compute_dtype.itemsize, self.cfg.lora.rank,
                       checkpoint_every=transformer.checkpoint_every, checkpoint_bytes=transformer.checkpoint_dtype.itemsize,
                       cap=PASS_TOKENS_JEMALLOC if jemalloc else PASS_TOKENS_GLIBC)

    @property
    def base_shapes(self) -> dict[str, tuple[int, ...]]:
        return {w.name: w.shape for w in self.model.transformer.frozen_weights()}

    def export(self, path: Path) -> Path:
        """The adapter as a llama.cpp LoRA GGUF, written atomically."""
        return write_adapter(
            path,
            adapter_tensors(self.adapter),
            arch=self.model.spec.arch,
            alpha=self.adapter.alpha,
            base_shapes=self.base_shapes,
            dtype=self.cfg.lora.dtype,
        )

    def write_output(self) -> Path:
        """What [output] asks for at the end of the run: the adapter at output.path, or with
        kind = "model" the base with the adapter merged in there and the adapter beside it."""
        out = self.cfg.output
        adapter = self.export(out.adapter_path)
        if out.kind == "adapter":
            return adapter
        self.message(f"adapter: {adapter}")
        merge(self.model.path, adapter, out.path, out.merge_type)
        self.message(f"merged model ({out.merge_type} weights): {out.path}")
        return out.path


def check_output(cfg: Config) -> None:
    """Fail before any work when the output could not be written where the config says."""
    folder = cfg.output.path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"output.path: folder {folder} is not writable ({e.strerror})") from None
    if cfg.output.kind == "model":
        check_out(cfg.output.path, {"base model": cfg.model.path or default_model_path()}, option="output.path")


def open_chat(cfg: Config) -> ChatFormat:
    """The tokenizer and chat template alone (no weights): enough to validate data files
    before the model loads."""
    variables = next((sec.template_variables for sec in (cfg.sft, cfg.agent) if sec is not None), {})
    return model_chat(cfg.model.path or default_model_path(), cfg.model.chat_template, variables)


def model_chat(path: Path, chat_template: str | None = None, variables: dict | None = None) -> ChatFormat:
    """The model file's tokenizer and chat template (or `chat_template`: a built-in name or a Jinja file)."""
    template = resolve_chat_template(read_spec(GGUFFile(path)).chat_template, chat_template)
    return ChatFormat(Tokenizer(path), template, variables=variables or {}, origin=str(path))


@dataclass
class Base:
    """The frozen base on its device, before any LoRA."""

    device: torch.device
    model: BaseModel
    precision: str  # resolved compute dtype name
    timings: dict  # start-up phase -> (seconds, Δ host RSS bytes)
    cpu: CpuShare  # torch's threads, following the machine's load


def load_base(cfg: Config, reporter: Reporter, chat: ChatFormat) -> Base:
    t = cfg.training
    if t.threads:
        torch.set_num_threads(t.threads)
    device = rank_device(resolve_device(cfg.model.device))
    for note in cfg.notes:
        reporter.message(f"note: {note}")
    if t.require_gpu_resident:
        off = off_device(device, sampling=cfg.run.algorithm != "sft")
        if device.type == "cpu":
            off = ["torch sees no CUDA GPU, so training would run on the CPU"]
        if off:
            raise DeviceError(f"training.require_gpu_resident = true, but {'; '.join(off)} (preflight shows it; unset the key to allow it)")
    precision = compute_dtype(t.compute_dtype, device)
    reporter.message("loading model")
    t0, r0 = time.perf_counter(), rss_bytes()
    model = load_model(cfg.model.path, weights=cfg.model.weights, compute_dtype=precision, device=device, tokenizer=chat.tokenizer)
    model.transformer.use_context(t.ctx)  # RoPE factors (phi3) as llama.cpp picks them for the sampler's context
    timings = {"model load": (time.perf_counter() - t0, rss_bytes() - r0)}
    reporter.message(f"model loaded in {timings['model load'][0]:.1f} s: {model.path.name} ({model.spec.arch}, {precision} compute)")
    reporter.message(f"weights: {model.weights_choice}")
    for note in model.notes:
        reporter.message(f"note: {note}")
    cpu = CpuShare(torch.get_num_threads(), adaptive=t.threads_follow_load and device.type == "cpu")
    return Base(device, model, precision, timings, cpu)


def prepare(cfg: Config, reporter: Reporter, chat: ChatFormat) -> Setup:
    """Everything a training run needs: the base, the [lora] adapter, checkpointing settings."""
    check_output(cfg)
    t = cfg.training
    base = load_base(cfg, reporter, chat)
    model = base.model
    if t.gradient_checkpointing:
        model.transformer.checkpoint_every = t.checkpoint_every_n_layers
        model.transformer.checkpoint_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[t.checkpoint_dtype]
    t0, r0 = time.perf_counter(), rss_bytes()
    adapter = attach_lora(model.transformer, cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha, cfg.lora.seed)
    if cfg.lora.init_adapter is not None:
        load_adapter_weights(adapter, cfg.lora.init_adapter)
    timings = base.timings | {"LoRA creation": (time.perf_counter() - t0, rss_bytes() - r0)}
    setup = Setup(cfg, base.device, model, adapter, chat, base.precision, timings, base.cpu, message=reporter.message)
    if cfg.run.verbose:
        setup.detail = reporter.message
    return setup


def load_adapter_weights(adapter: Adapter, path: Path) -> None:
    """Warm start from an adapter GGUF: same targets and rank, weights only."""
    loaded = read_adapter(path)
    if set(loaded.tensors) != set(adapter.layers) or loaded.rank != adapter.rank:
        raise ConfigError(
            f"lora.init_adapter {path}: adapts {len(loaded.tensors)} weights at rank {loaded.rank}, "
            f"but [lora] asks for {len(adapter.layers)} at rank {adapter.rank}"
        )
    with torch.no_grad():
        for name, layer in adapter.layers.items():
            w: LoRAWeights = loaded.tensors[name]
            layer.lora_a.copy_(torch.from_numpy(w.a))
            layer.lora_b.copy_(torch.from_numpy(w.b) * (loaded.alpha / loaded.rank) / layer.scale)


def run_prompts(cfg: Config, chat: ChatFormat, path: Path, max_new_tokens: int, reporter) -> tuple[Prompts, tuple]:
    """A sampling run's training prompts and its held-out ones ([evaluation], evenly spaced;
    () without), each leaving max_new_tokens of training.ctx, described at start-up."""
    budget = cfg.training.ctx - max_new_tokens
    prompts = load_prompts(path, chat, max_tokens=budget)
    reporter.message(f"prompts: {prompts.description}")
    if not cfg.evaluation:
        return prompts, ()
    held_out = load_prompts(cfg.evaluation.data, chat, max_tokens=budget, evaluation=True)
    reporter.message(f"evaluation: {held_out.description}")
    return prompts, evenly_spaced(held_out, cfg.evaluation.max_examples)


def held_out_rewards(sampler: Sampler, reward, prompts, sampling, seed: int, text) -> list[float]:
    """The reward of one completion per prompt, each seeded by its index (seed + 1: apart from
    training's draws), the prompt's reference answer given to the reward (grpo, ppo)."""
    requests = [GroupRequest(p.ids, [completion_seed(seed + 1, i, 0)], sampling) for i, p in enumerate(prompts)]
    completions = [group[0] for group in sampler.generate(requests)]
    return reward.score([p.text for p in prompts], [text(c.tokens) for c in completions], [p.reference for p in prompts])


def completion_text(tokenizer: Tokenizer, eog: frozenset[int], tokens) -> str:
    """A sampled completion's text as rewards and records see it: end-of-generation tokens dropped."""
    return tokenizer.decode([tok for tok in tokens if tok not in eog], special=False)


def completion_record(c, group: int, decision: Decision, policy_logprobs: list | None, update: int, cap: int,
                      **extra) -> dict:
    """rollouts.jsonl's line for one sampled completion `c` (grpo's or ppo's Completion);
    `extra` adds a recipe's own fields after the reward."""
    return {
        "update": update + 1, "group": group, "prompt": cut_text(c.prompt.text, cap), "source": c.prompt.source,
        "completion": cut_text(c.text, cap), "tokens": len(c.tokens), "truncated": c.truncated, "reward": c.reward,
        **extra,
        "advantage": decision.advantage, "trained": decision.trained, "skip_reason": decision.skip_reason,
        "prompt_ids": list(c.prompt.ids), "completion_ids": list(c.tokens),
        "sampler_logprobs": list(c.sampler_logprobs), "policy_logprobs": policy_logprobs,
    }


@dataclass
class RewardTrend:
    """The progress table's Δreward: each update's mean reward against the one before."""

    previous: float | None = None

    def delta(self, reward: float) -> float | None:
        change = None if self.previous is None else reward - self.previous
        self.previous = reward
        return change


def signature(setup: Setup, data_files: dict[str, Path]) -> dict:
    """Everything that shapes the trajectory; a resume is refused when any of it differs."""
    cfg = setup.cfg
    training = {k: v for k, v in dataclasses.asdict(cfg.training).items() if k not in UNSIGNED_TRAINING_KEYS}
    if not training["max_async_rollout"]:  # synchronous: signed as before the key existed, so older checkpoints resume
        del training["max_async_rollout"]
    lora = dataclasses.asdict(cfg.lora) | {"init_adapter": content_hash(cfg.lora.init_adapter) if cfg.lora.init_adapter else None}
    sig = {
        "algorithm": cfg.run.algorithm,
        "model": file_fingerprint(setup.model.path),
        "model.weights": SAME_NUMBERS.get(cfg.model.weights, cfg.model.weights),
        "compute_dtype": setup.precision,
        "lora": lora,
        "training": training,
    }
    for name, path in data_files.items():
        sig[name] = content_hash(path)
    for section in ("sft", "ppo", "grpo", "preference"):
        value = getattr(cfg, section, None)
        if value is not None:
            sig[section] = {k: v for k, v in dataclasses.asdict(value).items() if k not in ("data", "prompts")}
    return json.loads(json.dumps(sig, default=str))  # as it will read back from the manifest


@contextmanager
def open_rollout_sampler(cfg: Config, model_path: Path, options: SamplerOptions) -> Iterator:
    """What samples the rollouts: the in-process llama.cpp Sampler, or with [rollout] the
    listed `retrograd rollout-worker`s (checked to hold this model and tokenizer) or
    `local_workers` of them started here and stopped at the end."""
    rollout = cfg.rollout
    if rollout is None or not (rollout.workers or rollout.local_workers):
        with Sampler(model_path, options) as sampler:
            yield sampler
        return
    from retrograd.sampler.remote import connect, start_local_workers  # HTTP plumbing only when asked for

    with ExitStack() as stack:
        urls = rollout.workers
        if rollout.local_workers:
            threads = cfg.training.generation_threads
            urls = stack.enter_context(start_local_workers(rollout.local_workers, model_path, options, threads)).urls
        yield stack.enter_context(connect(urls, model_path, options, api_key_env=rollout.api_key_env))


def rollout_sampler_options(cfg: Config, sequences_per_update: int, n_ctx: int | None = None) -> SamplerOptions:
    """llama.cpp decodes one sequence per completion of an update together (at most 64 unless
    training.generation_concurrency says otherwise), each up to `n_ctx` tokens (training.ctx),
    on training.generation_threads CPU threads (default training.threads)."""
    t = cfg.training
    concurrency = t.generation_concurrency or min(sequences_per_update, 64)
    return SamplerOptions(
        n_ctx=n_ctx or t.ctx,
        n_seq_max=concurrency,
        n_batch=t.generation_batch or max(512, concurrency),
        kv_dtype=t.kv_dtype if t.fast_sampling_context else "f32",
        n_threads=t.generation_threads or t.threads or 0,
    )
