"""GRPO on the llama.cpp sampler, as two functions the rollout loop runs.

Per update (retrograd notes 4.2; Dr. GRPO + DAPO, optional GSPO):
1. `produce`: draw prompts_per_update prompts (in order or shuffled) with one seed per
   completion; llama.cpp samples group_size completions per prompt from the base GGUF plus
   the live adapter (one prompt prefill per group, continuous batching); the reward program
   (or function) scores them, the judge (when there is one) adds judge_weight x its verdict,
   and the overlong penalty is added. With dynamic sampling,
   groups without a learning signal are replaced by fresh prompts until enough are
   informative or the candidate budget is spent.
2. `plan`: with mask_truncated, completions that used the whole budget leave their group;
   group advantages per sampling wave; groups left with equal rewards (or < 2 members), and
   groups the judge failed on (judge_failure = "drop_group"), are dead: skipped and counted.
3. the loop's policy update: with kl_coefficient > 0 the reference log-probs come from this
   model with the adapter switched off; the behaviour log-probs from a teacher-forced torch
   pass, skipped when one optimizer step covers the update (then the ratio is exactly 1 by
   construction); grpo_epochs passes, each over `minibatches` shuffled minibatches, one
   optimizer step per minibatch, micro-batches packed with each group's prompt once; then
   llama.cpp gets the new adapter.
Checkpoints sit at update boundaries; every random choice derives from (seed, update), so a
resumed run repeats the remaining updates exactly.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from retrograd.config import Config
from retrograd.data import Prompt, completion_seed, order_name, prompt_index
from retrograd.objectives.advantages import baseline_name, group_advantages
from retrograd.objectives.policy import PolicyLossOptions
from retrograd.objectives.shaping import adapt_kl_multiplier, kl_coefficient, overlong_penalty
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
from retrograd.rollouts.judge import JudgeError, RulerJudge, judge_group, make_judge
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
from retrograd.training.scoring import Rollout
from retrograd.training.timeline import PhaseClock

PHASES = ("generation", "reward", "judge", "behavior_scoring", "reference", "optimizer", "adapter_refresh")


@dataclass(frozen=True)
class Completion:
    """One sampled and scored completion."""

    prompt: Prompt
    position: int  # the prompt's place in the run's stream of prompts
    group: int  # its group's index in the update (informative groups first)
    wave: int  # the dynamic-sampling wave that drew it (advantages are computed per wave)
    tokens: tuple[int, ...]
    sampler_logprobs: tuple[float, ...]
    text: str
    truncated: bool
    reward: float  # the reward, judge term and overlong penalty included
    verdict: float | None = None  # the judge's, in [0, 1]
    judge_dropped: bool = False  # the judge failed on its group, which is not trained


def sampler_options(cfg: Config) -> SamplerOptions:
    return rollout_sampler_options(cfg, cfg.grpo.prompts_per_update * cfg.grpo.group_size)


def run(cfg: Config, reporter: Reporter, *, resume: Path | bool | None = None) -> RolloutResult:
    g = cfg.grpo
    baseline_rss = rss_bytes()
    reward = make_reward(
        command=g.reward_command, mode=g.reward_mode, timeout_seconds=g.reward_timeout_seconds, function=g.reward_function
    )
    reward.judge_weight_allowed = g.judge is not None
    with reward, (make_judge(g.judge) if g.judge else contextlib.nullcontext()) as judge:
        chat = open_chat(cfg)
        prompts, eval_prompts = run_prompts(cfg, chat, g.prompts, g.sampling.max_new_tokens, reporter)
        setup = prepare(cfg, reporter, chat)
        t0, r0 = time.perf_counter(), rss_bytes()
        with on_rank_zero(setup.device, lambda: open_rollout_sampler(cfg, setup.model.path, sampler_options(cfg))) as sampler:
            if sampler is not None:
                reporter.message(f"sampler: llama.cpp on {sampler.placement.describe()}")
            init = setup.timings | {"llama.cpp sampler": (time.perf_counter() - t0, rss_bytes() - r0)}
            loss_options = PolicyLossOptions(
                clip_range_low=g.clip_range_low, clip_range_high=g.clip_range_high,
                importance_sampling_level=g.importance_sampling_level, loss_normalization=g.loss_normalization,
                tis_cap=g.tis_cap,
            )
            policy = make_policy(cfg, setup, loss_options, updates=g.updates, steps_per_update=g.grpo_epochs * g.minibatches,
                                 temperature=g.sampling.temperature, reporter=reporter)
            rollouts = GRPORollouts(cfg, sampler, reward, prompts, eval_prompts, policy.duty, setup.model.tokenizer, judge)
            data_files = {"grpo.prompts": g.prompts} | ({"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {})
            trainer = Trainer(setup, sampler, policy, reporter, signature(setup, data_files), init, baseline_rss)
            return run_rollouts(cfg, rollouts.recipe(), trainer, resume)


class GRPORollouts:
    """What GRPO hands the rollout loop: sampling and scoring groups, and their advantages."""

    def __init__(self, cfg: Config, sampler: Sampler, reward, prompts, eval_prompts, duty, tokenizer, judge=None):
        self.cfg, self.g, self.sampler, self.reward, self.tokenizer = cfg, cfg.grpo, sampler, reward, tokenizer
        self.duty = for_generation(duty, sampler)
        self.judge = judge
        self.prompts, self.eval_prompts = prompts, eval_prompts
        self.sampling = Sampling(self.g.sampling.max_new_tokens, self.g.sampling.temperature, self.g.sampling.top_p)
        self.eog = sampler.eog_ids if sampler is not None else frozenset()  # None: a torchrun rank that only trains
        self.trend = RewardTrend()

    def recipe(self) -> RolloutRecipe:
        g = self.g
        return RolloutRecipe(
            name="grpo",
            plan_line=(f"updates={g.updates}, grpo_epochs_per_update={g.grpo_epochs}, minibatches={g.minibatches}, "
                       f"optimizer_steps<={g.updates * g.grpo_epochs * g.minibatches}, prompts={len(self.prompts)}, "
                       f"group_size={g.group_size}"),
            updates=g.updates, epochs_label="grpo_epochs_per_update", epochs=g.grpo_epochs, minibatches=g.minibatches,
            budget_tokens=g.sampling.max_new_tokens, phases=PHASES,
            columns=("loss", "reward", "Δreward", "kl", "clip", "lr", "tok/s"), loss_key="policy/total_loss",
            produce=self.produce, plan=self.plan, record=self.record, row=self.row,
            status=lambda m: f"reward={m['reward/mean']:.3f}",
            evaluate=self.evaluate if self.eval_prompts else None,
            state={"stalled": 0, "kl_multiplier": 1.0}, settle=self.settle,
        )

    # ---------------------------------------------------------------- producing rollouts

    def produce(self, update: int, cursor: int, clock: PhaseClock) -> Batch:
        """prompts_per_update scored groups from the prompt stream at `cursor`; with dynamic
        sampling, dead groups are replaced by fresh prompts until enough are informative or
        the candidate budget is spent. Informative groups come first."""
        g = self.g
        want = g.prompts_per_update
        limit = want * (g.dynamic_sampling.max_resample_factor if g.dynamic_sampling else 1)
        kept: list[list[Completion]] = []
        dead: list[list[Completion]] = []
        drawn = wave = 0
        while drawn < limit and len(kept) < want:
            n = min(want - len(kept), limit - drawn)
            groups = self._sample_wave(cursor + drawn, n, wave, clock)
            drawn += n
            wave += 1
            for group, is_dead in zip(groups, self._dead(groups)):
                (dead if is_dead else kept).append(group)
            if not g.dynamic_sampling:
                break
        groups = [[replace(c, group=i) for c in group] for i, group in enumerate(kept + dead)]
        members = [c for group in groups for c in group]
        lengths = [len(c.tokens) for c in members]
        metrics = self._judge_metrics(groups) | {
            "completions/length_mean": float(np.mean(lengths)),
            "completions/length_min": float(min(lengths)),
            "completions/length_max": float(max(lengths)),
            "completions/truncation_fraction": float(np.mean([c.truncated for c in members])),
            "batch/groups_sampled_fraction": len(groups) / drawn,
        }
        return Batch(update, tuple(members), cursor + drawn, metrics)

    def _sample_wave(self, start: int, n_groups: int, wave: int, clock: PhaseClock) -> list[list[Completion]]:
        """n_groups groups from stream positions start, start + 1, …, sampled and scored."""
        g = self.g
        positions = range(start, start + n_groups)
        chosen = [self.prompts[prompt_index(p, len(self.prompts), order=order_name(g.prompt_order), seed=self.cfg.lora.seed)]
                  for p in positions]
        requests = [GroupRequest(prompt.ids, [completion_seed(g.sampling.seed, p, j) for j in range(g.group_size)], self.sampling)
                    for p, prompt in zip(positions, chosen)]
        with clock.phase("generation"), self.duty.burst():
            completions = self.sampler.generate(requests)
        texts = [[self._text(c.tokens) for c in group] for group in completions]
        with clock.phase("reward"):
            flat = self.reward.score([p.text for p, group in zip(chosen, texts) for _ in group], [t for group in texts for t in group])
        r = torch.tensor(flat, dtype=torch.float64).view(n_groups, g.group_size)  # [groups, G]
        verdicts: list[list[float] | None] = [None] * n_groups
        failed = [False] * n_groups
        if self.judge is not None:
            given = list(self.reward.judge_weights) if len(self.reward.judge_weights) == len(flat) else [None] * len(flat)
            weights = torch.tensor([g.judge_weight if w is None else w for w in given], dtype=torch.float64)
            weights = weights.view(n_groups, g.group_size)  # [groups, G]: a program's reply may override the weight
            judged = [bool(weights[i].any()) for i in range(n_groups)]  # a group weighted 0 throughout is not sent
            with clock.phase("judge"):
                verdicts = self._verdicts(chosen, texts, judged)
            for i, group_verdicts in enumerate(verdicts):
                if group_verdicts is not None:
                    r[i] += weights[i] * torch.tensor(group_verdicts, dtype=torch.float64)
                failed[i] = judged[i] and group_verdicts is None
        if g.overlong_penalty:
            lengths = torch.tensor([[len(c.tokens) for c in group] for group in completions])  # [groups, G]
            r = r + overlong_penalty(lengths, g.sampling.max_new_tokens, g.overlong_penalty.buffer_tokens, g.overlong_penalty.max_penalty)
        return [
            [Completion(prompt, p, 0, wave, tuple(c.tokens), tuple(c.logprobs), text, c.finish == "length", float(r[i, j]),
                        None if verdicts[i] is None else verdicts[i][j], failed[i])
             for j, (c, text) in enumerate(zip(group, group_texts))]
            for i, (p, prompt, group, group_texts) in enumerate(zip(positions, chosen, completions, texts))
        ]

    def _verdicts(self, chosen: list[Prompt], texts: list[list[str]], judged: list[bool]) -> list[list[float] | None]:
        """The judge's verdicts per group (those `judged`), groups judged in parallel; None for a
        group not judged or failed on (judge_failure = "drop_group"), up to max_judge_dropped_fraction."""
        g = self.g

        def one(k: int) -> list[float] | JudgeError | None:
            if not judged[k]:
                return None
            try:
                return judge_group(self.judge, chosen[k].text, texts[k], chosen[k].rubric)
            except JudgeError as error:
                return error

        with ThreadPoolExecutor(g.judge.max_concurrency) as pool:
            results = list(pool.map(one, range(len(chosen))))
        failed = [(k, r) for k, r in enumerate(results) if isinstance(r, JudgeError)]
        if failed and g.judge_failure == "fail":
            raise JudgeError(f"[grpo.judge] on prompt {chosen[failed[0][0]].source}: {failed[0][1]}")
        if len(failed) > g.max_judge_dropped_fraction * sum(judged):
            raise JudgeError(f"[grpo.judge] failed on {len(failed)} of {sum(judged)} groups, more than "
                             f"grpo.max_judge_dropped_fraction = {g.max_judge_dropped_fraction:g} (last: {failed[-1][1]})")
        return [r if isinstance(r, list) else None for r in results]

    def _judge_metrics(self, groups: list[list[Completion]]) -> dict[str, float]:
        if self.judge is None:
            return {}
        verdicts = [c.verdict for group in groups for c in group if c.verdict is not None]
        dropped = sum(group[0].judge_dropped for group in groups)
        metrics = {"judge/dropped_group_fraction": dropped / len(groups)}
        if verdicts:
            metrics |= {"judge/score_mean": float(np.mean(verdicts)), "judge/score_std": float(np.std(verdicts))}
        return metrics | (self.judge.metrics() if isinstance(self.judge, RulerJudge) else {})

    def _text(self, tokens) -> str:
        return completion_text(self.tokenizer, self.eog, tokens)

    def _live(self, groups: list[list[Completion]]) -> torch.Tensor:
        """[groups, G] False where mask_truncated takes a completion out of its group, and in a
        group the judge failed on (so that group is dead)."""
        return torch.tensor([[not (self.g.mask_truncated and c.truncated) and not c.judge_dropped for c in group]
                             for group in groups])

    def _advantages(self, groups: list[list[Completion]]):
        rewards = torch.tensor([[c.reward for c in group] for group in groups], dtype=torch.float64)  # [groups, G]
        return group_advantages(rewards, self._live(groups), baseline=baseline_name(self.g.baseline), scale_rewards=self.g.scale_rewards)

    def _dead(self, groups: list[list[Completion]]) -> list[bool]:
        return self._advantages(groups).dead.tolist()

    # ---------------------------------------------------------------- training samples

    def plan(self, batch: Batch, state: dict, clock: PhaseClock) -> TrainPlan:
        """Group advantages per wave (as they were sampled), the truncation mask, the KL
        coefficient of this update and the stall counter."""
        g = self.g
        groups: dict[int, list[int]] = {}  # group -> the indices of its members in the batch
        for k, c in enumerate(batch.rollouts):
            groups.setdefault(c.group, []).append(k)
        rollouts = batch.rollouts
        advantage, dead = [0.0] * len(rollouts), {}
        for wave in sorted({c.wave for c in rollouts}):
            in_wave = sorted((ks for ks in groups.values() if rollouts[ks[0]].wave == wave), key=lambda ks: rollouts[ks[0]].position)
            adv = self._advantages([[rollouts[k] for k in ks] for ks in in_wave])
            for i, ks in enumerate(in_wave):
                dead[rollouts[ks[0]].group] = bool(adv.dead[i])
                for j, k in enumerate(ks):
                    advantage[k] = float(adv.advantages[i, j])
        decisions, samples, trained = [], [], []
        for k, c in enumerate(rollouts):
            skip = ("judge_dropped" if c.judge_dropped else "truncated" if g.mask_truncated and c.truncated
                    else "zero_signal" if dead[c.group] else None)
            decisions.append(Decision(advantage[k], skip is None, skip))
            if skip is None:
                samples.append(TrainSample(Rollout(c.group, c.prompt.ids, c.tokens), torch.tensor(advantage[k]),
                                           torch.tensor(c.sampler_logprobs)))
                trained.append(k)
        metrics = self._advantages([[rollouts[k] for k in ks] for ks in groups.values()]).diagnostics
        stalled = state["stalled"] + 1 if metrics["batch/trained_fraction"] == 0 else 0
        halt = None
        if g.max_stalled_updates and stalled >= g.max_stalled_updates:
            halt = f"{stalled} updates in a row without a learning signal (grpo.max_stalled_updates)"
        warmup = g.kl_schedule.warmup_updates if g.kl_schedule else 0
        return TrainPlan(
            tuple(samples), tuple(trained), tuple(decisions), metrics,
            beta=kl_coefficient(g.kl_coefficient, batch.update, warmup, state["kl_multiplier"]),
            state=state | {"stalled": stalled}, discarded_groups=sum(dead.values()),
            note="every group was dead (equal rewards); nothing to train", halt=halt,
        )

    def settle(self, state: dict, metrics: dict) -> dict:
        """The adaptive KL multiplier follows the KL the update measured (once beta > 0)."""
        schedule = self.g.kl_schedule
        if schedule and schedule.target and "policy/kl" in metrics:
            return state | {"kl_multiplier": adapt_kl_multiplier(state["kl_multiplier"], metrics["policy/kl"], schedule.target)}
        return state

    # ---------------------------------------------------------------- reporting, evaluation

    def record(self, c: Completion, decision: Decision, policy_logprobs: list | None, update: int, cap: int) -> dict:
        return completion_record(c, c.group, decision, policy_logprobs, update, cap, judge_verdict=c.verdict)

    def row(self, m: dict) -> dict:
        reward = m["reward/mean"]
        return {"loss": m.get("policy/total_loss"), "reward": reward, "Δreward": self.trend.delta(reward), "kl": m.get("policy/kl"),
                "clip": m.get("policy/clip_fraction"), "lr": m.get("optimizer/learning_rate"), "tok/s": m["train/tokens_per_second"]}

    def evaluate(self, update: int):
        """Mean reward of one completion per held-out prompt (fixed seeds)."""
        rewards = held_out_rewards(self.sampler, self.reward, self.eval_prompts, self.sampling, self.g.sampling.seed, self._text)
        return reward_evaluation(update, self.g.updates, rewards)

