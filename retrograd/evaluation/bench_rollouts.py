"""`retrograd bench` for rollout configs: the reward of sampled answers, base versus adapter.

GRPO: each held-out prompt ([evaluation].data, or --data) is answered `samples` times by
the llama.cpp sampler with the sampling settings of training ([grpo.sampling]) and scored
by the config's reward program or function. Agent GRPO: each held-out scenario runs
`samples` times through the multi-turn agent loop of training (its tools, sandbox and
limits), and verify gives the reward (plus any step rewards, as training's evaluation
counts them).

Base and adapter answer with the same seeds (the evaluation stream of training: seed + 1,
prompt index, sample index), and a completion is a function of its seed and context alone
(retrograd.sampler), so the comparison is paired: an adapter that changes nothing gets the
same answers and Δ = 0 exactly. The adapter goes to llama.cpp as it is; no torch model is
loaded, nothing is trained or written.

Success: for GRPO a completion whose reward reaches `success_at` (default SUCCESS_AT, the
usual "correct" of a 0/1 or graded reward; the reward protocol declares no maximum); for
agent GRPO a trajectory whose verify command passed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.config import Config
from retrograd.data import completion_seed, load_prompts
from retrograd.errors import ConfigError, DataError
from retrograd.evaluation.common import (
    BenchOptions,
    ItemRow,
    Row,
    Verdict,
    make_verdict,
    percent_change,
    resolve_adapter,
)
from retrograd.gguf.adapter import AdapterFile, read_fitting_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.recipes import agent_grpo, grpo, ppo
from retrograd.recipes.common import open_chat
from retrograd.rollouts.agent import AgentRollouts, Request, Trajectory, trajectory_reward
from retrograd.rollouts.judge import judge_group, make_judge
from retrograd.rollouts.rewards import make_reward
from retrograd.runtime.bundled import default_model_path
from retrograd.sampler import GroupRequest, Sampler, Sampling
from retrograd.training.report import Reporter
from retrograd.training.timeline import PhaseClock

DEFAULT_SAMPLES = 4  # completions per prompt
SUCCESS_AT = 1.0  # GRPO: the reward a completion must reach to count as a success
UNCHANGED_REWARD = 1e-9  # |Δ mean reward of a prompt| at or below this counts as unchanged
EXCERPT_CHARS = 48  # of a prompt, in the per-prompt table


@dataclass(frozen=True)
class Sample:
    """One completion (GRPO) or trajectory (agent GRPO), scored."""

    text: str
    tokens: int  # sampled tokens
    truncated: bool  # it hit max_new_tokens (agent: a truncating stop)
    reward: float
    success: bool
    failed: bool = False  # agent: its sandbox or a tool broke
    verdict: float | None = None  # GRPO with a judge: its verdict, base and adapter judged in one group


@dataclass(frozen=True)
class RolloutPass:
    """Every prompt's samples with the LoRA off (base) or on (adapter)."""

    samples: tuple[tuple[Sample, ...], ...]  # [prompt][sample]
    seconds: float

    @property
    def flat(self) -> list[Sample]:
        return [s for prompt in self.samples for s in prompt]

    @property
    def prompt_means(self) -> np.ndarray:
        return np.array([np.mean([s.reward for s in prompt]) for prompt in self.samples])  # [prompts]

    def mean_of(self, field: str) -> float:
        return float(np.mean([getattr(s, field) for s in self.flat]))

    @property
    def reward_std(self) -> float:
        return float(np.std([s.reward for s in self.flat]))  # population, over every completion

    @property
    def tokens_per_second(self) -> float:
        return sum(s.tokens for s in self.flat) / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class RolloutBench:
    algorithm: str  # ppo | grpo | agent_grpo
    data: Path
    adapter_path: Path | None  # None: the base alone was measured
    prompts: tuple[str, ...]  # the reward's prompt text, or the scenario id
    samples_per_prompt: int
    success: str  # how success is defined, for the table
    base: RolloutPass
    adapter: RolloutPass | None

    @property
    def unit(self) -> str:
        return "scenario" if self.algorithm == "agent_grpo" else "prompt"

    @property
    def item_label(self) -> str:
        return f"{self.unit} (mean reward)"

    def rows(self) -> list[Row]:
        def row(group: str, metric: str, of: Callable[[RolloutPass], float], digits: int, better: int = 0) -> Row:
            return Row(group, metric, of(self.base), None if self.adapter is None else of(self.adapter), digits, better)

        agent = self.algorithm == "agent_grpo"
        completions = "trajectories" if agent else "completions"
        failed = [row(completions, "failed (sandbox or tool broke)", lambda p: p.mean_of("failed"), 4, -1)] if agent else []
        judged = self.base.flat and self.base.flat[0].verdict is not None
        judge = [row("judge", "mean verdict (sides judged in one group)", lambda p: p.mean_of("verdict"), 4, 1)] if judged else []
        return [
            *judge,
            row("reward", "mean", lambda p: p.mean_of("reward"), 4, 1),
            row("reward", "stddev", lambda p: p.reward_std, 4),
            row("reward", f"success rate ({self.success})", lambda p: p.mean_of("success"), 4, 1),
            row(completions, "mean length (tokens)", lambda p: p.mean_of("tokens"), 1),
            row(completions, "truncated", lambda p: p.mean_of("truncated"), 4, -1),
            *failed,
            row("data", f"{self.unit}s", lambda p: len(p.samples), 0),
            row("data", f"samples / {self.unit} (paired seeds)", lambda p: self.samples_per_prompt, 0),
            row("performance", "sampled tokens/s", lambda p: p.tokens_per_second, 1),
        ]

    def verdict(self) -> Verdict | None:
        if self.adapter is None:
            return None
        deltas = self.adapter.prompt_means - self.base.prompt_means  # [prompts]
        overall = percent_change(self.base.mean_of("reward"), self.adapter.mean_of("reward"))
        return make_verdict(deltas, "mean reward", overall, UNCHANGED_REWARD, unit="", percent_of="reward", items=f"{self.unit}s")

    def items(self) -> list[ItemRow]:
        adapter = self.adapter.prompt_means if self.adapter is not None else [None] * len(self.prompts)
        return [ItemRow(excerpt(p), float(b), None if a is None else float(a))
                for p, b, a in zip(self.prompts, self.base.prompt_means, adapter)]


def excerpt(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= EXCERPT_CHARS else flat[: EXCERPT_CHARS - 1] + "…"


# ----------------------------------------------------------------------------- GRPO


def bench_prompts(cfg: Config, reporter: Reporter, options: BenchOptions) -> RolloutBench:
    """grpo and ppo: sampled answers to held-out prompts, scored by the run's reward (and judge)."""
    g, t = cfg.grpo or cfg.ppo, cfg.training
    judge = getattr(g, "judge", None)
    data_path = held_out_path(cfg, options, "prompts")
    adapter_path, adapter = _adapter(cfg, options, reporter)
    chat = open_chat(cfg)
    held_out = load_prompts(data_path, chat, max_tokens=t.ctx - g.sampling.max_new_tokens, evaluation=True)
    reporter.message(f"data: {held_out.description}")
    prompts = held_out[: options.limit]
    k = options.samples or DEFAULT_SAMPLES
    success_at = SUCCESS_AT if options.success_at is None else options.success_at
    sampling = Sampling(g.sampling.max_new_tokens, g.sampling.temperature, g.sampling.top_p)
    seeds = [[completion_seed(g.sampling.seed + 1, i, j) for j in range(k)] for i in range(len(prompts))]
    reporter.message(f"bench: {len(prompts)} prompt(s) from {data_path}, {k} sample(s) each, "
                     f"temperature {sampling.temperature:g}, top_p {sampling.top_p:g}, max_new_tokens {sampling.max_new_tokens}")
    reward = make_reward(command=g.reward_command, mode=g.reward_mode, timeout_seconds=g.reward_timeout_seconds, function=g.reward_function)
    sampler_opts = (grpo if cfg.grpo else ppo).sampler_options(cfg)
    with reward, Sampler(_model_path(cfg), sampler_opts) as sampler:
        eog = sampler.eog_ids

        def answer(chunk: range) -> list[list[Sample]]:
            completions = [c for group in sampler.generate([GroupRequest(prompts[i].ids, seeds[i], sampling) for i in chunk]) for c in group]
            texts = [chat.tokenizer.decode([tok for tok in c.tokens if tok not in eog], special=False) for c in completions]
            rewards = reward.score([prompts[i].text for i in chunk for _ in range(k)], texts,
                                   [prompts[i].reference for i in chunk for _ in range(k)])
            flat = [Sample(x, len(c.tokens), c.finish == "length", r, r >= success_at) for x, c, r in zip(texts, completions, rewards)]
            return [flat[n * k:(n + 1) * k] for n in range(len(chunk))]

        base, tuned = _passes(sampler, adapter, len(prompts), max(1, sampler_opts.n_seq_max // k), answer, reporter, "prompts")
    if judge is not None:
        base, tuned = _judged(judge, prompts, base, tuned, reporter)
    return RolloutBench(cfg.run.algorithm, data_path, adapter_path, tuple(p.text for p in prompts), k, f"reward ≥ {success_at:g}", base, tuned)


def _judged(section, prompts, base: RolloutPass, tuned: RolloutPass | None, reporter: Reporter):
    """Both passes with the judge's verdicts: each prompt's base and adapter samples are judged
    together, as one group, so that the verdicts (relative within a group) compare the sides."""
    reporter.message(f"judge: {section.type} verdicts on {len(prompts)} prompt(s), base and adapter samples together")
    sides = [base] + ([tuned] if tuned is not None else [])
    with make_judge(section) as judge, ThreadPoolExecutor(section.max_concurrency) as pool:
        def one(i: int) -> list[float]:
            texts = [s.text for side in sides for s in side.samples[i]]
            return judge_group(judge, prompts[i].text, texts, prompts[i].rubric)

        verdicts = list(pool.map(one, range(len(prompts))))
    k = len(base.samples[0]) if base.samples else 0
    out = [RolloutPass(tuple(tuple(dataclasses.replace(s, verdict=v[n * k + j]) for j, s in enumerate(side.samples[i]))
                             for i, v in enumerate(verdicts)), side.seconds)
           for n, side in enumerate(sides)]
    return out[0], out[1] if tuned is not None else None


# ----------------------------------------------------------------------------- agent GRPO


def bench_agent_grpo(cfg: Config, reporter: Reporter, options: BenchOptions) -> RolloutBench:
    """The held-out scenarios stand in for the training ones (so every one needs verify, as
    in training's evaluation), checked and given a sandbox pool by the recipe's own open_task."""
    a = cfg.agent
    if options.success_at is not None:
        raise ConfigError(f"--success-at {options.success_at:g}: an agent_grpo trajectory succeeds when its verify command passes")
    data_path = held_out_path(cfg, options, "scenarios")
    adapter_path, adapter = _adapter(cfg, options, reporter)
    held_out = dataclasses.replace(cfg, agent=dataclasses.replace(a, scenarios=data_path, judge=None), evaluation=None)
    k = options.samples or DEFAULT_SAMPLES
    task = agent_grpo.open_task(held_out, reporter)
    try:
        scenarios = task.scenarios[: options.limit]
        limits = task.limits
        reporter.message(f"bench: {len(scenarios)} scenario(s) from {data_path}, {k} sample(s) each, temperature "
                         f"{limits.temperature:g}, top_p {limits.top_p:g}, max_turns {limits.max_turns}, "
                         f"environment {task.options.type if task.options else 'none'}")
        sampler_opts = agent_grpo.sampler_options(cfg)
        with Sampler(_model_path(cfg), sampler_opts) as sampler:
            rollouts = AgentRollouts(sampler, task.chat, task.pool, task.options, limits, concurrency=sampler_opts.n_seq_max)

            def run(chunk: range) -> list[list[Sample]]:
                requests = [Request(scenarios[i], i, j, completion_seed(a.seed + 1, i, j)) for i in chunk for j in range(k)]
                trajectories = rollouts.collect(requests, PhaseClock())
                return [[_verified(t) for t in trajectories[n * k:(n + 1) * k]] for n in range(len(chunk))]

            base, tuned = _passes(sampler, adapter, len(scenarios), max(1, rollouts.concurrency // k), run, reporter, "scenarios")
    finally:
        task.close()
    return RolloutBench("agent_grpo", data_path, adapter_path, tuple(s.id for s in scenarios), k, "verify passed", base, tuned)


def _verified(t: Trajectory) -> Sample:
    """Reward as training's evaluation counts it (0 for a broken sandbox); success when
    verify passed, i.e. gave its reward_on_success rather than 0."""
    passed = not t.failed and t.terminal_reward is not None and t.terminal_reward != 0.0
    return Sample(t.completion, sum(t.mask), t.truncated, 0.0 if t.failed else trajectory_reward(t), passed, t.failed)


# ----------------------------------------------------------------------------- shared


def _passes(
    sampler: Sampler,
    adapter: AdapterFile | None,
    n: int,
    per_call: int,
    answer: Callable[[range], list[list[Sample]]],
    reporter: Reporter,
    unit: str,
) -> tuple[RolloutPass, RolloutPass | None]:
    """The base pass, then the adapter's, over prompts 0..n-1 in calls of `per_call` prompts
    (what the sampler decodes together), with a progress bar over prompts."""
    sides: list[tuple[str, AdapterFile | None]] = [("base", None)] + ([("adapter", adapter)] if adapter is not None else [])
    passes: list[RolloutPass] = []
    reporter.start(len(sides) * n, ["model", unit, "reward", "success", "seconds"], unit)
    try:
        for name, side in sides:
            sampler.set_adapter(None if side is None else side.tensors, alpha=None if side is None else side.alpha)
            t0 = time.perf_counter()
            samples: list[list[Sample]] = []
            for start in range(0, n, per_call):
                samples += answer(range(start, min(start + per_call, n)))
                reporter.advance(len(passes) * n + len(samples), name)
            done = RolloutPass(tuple(map(tuple, samples)), time.perf_counter() - t0)
            passes.append(done)
            reporter.row({"model": name, unit: n, "reward": done.mean_of("reward"), "success": done.mean_of("success"),
                          "seconds": done.seconds})
    finally:
        reporter.finish()
    return passes[0], passes[1] if len(passes) > 1 else None


def held_out_path(cfg: Config, options: BenchOptions, what: str) -> Path:
    """--data, else [evaluation].data; never the training data (a reward measured on what
    was trained on says little)."""
    if options.data is not None:
        path, origin = Path(options.data).resolve(), "--data"
    elif cfg.evaluation is not None:
        path, origin = cfg.evaluation.data, "evaluation.data"
    else:
        raise DataError(f"{cfg.path}: no held-out {what} to bench on: the config has no [evaluation] data; pass --data FILE")
    if not path.is_file():
        raise DataError(f"{origin} {path}: no such file")
    return path


def _model_path(cfg: Config) -> Path:
    return cfg.model.path or default_model_path()


def _adapter(cfg: Config, options: BenchOptions, reporter: Reporter) -> tuple[Path | None, AdapterFile | None]:
    """The adapter to measure, read and checked against the base GGUF before anything loads."""
    path = resolve_adapter(cfg, options)
    if path is None:
        reporter.message(f"no adapter at {cfg.output.adapter_path}: measuring the base model alone")
        return None, None
    loaded = read_fitting_adapter(path, GGUFFile(_model_path(cfg)))
    reporter.message(f"adapter {path}: {len(loaded.tensors)} weights, rank {loaded.rank}, alpha {loaded.alpha:g}")
    return path, loaded


ROLLOUT_BENCHES: dict[str, Callable[[Config, Reporter, BenchOptions], RolloutBench]] = {
    "ppo": bench_prompts, "grpo": bench_prompts, "agent_grpo": bench_agent_grpo,
}
