"""Training objectives as pure functions of tensors.

- advantages.py: GRPO group rewards -> advantages (baselines, reward scaling, dead groups)
  and the agentic intermediate returns.
- shaping.py: what happens to rewards and to beta between updates (DAPO overlong
  penalty, KL warm-up and adaptive target).
- policy.py: the clipped GRPO/DAPO/GSPO policy loss with k3 KL and truncated importance
  sampling, normalised from minibatch counts so micro-batches accumulate exactly.
- distill.py: on-policy teacher advantages, offline top-k cross-entropy, GKD's
  generalized JSD over the teacher's top-k.

Variants are small functions in a dict, picked by name with `pick`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from retrograd.errors import ConfigError

Variant = TypeVar("Variant")


def pick(table: Mapping[str, Variant], name: str, key: str) -> Variant:
    """table[name], or a ConfigError naming the TOML key, the value and the choices."""
    if name not in table:
        choices = ", ".join(sorted(table))
        raise ConfigError(f"{key} = {name!r}: expected one of {choices}")
    return table[name]
