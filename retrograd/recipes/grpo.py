"""GRPO on the llama.cpp sampler: the update loop written out in full.

Per update (retrograd notes 4.2; Dr. GRPO + DAPO, optional GSPO):
1. draw prompts_per_update prompts (in order or shuffled) and derive one seed per completion;
2. llama.cpp samples group_size completions per prompt from the base GGUF plus the live
   adapter (one prompt prefill per group, continuous batching);
3. the reward program (or function) scores them; the overlong penalty is added and, with
   mask_truncated, completions that used the whole budget leave their group;
4. group advantages; groups left with equal rewards (or < 2 members) are dead: skipped and
   counted (dynamic sampling draws more prompts to replace them);
5. with kl_coefficient > 0 the reference log-probs come from this model with the adapter
   switched off; the behaviour log-probs from a teacher-forced torch pass, skipped when
   one optimizer step covers the update (then the ratio is exactly 1 by construction);
6. grpo_epochs passes, each over `minibatches` shuffled minibatches, one optimizer step
   per minibatch, micro-batches packed with each group's prompt once;
7. llama.cpp gets the new adapter.
Checkpoints sit at update boundaries; every random choice derives from (seed, update), so a
resumed run repeats the remaining updates exactly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrograd.config import Config
from retrograd.data import Prompt, completion_seed, evenly_spaced, load_prompts, order_name, prompt_index
from retrograd.memory import rss_bytes
from retrograd.objectives.advantages import baseline_name, group_advantages
from retrograd.objectives.policy import PolicyLossOptions
from retrograd.objectives.shaping import adapt_kl_multiplier, kl_coefficient, overlong_penalty
from retrograd.recipes.common import Setup, open_chat, prepare, resume_point, rollout_sampler_options, signature
from retrograd.rollouts.rewards import make_reward
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.training.batches import LogprobOptions
from retrograd.training.duty_cycle import for_device
from retrograd.training.metrics import MetricsSink
from retrograd.training.optim import Schedule, build_optimizer
from retrograd.training.report import Reporter
from retrograd.training.rollout_loop import cut_text, warm_up
from retrograd.training.rollout_run import RolloutResult, RunTotals, UpdateRecord, resume_rollouts, rollout_outputs
from retrograd.training.rollout_step import PolicyOptimizer, TrainSample
from retrograd.training.scoring import Rollout
from retrograd.training.state import RecipeLoop

PHASES = ("generation", "reward", "behavior_scoring", "reference", "optimizer", "adapter_refresh")


@dataclass
class Member:
    """One sampled completion and what the update made of it."""

    prompt: Prompt
    group: int
    tokens: tuple[int, ...]
    sampler_logprobs: tuple[float, ...]
    text: str
    truncated: bool
    reward: float = 0.0
    live: bool = True
    policy_logprobs: tuple[float, ...] | None = None  # torch's before the update, when trained
    advantage: float = 0.0
    skip_reason: str | None = None


def sampler_options(cfg: Config) -> SamplerOptions:
    return rollout_sampler_options(cfg, cfg.grpo.prompts_per_update * cfg.grpo.group_size)


def run(cfg: Config, reporter: Reporter, *, resume: Path | bool | None = None) -> RolloutResult:
    g, t = cfg.grpo, cfg.training
    baseline_rss = rss_bytes()
    reward = make_reward(
        command=g.reward_command, mode=g.reward_mode, timeout_seconds=g.reward_timeout_seconds, function=g.reward_function
    )
    with reward:
        chat = open_chat(cfg)
        budget = t.ctx - g.sampling.max_new_tokens
        prompts = load_prompts(g.prompts, chat, max_tokens=budget)
        reporter.message(f"prompts: {prompts.description}")
        eval_prompts = ()
        if cfg.evaluation:
            eval_prompts = evenly_spaced(load_prompts(cfg.evaluation.data, chat, max_tokens=budget), cfg.evaluation.max_examples)
        setup = prepare(cfg, reporter, chat)
        t0, r0 = time.perf_counter(), rss_bytes()
        with Sampler(setup.model.path, sampler_options(cfg)) as sampler:
            reporter.message(f"sampler: llama.cpp on {sampler.placement.describe()}")
            init = setup.timings | {"llama.cpp sampler": (time.perf_counter() - t0, rss_bytes() - r0)}
            loop = GRPOLoop(cfg, setup, sampler, reward, prompts, eval_prompts, reporter)
            init |= warm_up(setup)
            result = loop.run(resume)
            result.init_timing = init
            result.memory = {"baseline": baseline_rss, "after_load": loop.rss_after_load, "peak": loop.totals.peak_rss}
            result.duty = loop.duty.stats
            return result


class GRPOLoop(RecipeLoop):
    def __init__(self, cfg: Config, setup: Setup, sampler: Sampler, reward, prompts, eval_prompts, reporter: Reporter):
        self.cfg, self.setup, self.sampler, self.reward = cfg, setup, sampler, reward
        self.prompts, self.eval_prompts, self.reporter = prompts, eval_prompts, reporter
        g, t = cfg.grpo, cfg.training
        self.optimizer = build_optimizer(setup.adapter.parameters(), t.optimizer, t.lr, t.weight_decay)
        loss_options = PolicyLossOptions(
            clip_range_low=g.clip_range_low,
            clip_range_high=g.clip_range_high,
            importance_sampling_level=g.importance_sampling_level,
            loss_normalization=g.loss_normalization,
            tis_cap=g.tis_cap,
        )
        self.total_steps = g.updates * g.grpo_epochs * g.minibatches
        schedule = Schedule(t.lr, t.lr_scheduler, t.warmup_steps, self.total_steps, t.max_grad_norm, g.updates)
        self.duty = for_device(t.max_gpu_duty_cycle, setup.device, reporter.message)
        self.policy = PolicyOptimizer(
            setup, self.optimizer, loss_options, schedule, LogprobOptions.from_training(t, setup.model.spec.n_vocab, g.sampling.temperature),
            self.duty, t.micro_batch, cfg.lora.seed,
        )
        self.sampling = Sampling(g.sampling.max_new_tokens, g.sampling.temperature, g.sampling.top_p)
        self.eog = sampler.eog_ids
        self.progress = {"update": 0, "global_step": 0, "prompt_cursor": 0, "best_eval": None, "stale_evals": 0,
                         "stalled": 0, "kl_multiplier": 1.0}
        self.rss_after_load = rss_bytes()
        self.totals = RunTotals("policy/total_loss")
        out_dir = cfg.output.path.parent
        self.rollouts_path = (cfg.observe.directory if cfg.observe else out_dir) / "rollouts.jsonl"

    # ---------------------------------------------------------------- the loop

    def run(self, resume) -> RolloutResult:
        cfg, g = self.cfg, self.cfg.grpo
        data_files = {"grpo.prompts": g.prompts} | ({"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {})
        self.signature = signature(self.setup, data_files)
        checkpoint = resume_point(cfg, resume, self.reporter)
        self.progress = resume_rollouts(checkpoint, self.signature, self.policy, self.sampler, self.reporter) or self.progress
        self.reporter.message(
            f"grpo: updates={g.updates}, grpo_epochs_per_update={g.grpo_epochs}, minibatches={g.minibatches}, "
            f"optimizer_steps<={self.total_steps}, prompts={len(self.prompts)}, group_size={g.group_size}"
        )
        records: list[UpdateRecord] = []
        with rollout_outputs(cfg, self.rollouts_path, append=checkpoint is not None) as (metrics, rollouts_file):
            self.reporter.start(g.updates, ["update", "step", "loss", "reward", "Δreward", "kl", "clip", "lr", "tok/s"], "updates")
            self.reporter.advance(self.progress["update"], "")
            previous_reward = None
            try:
                while self.progress["update"] < g.updates:
                    update = self.progress["update"]
                    record, members = self.totals.measure(self.update, update)
                    records.append(record)
                    m = self.account(update, record.metrics, record.timing)
                    self.progress["update"] = update + 1
                    metrics.log(self.progress["global_step"], m | {"train/update": update + 1})
                    self._write_rollouts(rollouts_file, update, members)
                    reward_mean = m["reward/mean"]
                    delta = None if previous_reward is None else reward_mean - previous_reward
                    previous_reward = reward_mean
                    self.reporter.row({
                        "update": f"{update + 1}/{g.updates}", "step": self.progress["global_step"], "loss": m.get("policy/total_loss"),
                        "reward": reward_mean, "Δreward": delta, "kl": m.get("policy/kl"), "clip": m.get("policy/clip_fraction"),
                        "lr": m.get("optimizer/learning_rate"), "tok/s": m["train/tokens_per_second"],
                    })
                    self.reporter.advance(update + 1, f"reward={reward_mean:.3f}" + (f" loss={self.totals.last_loss:.4f}" if self.totals.losses else ""))
                    stop = self._stalled(m)
                    if self._evaluation_due(update):
                        stop = self._evaluate(update, metrics) or stop
                    self.save_if_crossed(record.steps)
                    if stop:
                        break
            finally:
                self.reporter.finish()
        out = self.setup.write_output()
        return RolloutResult(
            output=out,
            epochs_label="grpo_epochs_per_update",
            updates_done=self.progress["update"],
            steps=self.progress["global_step"],
            train_loss=self.totals.last_loss,
            tokens_per_second=self.totals.tokens_per_second,
            records=records,
            updates_planned=g.updates,
            epochs_per_update=g.grpo_epochs,
        )

    def update(self, update: int) -> tuple[UpdateRecord, list[Member]]:
        g = self.cfg.grpo
        timing = dict.fromkeys(PHASES, 0.0)
        groups = self._sample_groups(update, timing)
        members = [m for group in groups for m in group]
        live_groups = [group for group in groups if any(m.live and m.skip_reason is None for m in group)]
        metrics = self._rollout_metrics(groups)
        trainable = [m for group in live_groups for m in group if m.live and m.skip_reason is None]
        beta = kl_coefficient(g.kl_coefficient, update, g.kl_schedule.warmup_updates if g.kl_schedule else 0, self.progress["kl_multiplier"])
        steps_before = self.policy.global_step
        step_diagnostics: list[dict] = []
        if trainable:
            samples = [
                TrainSample(Rollout(m.group, m.prompt.ids, m.tokens), torch.tensor(m.advantage), torch.tensor(m.sampler_logprobs))
                for m in trainable
            ]
            result = self.policy.update(
                update, samples, beta=beta, epochs=g.grpo_epochs, minibatches=g.minibatches,
                budget_tokens=g.sampling.max_new_tokens, timing=timing,
            )
            step_diagnostics = result.step_diagnostics
            for m, logp in zip(trainable, result.policy_logprobs):
                m.policy_logprobs = tuple(logp.tolist())
            metrics |= result.diagnostics
            if g.kl_schedule and g.kl_schedule.target and "policy/kl" in metrics:  # measured once beta > 0
                self.progress["kl_multiplier"] = adapt_kl_multiplier(self.progress["kl_multiplier"], metrics["policy/kl"], g.kl_schedule.target)
            t0 = time.perf_counter()
            refresh = self.sampler.set_adapter(self.setup.adapter)
            timing["adapter_refresh"] = time.perf_counter() - t0
            metrics["sampler/adapter_refresh_seconds"] = refresh.total_s
        else:
            self.reporter.message(f"update {update + 1}: every group was dead (equal rewards); nothing to train")
        metrics["policy/beta"] = beta
        self.progress["global_step"] = self.policy.global_step
        return UpdateRecord(update, metrics, timing, self.policy.global_step - steps_before, step_diagnostics), members

    # ---------------------------------------------------------------- rollouts

    def _sample_groups(self, update: int, timing: dict) -> list[list[Member]]:
        """prompts_per_update groups; with dynamic sampling, dead groups are replaced by
        fresh prompts until enough are informative or the candidate budget is spent."""
        g = self.cfg.grpo
        want = g.prompts_per_update
        limit = want * (g.dynamic_sampling.max_resample_factor if g.dynamic_sampling else 1)
        kept: list[list[Member]] = []
        dead: list[list[Member]] = []
        drawn = 0
        while drawn < limit and len(kept) < want:
            n = min(want - len(kept), limit - drawn)
            wave = self._generate_wave(n, timing)
            drawn += n
            self._score(wave, timing)
            for group in wave:
                (kept if any(m.skip_reason is None for m in group) else dead).append(group)
            if not g.dynamic_sampling:
                break
        self.progress["sampled_groups"] = drawn
        groups = kept + dead
        for i, group in enumerate(groups):
            for m in group:
                m.group = i
        return groups

    def _generate_wave(self, n_groups: int, timing: dict) -> list[list[Member]]:
        g = self.cfg.grpo
        cursor = self.progress["prompt_cursor"]
        chosen = []
        requests = []
        for k in range(n_groups):
            position = cursor + k
            prompt = self.prompts[prompt_index(position, len(self.prompts), order=order_name(g.prompt_order), seed=self.cfg.lora.seed)]
            seeds = [completion_seed(g.sampling.seed, position, j) for j in range(g.group_size)]
            chosen.append(prompt)
            requests.append(GroupRequest(prompt.ids, seeds, self.sampling))
        self.progress["prompt_cursor"] = cursor + n_groups
        t0 = time.perf_counter()
        with self.duty.burst():
            completions = self.sampler.generate(requests)
        timing["generation"] += time.perf_counter() - t0
        wave = []
        for prompt, group in zip(chosen, completions):
            wave.append([
                Member(prompt, 0, tuple(c.tokens), tuple(c.logprobs), self._text(c.tokens), c.finish == "length")
                for c in group
            ])
        return wave

    def _text(self, tokens) -> str:
        body = [tok for tok in tokens if tok not in self.eog]
        return self.setup.model.tokenizer.decode(body, special=False)

    def _score(self, wave: list[list[Member]], timing: dict) -> None:
        """Rewards, overlong penalty, truncation mask and group advantages, in place."""
        g = self.cfg.grpo
        members = [m for group in wave for m in group]
        t0 = time.perf_counter()
        rewards = self.reward.score([m.prompt.text for m in members], [m.text for m in members])
        timing["reward"] += time.perf_counter() - t0
        r = torch.tensor(rewards, dtype=torch.float64).view(len(wave), g.group_size)  # [groups, G]
        if g.overlong_penalty:
            lengths = torch.tensor([len(m.tokens) for m in members]).view_as(r)
            r = r + overlong_penalty(lengths, g.sampling.max_new_tokens, g.overlong_penalty.buffer_tokens, g.overlong_penalty.max_penalty)
        live = torch.tensor([not (g.mask_truncated and m.truncated) for m in members]).view_as(r)
        adv = group_advantages(r, live, baseline=baseline_name(g.baseline), scale_rewards=g.scale_rewards)
        for k, m in enumerate(members):
            i, j = divmod(k, g.group_size)
            m.reward, m.live, m.advantage = float(r[i, j]), bool(live[i, j]), float(adv.advantages[i, j])
            if not m.live:
                m.skip_reason = "truncated"
            elif bool(adv.dead[i]):
                m.skip_reason = "zero_signal"

    def _rollout_metrics(self, groups: list[list[Member]]) -> dict:
        g = self.cfg.grpo
        members = [m for group in groups for m in group]
        rewards = torch.tensor([[m.reward for m in group] for group in groups], dtype=torch.float64)
        live = torch.tensor([[m.live for m in group] for group in groups])
        stats = group_advantages(rewards, live, baseline=baseline_name(g.baseline), scale_rewards=g.scale_rewards).diagnostics
        lengths = [len(m.tokens) for m in members]
        return stats | {
            "completions/length_mean": float(np.mean(lengths)),
            "completions/length_min": float(min(lengths)),
            "completions/length_max": float(max(lengths)),
            "completions/truncation_fraction": float(np.mean([m.truncated for m in members])),
            "batch/groups_sampled_fraction": len(groups) / self.progress.get("sampled_groups", len(groups)),
        }

    # ---------------------------------------------------------------- evaluation, checkpoints

    def _evaluation_due(self, update: int) -> bool:
        ev = self.cfg.evaluation
        return bool(self.eval_prompts) and ((update + 1) % ev.every_iterations == 0 or update + 1 == self.cfg.grpo.updates)

    def _evaluate(self, update: int, metrics: MetricsSink) -> bool:
        """Mean reward of one completion per held-out prompt (fixed seeds); best checkpoint
        and patience. Returns True to stop early."""
        g = self.cfg.grpo
        requests = [GroupRequest(p.ids, [completion_seed(g.sampling.seed + 1, i, 0)], self.sampling) for i, p in enumerate(self.eval_prompts)]
        completions = [group[0] for group in self.sampler.generate(requests)]
        rewards = self.reward.score([p.text for p in self.eval_prompts], [self._text(c.tokens) for c in completions])
        return self.held_out_reward(update, g.updates, rewards, metrics)

    def _stalled(self, m: dict) -> bool:
        g = self.cfg.grpo
        self.progress["stalled"] = self.progress["stalled"] + 1 if m["batch/trained_fraction"] == 0 else 0
        if g.max_stalled_updates and self.progress["stalled"] >= g.max_stalled_updates:
            self.reporter.message(f"stopping: {self.progress['stalled']} updates in a row without a learning signal (grpo.max_stalled_updates)")
            return True
        return False

    def _write_rollouts(self, f, update: int, members: list[Member]) -> None:
        observe = self.cfg.observe
        if observe and (update + 1) % observe.every:
            return
        cap = observe.max_text_chars if observe else 0
        for m in members:
            record = {
                "update": update + 1, "group": m.group, "prompt": cut_text(m.prompt.text, cap), "source": m.prompt.source,
                "completion": cut_text(m.text, cap), "tokens": len(m.tokens), "truncated": m.truncated, "reward": m.reward,
                "advantage": m.advantage, "trained": m.skip_reason is None, "skip_reason": m.skip_reason,
                "prompt_ids": list(m.prompt.ids), "completion_ids": list(m.tokens),
                "sampler_logprobs": list(m.sampler_logprobs), "policy_logprobs": m.policy_logprobs,
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
