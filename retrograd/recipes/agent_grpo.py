"""Agentic GRPO: multi-turn, tool-using trajectories in sandboxes, as the functions the
rollout loop runs.

Per update (retrograd notes §4.6, §5):
1. `produce`: scenarios_per_update scenarios, round robin from the update index,
   group_size trajectories each, with seeds derived from (seed, position, member); the
   rollout engine (retrograd.rollouts.agent) runs them in lockstep on the llama.cpp
   sampler, each in its own sandbox leased from the pool, turn by turn, extending the KV
   cache between turns; verify gives the terminal reward, json tools step rewards; the
   pool pre-warms sandboxes for the next update; scenarios without verify are scored by
   the [agent.judge] (a command or an LLM), per group; with truncation = "min_reward" a truncated member
   ends with the group's lowest complete reward;
2. `plan`: failed trajectories (a broken sandbox), truncated ones (truncation = "drop", or
   no complete member to take a reward from) and unscored ones leave their group. More
   dropped than max_dropped_fraction stops the run; an update without any group of two
   usable trajectories stops it too, unless skip_empty_updates; group advantages as in
   GRPO, plus each trajectory's intermediate returns of its step rewards;
3. the loop's policy update: epochs_per_update passes of the shared policy optimizer train
   the sampled tokens only, with the loss denominator min(max_turns x
   max_new_tokens_per_turn, max_trajectory_tokens); then llama.cpp gets the new adapter.
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
from retrograd.objectives.advantages import baseline_name, group_advantages
from retrograd.objectives.policy import PolicyLossOptions
from retrograd.recipes.common import Setup, open_chat, prepare, rollout_sampler_options, signature
from retrograd.rollouts.agent import (
    STOPS,
    AgentRollouts,
    Request,
    RolloutLimits,
    Trajectory,
    checked_prompt,
    trajectory_reward,
)
from retrograd.rollouts.http_env import HttpEnvironment, HttpEnvironmentOptions
from retrograd.rollouts.judge import RulerJudge, judge_group, make_judge
from retrograd.rollouts.mcp_tools import McpServerOptions, McpServers, server_options
from retrograd.rollouts.rewards import Reward, RewardError
from retrograd.rollouts.sandbox import EnvironmentOptions, SandboxPool, open_environment
from retrograd.rollouts.scenarios import Scenario, load_scenarios
from retrograd.rollouts.tools import ToolCatalog
from retrograd.runtime.memory import rss_bytes
from retrograd.sampler import Sampler, SamplerOptions
from retrograd.training.distributed import launched_as_rank_zero
from retrograd.training.report import Reporter
from retrograd.training.rollout_loop import (
    RolloutResult,
    Trainer,
    cut_text,
    make_policy,
    on_rank_zero,
    reward_evaluation,
    run_rollouts,
)
from retrograd.training.rollout_recipe import Batch, Decision, Evaluation, RolloutRecipe, TrainPlan
from retrograd.training.rollout_step import TrainSample
from retrograd.training.scoring import Rollout
from retrograd.training.timeline import PhaseClock

PHASES = ("environment", "generation", "tools", "reward", "judge", "behavior_scoring", "reference", "optimizer",
          "adapter_refresh")
DEFAULT_TOOLS = {"default": "python"}  # when [agent.environment] has no tools table
DROPPED = ("truncated", "failed", "unscored")  # skip reasons that take a trajectory out of its group


@dataclass(frozen=True)
class ScoredTrajectory:
    """A finished trajectory (with the judge's verdict as its terminal reward where a judge
    scored it) and the reward it ends with: terminal plus step rewards, or, truncated with
    truncation = "min_reward", the lowest complete reward of its group."""

    trajectory: Trajectory
    reward: float
    degenerate: bool = False  # its group's judge scores are all equal and agent.drop_degenerate_groups drops it

    @property
    def truncated(self) -> bool:
        return self.trajectory.truncated


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
    judge: Reward | RulerJudge | None
    pool: SandboxPool | None = None
    http: HttpEnvironment | None = None  # [agent.environment] type = "http": its client
    mcp: McpServers | None = None  # [[agent.mcp_servers]], agent.mcp_config

    def close(self) -> None:
        for part in (self.pool, self.judge, self.http, self.mcp):
            if part is not None:
                part.close()

    @property
    def environment(self) -> str:
        kind = self.options.type if self.options else "http" if self.http else "none (judge only)"
        return kind + (f" + {len(self.mcp.servers)} mcp server(s)" if self.mcp else "")


@dataclass(frozen=True)
class ToolOptions:
    """Where a run's tools come from, checked, nothing connected yet: the environment's own
    toolsets, an http environment (its server lists its tools) and the mcp servers."""

    environment: EnvironmentOptions | None
    catalog: ToolCatalog | None  # the environment's toolsets
    http: HttpEnvironmentOptions | None
    servers: tuple[McpServerOptions, ...]

    @classmethod
    def from_config(cls, cfg: Config) -> ToolOptions:
        a = cfg.agent
        http = a.environment.get("type") == "http"
        environment = EnvironmentOptions.from_table(a.environment) if a.environment and not http else None
        catalog = ToolCatalog.from_table(a.environment.get("tools", DEFAULT_TOOLS), cfg.path.parent) if environment else None
        return cls(environment, catalog, HttpEnvironmentOptions.from_table(a.environment) if http else None,
                   server_options(a.mcp_servers, a.mcp_config, cfg.path.parent, environment=bool(a.environment)))

    def connect(self, reporter: Reporter) -> tuple[ToolCatalog | None, HttpEnvironment | None, McpServers | None]:
        """The whole catalogue, with the clients of the servers it connected to (the caller
        closes them); `reporter` hears of servers left out (required = false)."""
        catalog, http, mcp = self.catalog, None, None
        try:
            if self.http is not None:
                http = HttpEnvironment(self.http)
                catalog = ToolCatalog.of("http", http.tools)
            if self.servers:
                mcp = McpServers(self.servers)
                for line in mcp.left_out:
                    reporter.message(f"note: {line}")
                catalog = catalog.with_tools(mcp.tools, "agent.mcp_servers") if catalog else ToolCatalog.of("mcp", mcp.tools)
        except BaseException:
            for client in (http, mcp):
                if client is not None:
                    client.close()
            raise
        return catalog, http, mcp


def open_task(cfg: Config, reporter: Reporter) -> AgentTask:
    """Checks every input the run depends on, cheapest first: the options, then the servers
    whose tools the prompts show (an http environment's tool list, the mcp servers, started
    once for the run; `reporter` hears of those left out), the scenarios, and opens the sandbox
    pool last (it checks the daemon and the image, or bubblewrap, and reaps dead runs' leftovers)."""
    a = cfg.agent
    base = open_chat(cfg)
    chat = ChatFormat(base.tokenizer, base.source, variables=a.template_variables, origin=base.origin)
    chat.require_template(a.scenarios)
    limits = RolloutLimits.from_agent(a, cfg.training.ctx)
    tools = ToolOptions.from_config(cfg)
    options, http = tools.environment, tools.http is not None
    task = AgentTask(chat, limits, tools.catalog, options, (), (), None)
    try:
        task.catalog, task.http, task.mcp = tools.connect(reporter)
        catalog = task.catalog
        # scenarios without verify are scored by the judge, or by an http environment's step rewards
        scored = a.judge is not None or http
        task.scenarios = load_scenarios(a.scenarios, catalog, judged=scored, system_suffix=a.system_suffix,
                                        sandboxed=options is not None)
        if cfg.evaluation is not None:  # environment reward only, so every held-out scenario needs verify (or http)
            task.eval_scenarios = evenly_spaced(
                load_scenarios(cfg.evaluation.data, catalog, judged=http, system_suffix=a.system_suffix,
                               sandboxed=options is not None), cfg.evaluation.max_examples
            )
        for scenario in task.scenarios + task.eval_scenarios:
            checked_prompt(chat, scenario, limits)
        task.judge = make_judge(a.judge) if a.judge is not None else None
        if options is not None and launched_as_rank_zero():  # torchrun: the other ranks never run a tool
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
    task = open_task(cfg, reporter)
    try:
        setup = prepare(cfg, reporter, task.chat)
        options = sampler_options(cfg)
        setup.model.transformer.use_context(options.n_ctx)  # phi3's RoPE factors as the sampler's context picks them
        t0, r0 = time.perf_counter(), rss_bytes()
        with on_rank_zero(setup.device, lambda: Sampler(setup.model.path, options)) as sampler:
            if sampler is not None:  # None: a torchrun rank that only trains
                reporter.message(f"sampler: llama.cpp on {sampler.placement.describe()}")
            init = setup.timings | {"llama.cpp sampler": (time.perf_counter() - t0, rss_bytes() - r0)}
            return train(cfg, setup, sampler, task, reporter, resume=resume, init_timing=init, baseline_rss=baseline_rss)
    finally:
        task.close()


def train(cfg: Config, setup: Setup, sampler, task: AgentTask, reporter: Reporter, *, resume: Path | bool | None = None,
          init_timing: dict | None = None, baseline_rss: int = 0) -> RolloutResult:
    """The run on a given sampler: llama.cpp's in `run`, a scripted policy in the tests."""
    a = cfg.agent
    loss_options = PolicyLossOptions(
        clip_range_low=a.clip_range_low, clip_range_high=a.clip_range_high, loss_normalization=a.loss_normalization,
        tis_cap=a.tis_cap,
    )
    policy = make_policy(cfg, setup, loss_options, updates=a.updates, steps_per_update=a.epochs_per_update * a.minibatches,
                         temperature=a.temperature, reporter=reporter)
    recipe = AgentRecipe(cfg, sampler, task, reporter)
    trainer = Trainer(setup, sampler, policy, reporter, _signature(cfg, setup, task), init_timing or {}, baseline_rss)
    return run_rollouts(cfg, recipe.recipe(), trainer, resume)


def _signature(cfg: Config, setup: Setup, task: AgentTask) -> dict:
    """common.signature plus what only this recipe has: [agent] and the tool definitions."""
    data = {"agent.scenarios": cfg.agent.scenarios} | ({"evaluation.data": cfg.evaluation.data} if cfg.evaluation else {})
    agent = {k: v for k, v in dataclasses.asdict(cfg.agent).items()  # collect_api is collect's, not training's;
             if k not in ("scenarios", "collect_api") and not (k == "tis_cap" and v is None)}  # tis_cap unset: signed as before it existed
    tools = task.catalog.signature() if task.catalog else None
    return json.loads(json.dumps(signature(setup, data) | {"agent": agent, "tools": tools}, default=str))


# ---------------------------------------------------------------- what the loop runs


class AgentRecipe:
    """What agentic GRPO hands the rollout loop: collecting and scoring trajectories, their
    liveness and advantages, and the failure policy."""

    def __init__(self, cfg: Config, sampler, task: AgentTask, reporter: Reporter, engine: type[AgentRollouts] = AgentRollouts):
        """`engine` runs the episodes on `sampler` (collect --api: rollouts.api_agent's, on an endpoint)."""
        self.a, self.task, self.reporter = cfg.agent, task, reporter
        self.rollouts = engine(sampler, task.chat, task.pool, task.options, task.limits,
                               concurrency=sampler_options(cfg).n_seq_max, http=task.http)

    def recipe(self) -> RolloutRecipe:
        a, task = self.a, self.task
        return RolloutRecipe(
            name="agent_grpo",
            plan_line=(f"updates={a.updates}, epochs_per_update={a.epochs_per_update}, scenarios={len(task.scenarios)}, "
                       f"scenarios_per_update={a.scenarios_per_update}, group_size={a.group_size}, max_turns={a.max_turns}, "
                       f"environment={task.environment}"),
            updates=a.updates, epochs_label="agent_epochs_per_update", epochs=a.epochs_per_update, minibatches=a.minibatches,
            budget_tokens=task.limits.budget_tokens, phases=PHASES,
            columns=("loss", "reward", "turns", "calls", "trunc", "kl", "tok/s"), loss_key="policy/total_loss",
            produce=self.produce, plan=self.plan, record=trajectory_record, row=self.row,
            status=lambda m: f"reward={m['reward/mean']:.3f}",
            evaluate=self.evaluate if task.eval_scenarios else None,
        )

    # ---------------------------------------------------------------- producing trajectories

    def produce(self, update: int, cursor: int, clock: PhaseClock) -> Batch:
        """scenarios_per_update groups, collected, judged and given the reward each ends with.
        The scenarios follow from the update index alone (as in checkpoints written before the
        data cursor existed), so `cursor` is always update × scenarios_per_update here."""
        a = self.a
        cursor = update * a.scenarios_per_update
        t0 = time.perf_counter()
        trajectories = self.rollouts.collect(self._requests(cursor), clock)
        rollout_seconds = time.perf_counter() - t0
        if self.task.pool is not None:
            self.task.pool.prewarm()  # the next update's sandboxes start while the optimizer runs
        groups = [trajectories[i:i + a.group_size] for i in range(0, len(trajectories), a.group_size)]
        scored, judge_metrics = self.score(groups, clock)
        metrics = _rollout_metrics(trajectories) | judge_metrics | {"timing/rollout_seconds": rollout_seconds}
        if self.task.pool is not None:
            metrics |= self.task.pool.metrics(reset=True)
        if isinstance(self.task.judge, RulerJudge):
            metrics |= self.task.judge.metrics()
        return Batch(update, tuple(scored), cursor + a.scenarios_per_update, metrics)

    def score(self, groups: list[list[Trajectory]], clock: PhaseClock) -> tuple[list[ScoredTrajectory], dict]:
        """Every member with the reward it ends with (the judge scores groups without verify,
        an http environment's step rewards are its score), and the judge/* metrics: how many
        groups the judge scored, the share it left unscored and the share it scored alike
        (`retrograd collect` scores its groups this way)."""
        judged = dropped = degenerate = 0
        scored = []
        for group in groups:
            alike = False
            if not group[0].scenario.verifiable and self.task.judge is not None:
                group, kept = self._judged(group, clock)
                judged += 1
                dropped += not kept
                verdicts = [t.terminal_reward for t in group if _complete(t)]
                alike = kept and len(verdicts) >= 2 and len(set(verdicts)) == 1
                degenerate += alike
            elif self.task.http is not None:  # the environment scored it, step by step
                group = [t if t.failed else dataclasses.replace(t, terminal_reward=0.0) for t in group]
            scored += _scored(group, self.a.truncation, alike and self.a.drop_degenerate_groups)
        share = (lambda n: n / judged) if judged else (lambda n: 0.0)
        return scored, {"judge/groups": float(judged), "judge/dropped_group_fraction": share(dropped),
                        "judge/degenerate_group_fraction": share(degenerate)}

    def _requests(self, cursor: int) -> list[Request]:
        a = self.a
        requests = []
        for k in range(a.scenarios_per_update):
            position = cursor + k
            scenario = self.task.scenarios[position % len(self.task.scenarios)]
            requests += [Request(scenario, k, j, completion_seed(a.seed, position, j)) for j in range(a.group_size)]
        return requests

    def _judged(self, group: list[Trajectory], clock: PhaseClock) -> tuple[list[Trajectory], bool]:
        """The group with the judge's verdict as the terminal reward of every complete member;
        False when the judge failed and judge_failure = "drop_group" left the group unscored."""
        members = [k for k, t in enumerate(group) if not t.failed and not t.truncated]
        if not members:
            return group, True
        scenario = group[0].scenario
        prompt = "\n".join(m["content"] for m in scenario.messages())
        with clock.phase("judge"):
            try:
                verdicts = judge_group(self.task.judge, prompt, [group[k].transcript for k in members], scenario.rubric)
            except RewardError as error:
                if self.a.judge_failure == "fail":
                    raise RewardError(f"[agent.judge] on scenario {scenario.id!r}: {error}") from None
                self.reporter.message(f"judge failed on scenario {scenario.id!r}; its group is dropped: {error}")
                return group, False
        verdict = dict(zip(members, verdicts))
        return [dataclasses.replace(t, terminal_reward=verdict[k]) if k in verdict else t for k, t in enumerate(group)], True

    # ---------------------------------------------------------------- training samples

    def plan(self, batch: Batch, state: dict, clock: PhaseClock) -> TrainPlan:
        """Who stays in its group, group advantages with the step rewards' returns per token,
        and the failure policy."""
        a, update = self.a, batch.update
        groups = [batch.rollouts[i:i + a.group_size] for i in range(0, len(batch.rollouts), a.group_size)]
        skips = [[_dropped(s, group, a.truncation) for s in group] for group in groups]
        live = torch.tensor([[skip is None for skip in group] for group in skips])  # [groups, G]
        rewards = torch.tensor([[s.reward for s in group] for group in groups], dtype=torch.float64)  # [groups, G]
        adv = group_advantages(rewards, live, baseline=baseline_name(a.baseline), scale_rewards=a.scale_rewards)
        decisions, samples, trained = [], [], []
        prompts: dict[tuple[int, tuple[int, ...]], int] = {}  # members share a prompt unless an http reset's observation differs
        for i, group in enumerate(groups):
            for j, s in enumerate(group):
                advantage, skip = float(adv.advantages[i, j]), skips[i][j]
                if skip is None and group[0].degenerate:
                    skip = "degenerate_judge"
                elif skip is None and bool(adv.dead[i]):
                    skip = "zero_signal"
                decisions.append(Decision(advantage, skip is None, skip))
                if skip is None:
                    t = s.trajectory
                    packing = prompts.setdefault((t.group, t.prompt), len(prompts))
                    samples.append(TrainSample(Rollout(packing, t.prompt, t.tokens, t.mask), t.token_advantages(advantage),
                                               torch.tensor(t.logprobs)))
                    trained.append(len(decisions) - 1)
        n = len(decisions)
        lost = [d.skip_reason for d in decisions if d.skip_reason in DROPPED]
        metrics = adv.diagnostics | {
            "agent/unscored_fraction": lost.count("unscored") / n,
            "agent/lost_fraction": len(lost) / n,
        }
        fail = note = None
        if len(lost) / n > a.max_dropped_fraction:
            kinds = ", ".join(f"{lost.count(kind)} {kind}" for kind in DROPPED)
            fail = (f"update {update + 1}: {len(lost)} of {n} trajectories dropped ({kinds}), more than "
                    f"agent.max_dropped_fraction = {a.max_dropped_fraction}; raise max_turns / max_new_tokens_per_turn, "
                    "set truncation = \"min_reward\", or raise the fraction")
        elif not bool((live.sum(-1) >= 2).any()):
            if a.skip_empty_updates:
                note = "no group has two usable trajectories; skipped (skip_empty_updates)"
            else:
                fail = (f"update {update + 1}: no group has two usable trajectories, so there is no baseline; "
                        "set agent.skip_empty_updates = true to skip such updates")
        else:
            alike = any(group[0].degenerate for group in groups)
            note = f"no group has different rewards{', or the judge scored it alike (drop_degenerate_groups)' * alike}; nothing to train"
        discarded = sum(bool(adv.dead[i]) or group[0].degenerate for i, group in enumerate(groups))
        return TrainPlan(tuple(samples), tuple(trained), tuple(decisions), metrics, beta=a.kl_coefficient,
                         discarded_groups=discarded, note=note, fail=fail)

    # ---------------------------------------------------------------- reporting, evaluation

    def row(self, m: dict) -> dict:
        return {"loss": m.get("policy/total_loss"), "reward": m["reward/mean"], "turns": m["agent/turns_per_traj_mean"],
                "calls": m["agent/tool_calls_per_turn"], "trunc": m["agent/truncated_fraction"], "kl": m.get("policy/kl"),
                "tok/s": m["train/tokens_per_second"]}

    def evaluate(self, update: int) -> Evaluation:
        """Environment reward of one trajectory per held-out scenario (fixed seeds)."""
        a = self.a
        requests = [Request(s, i, 0, completion_seed(a.seed + 1, i, 0)) for i, s in enumerate(self.task.eval_scenarios)]
        trajectories = self.rollouts.collect(requests, PhaseClock())
        rewards = [trajectory_reward(t) if not t.failed else 0.0 for t in trajectories]
        return reward_evaluation(update, a.updates, rewards, {"eval/failed_fraction": float(np.mean([t.failed for t in trajectories]))})


def _complete(t: Trajectory) -> bool:
    """Scored and ended on its own: what a truncated member may take its reward from."""
    return t.terminal_reward is not None and not t.truncated and not t.failed


def _scored(group: list[Trajectory], truncation: str, degenerate: bool = False) -> list[ScoredTrajectory]:
    """Each member's reward: terminal plus step rewards; with truncation = "min_reward" a
    truncated member gets the group's lowest complete reward (when it has one)."""
    complete = [trajectory_reward(t) for t in group if _complete(t)]
    substitute = truncation == "min_reward" and bool(complete)
    return [ScoredTrajectory(t, min(complete) if t.truncated and substitute else trajectory_reward(t), degenerate) for t in group]


def _dropped(s: ScoredTrajectory, group: list[ScoredTrajectory], truncation: str) -> str | None:
    """Why a member leaves its group (failed, truncated, unscored), or None when it stays."""
    t = s.trajectory
    if t.failed:
        return "failed"
    if t.truncated:
        return None if truncation == "min_reward" and any(_complete(m.trajectory) for m in group) else "truncated"
    return "unscored" if t.terminal_reward is None else None


def _rollout_metrics(members: list[Trajectory]) -> dict:
    """agent/* and generation/* of notes §5: failed_tool counts trajectories lost to a broken
    sandbox or tool, failed_policy those cut by max_failed_turns (also truncations),
    failed_fraction both; agent/stop/* why each trajectory ended. (unscored_fraction and
    lost_fraction are the plan's: what left training.)"""
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


def trajectory_record(s: ScoredTrajectory, decision: Decision, policy_logprobs: list | None, update: int, cap: int = 0) -> dict:
    """One line of rollouts.jsonl: every turn with its calls and observations, and the
    numbers behind its training: the token ids before and of the turn, the sampler's and
    torch's log-probs of each sampled token (README: rollouts.jsonl)."""
    t = s.trajectory
    turns, first = [], 0  # first: where the turn's tokens begin among the sampled ones
    for turn in t.turns:
        span, first = slice(first, first + turn.n_tokens), first + turn.n_tokens
        turns.append(
            {"assistant": cut_text(turn.text, cap), "finish": turn.finish, "tokens": turn.n_tokens,
             "calls": [{"name": c.name, "arguments": c.arguments, "observation": cut_text(c.content, cap),
                        "is_error": c.is_error, "reward": c.reward} for c in turn.calls]}
            | ({"error": turn.note} if turn.note else {})
            | {"prompt_ids": [*t.prompt, *t.tokens[: turn.start]],
               "completion_ids": list(t.tokens[turn.start: turn.start + turn.n_tokens]),
               "sampler_logprobs": list(t.logprobs[span]),
               "policy_logprobs": policy_logprobs[span] if policy_logprobs is not None else None}
        )
    return {
        "update": update + 1, "group": t.group, "member": t.member, "scenario": t.scenario.id, "source": t.scenario.source,
        "stop": t.stop, "cause": t.cause, "truncated": t.truncated, "state": t.state, "turns": turns, "tokens": len(t.tokens), "sampled_tokens": sum(t.mask),
        "terminal_reward": t.terminal_reward, "step_rewards": [r for _, r in t.step_rewards], "reward": s.reward,
        "advantage": decision.advantage, "trained": decision.trained, "skip_reason": decision.skip_reason,
    }
