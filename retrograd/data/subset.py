"""Which held-out items an evaluation uses."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def evenly_spaced(items: Sequence, limit: int | None) -> tuple:
    """`evaluation.max_examples` for every algorithm: `limit` items evenly spaced over the
    file (first and last included), as the Rust retrograd picks held-out prompts, so a
    file sorted by difficulty or source is still sampled across its whole range."""
    if not limit or limit >= len(items):
        return tuple(items)
    return tuple(items[i] for i in np.linspace(0, len(items) - 1, limit).round().astype(int))
