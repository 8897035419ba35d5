"""Agentic rollouts on the bundled SmolLM2: trajectories per minute for one group per
environment type, and the share of rollout time spent in prefill with and without the
cross-turn KV reuse of the rollout engine.

    python benchmarks/agent.py [--backends container,sandbox,local] [--group 8] [--turns 3]
                               [--tokens 32] [--repeats 2]

Workload: examples/agent's echo-call scenario (the one the 135M model sometimes solves)
with its four-tool catalogue, a group of --group trajectories in lockstep, --turns turns
each (a turn without a call gets an error observation and the trajectory goes on, so
every trajectory has the same number of turns), --tokens per turn, temperature 0.7.
The pool is pre-warmed with one sandbox per trajectory, as during training.

Columns:
  traj/min        trajectories over the wall time of the whole collection (median of --repeats)
  gen s, tools s, env s, verify s   seconds of each phase per collection
  acquire ms      the pool's mean acquire latency (pre-warmed)
  calls           tool calls the model made in the collection
  prefill %       time of the llama_decode calls that carry prefill, over the collection's wall
                  time, with reuse (the engine's default) and, after "no reuse:", without it
                  (the cache is dropped before every turn, so each turn prefills its whole context)
  prefilled       context tokens decoded per collection, with and without reuse
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from retrograd.data import ChatFormat
from retrograd.gguf.file import GGUFFile
from retrograd.gguf.spec import read_spec
from retrograd.model.tokenizer import Tokenizer
from retrograd.rollouts.agent import AgentRollouts, Request, RolloutLimits, forget_kv_cache
from retrograd.rollouts.sandbox import EnvironmentOptions, PoolOptions, SandboxError, open_environment
from retrograd.rollouts.scenarios import load_scenarios
from retrograd.rollouts.tools import ToolCatalog
from retrograd.runtime.bundled import default_model_path
from retrograd.sampler import Sampler, SamplerOptions
from retrograd.training.timeline import PhaseClock

EXAMPLES = Path(__file__).resolve().parents[1] / "examples/agent"
COLUMNS = ["traj/min", "gen s", "tools s", "env s", "verify s", "acquire ms", "calls", "prefill %", "prefilled",
           "no reuse: traj/min", "prefill % ", "prefilled "]
TOOLS = {"default": "small", "toolset": {"small": {"tools": ["bash", "read_file", "write_file", "submit"]}}}


class PrefillClock:
    """Wraps the engine's llama_decode to add up the seconds of the calls that prefill
    (any sequence fed more than one token)."""

    def __init__(self, engine):
        self.engine, self.decode = engine, engine.decode
        self.seconds = 0.0
        engine.decode = self

    def __call__(self, feeds):
        start = time.perf_counter()
        try:
            return self.decode(feeds)
        finally:
            if any(len(feed.tokens) > 1 for feed in feeds):
                self.seconds += time.perf_counter() - start


def collect(sampler, chat, pool, options, scenario, args, *, reuse: bool, clock: PrefillClock) -> dict:
    limits = RolloutLimits(max_turns=args.turns, max_new_tokens_per_turn=args.tokens, max_trajectory_tokens=args.ctx,
                           max_rollout_secs=0, end_on_no_tool_call=False, temperature=0.7)
    engine = AgentRollouts(sampler, chat, pool, options, limits, concurrency=args.group, reuse_kv=reuse)
    forget_kv_cache(sampler)  # every collection starts cold, its group prompt included
    pool.prewarm(wait=True)
    pool.metrics(reset=True)
    timing, clock.seconds = PhaseClock(), 0.0
    start = time.perf_counter()
    trajectories = engine.collect([Request(scenario, 0, j, 1000 + j) for j in range(args.group)], timing)
    wall = time.perf_counter() - start
    turns = [turn for t in trajectories for turn in t.turns]
    return {"wall": wall, "prefill": clock.seconds, "prefilled": sum(turn.prefilled for turn in turns),
            "calls": sum(len(turn.calls) for turn in turns), "acquire_ms": pool.metrics()["env/acquire_ms_mean"],
            **{phase: timing.get(phase, 0.0) for phase in ("generation", "tools", "environment", "reward")}}


def measure(kind: str, sampler, chat, args) -> dict:
    options = EnvironmentOptions(type=kind, allow_unsandboxed=kind == "local",
                                 pool=PoolOptions(max_live=args.group, min_idle=args.group, reuse="workspace"))
    catalog = ToolCatalog.from_table(TOOLS, EXAMPLES)
    scenario = next(s for s in load_scenarios(EXAMPLES / "scenarios.jsonl", catalog, judged=True) if s.id == "echo-call")
    clock = PrefillClock(sampler.engine)
    try:
        with open_environment(options) as pool:
            runs = {reuse: [collect(sampler, chat, pool, options, scenario, args, reuse=reuse, clock=clock)
                            for _ in range(args.repeats)] for reuse in (True, False)}
    finally:
        sampler.engine.decode = clock.decode
    median = lambda reuse, key: statistics.median(run[key] for run in runs[reuse])
    share = lambda reuse: 100 * statistics.median(r["prefill"] / r["wall"] for r in runs[reuse])
    return {
        "traj/min": 60 * args.group / median(True, "wall"), "gen s": median(True, "generation"),
        "tools s": median(True, "tools"), "env s": median(True, "environment"), "verify s": median(True, "reward"),
        "acquire ms": median(True, "acquire_ms"), "calls": median(True, "calls"), "prefill %": share(True),
        "prefilled": median(True, "prefilled"), "no reuse: traj/min": 60 * args.group / median(False, "wall"),
        "prefill % ": share(False), "prefilled ": median(False, "prefilled"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="container,sandbox,local")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: every CPU)")
    args = parser.parse_args()
    path = default_model_path()
    chat = ChatFormat(Tokenizer(path), read_spec(GGUFFile(path)).chat_template, origin=str(path))
    print(f"SmolLM2-135M Q4_1, group {args.group}, {args.turns} turns x {args.tokens} tokens, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'backend':<10}" + "".join(f"{column:>{max(len(column) + 2, 10)}}" for column in COLUMNS))
    with Sampler(path, SamplerOptions(n_ctx=args.ctx, n_seq_max=args.group, n_threads=args.threads)) as sampler:
        for kind in args.backends.split(","):
            try:
                row = measure(kind, sampler, chat, args)
            except SandboxError as error:
                print(f"{kind:<10} unavailable: {error}")
                continue
            print(f"{kind:<10}" + "".join(f"{row[column]:>{max(len(column) + 2, 10)}.2f}" for column in COLUMNS))


if __name__ == "__main__":
    main()
