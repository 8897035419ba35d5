"""`retrograd collect`: an agent_grpo config's scenarios rolled out without training, the
good trajectories written as SFT tool records (or, with `pairs`, as preference pairs), the
warm start of notes "Warm start": collect -> SFT -> agent_grpo with lora.init_adapter.

Sampling is training's: the task opened by agent_grpo.open_task, its rollout engine on the
llama.cpp sampler (the base model, plus lora.init_adapter or --adapter), scored by
AgentRecipe.score (verify, an http environment's step rewards, the judge). Scenario i runs
`k` times with seeds seed + i*k + j.

Each record is the conversation the policy saw: the scenario's messages, every assistant
turn, and every observation as a `tool` message. A turn is written in one of two forms:
- raw (the default for the local model): the text it sampled (`"raw": true`, so its
  <tool_call> blocks are the calls). SFT must teach exactly what the policy did, so each
  record is encoded by the SFT loader's own code (data.sft.chat_example) and compared with
  the rollout's tokens and mask; one that differs (a tokenization the tokenizer would not
  produce, a turn the template renders differently) is dropped as `not_reproducible`.
- structured (`--structured`, and always with `--api`): its words as `content` and its calls
  as `tool_calls`, which any model's template renders its own way, so a student of another
  family can learn from it; one the SFT loader refuses is dropped as `not_loadable`.

With `api`, the policy is `[agent.collect_api]`'s OpenAI-compatible endpoint instead of the
local model (rollouts.api_agent): the same episodes, tools and scoring.

Every trajectory that is not written is counted under one cause: failed and truncated (with
their stop reason), unscored (the judge failed), malformed_call, turn_cut (a turn that hit
max_new_tokens_per_turn), not_verified (with require_verified), not_successful or
below_min_reward, duplicate (the same record as one kept), over_keep, not_reproducible (raw)
or not_loadable and over_max_trajectory_tokens (structured). A failed cause's first reason (the
sandbox's, the endpoint's error) is printed with the counts.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from retrograd.config import Config
from retrograd.data.sft import chat_example
from retrograd.data.shapes import Chat
from retrograd.data.tools import ERROR_PREFIX, ToolCall, assistant_message, text_around_calls
from retrograd.errors import DataError
from retrograd.evaluation.collect_request import CollectOptions, check_request
from retrograd.gguf.adapter import read_fitting_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.recipes.agent_grpo import AgentRecipe, AgentTask, ScoredTrajectory, open_task, sampler_options
from retrograd.rollouts.agent import NO_CALL, AgentRollouts, Request, Trajectory
from retrograd.rollouts.api_agent import NO_STRUCTURED_CALL, EndpointPolicy, EndpointRollouts
from retrograd.runtime.bundled import default_model_path
from retrograd.sampler import Sampler
from retrograd.training.report import Reporter
from retrograd.training.timeline import PhaseClock

SUCCESS_REWARD = 1.0  # without min_reward a trace is kept when verify passed or its reward reaches this
NOT_A_CALL = (ERROR_PREFIX + NO_CALL, ERROR_PREFIX + NO_STRUCTURED_CALL)  # notes of a turn without a call: not malformed
DEFAULT_MIN_GAP = 0.5


@dataclass(frozen=True)
class ScenarioReport:
    id: str
    attempts: int
    passes: int
    kept: int

    @property
    def pass_rate(self) -> float:
        return self.passes / self.attempts


@dataclass(frozen=True)
class CollectResult:
    out: Path
    written: int  # records, or pairs
    pairs: bool
    scenarios: tuple[ScenarioReport, ...]
    dropped: dict[str, int]  # traces (and, with pairs, scenarios without a pair) by cause
    reasons: dict[str, str]  # a failed cause's first recorded reason (a broken sandbox's, endpoint's)

    def report(self) -> dict:
        return {"out": str(self.out), "pairs" if self.pairs else "records": self.written, "dropped": self.dropped,
                "scenarios": [{"id": s.id, "attempts": s.attempts, "passes": s.passes, "kept": s.kept,
                               "pass_rate": s.pass_rate} for s in self.scenarios]}

    def summary(self) -> list[str]:
        attempts = sum(s.attempts for s in self.scenarios)
        what = "preference pair(s)" if self.pairs else "trace(s)"
        causes = ", ".join(f"{cause} {n}" for cause, n in sorted(self.dropped.items(), key=lambda kv: (-kv[1], kv[0])))
        return [f"kept {self.written} {what} from {attempts} trajectories of {len(self.scenarios)} scenario(s) -> {self.out}",
                f"dropped: {causes or 'none'}", *(f"  {cause}, first: {reason}" for cause, reason in sorted(self.reasons.items()))]


@dataclass(frozen=True)
class Kept:
    """A trace that passed every filter, and its SFT record."""

    scored: ScoredTrajectory
    record: dict


def collect(cfg: Config, options: CollectOptions, reporter: Reporter) -> CollectResult:
    """Opens the task and the llama.cpp sampler (with the adapter, when there is one), or the
    endpoint with `api`, and collects."""
    check_request(cfg, options)
    model = cfg.model.path or default_model_path()
    adapter_path = None if options.api else options.adapter or cfg.lora.init_adapter
    adapter = read_fitting_adapter(Path(adapter_path), GGUFFile(model)) if adapter_path else None
    task = open_task(cfg, reporter)
    try:
        if options.api:
            with EndpointPolicy(cfg.agent.collect_api) as policy:
                reporter.message(f"policy: {policy.describe()}; records are structured, tokenized with the model's template")
                return collect_with(cfg, options, task, policy, reporter)
        with Sampler(model, sampler_options(cfg)) as sampler:
            reporter.message(f"sampler: llama.cpp on {sampler.placement.describe()}, "
                             + (f"adapter {adapter_path}" if adapter else "the base model"))
            if adapter is not None:
                sampler.set_adapter(adapter.tensors, alpha=adapter.alpha)
            return collect_with(cfg, options, task, sampler, reporter)
    finally:
        task.close()


def collect_with(cfg: Config, options: CollectOptions, task: AgentTask, sampler, reporter: Reporter) -> CollectResult:
    """The collection on a given sampler (llama.cpp's or an EndpointPolicy in `collect`, a
    scripted policy in the tests), written to OUT.tmp and renamed to OUT once complete."""
    a = cfg.agent
    k = options.k or a.group_size
    seed = a.seed if options.seed is None else options.seed
    scenarios = task.scenarios[: options.limit]
    recipe = AgentRecipe(cfg, sampler, task, reporter, EndpointRollouts if isinstance(sampler, EndpointPolicy) else AgentRollouts)
    per_call = max(1, recipe.rollouts.concurrency // k)
    reports, dropped, reasons, written = [], Counter(), {}, 0
    reporter.start(len(scenarios), ["scenario", "attempts", "passes", "kept", "best"], "scenarios")
    try:
        with atomic_lines(options.out) as out:
            for start in range(0, len(scenarios), per_call):
                chunk = range(start, min(start + per_call, len(scenarios)))
                requests = [Request(scenarios[i], i, j, seed + i * k + j) for i in chunk for j in range(k)]
                clock = PhaseClock()
                trajectories = recipe.rollouts.collect(requests, clock)
                scored, _ = recipe.score([trajectories[n:n + k] for n in range(0, len(trajectories), k)], clock)
                for t in trajectories:
                    if t.failed and t.cause:
                        reasons.setdefault(f"failed ({t.stop})", " ".join(t.cause.split())[:300])
                for n in range(0, len(scored), k):
                    group = scored[n:n + k]
                    lines, causes = _pair_lines(task, group, options) if options.pairs else _record_lines(task, group, options)
                    out.writelines(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
                    written += len(lines)
                    dropped.update(causes)
                    reports.append(ScenarioReport(group[0].trajectory.scenario.id, k, sum(map(successful, group)), len(lines)))
                    reporter.row({"scenario": reports[-1].id, "attempts": k, "passes": reports[-1].passes,
                                  "kept": len(lines), "best": max(s.reward for s in group)})
                reporter.advance(len(reports), f"kept={written}")
    finally:
        reporter.finish()
    result = CollectResult(options.out, written, options.pairs, tuple(reports), dict(dropped), reasons)
    if options.report is not None:
        options.report.write_text(json.dumps(result.report(), indent=2) + "\n")
    return result


@contextmanager
def atomic_lines(out: Path) -> Iterator[IO[str]]:
    """A file to write OUT's lines into: OUT.tmp, renamed to OUT when the block completes and
    removed when it fails or is interrupted, so OUT is never half written."""
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            yield f
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- which traces are kept


def verified(t: Trajectory) -> bool:
    """The scenario's verify command passed (gave its reward_on_success rather than 0)."""
    return t.scenario.verifiable and t.terminal_reward not in (None, 0.0)


def successful(s: ScoredTrajectory) -> bool:
    """Complete, and verify passed or the reward (judge, step rewards) reached SUCCESS_REWARD."""
    t = s.trajectory
    return not t.failed and not t.truncated and (verified(t) or s.reward >= SUCCESS_REWARD)


def drop_cause(s: ScoredTrajectory, min_reward: float | None, require_verified: bool = False) -> str | None:
    """Why a trace cannot be kept whatever the others are, or None."""
    t = s.trajectory
    if t.failed:
        return f"failed ({t.stop})"
    if t.truncated:
        return f"truncated ({t.stop})"
    if t.terminal_reward is None:
        return "unscored"
    if any(turn.note not in (None, *NOT_A_CALL) for turn in t.turns):
        return "malformed_call"  # no record can hold a turn whose calls do not parse
    if any(turn.finish == "length" for turn in t.turns):
        return "turn_cut"  # SFT would train the end of a turn the policy never ended (max_new_tokens_per_turn)
    if require_verified and not verified(t):
        return "not_verified"
    if min_reward is None:
        return None if successful(s) else "not_successful"
    return None if s.reward >= min_reward else "below_min_reward"


def ranked(group: list[ScoredTrajectory]) -> list[ScoredTrajectory]:
    """Highest reward first, shortest on ties (in tokens; an endpoint's in characters), then
    the member order."""
    def length(t: Trajectory) -> int:
        return len(t.tokens) or sum(len(turn.text) for turn in t.turns)
    return sorted(group, key=lambda s: (-s.reward, length(s.trajectory), s.trajectory.member))


def select(task: AgentTask, group: list[ScoredTrajectory], options: CollectOptions, keep: int) -> tuple[list[Kept], Counter]:
    """Up to `keep` traces of one scenario, best first, none an exact duplicate of another,
    each reproducible; and every other trace's cause."""
    form = STRUCTURED if options.structured_records else RAW
    kept: list[Kept] = []
    causes: Counter = Counter()
    for s in ranked(group):
        cause = drop_cause(s, options.min_reward, options.require_verified)
        record = form.record(s.trajectory, s.reward) if cause is None else None
        if cause is None and any(_same(record, other.record) for other in kept):
            cause = "duplicate"
        elif cause is None and len(kept) == keep:
            cause = "over_keep"
        elif cause is None:
            cause = form.check(task, record, s.trajectory)
        if cause is None:
            kept.append(Kept(s, record))
        else:
            causes[cause] += 1
    return kept, causes


def _record_lines(task: AgentTask, group: list[ScoredTrajectory], options: CollectOptions) -> tuple[list[dict], Counter]:
    kept, causes = select(task, group, options, options.keep)
    return [k.record for k in kept], causes


def _same(a: dict, b: dict) -> bool:
    return a["messages"] == b["messages"]


# ---------------------------------------------------------------- records


def raw_record(t: Trajectory, reward: float) -> dict:
    """The conversation as the policy saw it, each assistant turn the text it sampled."""
    def turn_messages(turn, _first_id: int) -> list[dict]:
        return [{"role": "assistant", "content": turn.text, "raw": True},
                *({"role": "tool", "content": c.content} | ({"is_error": True} if c.is_error else {}) for c in turn.calls)]
    return _record(t, reward, turn_messages)


def structured_record(t: Trajectory, reward: float) -> dict:
    """The conversation as the policy saw it, each assistant turn its words and its calls."""
    def turn_messages(turn, first_id: int) -> list[dict]:
        calls = [ToolCall(f"call_{first_id + i}", step.name, step.arguments) for i, step in enumerate(turn.calls)]
        words = turn.content if turn.content is not None else text_around_calls(turn.text) if calls else turn.text
        return [assistant_message(words, calls),
                *({"role": "tool", "content": step.content, "tool_call_id": c.id} | ({"is_error": True} if step.is_error else {})
                  for c, step in zip(calls, turn.calls))]
    return _record(t, reward, turn_messages)


def _record(t: Trajectory, reward: float, turn_messages: Callable) -> dict:
    """The SFT loader's tool-record form: the scenario, each turn's messages and its note."""
    scenario = t.scenario
    messages = scenario.messages() + ([{"role": "user", "content": t.opening}] if t.opening is not None else [])
    calls = 0
    for turn in t.turns:
        messages += turn_messages(turn, calls)
        calls += len(turn.calls)
        if turn.note is not None:
            messages.append({"role": "user", "content": turn.note})
    tools = scenario.toolset.specs() if scenario.toolset else []
    return {"messages": messages} | ({"tools": tools} if tools else {}) | {"scenario": scenario.id, "reward": reward}


def reproduces(task: AgentTask, record: dict, t: Trajectory) -> str | None:
    """None when the SFT loader turns `record` into the rollout's tokens, training exactly the
    sampled ones (the render may add untrained text after the last turn); else the cause."""
    try:
        ids, mask = chat_example(Path(t.scenario.source), task.chat, Chat(record), t.scenario.source)
    except DataError:
        return "not_reproducible"
    ours = [*t.prompt, *t.tokens]
    n = len(ours)
    same = ids[:n] == ours and mask[:n] == [False] * len(t.prompt) + list(t.mask) and not any(mask[n:])
    return None if same else "not_reproducible"


def loads(task: AgentTask, record: dict, t: Trajectory) -> str | None:
    """None when the SFT loader takes `record` (its calls parse back from the template's
    render) within max_trajectory_tokens (an endpoint's last turn was never counted in ours);
    else the cause."""
    try:
        ids, _ = chat_example(Path(t.scenario.source), task.chat, Chat(record), t.scenario.source)
    except DataError:
        return "not_loadable"
    return None if len(ids) <= task.limits.max_trajectory_tokens else "over_max_trajectory_tokens"


@dataclass(frozen=True)
class RecordForm:
    """How a trace becomes an SFT record, and the check the record must pass to be written
    (None, or why it is dropped)."""

    record: Callable[[Trajectory, float], dict]
    check: Callable[[AgentTask, dict, Trajectory], str | None]


RAW = RecordForm(raw_record, reproduces)
STRUCTURED = RecordForm(structured_record, loads)


# ---------------------------------------------------------------- preference pairs


def _pair_lines(task: AgentTask, group: list[ScoredTrajectory], options: CollectOptions) -> tuple[list[dict], Counter]:
    """One pair: the best kept trace against the worst complete one, when their rewards
    differ by min_gap or more; else a cause for the scenario (`pair: ...`)."""
    best, causes = select(task, group, options, 1)
    if not best:
        return [], causes + Counter({"pair: no trace kept": 1})
    chosen = best[0]
    prompt = _prompt(chosen.record)
    if not _answer_only(chosen.record, prompt):
        return [], causes + Counter({"pair: a user note in the best trace": 1})
    form = STRUCTURED if options.structured_records else RAW
    complete = [s for s in ranked(group)[::-1] if s is not chosen.scored and drop_cause(s, float("-inf")) is None]
    rejected = next((Kept(s, r) for s in complete
                     if _answer_only(r := form.record(s.trajectory, s.reward), prompt) and not _same(r, chosen.record)
                     and form.check(task, r, s.trajectory) is None), None)
    if rejected is None:
        return [], causes + Counter({"pair: no rejected trace": 1})
    gap = chosen.scored.reward - rejected.scored.reward
    min_gap = DEFAULT_MIN_GAP if options.min_gap is None else options.min_gap
    if gap < min_gap:
        return [], causes + Counter({"pair: gap below min_gap": 1})
    n = len(prompt)
    record = chosen.record
    return [{"prompt": prompt, "chosen": record["messages"][n:], "rejected": rejected.record["messages"][n:]}
            | ({"tools": record["tools"]} if "tools" in record else {})
            | {"scenario": record["scenario"], "chosen_reward": chosen.scored.reward,
               "rejected_reward": rejected.scored.reward}], causes


def _prompt(record: dict) -> list[dict]:
    """The messages before the first assistant turn."""
    messages = record["messages"]
    return messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant")]


def _answer_only(record: dict, prompt: list[dict]) -> bool:
    """Whether `record` continues `prompt` with assistant and tool messages only (what the
    preference loader takes as an answer)."""
    messages = record["messages"]
    return messages[: len(prompt)] == prompt and all(m["role"] in ("assistant", "tool") for m in messages[len(prompt):])
