"""Agentic GRPO: multi-turn, tool-using trajectories in sandboxes, the update loop written out.

Per update (retrograd notes §4.6, §5):
1. scenarios_per_update scenarios, round robin from the update index, group_size
   trajectories each, with seeds derived from (seed, position, member);
2. the rollout engine (retrograd.rollouts.agent) runs them in lockstep on the llama.cpp
   sampler, each in its own sandbox leased from the pool, turn by turn, extending the KV
   cache between turns; verify gives the terminal reward, json tools step rewards;
3. scenarios without verify are scored by the [agent.judge] command, per group;
4. failed trajectories (a broken sandbox) and truncated ones (truncation = "drop") leave
   their group; with "min_reward" a truncated member gets the group's lowest total reward.
   More dropped than max_dropped_fraction stops the run; an update without any group of two
   usable trajectories stops it too, unless skip_empty_updates;
5. group advantages as in GRPO, plus each trajectory's intermediate returns of its step
   rewards; the pool pre-warms sandboxes for the next update while
6. epochs_per_update passes of the shared policy optimizer train the sampled tokens only,
   with the loss denominator min(max_turns x max_new_tokens_per_turn, max_trajectory_tokens);
7. llama.cpp gets the new adapter.
The scenarios, tools, judge and sandbox backend (daemon, image, bubblewrap) are all checked
before the model loads. Checkpoints sit at update boundaries; every random choice derives
from (seed, update), so a resumed run repeats the remaining updates exactly.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrograd.config import Config
from retrograd.data import ChatFormat, completion_seed, evenly_spaced
from retrograd.errors import RetrogradError
from retrograd.memory import rss_bytes
from retrograd.objectives.advantages import baseline_name, group_advantages
from retrograd.objectives.policy import PolicyLossOptions
from retrograd.recipes.common import Setup, open_chat, prepare, resume_point, rollout_sampler_options, signature
from retrograd.rollouts.agent import (
    STOPS,
    AgentRollouts,
    Request,
    RolloutLimits,
    Trajectory,
    checked_prompt,
    trajectory_reward,
)
from retrograd.rollouts.rewards import OneshotCommandReward, Reward, RewardError
from retrograd.rollouts.sandbox import EnvironmentOptions, SandboxPool, open_environment
from retrograd.rollouts.scenarios import Scenario, load_scenarios
from retrograd.rollouts.tools import ToolCatalog
from retrograd.sampler import Sampler, SamplerOptions
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

PHASES = ("environment", "generation", "tools", "reward", "judge", "behavior_scoring", "reference", "optimizer",
          "adapter_refresh")
DEFAULT_TOOLS = {"default": "python"}  # when [agent.environment] has no tools table


class AgentRunStopped(RetrogradError):
    """The failure policy ended the run (too many dropped trajectories, an empty update)."""


# ---------------------------------------------------------------- the task: everything but the model


@dataclass
class AgentTask:
    """Scenarios, tools, judge and sandbox pool of a run, all validated."""

    chat: ChatFormat
    limits: RolloutLimits
    catalog: ToolCatalog | None
    options: EnvironmentOptions | None
    scenarios: tuple[Scenario, ...]
    eval_scenarios: tuple[Scenario, ...]
    judge: Reward | None
    pool: SandboxPool | None = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.judge is not None:
            self.judge.close()


def open_task(cfg: Config) -> AgentTask:
    """Checks every input the run depends on, cheapest first, and opens the sandbox pool
    last (it checks the daemon and the image, or bubblewrap, and reaps dead runs' leftovers)."""
    a = cfg.agent
    base = open_chat(cfg)
    chat = ChatFormat(base.tokenizer, base.source, variables=a.template_variables, origin=base.origin)
    chat.require_template(a.scenarios)
    limits = RolloutLimits.from_agent(a, cfg.training.ctx)
    catalog = options = None
    if a.environment:
        options = EnvironmentOptions.from_table(a.environment)
        catalog = ToolCatalog.from_table(a.environment.get("tools", DEFAULT_TOOLS), cfg.path.parent)
    scenarios = load_scenarios(a.scenarios, catalog, judged=a.judge is not None, system_suffix=a.system_suffix)
    eval_scenarios = ()
    if cfg.evaluation is not None:  # environment reward only, so every held-out scenario needs verify
        eval_scenarios = evenly_spaced(
            load_scenarios(cfg.evaluation.data, catalog, judged=False, system_suffix=a.system_suffix), cfg.evaluation.max_examples
        )
    for scenario in scenarios + eval_scenarios:
        checked_prompt(chat, scenario, limits)
    judge = OneshotCommandReward(a.judge.command, a.judge.timeout_secs) if a.judge is not None else None
    task = AgentTask(chat, limits, catalog, options, scenarios, eval_scenarios, judge)
    if options is not None:
        try:
            task.pool = open_environment(options)
        except BaseException:
            task.close()
            raise
    return task


def sampler_options(cfg: Config) -> SamplerOptions:
    """One sequence per trajectory of an update, each as long as a trajectory may be."""
    a = cfg.agent
    return rollout_sampler_options(cfg, a.scenarios_per_update * a.group_size, a.max_trajectory_tokens)


def run(cfg: Config, reporter: Reporter, *, resume: Path | bool | None = None) -> RolloutResult:
    baseline_rss = rss_bytes()
    task = open_task(cfg)
    try:
        setup = prepare(cfg, reporter, task.chat)
        options = sampler_options(cfg)
        setup.model.transformer.use_context(options.n_ctx)  # phi3's RoPE factors as the sampler's context picks them
        t0, r0 = time.perf_counter(), rss_bytes()
        with Sampler(setup.model.path, options) as sampler:
            reporter.message(f"sampler: llama.cpp on {sampler.placement.describe()}")
            init = setup.timings | {"llama.cpp sampler": (time.perf_counter() - t0, rss_bytes() - r0)}
            loop = AgentLoop(cfg, setup, sampler, task, reporter)
            init |= warm_up(setup)
            result = loop.run(resume)
            result.init_timing = init
            result.memory = {"baseline": baseline_rss, "after_load": loop.rss_after_load, "peak": loop.totals.peak_rss}
            result.duty = loop.duty.stats
            return result
    finally:
        task.close()


# ---------------------------------------------------------------- the loop


class AgentLoop(RecipeLoop):
    def __init__(self, cfg: Config, setup: Setup, sampler, task: AgentTask, reporter: Reporter):
        self.cfg, self.setup, self.sampler, self.task, self.reporter = cfg, setup, sampler, task, reporter
        a, t = cfg.agent, cfg.training
        self.optimizer = build_optimizer(setup.adapter.parameters(), t.optimizer, t.lr, t.weight_decay)
        loss_options = PolicyLossOptions(
            clip_range_low=a.clip_range_low, clip_range_high=a.clip_range_high, loss_normalization=a.loss_normalization,
        )
        self.total_steps = a.updates * a.epochs_per_update * a.minibatches
        schedule = Schedule(t.lr, t.lr_scheduler, t.warmup_steps, self.total_steps, t.max_grad_norm, a.updates)
        self.duty = for_device(t.max_gpu_duty_cycle, setup.device, reporter.message)
        self.policy = PolicyOptimizer(
            setup, self.optimizer, loss_options, schedule, LogprobOptions.from_training(t, setup.model.spec.n_vocab, a.temperature),
            self.duty, t.micro_batch, cfg.lora.seed,
        )
        self.rollouts = AgentRollouts(sampler, task.chat, task.pool, task.options, task.limits,
                                      concurrency=sampler_options(cfg).n_seq_max)
        self.progress = {"update": 0, "global_step": 0, "best_eval": None, "stale_evals": 0}
        self.rss_after_load = rss_bytes()
        self.totals = RunTotals("policy/total_loss")
        self.rollouts_path = (cfg.observe.directory if cfg.observe else cfg.output.path.parent) / "rollouts.jsonl"

    def run(self, resume) -> RolloutResult:
        cfg, a = self.cfg, self.cfg.agent
        self.signature = self._signature()
        checkpoint = resume_point(cfg, resume, self.reporter)
        self.progress = resume_rollouts(checkpoint, self.signature, self.policy, self.sampler, self.reporter) or self.progress
        self.reporter.message(
            f"agent_grpo: updates={a.updates}, epochs_per_update={a.epochs_per_update}, scenarios={len(self.task.scenarios)}, "
            f"scenarios_per_update={a.scenarios_per_update}, group_size={a.group_size}, max_turns={a.max_turns}, "
            f"environment={self.task.options.type if self.task.options else 'none (judge only)'}"
        )
        records: list[UpdateRecord] = []
        with rollout_outputs(cfg, self.rollouts_path, append=checkpoint is not None) as (metrics, rollouts_file):
            self.reporter.start(a.updates, ["update", "step", "loss", "reward", "turns", "calls", "trunc", "kl", "tok/s"], "updates")
            self.reporter.advance(self.progress["update"], "")
            try:
                while self.progress["update"] < a.updates:
                    update = self.progress["update"]
                    record, trajectories, stop = self.totals.measure(self.update, update)
                    records.append(record)
                    m = self.account(update, record.metrics, record.timing)
                    metrics.log(self.progress["global_step"], m | {"train/update": update + 1})
                    self._write_rollouts(rollouts_file, update, trajectories)
                    if stop:
                        raise AgentRunStopped(stop)
                    self.progress["update"] = update + 1
                    self.reporter.row({
                        "update": f"{update + 1}/{a.updates}", "step": self.progress["global_step"],
                        "loss": m.get("policy/total_loss"), "reward": m["reward/mean"], "turns": m["agent/turns_per_traj_mean"],
                        "calls": m["agent/tool_calls_per_turn"], "trunc": m["agent/truncated_fraction"], "kl": m.get("policy/kl"),
                        "tok/s": m["train/tokens_per_second"],
                    })
                    self.reporter.advance(update + 1, f"reward={m['reward/mean']:.3f}" + (f" loss={self.totals.last_loss:.4f}" if self.totals.losses else ""))
                    halt = self._evaluate(update, metrics) if self._evaluation_due(update) else False
                    self.save_if_crossed(record.steps)
                    if halt:
                        break
            finally:
                self.reporter.finish()
        out = self.setup.write_output()
        return RolloutResult(
            output=out, epochs_label="agent_epochs_per_update",
            updates_done=self.progress["update"], steps=self.progress["global_step"],
            train_loss=self.totals.last_loss, tokens_per_second=self.totals.tokens_per_second,
            records=records, updates_planned=a.updates, epochs_per_update=a.epochs_per_update,
        )

    def update(self, update: int) -> tuple[UpdateRecord, list[Trajectory], str | None]:
        """One update; the third value says why the failure policy stops the run (None: it goes on)."""
        a = self.cfg.agent
        timing = dict.fromkeys(PHASES, 0.0)
        t0 = time.perf_counter()
        trajectories = self.rollouts.collect(self._requests(update), timing)
        rollout_seconds = time.perf_counter() - t0
        if self.task.pool is not None:
            self.task.pool.prewarm()  # the next update's sandboxes start while the optimizer runs
        groups = [trajectories[i:i + a.group_size] for i in range(0, len(trajectories), a.group_size)]
        metrics = self._score(groups, timing) | self._rollout_metrics(groups) | {"timing/rollout_seconds": rollout_seconds}
        if self.task.pool is not None:
            metrics |= self.task.pool.metrics(reset=True)
        stop = self._failure_policy(update, groups, metrics)
        trainable = [t for t in trajectories if t.live and t.skip_reason is None]
        steps_before = self.policy.global_step
        step_diagnostics: list[dict] = []
        if trainable and stop is None:
            samples = [
                TrainSample(Rollout(t.group, t.prompt, tuple(t.tokens), tuple(t.mask)), t.token_advantages(),
                            torch.tensor(t.logprobs))
                for t in trainable
            ]
            t1 = time.perf_counter()
            result = self.policy.update(
                update, samples, beta=a.kl_coefficient, epochs=a.epochs_per_update, minibatches=a.minibatches,
                budget_tokens=self.task.limits.budget_tokens, timing=timing,
            )
            step_diagnostics = result.step_diagnostics
            for t, logp in zip(trainable, result.policy_logprobs):
                t.policy_logprobs = logp.tolist()
            metrics |= result.diagnostics | {"timing/optimizer_wall_seconds": time.perf_counter() - t1}
            t2 = time.perf_counter()
            refresh = self.sampler.set_adapter(self.setup.adapter)
            timing["adapter_refresh"] = time.perf_counter() - t2
            metrics["sampler/adapter_refresh_seconds"] = refresh.total_s
        elif stop is None:
            self.reporter.message(f"update {update + 1}: no group has different rewards; nothing to train")
        self.progress["global_step"] = self.policy.global_step
        record = UpdateRecord(update, metrics, timing, self.policy.global_step - steps_before, step_diagnostics)
        return record, trajectories, stop

    # ---------------------------------------------------------------- rollouts and rewards

    def _requests(self, update: int) -> list[Request]:
        a = self.cfg.agent
        requests = []
        for k in range(a.scenarios_per_update):
            position = update * a.scenarios_per_update + k
            scenario = self.task.scenarios[position % len(self.task.scenarios)]
            requests += [Request(scenario, k, j, completion_seed(a.seed, position, j)) for j in range(a.group_size)]
        return requests

    def _score(self, groups: list[list[Trajectory]], timing: dict) -> dict:
        """Judge verdicts, the truncation policy and group advantages, in place; returns the
        reward/*, batch/* and judge/* metrics."""
        a = self.cfg.agent
        judged = dropped = 0
        for group in groups:
            if not group[0].scenario.verifiable and self.task.judge is not None:
                judged += 1
                dropped += not self._judge(group, timing)
            complete = [trajectory_reward(t) for t in group if t.terminal_reward is not None and not t.truncated and not t.failed]
            for t in group:
                t.reward, t.live, t.skip_reason = trajectory_reward(t), True, None
                if t.failed:
                    t.live, t.skip_reason = False, "failed"
                elif t.truncated and (a.truncation == "drop" or not complete):
                    t.live, t.skip_reason = False, "truncated"
                elif t.truncated:
                    t.reward = min(complete)
                elif t.terminal_reward is None:
                    t.live, t.skip_reason = False, "unscored"
        rewards = torch.tensor([[t.reward for t in group] for group in groups], dtype=torch.float64)  # [groups, G]
        live = torch.tensor([[t.live for t in group] for group in groups])  # [groups, G]
        adv = group_advantages(rewards, live, baseline=baseline_name(a.baseline), scale_rewards=a.scale_rewards)
        for i, group in enumerate(groups):
            for j, t in enumerate(group):
                t.advantage = float(adv.advantages[i, j])
                if t.live and bool(adv.dead[i]):
                    t.skip_reason = "zero_signal"
        return adv.diagnostics | {"judge/groups": float(judged), "judge/dropped_group_fraction": dropped / judged if judged else 0.0}

    def _judge(self, group: list[Trajectory], timing: dict) -> bool:
        """The judge's verdict becomes the terminal reward of every complete member; False
        when it failed and judge_failure = "drop_group" left the group unscored."""
        members = [t for t in group if not t.failed and not t.truncated]
        if not members:
            return True
        scenario = group[0].scenario
        prompt = "\n".join(m["content"] for m in scenario.messages())
        t0 = time.perf_counter()
        try:
            verdicts = self.task.judge.score([prompt] * len(members), [t.completion for t in members])
        except RewardError as error:
            if self.cfg.agent.judge_failure == "fail":
                raise RewardError(f"[agent.judge] on scenario {scenario.id!r}: {error}") from None
            self.reporter.message(f"judge failed on scenario {scenario.id!r}; its group is dropped: {error}")
            return False
        finally:
            timing["judge"] += time.perf_counter() - t0
        for t, verdict in zip(members, verdicts):
            t.terminal_reward = verdict
        return True

    def _failure_policy(self, update: int, groups: list[list[Trajectory]], metrics: dict) -> str | None:
        a = self.cfg.agent
        members = [t for group in groups for t in group]
        dropped = [t for t in members if t.skip_reason in ("failed", "truncated", "unscored")]
        if len(dropped) / len(members) > a.max_dropped_fraction:
            kinds = {k: sum(t.skip_reason == k for t in dropped) for k in ("truncated", "failed", "unscored")}
            return (f"update {update + 1}: {len(dropped)} of {len(members)} trajectories dropped "
                    f"({', '.join(f'{v} {k}' for k, v in kinds.items())}), more than agent.max_dropped_fraction = "
                    f"{a.max_dropped_fraction}; raise max_turns / max_new_tokens_per_turn, set truncation = "
                    "\"min_reward\", or raise the fraction")
        if not any(sum(t.live for t in group) >= 2 for group in groups):
            if a.skip_empty_updates:
                self.reporter.message(f"update {update + 1}: no group has two usable trajectories; skipped (skip_empty_updates)")
                return None
            return (f"update {update + 1}: no group has two usable trajectories, so there is no baseline; "
                    "set agent.skip_empty_updates = true to skip such updates")
        return None

    def _rollout_metrics(self, groups: list[list[Trajectory]]) -> dict:
        """agent/* and generation/* of notes §5: failed_tool counts trajectories lost to a broken
        sandbox or tool, failed_policy those cut by max_failed_turns (also truncations),
        failed_fraction both; lost_fraction what left training (truncated with "drop", failed,
        unscored); agent/stop/* why each trajectory ended."""
        members = [t for group in groups for t in group]
        turns = [turn for t in members for turn in t.turns]
        calls = [call for turn in turns for call in turn.calls]
        prefilled, reused = sum(turn.prefilled for turn in turns), sum(turn.reused for turn in turns)
        n = len(members)
        failed_tool = sum(t.failed for t in members) / n
        failed_policy = sum(t.stop == "max_failed_turns" for t in members) / n
        out = {
            "agent/truncated_fraction": sum(t.truncated for t in members) / n,
            "agent/failed_fraction": failed_tool + failed_policy,
            "agent/failed_tool": failed_tool,
            "agent/failed_policy": failed_policy,
            "agent/unscored_fraction": sum(t.skip_reason == "unscored" for t in members) / n,
            "agent/lost_fraction": sum(t.skip_reason in ("failed", "truncated", "unscored") for t in members) / n,
            "agent/tool_error_fraction": sum(c.is_error for c in calls) / len(calls) if calls else 0.0,
            "agent/turns_per_traj_mean": len(turns) / n,
            "agent/tokens_per_traj_mean": float(np.mean([len(t.tokens) for t in members])),
            "agent/sampled_tokens_per_traj_mean": float(np.mean([sum(t.mask) for t in members])),
            "agent/tool_calls_per_turn": len(calls) / len(turns) if turns else 0.0,
            "agent/turn_cut_fraction": sum(turn.finish == "length" for turn in turns) / len(turns) if turns else 0.0,
            "agent/step_rewards_per_traj_mean": sum(len(t.step_rewards) for t in members) / n,
            "agent/seconds_per_traj_mean": float(np.mean([t.seconds for t in members])),
            "generation/prefilled_tokens": float(prefilled),
            "generation/prefill_reuse_fraction": reused / (prefilled + reused) if prefilled + reused else 0.0,
        }
        return out | {f"agent/stop/{reason}": sum(t.stop == reason for t in members) / n for reason in STOPS}

    # ---------------------------------------------------------------- evaluation, checkpoints

    def _evaluation_due(self, update: int) -> bool:
        ev = self.cfg.evaluation
        return bool(self.task.eval_scenarios) and ((update + 1) % ev.every_iterations == 0 or update + 1 == self.cfg.agent.updates)

    def _evaluate(self, update: int, metrics: MetricsSink) -> bool:
        """Environment reward of one trajectory per held-out scenario (fixed seeds); best
        checkpoint and patience. Returns True to stop early."""
        a = self.cfg.agent
        requests = [Request(s, i, 0, completion_seed(a.seed + 1, i, 0)) for i, s in enumerate(self.task.eval_scenarios)]
        trajectories = self.rollouts.collect(requests, {})
        rewards = [trajectory_reward(t) if not t.failed else 0.0 for t in trajectories]
        return self.held_out_reward(update, a.updates, rewards, metrics, {"eval/failed_fraction": float(np.mean([t.failed for t in trajectories]))})

    def _signature(self) -> dict:
        """common.signature plus what only this recipe has: [agent] and the tool definitions."""
        cfg = self.cfg
        data = {"agent.scenarios": cfg.agent.scenarios} | ({"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {})
        agent = {k: v for k, v in dataclasses.asdict(cfg.agent).items() if k != "scenarios"}
        tools = self.task.catalog.signature() if self.task.catalog else None
        return json.loads(json.dumps(signature(self.setup, data) | {"agent": agent, "tools": tools}, default=str))

    def _write_rollouts(self, f, update: int, trajectories: list[Trajectory]) -> None:
        observe = self.cfg.observe
        if observe and (update + 1) % observe.every:
            return
        cap = observe.max_text_chars if observe else 0
        for t in trajectories:
            f.write(json.dumps(trajectory_record(t, update, cap), ensure_ascii=False) + "\n")
        f.flush()


def trajectory_record(t: Trajectory, update: int, cap: int = 0) -> dict:
    """One line of rollouts.jsonl: every turn with its calls and observations, and the
    numbers behind its training: the token ids before and of the turn, the sampler's and
    torch's log-probs of each sampled token (README: rollouts.jsonl)."""
    turns, first = [], 0  # first: where the turn's tokens begin among the sampled ones
    for turn in t.turns:
        span, first = slice(first, first + turn.n_tokens), first + turn.n_tokens
        turns.append(
            {"assistant": cut_text(turn.text, cap), "finish": turn.finish, "tokens": turn.n_tokens,
             "calls": [{"name": c.name, "arguments": c.arguments, "observation": cut_text(c.content, cap),
                        "is_error": c.is_error, "reward": c.reward} for c in turn.calls]}
            | ({"error": turn.note} if turn.note else {})
            | {"prompt_ids": [*t.prompt, *t.tokens[: turn.start]], "completion_ids": t.tokens[turn.start: turn.start + turn.n_tokens],
               "sampler_logprobs": t.logprobs[span],
               "policy_logprobs": t.policy_logprobs[span] if t.policy_logprobs is not None else None}
        )
    return {
        "update": update + 1, "group": t.group, "member": t.member, "scenario": t.scenario.id, "source": t.scenario.source,
        "stop": t.stop, "truncated": t.truncated, "turns": turns, "tokens": len(t.tokens), "sampled_tokens": sum(t.mask),
        "terminal_reward": t.terminal_reward, "step_rewards": [r for _, r in t.step_rewards], "reward": t.reward,
        "advantage": t.advantage, "trained": t.live and t.skip_reason is None, "skip_reason": t.skip_reason,
    }
