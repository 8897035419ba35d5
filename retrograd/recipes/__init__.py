"""One recipe per algorithm: `run(cfg, reporter, resume=...) -> result` with `.summary()`."""

from __future__ import annotations

from typing import Callable


def _sft(cfg, reporter, resume=None):
    from retrograd.recipes import sft

    return sft.run(cfg, reporter, resume=resume)


def _grpo(cfg, reporter, resume=None):
    from retrograd.recipes import grpo

    return grpo.run(cfg, reporter, resume=resume)


def _agent_grpo(cfg, reporter, resume=None):
    from retrograd.recipes import agent_grpo

    return agent_grpo.run(cfg, reporter, resume=resume)


def _not_yet(algorithm: str) -> Callable:
    def run(cfg, reporter, resume=None):
        from retrograd.errors import ConfigError

        raise ConfigError(f"{cfg.path}: run.algorithm = {algorithm!r} is not available in this version (available: sft, grpo, agent_grpo)")

    return run


RECIPES: dict[str, Callable] = {"sft": _sft, "grpo": _grpo, "agent_grpo": _agent_grpo, "distill": _not_yet("distill")}
