"""What `retrograd collect` is asked to do, and the requests it refuses before anything loads:
checked by the command before it imports the collector (and torch), so a misuse is answered
in under a second."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrograd.config import Config
from retrograd.errors import ConfigError, DataError


@dataclass(frozen=True)
class CollectOptions:
    out: Path
    k: int | None = None  # trajectories per scenario (default agent.group_size)
    keep: int = 1  # records per scenario
    min_reward: float | None = None  # None: keep successful traces (see `successful`)
    require_verified: bool = False  # keep only traces a scenario's verify command passed (not judged ones)
    limit: int | None = None  # the first N scenarios
    seed: int | None = None  # default agent.seed
    report: Path | None = None
    force: bool = False
    pairs: bool = False
    min_gap: float | None = None  # pairs only (default collect.DEFAULT_MIN_GAP)
    adapter: Path | None = None  # default lora.init_adapter; None there too: the base model
    api: bool = False  # roll out with [agent.collect_api]'s endpoint instead of the local model
    structured: bool | None = None  # records' turns as content + tool_calls; None: raw locally, structured with api

    @property
    def structured_records(self) -> bool:
        return self.api if self.structured is None else self.structured


def check_request(cfg: Config, options: CollectOptions) -> None:
    """What is refused before anything loads."""
    if cfg.run.algorithm != "agent_grpo":
        raise ConfigError(f"{cfg.path}: run.algorithm = {cfg.run.algorithm!r}; collect rolls out agent_grpo configs")
    if options.out.exists() and not options.force:
        raise DataError(f"--out {options.out}: the file exists; pass --force to overwrite it")
    if options.min_gap is not None and not options.pairs:
        raise ConfigError("--min-gap applies to --pairs only")
    if options.api and cfg.agent.collect_api is None:
        raise ConfigError(f"{cfg.path}: --api needs an [agent.collect_api] table (base_url, model) naming the endpoint")
    if options.api and options.structured is False:
        raise ConfigError("--raw needs the local model's own tokens; with --api the records are structured")
    if options.api and options.adapter is not None:
        raise ConfigError("--adapter applies to the local model, not to --api")
