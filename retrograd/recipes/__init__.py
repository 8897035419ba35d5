"""One recipe per algorithm: `run(cfg, reporter, resume=...) -> result` with `.summary()`."""

from __future__ import annotations

from collections.abc import Callable


def _sft(cfg, reporter, resume=None):
    from retrograd.recipes import sft

    return sft.run(cfg, reporter, resume=resume)


def _ppo(cfg, reporter, resume=None):
    from retrograd.recipes import ppo

    return ppo.run(cfg, reporter, resume=resume)


def _grpo(cfg, reporter, resume=None):
    from retrograd.recipes import grpo

    return grpo.run(cfg, reporter, resume=resume)


def _agent_grpo(cfg, reporter, resume=None):
    from retrograd.recipes import agent_grpo

    return agent_grpo.run(cfg, reporter, resume=resume)


def _distill(cfg, reporter, resume=None):
    from retrograd.recipes import distill

    return distill.run(cfg, reporter, resume=resume)


def _preference(cfg, reporter, resume=None):
    from retrograd.recipes import preference

    return preference.run(cfg, reporter, resume=resume)


RECIPES: dict[str, Callable] = {"sft": _sft, "ppo": _ppo, "grpo": _grpo, "agent_grpo": _agent_grpo, "distill": _distill,
                                "preference": _preference}
