"""PPO on the llama.cpp sampler: one completion per prompt, a critic on the trunk's own
features, per-token GAE advantages, the clipped policy loss GRPO uses (retrograd notes 4.3).

Per update:
1. `produce`: rollout_batch_size prompts from the prompt stream, one completion each
   (seeded by its place in the stream), scored by the reward program.
2. `plan`: with the critic (default), one forward without gradients captures the final
   hidden state before every completion token; the value head gives V per token, GAE turns
   the reward on the last token into advantages per token, whitened over every completion
   token of the batch, and the head is then fit toward A + V. Without it the advantage is
   the batch-whitened reward on every token of its completion (REINFORCE with a KL penalty).
3. the loop's policy update: ppo_epochs passes over `minibatches` minibatches, symmetric
   clip at clip_range (dual clip at 3), k3 KL toward the policy that sampled the batch,
   each completion's loss averaged over its tokens (loss_normalization "sequence").
The head's weights and Adam moments are part of the recipe's checkpointed state, so a
resumed run repeats the remaining updates exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrograd.config import Config
from retrograd.data import Prompt, completion_seed, order_name, prompt_index
from retrograd.objectives.critic import FEATURE_DTYPES, ValueHead, explained_variance, gae, whiten
from retrograd.objectives.policy import PolicyLossOptions
from retrograd.recipes.common import (
    RewardTrend,
    completion_record,
    completion_text,
    held_out_rewards,
    open_chat,
    open_rollout_sampler,
    prepare,
    rollout_sampler_options,
    run_prompts,
    signature,
)
from retrograd.rollouts.rewards import make_reward
from retrograd.runtime.memory import rss_bytes
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.training.duty_cycle import for_generation
from retrograd.training.report import Reporter
from retrograd.training.rollout_loop import (
    RolloutResult,
    Trainer,
    make_policy,
    on_rank_zero,
    reward_evaluation,
    run_rollouts,
)
from retrograd.training.rollout_recipe import Batch, Decision, RolloutRecipe, TrainPlan
from retrograd.training.rollout_step import TrainSample
from retrograd.training.scoring import Rollout, rollout_features
from retrograd.training.timeline import PhaseClock

PHASES = ("generation", "reward", "critic", "behavior_scoring", "optimizer", "adapter_refresh")


@dataclass(frozen=True)
class Completion:
    """One sampled and scored completion."""

    prompt: Prompt
    position: int  # the prompt's place in the run's stream of prompts
    tokens: tuple[int, ...]
    sampler_logprobs: tuple[float, ...]
    text: str
    truncated: bool
    reward: float


def sampler_options(cfg: Config) -> SamplerOptions:
    return rollout_sampler_options(cfg, cfg.ppo.rollout_batch_size)


def run(cfg: Config, reporter: Reporter, *, resume: Path | bool | None = None) -> RolloutResult:
    p = cfg.ppo
    baseline_rss = rss_bytes()
    reward = make_reward(command=p.reward_command, mode=p.reward_mode, timeout_seconds=p.reward_timeout_seconds,
                         function=p.reward_function)
    with reward:
        chat = open_chat(cfg)
        prompts, eval_prompts = run_prompts(cfg, chat, p.prompts, p.sampling.max_new_tokens, reporter)
        setup = prepare(cfg, reporter, chat)
        t0, r0 = time.perf_counter(), rss_bytes()
        with on_rank_zero(setup.device, lambda: open_rollout_sampler(cfg, setup.model.path, sampler_options(cfg))) as sampler:
            if sampler is not None:
                reporter.message(f"sampler: llama.cpp on {sampler.placement.describe()}")
            init = setup.timings | {"llama.cpp sampler": (time.perf_counter() - t0, rss_bytes() - r0)}
            loss_options = PolicyLossOptions(clip_range_low=p.clip_range, clip_range_high=p.clip_range,
                                             loss_normalization="sequence")
            policy = make_policy(cfg, setup, loss_options, updates=p.updates, steps_per_update=p.ppo_epochs * p.minibatches,
                                 temperature=p.sampling.temperature, reporter=reporter)
            rollouts = PPORollouts(cfg, setup, sampler, reward, prompts, eval_prompts, policy)
            data_files = {"ppo.prompts": p.prompts} | ({"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {})
            trainer = Trainer(setup, sampler, policy, reporter, signature(setup, data_files), init, baseline_rss)
            return run_rollouts(cfg, rollouts.recipe(), trainer, resume)


class PPORollouts:
    """What PPO hands the rollout loop: sampled and scored completions, and their advantages."""

    def __init__(self, cfg: Config, setup, sampler: Sampler, reward, prompts, eval_prompts, policy):
        self.cfg, self.p, self.setup, self.sampler, self.reward, self.policy = cfg, cfg.ppo, setup, sampler, reward, policy
        self.prompts, self.eval_prompts = prompts, eval_prompts
        self.sampling = Sampling(self.p.sampling.max_new_tokens, self.p.sampling.temperature, self.p.sampling.top_p)
        self.eog = sampler.eog_ids if sampler is not None else frozenset()  # None: a torchrun rank that only trains
        self.trend = RewardTrend()

    def recipe(self) -> RolloutRecipe:
        p = self.p
        critic = (f"critic on (gamma={p.critic.gamma:g}, gae_lambda={p.critic.gae_lambda:g})" if p.critic.enabled
                  else "critic off (batch-whitened rewards)")
        return RolloutRecipe(
            name="ppo",
            plan_line=(f"updates={p.updates}, ppo_epochs_per_update={p.ppo_epochs}, minibatches={p.minibatches}, "
                       f"optimizer_steps<={p.updates * p.ppo_epochs * p.minibatches}, prompts={len(self.prompts)}, "
                       f"rollout_batch_size={p.rollout_batch_size}, {critic}"),
            updates=p.updates, epochs_label="ppo_epochs_per_update", epochs=p.ppo_epochs, minibatches=p.minibatches,
            budget_tokens=p.sampling.max_new_tokens, phases=PHASES,
            columns=("loss", "reward", "Δreward", "value_loss", "expl_var", "clip", "lr", "tok/s"),
            loss_key="policy/total_loss", produce=self.produce, plan=self.plan, record=self.record, row=self.row,
            status=lambda m: f"reward={m['reward/mean']:.3f}",
            evaluate=self.evaluate if self.eval_prompts else None,
            state={"critic": None}, kl_reference="behavior",
        )

    # ---------------------------------------------------------------- producing rollouts

    def produce(self, update: int, cursor: int, clock: PhaseClock) -> Batch:
        """rollout_batch_size completions, one per prompt from the stream at `cursor`."""
        p = self.p
        positions = range(cursor, cursor + p.rollout_batch_size)
        chosen = [self.prompts[prompt_index(k, len(self.prompts), order=order_name(p.prompt_order), seed=self.cfg.lora.seed)]
                  for k in positions]
        requests = [GroupRequest(prompt.ids, [completion_seed(p.sampling.seed, k, 0)], self.sampling)
                    for k, prompt in zip(positions, chosen)]
        with clock.phase("generation"), for_generation(self.policy.duty, self.sampler).burst():
            completions = [group[0] for group in self.sampler.generate(requests)]
        texts = [self._text(c.tokens) for c in completions]
        with clock.phase("reward"):
            rewards = self.reward.score([prompt.text for prompt in chosen], texts)
        members = tuple(Completion(prompt, k, tuple(c.tokens), tuple(c.logprobs), text, c.finish == "length", float(r))
                        for k, prompt, c, text, r in zip(positions, chosen, completions, texts, rewards))
        lengths = [len(c.tokens) for c in members]
        metrics = {
            "completions/length_mean": float(np.mean(lengths)),
            "completions/length_min": float(min(lengths)),
            "completions/length_max": float(max(lengths)),
            "completions/truncation_fraction": float(np.mean([c.truncated for c in members])),
        }
        return Batch(update, members, cursor + p.rollout_batch_size, metrics)

    def _text(self, tokens) -> str:
        return completion_text(self.setup.model.tokenizer, self.eog, tokens)

    # ---------------------------------------------------------------- advantages

    def plan(self, batch: Batch, state: dict, clock: PhaseClock) -> TrainPlan:
        """Per-token advantages from the critic (fit afterwards) or the whitened rewards."""
        completions = batch.rollouts
        rewards = torch.tensor([c.reward for c in completions], dtype=torch.float64)  # [n]
        lengths = [len(c.tokens) for c in completions]
        metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
                   "reward/min": float(rewards.min()), "reward/max": float(rewards.max())}
        if self.p.critic.enabled:
            with clock.phase("critic"):
                per_token, critic_state, critic_metrics = self._critic(completions, state["critic"])
            metrics |= critic_metrics
        else:
            per_token = list(whiten(rewards).repeat_interleave(torch.tensor(lengths)).split(lengths))
            critic_state = None
        flat = torch.cat(per_token)
        metrics |= {"advantages/mean": float(flat.mean()), "advantages/std": float(flat.std(unbiased=False)),
                    "advantages/min": float(flat.min()), "advantages/max": float(flat.max())}
        decisions, samples, trained = [], [], []
        for k, (c, adv) in enumerate(zip(completions, per_token)):
            train = bool(adv.any())
            decisions.append(Decision(float(adv.mean()), train, None if train else "zero_signal"))
            if train:
                samples.append(TrainSample(Rollout(k, c.prompt.ids, c.tokens), adv.float(), torch.tensor(c.sampler_logprobs)))
                trained.append(k)
        metrics["batch/trained_fraction"] = len(samples) / len(completions)
        return TrainPlan(tuple(samples), tuple(trained), tuple(decisions), metrics, beta=self.p.kl_coefficient,
                         state=state | {"critic": critic_state}, note="every advantage was zero (equal rewards); nothing to train")

    def _critic(self, completions, saved: dict | None) -> tuple[list[torch.Tensor], dict, dict]:
        """GAE advantages per completion (whitened over the batch's tokens), the head's state
        after fitting it toward A + V, and the critic's metrics."""
        critic = self.p.critic
        rollouts = [Rollout(k, c.prompt.ids, c.tokens) for k, c in enumerate(completions)]
        features = rollout_features(self.setup.model.transformer, rollouts, self.policy.passes(rollouts).score, self.setup.device)
        features = torch.cat(features).to("cpu", FEATURE_DTYPES[critic.feature_dtype])  # [N, E]
        head = (ValueHead(features.shape[1], critic.value_lr) if saved is None
                else ValueHead.from_state(saved, critic.value_lr))
        values = head(features).double()  # [N]
        lengths = [len(c.tokens) for c in completions]
        raw = torch.cat([gae(v, c.reward, critic.gamma, critic.gae_lambda)
                         for v, c in zip(values.split(lengths), completions)])  # [N]
        targets = raw + values  # [N]
        metrics = {"critic/explained_variance": explained_variance(values, targets),
                   "critic/value_loss_before": float((targets - values).pow(2).mean()),
                   "critic/feature_mib": features.numel() * features.element_size() / 2**20,
                   "critic/raw_advantage_mean": float(raw.mean())}
        metrics["critic/value_loss"] = head.fit(features, targets, critic.value_epochs)
        return list(whiten(raw).split(lengths)), head.state(), metrics

    # ---------------------------------------------------------------- reporting, evaluation

    def record(self, c: Completion, decision: Decision, policy_logprobs: list | None, update: int, cap: int) -> dict:
        return completion_record(c, c.position, decision, policy_logprobs, update, cap)

    def row(self, m: dict) -> dict:
        reward = m["reward/mean"]
        return {"loss": m.get("policy/total_loss"), "reward": reward, "Δreward": self.trend.delta(reward),
                "value_loss": m.get("critic/value_loss"),
                "expl_var": m.get("critic/explained_variance"), "clip": m.get("policy/clip_fraction"),
                "lr": m.get("optimizer/learning_rate"), "tok/s": m["train/tokens_per_second"]}

    def evaluate(self, update: int):
        """Mean reward of one completion per held-out prompt (fixed seeds), as GRPO measures it."""
        rewards = held_out_rewards(self.sampler, self.reward, self.eval_prompts, self.sampling, self.p.sampling.seed, self._text)
        return reward_evaluation(update, self.p.updates, rewards)
