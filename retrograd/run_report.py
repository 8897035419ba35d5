"""`report.html`: one self-contained page about a run, built from what the run leaves behind.

A run's folder (the output's parent) holds metrics.jsonl (one record per step or update,
plus evaluation records); rollout runs (grpo, agent_grpo, on-policy distill) also write
rollouts.jsonl there (or in [observe].directory), and checkpoints go to
[checkpoint].directory. The page draws the curves those records hold, for rollout runs a
timeline of each update's phases and the counters that explain throughput, and a browser
of the rollouts. plotly.js is embedded, so the page opens without a network. Rollout text is
model output, never trusted: it reaches the page only through Jinja's autoescaping.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from retrograd.errors import RetrogradError

REPORT_NAME = "report.html"
ROLLOUT_ROWS_CAP = 2000  # rows in the rollout browser: whole updates, evenly spread over the run
TIMELINE_CAP = 60  # updates on the timeline and in the counters table, evenly spread over the run
TEXT_CAP = 4000  # characters of one prompt, completion, turn or tool observation
ROLLOUT_ALGORITHMS = ("grpo", "agent_grpo")

# (panel title, y-axis title, series drawn as lines, series drawn as markers: evaluation points)
CURVES = (
    ("Loss", "loss", ("train/loss", "policy/total_loss"), ("eval/loss",)),
    ("Reward", "reward", ("reward/mean", "reward/min", "reward/max"), ("eval/mean_reward",)),
    ("KL", "nats per token", ("policy/kl", "distill/teacher_kl_mean"), ("eval/teacher_kl_mean",)),
    ("Learning rate", "learning rate", ("train/lr", "optimizer/learning_rate"), ()),
    ("Throughput", "tokens per second", ("train/tokens_per_second",), ()),
)
PHASE_COLOURS = {  # one colour per phase across algorithms; a phase not named here gets plotly's next
    "environment": "#8c564b", "generation": "#1f77b4", "tools": "#17becf", "reward": "#ff7f0e", "judge": "#bcbd22",
    "teacher": "#e377c2", "behavior_scoring": "#2ca02c", "reference": "#d62728", "optimizer": "#9467bd",
    "adapter_refresh": "#000000", "waiting_for_batch": "#ffd700", "other": "#c7c7c7",
}
# timing/<name>_seconds keys that sum other phases or are drawn apart, not phases of their own
NOT_PHASES = {"update", "rollout", "optimizer_wall", "waiting_for_batch"}


@dataclass(frozen=True)
class RunFiles:
    """Where one run's records are. rollouts is None for runs that sample nothing."""

    directory: Path
    metrics: Path
    rollouts: Path | None
    checkpoints: Path | None
    algorithm: str | None  # from the config; None when only the folder was given


def locate(run: Path) -> RunFiles:
    """The files of the run in folder `run`, or of the run a config TOML describes."""
    if run.is_file() and run.suffix == ".toml":
        from retrograd.config import load_config

        return run_files(load_config(run))
    if not run.is_dir():
        problem = "not a folder or a .toml file" if run.exists() else "no such folder"
        raise RetrogradError(f"{run}: {problem} (give a run's folder holding metrics.jsonl, or its config .toml)")
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise RetrogradError(f"{run}: no metrics.jsonl here (give the folder a run wrote it to, or the run's config .toml)")
    return RunFiles(run, metrics, run / "rollouts.jsonl", run, None)


def run_files(cfg) -> RunFiles:
    """The files `cfg`'s run writes (the recipes decide these paths; this follows them)."""
    directory = cfg.output.path.parent
    algorithm = cfg.run.algorithm
    rollouts = None
    if algorithm in ROLLOUT_ALGORITHMS:
        rollouts = (cfg.observe.directory if cfg.observe else directory) / "rollouts.jsonl"
    elif algorithm == "distill" and cfg.distill.mode == "on_policy":
        rollouts = directory / "rollouts.jsonl"
    checkpoints = cfg.checkpoint.directory if cfg.checkpoint else None
    metrics = directory / "metrics.jsonl"
    if not metrics.is_file():
        raise RetrogradError(f"{cfg.path}: its run has no {metrics} yet (train it first: retrograd train {cfg.path})")
    return RunFiles(directory, metrics, rollouts, checkpoints, algorithm)


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file a run may still be appending to: a line that does not
    parse (the one being written, or damage) is left out."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def latest_attempt(records: list[dict]) -> list[dict]:
    """metrics.jsonl of a resumed run holds the steps after the checkpoint twice (the lost
    attempt, then the resumed one): keep the later ones."""
    kept: list[dict] = []
    for record in records:
        step = record.get("step")
        if not _is_number(step):
            continue
        if kept and step < kept[-1]["step"]:
            kept = [r for r in kept if r["step"] < step]
        kept.append(record)
    return kept


# ---------------------------------------------------------------- what the page shows


def curves(records: list[dict], x: str) -> list[dict]:
    """One plotly figure per panel whose series the records hold, against `x` (step, or
    train/update for rollout runs: an update without a learning signal takes no step)."""
    figures = []
    for title, y_title, lines, markers in CURVES:
        traces = [_series(records, x, key, "lines") for key in lines]
        traces += [_series(records, x, key, "markers") for key in markers]
        traces = [t for t in traces if t["x"]]
        if traces:
            x_title = "optimizer step" if x == "step" else "update"
            layout = _layout(title) | {"xaxis": {"title": {"text": x_title}}, "yaxis": {"title": {"text": y_title}}}
            if title == "Learning rate":
                layout["yaxis"] |= {"exponentformat": "e", "rangemode": "tozero"}
            figures.append({"id": f"curve-{len(figures)}", "data": traces, "layout": layout})
    return figures


def _series(records: list[dict], x: str, key: str, mode: str) -> dict:
    points = [(r[x], r[key]) for r in records if _is_number(r.get(key)) and _is_number(r.get(x))]
    if mode == "lines" and len(points) <= 60:
        mode = "lines+markers"  # few points: each one visible
    trace = {"type": "scatter", "mode": mode, "name": key, "x": [p[0] for p in points], "y": [p[1] for p in points]}
    if mode == "markers":
        trace["marker"] = {"size": 10, "symbol": "diamond"}
    elif key.endswith(("/min", "/max")):
        trace["line"] = {"dash": "dot", "width": 1}
    return trace


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)  # NaN, inf: not drawn


def update_records(records: list[dict]) -> list[dict]:
    """The records of rollout updates (they carry train/update and the update's timing)."""
    return [r for r in records if "train/update" in r and "timing/update_seconds" in r]


def timed_updates(updates: list[dict]) -> list[dict]:
    """The updates the timeline and the counters show: up to TIMELINE_CAP, the first and the last among them."""
    return _evenly(updates, TIMELINE_CAP)


def phase_names(updates: list[dict]) -> list[str]:
    """The phases the run timed, in the order its first update recorded them."""
    names: dict[str, None] = {}
    for r in updates:
        for key in r:
            if key.startswith("timing/") and key.endswith("_seconds") and key[7:-8] not in NOT_PHASES:
                names[key[7:-8]] = None
    return list(names)


def timeline(updates: list[dict]) -> dict:
    """Telescope-style: one row per update, its phases as stacked bars on the run's clock.
    An update's start is its record's time less its duration; phases are drawn in the order
    they run (dynamic sampling's waves interleave generation and reward; their sums are drawn)."""
    if not updates:
        return {}
    origin = min(r["time"] - r["timing/update_seconds"] for r in updates)
    updates = timed_updates(updates)
    starts = [r["time"] - r["timing/update_seconds"] for r in updates]
    labels = [f"update {r['train/update']}" for r in updates]
    phases = phase_names(updates)
    traces, offsets = [], [s - origin for s in starts]
    for name in [*phases, "waiting_for_batch", "other"]:
        if name == "other":  # what no phase covers: data preparation, tokenization, bookkeeping
            widths = [max(r["timing/update_seconds"] - sum(r.get(f"timing/{p}_seconds", 0.0) for p in phases), 0.0) for r in updates]
        else:
            widths = [float(r.get(f"timing/{name}_seconds", 0.0)) for r in updates]
        traces.append({
            "type": "bar", "orientation": "h", "name": name.replace("_", " "), "y": labels, "x": widths,
            "base": list(offsets), "hovertemplate": f"{name}: %{{x:.2f}} s<extra>%{{y}}</extra>",
        } | ({"marker": {"color": PHASE_COLOURS[name]}} if name in PHASE_COLOURS else {}))
        offsets = [o + w for o, w in zip(offsets, widths)]
    layout = _layout("Timeline of updates") | {
        "barmode": "overlay",
        "xaxis": {"title": {"text": "seconds since the first update began"}},
        "yaxis": {"autorange": "reversed", "type": "category"},
        "height": max(300, 120 + 26 * len(updates)),
        "margin": {"l": 90, "r": 20, "t": 70, "b": 45},
        "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.02, "yanchor": "bottom"},
    }
    return {"id": "timeline", "data": traces, "layout": layout}


def _layout(title: str) -> dict:
    return {"title": {"text": title, "x": 0.01, "xanchor": "left"}, "height": 320, "margin": {"l": 70, "r": 20, "t": 40, "b": 45},
            "legend": {"orientation": "h", "y": -0.25}}


def counters(updates: list[dict], rollouts: list[dict]) -> list[dict]:
    """Per update, what explains its throughput. Counts come from the update's rollouts
    when rollouts.jsonl holds them ([observe].every may thin it), else the recorded fractions."""
    by_update: dict[int, list[dict]] = {}
    for r in rollouts:
        by_update.setdefault(r.get("update"), []).append(r)
    rows = []
    for m in timed_updates(updates):
        n = m["train/update"]
        members = by_update.get(n)
        if members:
            groups = Counter(r.get("group") for r in members)
            dead = {r.get("group") for r in members if r.get("skip_reason") == "zero_signal"}
            row = {
                "groups": f"{len(dead)} / {len(groups)}",
                "truncated": f"{sum(bool(r.get('truncated')) for r in members)} / {len(members)}",
                "dropped": f"{sum(r.get('skip_reason') not in (None, 'zero_signal') for r in members)} / {len(members)}",
            }
        else:
            row = {
                "groups": _percent(m.get("batch/dead_group_fraction")),
                "truncated": _percent(m.get("completions/truncation_fraction", m.get("agent/truncated_fraction"))),
                "dropped": _percent(m.get("agent/lost_fraction")),
            }
        rows.append(row | {
            "update": n,
            "seconds": f"{m['timing/update_seconds']:.2f}",
            "canceled": m.get("rollouts/canceled", "not recorded"),
            "waiting": _seconds(m.get("timing/waiting_for_batch_seconds")),
            "tokens_per_second": f"{m.get('train/tokens_per_second', 0.0):.1f}",
        })
    return rows


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def _seconds(value) -> str:
    return "not recorded" if value is None else f"{value:.2f} s"


class RolloutLog:
    """rollouts.jsonl read as it grows: each read parses only the lines appended since the
    last one (a line still being written waits for the next), so refreshing the report at
    every checkpoint costs what the run added, not what it holds. The bulky token ids and
    log-probs are dropped on the way in."""

    def __init__(self, path: Path | None):
        self.path, self.offset, self.rows = path, 0, []

    def read(self) -> list[dict]:
        if self.path is None or not self.path.is_file():
            return self.rows
        if self.path.stat().st_size < self.offset:  # rewritten by a fresh run
            self.offset, self.rows = 0, []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break
                self.offset += len(line)
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    self.rows.append(_slim(record))
        return self.rows


def _slim(record: dict) -> dict:
    for key in ("prompt_ids", "completion_ids", "sampler_logprobs", "policy_logprobs", "teacher_logprobs"):
        record.pop(key, None)
    turns = record.get("turns")
    if isinstance(turns, list):  # agent runs; only the parts of the shape retrograd writes
        record["turns"] = [
            {k: v for k, v in turn.items() if k not in ("prompt_ids", "completion_ids", "sampler_logprobs", "policy_logprobs")}
            | {"calls": [c for c in turn.get("calls") or () if isinstance(c, dict)]}
            for turn in turns if isinstance(turn, dict)
        ]
    else:
        record.pop("turns", None)
    return record


def browser(rows: list[dict]) -> dict:
    """What the rollout browser keeps: whole updates, evenly spread over the run, up to
    ROLLOUT_ROWS_CAP rows."""
    sizes = Counter(r.get("update") for r in rows)
    updates = sorted(u for u in sizes if isinstance(u, int))
    chosen, budget = [], ROLLOUT_ROWS_CAP
    for u in _evenly(updates, ROLLOUT_ROWS_CAP // max(max(sizes.values(), default=1), 1)):
        if sizes[u] <= budget:
            chosen.append(u)
            budget -= sizes[u]
    keep = set(chosen)
    shown = [_browsable(r) for r in rows if r.get("update") in keep]
    return {"shown": shown, "total": len(rows), "updates_total": len(updates), "updates_shown": chosen}


def _evenly(items: list, n: int) -> list:
    """Up to n items spread evenly, the first and last among them."""
    if n >= len(items):
        return items
    if n <= 1:
        return items[-1:]
    return [items[k] for k in sorted({round(i * (len(items) - 1) / (n - 1)) for i in range(n)})]


def _browsable(r: dict) -> dict:
    """One rollout as the browser shows it: texts cut to TEXT_CAP characters."""
    turns = [
        {"assistant": _cut(t.get("assistant")), "finish": t.get("finish"), "error": _cut(t.get("error")),
         "calls": [{"name": c.get("name"), "arguments": _cut(json.dumps(c.get("arguments"), ensure_ascii=False)),
                    "observation": _cut(c.get("observation")), "is_error": c.get("is_error"), "reward": c.get("reward")}
                   for c in t.get("calls") or ()]}
        for t in r.get("turns") or ()
    ]
    reward = r.get("reward")
    return {
        "update": r.get("update"), "group": r.get("group"), "prompt": _cut(r.get("prompt") or r.get("scenario")),
        "completion": _cut(r.get("completion")), "turns": turns, "tokens": r.get("tokens"),
        "truncated": bool(r.get("truncated")), "reward": reward if _is_number(reward) else None,
        "advantage": r.get("advantage") if _is_number(r.get("advantage")) else None,
        "teacher_kl": r.get("teacher_kl_mean") if _is_number(r.get("teacher_kl_mean")) else None,
        "trained": r.get("trained"), "skip_reason": r.get("skip_reason"),
    }


def _cut(text) -> str | None:
    if text is None:
        return None
    text = str(text)
    return text if len(text) <= TEXT_CAP else text[:TEXT_CAP] + " […]"


def checkpoint_rows(directory: Path | None) -> list[dict]:
    """The run's checkpoints (step-N and best), from their progress.json (display only: the
    files are not verified here, `--resume` does that)."""
    if directory is None or not directory.is_dir():
        return []
    folders = sorted({*directory.glob("step-*.state"), *directory.glob("best.state"), *directory.glob("*/step-*.state"),
                      *directory.glob("*/best.state")})
    rows = []
    for folder in folders:
        try:
            progress = json.loads((folder / "progress.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(progress, dict):
            rows.append({"name": folder.stem, "path": str(folder),
                         "step": progress.get("global_step"), "update": progress.get("update"), "best_eval": progress.get("best_eval"),
                         "written": datetime.datetime.fromtimestamp(folder.stat().st_mtime).strftime("%Y-%m-%d %H:%M:%S")})
    return rows


def algorithm_of(files: RunFiles, updates: list[dict], rollouts: list[dict]) -> str:
    if files.algorithm:
        return files.algorithm
    if not updates:
        return "sft or offline distill"
    if any("turns" in r for r in rollouts):
        return "agent_grpo"
    if any("teacher_kl_mean" in r for r in rollouts):
        return "distill (on-policy)"
    return "grpo"


# ---------------------------------------------------------------- the page


class RunReport:
    """A run's report, rewritten on demand; keeps what it read of rollouts.jsonl between writes."""

    def __init__(self, files: RunFiles):
        self.files = files
        self.rollouts = RolloutLog(files.rollouts)

    def write(self, out: Path | None = None) -> Path:
        """Write the page (to a temporary file, then renamed: a reader never sees half of it)."""
        from retrograd.run_report_page import render

        files = self.files
        records = latest_attempt(read_jsonl(files.metrics))
        updates = update_records(records)
        rollouts = self.rollouts.read() if updates else []  # a run without updates sampled nothing
        page = render(
            run=str(files.directory),
            algorithm=algorithm_of(files, updates, rollouts),
            generated=datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
            n_records=len(records),
            last_step=max((r["step"] for r in records), default=0),
            curves=curves(records, "train/update" if updates else "step"),
            timeline=timeline(updates),
            counters=counters(updates, rollouts),
            phases=phase_names(updates),
            browser=browser(rollouts),
            n_updates=len(updates),
            timeline_cap=TIMELINE_CAP,
            rows_cap=ROLLOUT_ROWS_CAP,
            text_cap=TEXT_CAP,
            checkpoints=checkpoint_rows(files.checkpoints),
        )
        out = out or files.directory / REPORT_NAME
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(page)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return out
