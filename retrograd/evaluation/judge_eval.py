"""`retrograd judge eval`: does the configured judge rank answers as people do, and does it
agree with itself? Labelled groups are judged twice (the verdict cache left out, so the
second pass asks again) and compared by rank correlation, group by group.

A fixture is one JSONL record: {"prompt", "completions": [two or more], "labels": [a number
per completion, higher is better], "rubric"?}. A group whose labels (or a pass's verdicts)
are all equal has no ranking to compare and is left out of that row; a group the judge
fails on is counted, not scored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.config import JudgeSection
from retrograd.data.files import json_lines, read_text
from retrograd.errors import DataError
from retrograd.rollouts.judge import judge_group, make_judge
from retrograd.rollouts.rewards import RewardError


@dataclass(frozen=True)
class Fixture:
    prompt: str
    completions: tuple[str, ...]
    labels: tuple[float, ...]
    rubric: str | None
    source: str  # file:line


def load_fixtures(path: Path) -> tuple[Fixture, ...]:
    fixtures = []
    for where, record in json_lines(path, read_text(path)):
        prompt, completions, labels = record.get("prompt"), record.get("completions"), record.get("labels")
        rubric = record.get("rubric")
        if not (isinstance(prompt, str) and prompt and isinstance(completions, list) and len(completions) >= 2
                and all(isinstance(c, str) for c in completions)):
            raise DataError(f"{where}: expected \"prompt\": a non-empty string and \"completions\": two or more strings")
        if not (isinstance(labels, list) and len(labels) == len(completions)
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in labels)):
            raise DataError(f"{where}: expected \"labels\": one finite number per completion (higher is better)")
        if rubric is not None and not (isinstance(rubric, str) and rubric):
            raise DataError(f"{where}: \"rubric\" must be a non-empty string")
        fixtures.append(Fixture(prompt, tuple(completions), tuple(float(v) for v in labels), rubric, where))
    if not fixtures:
        raise DataError(f"{path}: no fixtures")
    return tuple(fixtures)


def kendall_tau(x, y) -> float | None:
    """Kendall's tau-b (ties in either ranking allowed); None when either is all ties."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    i, j = np.triu_indices(len(x), 1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    untied_x, untied_y = np.count_nonzero(dx), np.count_nonzero(dy)
    if not untied_x or not untied_y:
        return None
    return float((dx * dy).sum() / math.sqrt(untied_x * untied_y))


def spearman_rho(x, y) -> float | None:
    """Spearman's rho: the Pearson correlation of average ranks; None when either is all ties."""
    rx, ry = _average_ranks(x), _average_ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def _average_ranks(values) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    _, first, counts = np.unique(v[order], return_index=True, return_counts=True)
    for start, n in zip(first, counts):
        ranks[order[start : start + n]] = start + (n - 1) / 2
    return ranks


@dataclass(frozen=True)
class Agreement:
    """Mean per-group correlations of one comparison, over the groups where both rankings
    have at least one untied pair."""

    kendall: float | None
    spearman: float | None
    groups: int


@dataclass(frozen=True)
class JudgeEvaluation:
    fixtures: int
    failed: int  # groups the judge gave no verdicts for (either pass)
    labels: Agreement  # first pass vs the labels
    consistency: Agreement  # second pass vs the first
    verdicts: tuple[tuple[tuple[float, ...], tuple[float, ...]] | None, ...]  # per fixture: both passes, or None

    def to_json(self, fixtures: tuple[Fixture, ...]) -> dict:
        return {"fixtures": self.fixtures, "failed": self.failed,
                "vs_labels": dataclasses.asdict(self.labels), "self_consistency": dataclasses.asdict(self.consistency),
                "per_fixture": [{"source": f.source, "labels": list(f.labels),
                                 "verdicts": None if v is None else [list(v[0]), list(v[1])]}
                                for f, v in zip(fixtures, self.verdicts)]}


def evaluate_judge(section: JudgeSection, fixtures: tuple[Fixture, ...], progress: Callable[[int], None]) -> JudgeEvaluation:
    """Both passes, each with a judge of its own that reads and writes no verdict cache."""
    uncached = dataclasses.replace(section, cache_path=None)
    passes = []
    for _ in range(2):
        verdicts = []
        with make_judge(uncached) as judge:
            for f in fixtures:
                try:
                    verdicts.append(tuple(judge_group(judge, f.prompt, list(f.completions), f.rubric)))
                except RewardError:
                    verdicts.append(None)
                progress(1)
        passes.append(verdicts)
    both = tuple(None if a is None or b is None else (a, b) for a, b in zip(*passes))
    judged = [(f, v) for f, v in zip(fixtures, both) if v is not None]
    return JudgeEvaluation(
        len(fixtures), len(fixtures) - len(judged),
        _agreement([(f.labels, v[0]) for f, v in judged]),
        _agreement([(v[0], v[1]) for _, v in judged]),
        both,
    )


def _agreement(pairs: list[tuple]) -> Agreement:
    ranked = [(a, b) for a, b in pairs if kendall_tau(a, b) is not None]  # (spearman_rho is None for the same ones)
    if not ranked:
        return Agreement(None, None, 0)
    return Agreement(float(np.mean([kendall_tau(a, b) for a, b in ranked])),
                     float(np.mean([spearman_rho(a, b) for a, b in ranked])), len(ranked))
