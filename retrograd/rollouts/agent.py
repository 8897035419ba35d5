"""Multi-turn, tool-using rollouts for agentic GRPO (notes §4.6, §5).

Trajectories run in lockstep waves on the sampler: each turn samples one assistant turn
for every live trajectory at once, then runs their tool calls (each trajectory in its own
sandbox, all trajectories in parallel threads), then appends the observations. A
trajectory ends when:

    no_tool_call         a turn without a call (end_on_no_tool_call; otherwise the turn gets
                         an error observation and the trajectory goes on)
    submitted            a tool said done (`submit`, a json exec tool)
    max_turns            the last allowed turn still called tools           (truncated)
    max_trajectory_tokens  no room for another turn, or more text than the template may
                         render (data/bounded_jinja.py)                     (truncated)
    max_rollout_secs     the wall budget ran out (checked at every stage)   (truncated)
    max_failed_turns     that many turns in a row without a parsable call   (truncated)
    template_rewrote_turn  the template rendered this turn's text differently (e.g. trimmed
                         its whitespace), so the tokens cannot grow on     (truncated)
    sandbox_broken       the sandbox or a tool broke; this trajectory only  (failed)
    environment_broken   the http environment broke the episode (rollouts.http_env)  (failed)
    tool_broken          an mcp server hung, erred or died (rollouts.mcp_tools)  (failed)
    policy_broken        an endpoint policy gave no usable reply (rollouts.api_agent, collect --api)  (failed)

A failed trajectory records its cause. With an http environment, each trajectory is one
episode of the server: reset before the first turn (its opening observation becomes a user
message after the scenario's, so that member's prompt is its own), its tools' calls are the
episode's steps, its terminal state is read after the last turn, and it is closed at the end
whatever happened.

Rendering: the conversation goes through the model's chat template with
retrograd.data's tool style (the template renders the catalogue and `tool` messages when
it passes the native probe, else the Hermes `<tool_call>` convention of data/tools.py),
exactly as SFT tool records are rendered. Calls are parsed with the same convention. The
token sequence grows incrementally: the policy's own sampled tokens are kept as they are
(never re-rendered or re-tokenized), and after each turn only the text the template adds
after them (its end-of-turn, the observations, the next assistant header) is tokenized
and appended. Before that, the new render must start with the previous render plus the
turn's exact text; a template that rewrites every earlier turn is refused with an error,
one that rewrites only this turn's text ends that trajectory. So
the sampler's KV cache is extended between turns, never re-prefilled (except on recurrent
models such as lfm2, whose state the sampler cannot cut back: each of their turns prefills the
history again, to the same tokens), and `mask` marks exactly the sampled tokens.

After the last turn, `verify` runs in the trajectory's sandbox (unless it broke or ran out
of time) for the terminal reward; json tools' rewards are step rewards, each starting at
the first token after the turn that earned it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from retrograd.data import ChatFormat, tools as hermes
from retrograd.data.chat import render_prompt
from retrograd.data.messages import Conversation
from retrograd.data.template import TemplateBudgetError
from retrograd.data.tools import ERROR_PREFIX, ToolCall
from retrograd.errors import DataError
from retrograd.objectives.advantages import add_intermediate_returns
from retrograd.rollouts.http_env import EnvironmentBroken, HttpEnvironment, HttpEpisode
from retrograd.rollouts.sandbox import EnvironmentOptions, Sandbox, SandboxBroken, SandboxPool
from retrograd.rollouts.scenarios import Scenario
from retrograd.rollouts.tools import ToolResult
from retrograd.sampler import Sampling
from retrograd.training.timeline import PhaseClock

ENDED = ("no_tool_call", "submitted")
TRUNCATED = ("max_turns", "max_trajectory_tokens", "max_rollout_secs", "max_failed_turns", "template_rewrote_turn")
FAILED = ("sandbox_broken", "environment_broken", "tool_broken", "policy_broken")
STOPS = ENDED + TRUNCATED + FAILED
NO_CALL = ("no tool call found; call a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, "
           "or call submit when you are done")
NO_TOOLS = "error: this run has no tools"
PLAIN_TURN = "ok"  # a turn every template should keep verbatim


@dataclass(frozen=True)
class RolloutLimits:
    max_turns: int
    max_new_tokens_per_turn: int
    max_trajectory_tokens: int  # prompt included
    max_rollout_secs: float  # 0: no wall budget
    end_on_no_tool_call: bool = True
    max_failed_turns: int = 0  # 0: never cut
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def from_agent(cls, agent, ctx: int) -> RolloutLimits:
        """From [agent]; max_trajectory_tokens defaults to training.ctx."""
        return cls(agent.max_turns, agent.max_new_tokens_per_turn, agent.max_trajectory_tokens or ctx,
                   agent.max_rollout_secs, agent.end_on_no_tool_call, agent.max_failed_turns, agent.temperature,
                   agent.top_p)

    @property
    def budget_tokens(self) -> int:
        """The loss denominator of notes §4.6: what one trajectory may sample at most."""
        return min(self.max_turns * self.max_new_tokens_per_turn, self.max_trajectory_tokens)


@dataclass(frozen=True)
class Request:
    scenario: Scenario
    group: int
    member: int
    seed: int


@dataclass(frozen=True)
class ToolStep:
    name: str
    arguments: dict
    content: str  # what the model reads (without the error prefix)
    is_error: bool
    reward: float | None


@dataclass(frozen=True)
class Turn:
    text: str  # the policy's sampled bytes as text, without a final end-of-generation token
    n_tokens: int
    finish: str  # "eos" | "length" (max_new_tokens_per_turn)
    prefilled: int  # context tokens the sampler decoded for this turn
    reused: int  # context tokens it found in the KV cache
    start: int  # where its tokens begin in Trajectory.tokens
    calls: tuple[ToolStep, ...] = ()
    note: str | None = None  # the error observation of a turn without a valid call
    content: str | None = None  # an endpoint's words apart from its calls (rollouts.api_agent); None: in `text`


@dataclass(frozen=True)
class Trajectory:
    """One finished episode as `collect` returns it; a recipe that scores it further (a
    judge) makes a new record rather than changing this one."""

    scenario: Scenario
    group: int
    member: int
    seed: int
    prompt: tuple[int, ...]  # the rendered scenario up to the first assistant header (shared by the group)
    tokens: tuple[int, ...]  # after the prompt, ending with the last sampled token
    mask: tuple[bool, ...]  # True where the policy sampled the token
    logprobs: tuple[float, ...]  # the sampler's, one per sampled token
    turns: tuple[Turn, ...]
    step_rewards: tuple[tuple[int, float], ...]  # (index in tokens where it starts, reward)
    stop: str
    terminal_reward: float | None  # verify's (or, in a record the recipe makes, the judge's)
    seconds: float  # wall time from the first turn to the end of verify
    cause: str | None = None  # why it failed (a FAILED stop)
    state: str | None = None  # an http environment's terminal state
    opening: str | None = None  # an http episode's opening observation: a user message after the scenario's

    @property
    def truncated(self) -> bool:
        return self.stop in TRUNCATED

    @property
    def failed(self) -> bool:
        return self.stop in FAILED

    @property
    def completion(self) -> str:
        """What a judge reads: the assistant turns' text without end-of-generation tokens, then
        the environment's terminal state when it keeps one."""
        return "\n".join(self.transcript)

    @property
    def transcript(self) -> tuple[str, ...]:
        """`completion` in parts (each turn, then the state), which judge compaction keeps or summarises."""
        turns = tuple(turn.text for turn in self.turns)
        return turns if self.state is None else (*turns, f"[environment state]\n{self.state}")

    def token_advantages(self, advantage: float) -> torch.Tensor:
        """[] the group advantage, or [n_sampled] with the intermediate returns of the
        step rewards added (notes §4.6) when there are any."""
        if not self.step_rewards:
            return torch.tensor(advantage)
        mask = torch.tensor(self.mask)[None]  # [1, T]
        starts = torch.tensor([s for s, _ in self.step_rewards])[None]  # [1, S]
        rewards = torch.tensor([r for _, r in self.step_rewards], dtype=torch.float64)[None]  # [1, S]
        per_token = add_intermediate_returns(torch.tensor([advantage], dtype=torch.float64), mask, starts, rewards,
                                             torch.ones_like(starts, dtype=torch.bool))  # [1, T]
        return per_token[mask].float()  # [n_sampled]


def trajectory_reward(t: Trajectory) -> float:
    """Terminal reward (0 when there is none) plus every step reward (gamma = 1)."""
    return (t.terminal_reward or 0.0) + sum(r for _, r in t.step_rewards)


@dataclass
class LiveTrajectory:
    """A trajectory while it runs: what it has so far, its sandbox, sampler conversation and
    chat state. `finished` makes the Trajectory record."""

    request: Request
    prompt: tuple[int, ...]
    rendered: str  # the conversation's render up to the open assistant header
    messages: list[dict]
    sandbox: Sandbox | None = None
    episode: HttpEpisode | None = None
    conversation: object = None  # retrograd.sampler.Conversation
    started: float = 0.0
    seconds: float = 0.0
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    step_rewards: list[tuple[int, float]] = field(default_factory=list)
    stop: str | None = None
    cause: str | None = None
    state: str | None = None
    terminal_reward: float | None = None
    calls: list[tuple[ToolCall, ...]] = field(default_factory=list)  # per assistant turn, as data.messages.Conversation holds them
    failed_turns: int = 0
    content: str = ""  # this turn's text as the assistant message holds it (no end-of-generation token)
    pending: list[ToolCall] = field(default_factory=list)  # this turn's parsed calls
    done: bool = False

    @property
    def scenario(self) -> Scenario:
        return self.request.scenario

    @property
    def context(self) -> list[int]:
        return [*self.prompt, *self.tokens]

    def finished(self) -> Trajectory:
        """The record, cut after its last sampled token (nothing after it is trained)."""
        end = len(self.mask)
        while end and not self.mask[end - 1]:
            end -= 1
        r = self.request
        return Trajectory(r.scenario, r.group, r.member, r.seed, self.prompt, tuple(self.tokens[:end]), tuple(self.mask[:end]),
                          tuple(self.logprobs), tuple(self.turns), tuple(self.step_rewards), self.stop, self.terminal_reward,
                          self.seconds, self.cause, self.state, self.episode.observation if self.episode else None)


def render(chat: ChatFormat, scenario: Scenario, messages: list[dict], calls: list[tuple[ToolCall, ...]]) -> str:
    """The conversation so far, up to an open assistant header (retrograd.data.chat.render_prompt)."""
    specs = tuple(scenario.toolset.specs()) if scenario.toolset else ()
    return render_prompt(chat, Conversation(tuple(messages), specs, tuple(calls)), scenario.source)


def scenario_prompt(chat: ChatFormat, scenario: Scenario) -> tuple[str, tuple[int, ...]]:
    """The scenario rendered up to the first assistant header, and its tokens."""
    text = render(chat, scenario, scenario.messages(), [])
    ids, _ = chat.tokenize(text, scenario.source)
    return text, tuple(ids)


def checked_prompt(chat: ChatFormat, scenario: Scenario, limits: RolloutLimits) -> tuple[str, tuple[int, ...]]:
    """scenario_prompt, refused when it leaves no room for a single sampled token."""
    text, ids = scenario_prompt(chat, scenario)
    n = len(ids)
    if n + 1 > limits.max_trajectory_tokens:
        raise DataError(f"{scenario.source}: scenario {scenario.id!r} renders to {n} tokens with its tool catalogue, "
                        f"leaving no room to answer within {limits.max_trajectory_tokens} tokens "
                        "(agent.max_trajectory_tokens, else training.ctx)")
    return text, ids


class AgentRollouts:
    """Collects trajectories. `sampler` needs `open(seeds)` and `generate_turn(turns,
    sampling)` (retrograd.sampler.Sampler); `pool` is None for a run without an environment
    (no tools) or one whose environment is `http`. `reuse_kv=False` forgets the KV cache before
    every turn (benchmarks only)."""

    def __init__(self, sampler, chat: ChatFormat, pool: SandboxPool | None, options: EnvironmentOptions | None,
                 limits: RolloutLimits, *, concurrency: int, reuse_kv: bool = True, http: HttpEnvironment | None = None):
        self.sampler, self.chat, self.pool, self.options, self.limits = sampler, chat, pool, options, limits
        self.http = http
        self.concurrency = concurrency if pool is None else min(concurrency, pool.options.max_live)
        self.reuse_kv = reuse_kv
        self._prompts: dict[str, tuple[str, tuple[int, ...]]] = {}

    # ---------------------------------------------------------------- prompts

    def prompt(self, scenario: Scenario) -> tuple[int, ...]:
        if scenario.source not in self._prompts:
            self._prompts[scenario.source] = checked_prompt(self.chat, scenario, self.limits)
        return self._prompts[scenario.source][1]

    # ---------------------------------------------------------------- collection

    def collect(self, requests: Sequence[Request], clock: PhaseClock) -> list[Trajectory]:
        """Trajectories in the order of `requests`, in waves of `concurrency`. `clock` times
        environment (acquire, setup, release), generation, tools and reward (verify)."""
        out = []
        for start in range(0, len(requests), self.concurrency):
            out += self._wave(requests[start:start + self.concurrency], clock)
        return out

    def _wave(self, requests: Sequence[Request], clock: PhaseClock) -> list[Trajectory]:
        lives = [LiveTrajectory(r, self.prompt(r.scenario), self._prompts[r.scenario.source][0], r.scenario.messages()) for r in requests]
        with ThreadPoolExecutor(max_workers=len(requests), thread_name_prefix="retrograd-agent") as threads:
            with clock.phase("environment"):
                _each(threads, self._open, lives)
            opened: list[LiveTrajectory] = []
            try:
                conversations = self.sampler.open([r.seed for r in requests])
                started = time.monotonic()
                for live, conversation in zip(lives, conversations):
                    live.conversation, live.started = conversation, started
                    opened.append(live)
                running = [live for live in lives if live.stop is None]
                while running:
                    self._check_clock(running)
                    running = [live for live in running if live.stop is None]
                    if not running:
                        break
                    with clock.phase("generation"):
                        self._sample(running)
                    with clock.phase("tools"):
                        _each(threads, self._act, running)
                    self._check_clock(running)
                    for live in running:
                        self._continue(live)
                    running = [live for live in running if live.stop is None]
                with clock.phase("reward"):
                    _each(threads, self._verify, lives)
            finally:
                for live in opened:
                    live.conversation.close()
                    live.seconds = time.monotonic() - live.started
                with clock.phase("environment"):
                    _each(threads, _release, [live.sandbox or live.episode for live in lives])
        return [live.finished() for live in lives]

    def _open(self, live: LiveTrajectory) -> None:
        """A prepared sandbox or a reset episode; a broken one costs this trajectory only (a
        failing setup, like an unavailable daemon, stops the run: SandboxError)."""
        if self.http is not None:
            self._reset(live)
            return
        if self.pool is None:
            return
        sandbox = self.pool.acquire()
        try:
            if live.scenario.env is not None:
                sandbox.prepare(live.scenario.env, self.options.setup_timeout_secs, live.scenario.source)
        except SandboxBroken as broken:
            live.stop, live.cause = "sandbox_broken", str(broken)
        except BaseException:
            sandbox.close()
            raise
        live.sandbox = sandbox

    def _reset(self, live: LiveTrajectory) -> None:
        """A new episode; its opening observation (a user message) makes this member's prompt."""
        try:
            live.episode = self.http.reset(live.scenario, live.request.seed)
        except EnvironmentBroken as broken:
            live.stop, live.cause = "environment_broken", str(broken)
            return
        if live.episode.observation is None:
            return
        live.messages.append({"role": "user", "content": live.episode.observation})
        try:
            live.rendered = render(self.chat, live.scenario, live.messages, [])
        except TemplateBudgetError:
            live.stop = "max_trajectory_tokens"
            return
        live.prompt = tuple(self.chat.tokenize(live.rendered, live.scenario.source)[0])
        if len(live.prompt) + 1 > self.limits.max_trajectory_tokens:
            live.stop = "max_trajectory_tokens"

    def _check_clock(self, running: list[LiveTrajectory]) -> None:
        budget = self.limits.max_rollout_secs
        for live in running:
            if budget and live.stop is None and time.monotonic() - live.started > budget:
                live.stop = "max_rollout_secs"

    # ---------------------------------------------------------------- one turn

    def _sample(self, running: list[LiveTrajectory]) -> None:
        """One assistant turn for every running trajectory; those with the same token budget
        share a generate_turn call (all of them, until one nears max_trajectory_tokens)."""
        if not self.reuse_kv:
            forget_kv_cache(self.sampler)
        by_budget: dict[int, list[LiveTrajectory]] = defaultdict(list)
        for live in running:
            room = self.limits.max_trajectory_tokens - len(live.context)
            by_budget[min(self.limits.max_new_tokens_per_turn, room)].append(live)
        for budget, lives in by_budget.items():
            sampling = Sampling(budget, self.limits.temperature, self.limits.top_p)
            completions = self.sampler.generate_turn([(live.conversation, live.context) for live in lives], sampling)
            for live, completion in zip(lives, completions):
                self._take_turn(live, completion)
                if completion.finish == "length" and budget < self.limits.max_new_tokens_per_turn:
                    live.stop = "max_trajectory_tokens"  # cut by the trajectory's room, not the turn's

    def _take_turn(self, live: LiveTrajectory, completion) -> None:
        tokens = list(completion.tokens)
        ends = completion.finish == "eos"
        body = tokens[:-1] if ends else tokens
        content = self._text(body)
        start = len(live.tokens)
        live.tokens += tokens
        live.mask += [True] * len(tokens)
        live.logprobs += list(completion.logprobs)
        live.content = content
        live.messages.append({"role": "assistant", "content": content})
        live.pending, note = parse_turn(content, first_id=sum(len(calls) for calls in live.calls))
        live.calls.append(tuple(live.pending))
        if not live.pending and note is None:
            if self.limits.end_on_no_tool_call:
                live.stop = "no_tool_call"
            else:
                note = ERROR_PREFIX + NO_CALL
        live.turns.append(Turn(content, len(tokens), completion.finish, completion.prefilled, completion.reused, start,
                               note=note))
        live.failed_turns = 0 if live.pending else live.failed_turns + 1

    def _text(self, tokens: list[int]) -> str:
        return b"".join(self.chat.piece(token) for token in tokens).decode("utf-8", errors="replace")

    def _act(self, live: LiveTrajectory) -> None:
        """This turn's calls, in order, in the trajectory's sandbox; a `done` skips the rest."""
        if live.stop is not None:
            return
        steps = []
        for call in live.pending:
            result = self._call(live, call)
            steps.append(ToolStep(call.name, call.arguments, result.content, result.is_error, result.reward))
            if result.broken:
                live.stop, live.cause = result.broken, result.content
                break
            if result.reward is not None:
                live.step_rewards.append((len(live.tokens), result.reward))
            if result.done:
                live.done = True
                break
        live.turns[-1] = replace(live.turns[-1], calls=tuple(steps))

    def _call(self, live: LiveTrajectory, call: ToolCall) -> ToolResult:
        toolset = live.scenario.toolset
        if toolset is None:
            return ToolResult(NO_TOOLS, is_error=True)
        return toolset.call(live.sandbox or live.episode, call.name, call.arguments)

    def _continue(self, live: LiveTrajectory) -> None:
        """Ends the trajectory, or appends the observations and (`_extend`) the template's
        text up to the next assistant header."""
        if live.stop is not None:
            return
        if live.done:
            live.stop = "submitted"
        elif len(live.turns) >= self.limits.max_turns:
            live.stop = "max_turns"
        elif self.limits.max_failed_turns and live.failed_turns >= self.limits.max_failed_turns:
            live.stop = "max_failed_turns"
        if live.stop is not None:
            return
        turn = live.turns[-1]
        for call, step in zip(live.pending, turn.calls):
            live.messages.append({"role": "tool", "content": (ERROR_PREFIX if step.is_error else "") + step.content,
                                  "tool_call_id": call.id, "name": call.name})
        if turn.note is not None:
            live.messages.append({"role": "user", "content": turn.note})
        try:
            length = self._extend(live)
        except TemplateBudgetError:  # the conversation outgrew what a template may render, far past any context
            live.stop = "max_trajectory_tokens"
            return
        if live.stop is None and length + 1 > self.limits.max_trajectory_tokens:
            live.stop = "max_trajectory_tokens"

    def _extend(self, live: LiveTrajectory) -> int:
        """Appends the template's new text as tokens; the context's length after it."""
        before, content = live.rendered, live.content
        after = render(self.chat, live.scenario, live.messages, live.calls)
        if not after.startswith(before + content):
            if not self._keeps_plain_turns(live):
                raise DataError(
                    f"{live.scenario.source}: the chat template of {self.chat.origin} does not render the earlier turns as "
                    f"an exact prefix after assistant turn {len(live.turns)}, so the conversation cannot grow token by "
                    "token; agentic rollouts need a template that keeps earlier turns verbatim"
                )
            live.stop = "template_rewrote_turn"  # this turn's text only (e.g. whitespace the template trims)
            return len(live.context)
        added = after[len(before) + len(content):]
        if live.turns[-1].finish == "eos":  # the policy already wrote the end of its turn when the template uses that token
            added = added.removeprefix(self.chat.piece(live.tokens[-1]).decode("utf-8", errors="replace"))
        ids = self.chat.tokenizer.encode(added, add_bos=False, special=True)
        live.tokens += ids
        live.mask += [False] * len(ids)
        live.rendered = after
        return len(live.context)

    def _keeps_plain_turns(self, live: LiveTrajectory) -> bool:
        """Whether the template keeps a plain assistant turn verbatim where this one sat: if
        not, the template itself is unusable; if so, only this turn's text was rewritten."""
        messages = [*live.messages]
        last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
        messages[last] = {"role": "assistant", "content": PLAIN_TURN}
        probe = render(self.chat, live.scenario, messages, live.calls)
        return probe.startswith(live.rendered + PLAIN_TURN)

    def _verify(self, live: LiveTrajectory) -> None:
        if live.episode is not None and live.stop not in FAILED and live.stop != "max_rollout_secs":
            try:
                live.state = live.episode.state()
            except EnvironmentBroken as broken:
                live.stop, live.cause = "environment_broken", str(broken)
        spec = live.scenario.env.verify if live.scenario.env is not None else None
        if spec is None or live.stop in FAILED or live.stop == "max_rollout_secs" or live.sandbox is None:
            return
        try:
            live.terminal_reward = live.sandbox.verify(spec, self.options.verify_timeout)
        except SandboxBroken as broken:
            live.stop, live.cause = "sandbox_broken", str(broken)


def parse_turn(content: str, first_id: int) -> tuple[list[ToolCall], str | None]:
    """One assistant turn's calls (ids from call_{first_id} on) and no note; or, when a call is
    malformed, no calls and the error observation the model reads instead. Never raises,
    whatever the model wrote."""
    parsed = hermes.parse_calls(content)
    if isinstance(parsed, str):
        return [], ERROR_PREFIX + parsed
    return [ToolCall(f"call_{first_id + i}", name, arguments) for i, (name, arguments) in enumerate(parsed)], None


def forget_kv_cache(sampler) -> None:
    """Drops every cached sequence, so the next turn prefills its whole context: the
    benchmark's "without cross-turn reuse" arm."""
    sampler.engine.clear()
    for slot in sampler.slots:
        slot.cached = []


def _release(world: Sandbox | HttpEpisode | None) -> None:
    if world is not None:
        world.close()


def _each(threads: ThreadPoolExecutor, work: Callable, items: list) -> list:
    """work(item) for every item, in parallel threads; results in order, the first error raised."""
    return list(threads.map(work, items))
