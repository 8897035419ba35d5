"""`NAME.report.html`: one self-contained page about a run, built from what the run leaves behind.

A run whose output is NAME.gguf writes NAME.metrics.jsonl beside it (one record per step or
update, plus evaluation records); rollout runs (grpo, agent_grpo, on-policy distill) also
write NAME.rollouts.jsonl there (or in [observe].directory), and checkpoints go to
[checkpoint].directory. The page (NAME.report.html beside the metrics) draws the curves
those records hold, for rollout runs a timeline of each update's phases, the counters that
explain throughput and a browser of the rollouts, and after `retrograd eval` its paired table
(NAME.eval.json). plotly.js is embedded, so the page opens without a network. Rollout text is model output, never trusted: it reaches the page
only through Jinja's autoescaping; a line of a record file that is not as retrograd writes
it is left out, and the page says how many were.
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

METRICS_SUFFIX = ".metrics.jsonl"
ROLLOUT_ROWS_CAP = 2000  # rows in the rollout browser: whole updates, evenly spread over the run
TIMELINE_CAP = 60  # updates on the timeline and in the counters table, evenly spread over the run
TEXT_CAP = 4000  # characters of one prompt, completion, turn or tool observation
ROLLOUT_ALGORITHMS = ("ppo", "grpo", "agent_grpo")

# (panel title, y-axis title, series drawn as lines, series drawn as markers: evaluation points)
CURVES = (
    ("Loss", "loss", ("train/loss", "policy/total_loss"), ("eval/loss",)),
    ("Reward", "reward", ("reward/mean", "reward/min", "reward/max"), ("eval/mean_reward",)),
    ("KL", "nats per token", ("policy/kl", "distill/teacher_kl_mean"), ("eval/teacher_kl_mean",)),
    ("Preference accuracy", "share of pairs", ("rewards/accuracies",), ("eval/rewards/accuracies",)),
    ("Preference rewards", "implicit reward", ("rewards/chosen", "rewards/rejected", "rewards/margins"), ("eval/rewards/margins",)),
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
# metrics keys the page computes with besides timing/*: a record holding anything but a finite
# number under one of them is left out (other values that are not numbers are simply not drawn)
COMPUTED_METRICS = ("step", "time", "train/update", "train/tokens_per_second", "rollouts/canceled",
                    "batch/dead_group_fraction", "completions/truncation_fraction", "agent/truncated_fraction",
                    "agent/lost_fraction")


@dataclass(frozen=True)
class RunFiles:
    """Where one run's records are: NAME.metrics.jsonl and the rest (training.metrics.run_record).
    rollouts is None for runs that sample nothing."""

    metrics: Path
    rollouts: Path | None
    checkpoints: Path | None
    algorithm: str | None  # from the config; None when only the folder or a file was given

    @property
    def run(self) -> Path:
        """The run's records without their suffix: out/a for out/a.metrics.jsonl."""
        return self.metrics.with_name(self.metrics.name.removesuffix(METRICS_SUFFIX))

    @property
    def report(self) -> Path:
        """Where the page goes unless told: NAME.report.html beside the metrics."""
        return self.run.with_name(f"{self.run.name}.report.html")

    @property
    def evaluation(self) -> Path:
        """NAME.eval.json: `retrograd eval` of the base and the run's adapter ([evaluation] tasks
        after the run, or `retrograd eval --run`)."""
        return self.run.with_name(f"{self.run.name}.eval.json")


def locate(run: Path) -> RunFiles:
    """The files of the run a config TOML describes, of the one run whose records folder `run`
    holds, or of the run whose output .gguf or NAME.metrics.jsonl `run` names."""
    usage = "give the run's config .toml, its output .gguf, its NAME.metrics.jsonl or the folder holding it"
    if run.is_file() and run.suffix == ".toml":
        from retrograd.config import load_config

        return run_files(load_config(run))
    if run.is_dir():
        found = sorted(p for p in run.glob(f"*{METRICS_SUFFIX}") if p.is_file())
        if len(found) != 1:
            held = f"holds the records of {len(found)} runs ({', '.join(p.name for p in found)})" if found else "no run's records"
            raise RetrogradError(f"{run}: {held}; {usage}")
        metrics = found[0]
    elif run.name.endswith(METRICS_SUFFIX):
        metrics = run
    elif run.suffix == ".gguf":
        metrics = run.with_name(run.stem + METRICS_SUFFIX)
    else:
        raise RetrogradError(f"{run}: {'not a run' if run.exists() else 'no such file or folder'}; {usage}")
    if not metrics.is_file():
        raise RetrogradError(f"{run}: no {metrics} (train the run first; {usage})")
    name = metrics.name.removesuffix(METRICS_SUFFIX)
    return RunFiles(metrics, metrics.with_name(f"{name}.rollouts.jsonl"), metrics.parent, None)


def run_files(cfg) -> RunFiles:
    """The files `cfg`'s run writes (where the recipes write them: training.metrics.run_record)."""
    from retrograd.training.metrics import run_record

    algorithm = cfg.run.algorithm
    samples = algorithm in ROLLOUT_ALGORITHMS or (algorithm == "distill" and cfg.distill.mode == "on_policy")
    checkpoints = cfg.checkpoint.directory if cfg.checkpoint else None
    metrics = run_record(cfg, "metrics.jsonl")
    if not metrics.is_file():
        raise RetrogradError(f"{cfg.path}: its run has no {metrics} yet (train it first: retrograd train {cfg.path})")
    return RunFiles(metrics, run_record(cfg, "rollouts.jsonl") if samples else None, checkpoints, algorithm)


def parse_record(line: str | bytes) -> dict | None:
    """One line of a run's JSONL file as a JSON object, or None (damage, a line being
    written, nesting too deep to parse)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """The metrics records of a file a run may still be appending to, and how many lines were
    left out: not a JSON object, or no finite number under a key the page computes with."""
    records, skipped = [], 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                record = parse_record(line)
                if record is not None and _is_metrics(record):
                    records.append(record)
                elif line.strip():
                    skipped += 1
    except OSError as e:
        raise RetrogradError(f"{path}: cannot read the run's metrics ({e.strerror or e})") from None
    return records, skipped


def _is_metrics(record: dict) -> bool:
    """A record as MetricsSink writes it: a step and a time, and numbers where the page computes."""
    computed = [value for key, value in record.items() if key in COMPUTED_METRICS or key.startswith("timing/")]
    return "step" in record and "time" in record and all(map(_is_number, computed))


def latest_attempt(records: list[dict]) -> list[dict]:
    """NAME.metrics.jsonl of a resumed run holds the steps after the checkpoint twice (the
    lost attempt, then the resumed one): keep the later ones."""
    kept: list[dict] = []
    for record in records:
        step = record["step"]
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
    """A finite number: NaN, inf and integers beyond float range are not drawn."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    """NAME.rollouts.jsonl read as it grows: each read parses only the lines appended since
    the last one (a line still being written waits for the next), so refreshing the report
    at every checkpoint costs what the run added, not what it holds. Each rollout is kept as
    the counters and the browser use it (texts cut, token ids and log-probs dropped); a line
    that is not a rollout as retrograd writes it is left out and counted."""

    def __init__(self, path: Path | None):
        self.path, self.offset, self.rows, self.skipped = path, 0, [], 0

    def read(self) -> list[dict]:
        if self.path is None or not self.path.is_file():
            return self.rows
        try:
            if self.path.stat().st_size < self.offset:  # rewritten by a fresh run
                self.offset, self.rows, self.skipped = 0, [], 0
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                for line in f:
                    if not line.endswith(b"\n"):
                        break
                    self.offset += len(line)
                    row = _browsable(parse_record(line))
                    if row is not None:
                        self.rows.append(row)
                    elif line.strip():
                        self.skipped += 1
        except OSError as e:
            raise RetrogradError(f"{self.path}: cannot read the run's rollouts ({e.strerror or e})") from None
        return self.rows


def _is_rollout(record: dict) -> bool:
    """What the counters and the browser compute with: the update and group numbers, and an
    agent run's turns as lists of objects."""
    turns = record.get("turns", [])
    if not (_is_count(record.get("update")) and _is_count(record.get("group")) and isinstance(turns, list)):
        return False
    calls = [turn.get("calls", []) if isinstance(turn, dict) else None for turn in turns]
    return all(isinstance(c, list) and all(isinstance(call, dict) for call in c) for c in calls)


def browser(rows: list[dict]) -> dict:
    """What the rollout browser keeps: whole updates, evenly spread over the run, up to
    ROLLOUT_ROWS_CAP rows."""
    sizes = Counter(r["update"] for r in rows)
    updates = sorted(sizes)
    chosen, budget = [], ROLLOUT_ROWS_CAP
    for u in _evenly(updates, ROLLOUT_ROWS_CAP // max(max(sizes.values(), default=1), 1)):
        if sizes[u] <= budget:
            chosen.append(u)
            budget -= sizes[u]
    keep = set(chosen)
    shown = [r for r in rows if r["update"] in keep]
    return {"shown": shown, "total": len(rows), "updates_total": len(updates), "updates_shown": chosen}


def _evenly(items: list, n: int) -> list:
    """Up to n items spread evenly, the first and last among them."""
    if n >= len(items):
        return items
    if n <= 1:
        return items[-1:]
    return [items[k] for k in sorted({round(i * (len(items) - 1) / (n - 1)) for i in range(n)})]


def _browsable(r: dict | None) -> dict | None:
    """One rollout as the counters and the browser use it: texts cut to TEXT_CAP characters,
    numbers that are numbers (else None), nothing else; None when `r` is not a rollout as
    retrograd writes it (the update and group it counts by, its turns' shape) or holds a
    value nested too deep to print."""
    if r is None or not _is_rollout(r):
        return None
    try:
        turns = [
            {"assistant": _cut(t.get("assistant")), "finish": _cut(t.get("finish")), "error": _cut(t.get("error")),
             "calls": [{"name": _cut(c.get("name")), "arguments": _cut(json.dumps(c.get("arguments"), ensure_ascii=False)),
                        "observation": _cut(c.get("observation")), "is_error": bool(c.get("is_error")),
                        "reward": _number(c.get("reward"))}
                       for c in t.get("calls", [])]}
            for t in r.get("turns", [])
        ]
        return {
            "update": r["update"], "group": r["group"], "prompt": _cut(r.get("prompt") or r.get("scenario")),
            "completion": _cut(r.get("completion")), "turns": turns, "tokens": _number(r.get("tokens")),
            "truncated": bool(r.get("truncated")), "reward": _number(r.get("reward")), "advantage": _number(r.get("advantage")),
            "teacher_kl": _number(r.get("teacher_kl_mean")),
            "trained": None if r.get("trained") is None else bool(r["trained"]), "skip_reason": _cut(r.get("skip_reason")),
        }
    except RecursionError:
        return None


def _number(value) -> int | float | None:
    return value if _is_number(value) else None


def _cut(text) -> str | None:
    if text is None:
        return None
    text = str(text)
    return text if len(text) <= TEXT_CAP else text[:TEXT_CAP] + " […]"


def checkpoint_rows(directory: Path | None) -> tuple[list[dict], int]:
    """The run's checkpoints (step-N and best), from their progress.json (display only: the
    files are not verified here, `--resume` does that), and how many were left out because
    their progress.json is unreadable or not as retrograd writes it."""
    if directory is None or not directory.is_dir():
        return [], 0
    folders = sorted({*directory.glob("step-*.state"), *directory.glob("best.state"), *directory.glob("*/step-*.state"),
                      *directory.glob("*/best.state")})
    rows, skipped = [], 0
    for folder in folders:
        try:
            progress = parse_record((folder / "progress.json").read_bytes())
            written = datetime.datetime.fromtimestamp(folder.stat().st_mtime).strftime("%Y-%m-%d %H:%M:%S")
        except OSError:
            progress = None
        if (progress is None or not _is_count(progress.get("global_step"))
                or not (progress.get("update") is None or _is_count(progress["update"]))
                or not (progress.get("best_eval") is None or _is_number(progress["best_eval"]))):
            skipped += 1
            continue
        rows.append({"name": folder.stem, "path": str(folder), "step": progress["global_step"],
                     "update": progress.get("update"), "best_eval": progress.get("best_eval"), "written": written})
    return rows, skipped


def evaluation_rows(path: Path) -> tuple[list[dict], int]:
    """The paired table of NAME.eval.json (cli.eval.write_results): per task, each metric of each
    model and each adapter's difference with the base, and how many tasks were left out as not
    as retrograd writes them (the file is written whole, so a damaged one is left out whole)."""
    if not path.is_file():
        return [], 0
    try:
        results = parse_record(path.read_bytes())
    except OSError:
        results = None
    if results is None:
        return [], 1
    rows, skipped = [], 0
    for name, result in results.items():
        row = _evaluation_row(str(name), result)
        if row is None or (rows and row["models"] != rows[0]["models"]):  # one table: the same models throughout
            skipped += 1
        else:
            rows.append(row)
    return rows, skipped


def _evaluation_row(task: str, result) -> dict | None:
    metrics = result.get("metrics") if isinstance(result, dict) else None
    differences = result.get("differences", {}) if isinstance(result, dict) else None
    if not (isinstance(metrics, dict) and isinstance(metrics.get("base"), dict) and isinstance(differences, dict)):
        return None
    models = ["base", *(m for m in metrics if m != "base")]
    names = list(metrics["base"])
    if not all(isinstance(metrics[m], dict) and all(_is_number(metrics[m].get(n)) for n in names) for m in models):
        return None
    kept = {}
    for model, d in differences.items():
        if model not in metrics or not isinstance(d, dict) or not all(_is_number(d.get(k)) for k in ("mean", "low", "high")):
            return None
        kept[model] = {"mean": d["mean"], "low": d["low"], "high": d["high"], "verdict": _cut(d.get("verdict"))}
    return {"task": task, "kind": _cut(result.get("kind")), "items": _number(result.get("items")), "models": models,
            "metrics": [{"name": _cut(n), "values": [metrics[m][n] for m in models]} for n in names],
            "differences": [kept.get(m) for m in models[1:]]}


def algorithm_of(files: RunFiles, updates: list[dict], rollouts: list[dict]) -> str:
    if files.algorithm:
        return files.algorithm
    if not updates:
        return "sft or offline distill"
    if any(r["turns"] for r in rollouts):
        return "agent_grpo"
    if any(r["teacher_kl"] is not None for r in rollouts):
        return "distill (on-policy)"
    return "grpo"


# ---------------------------------------------------------------- the page


class RunReport:
    """A run's report, rewritten on demand; keeps what it read of NAME.rollouts.jsonl between
    writes. `skipped` says what the last write left out as malformed ([] when nothing)."""

    def __init__(self, files: RunFiles):
        self.files = files
        self.rollouts = RolloutLog(files.rollouts)
        self.skipped: list[str] = []

    def write(self, out: Path | None = None) -> Path:
        """Write the page (to a temporary file, then renamed: a reader never sees half of it)."""
        from retrograd.reports.page import render

        files = self.files
        records, bad_metrics = read_metrics(files.metrics)
        records = latest_attempt(records)
        updates = update_records(records)
        rollouts = self.rollouts.read() if updates else []  # a run without updates sampled nothing
        checkpoints, bad_checkpoints = checkpoint_rows(files.checkpoints)
        evaluation, bad_tasks = evaluation_rows(files.evaluation)
        self.skipped = [f"{n} {what}" for n, what in (
            (bad_metrics, f"line{'s' * (bad_metrics != 1)} of {files.metrics}"),
            (self.rollouts.skipped if updates else 0, f"line{'s' * (self.rollouts.skipped != 1)} of {files.rollouts}"),
            (bad_checkpoints, f"checkpoint{'s' * (bad_checkpoints != 1)} (progress.json)"),
            (bad_tasks, f"evaluation task{'s' * (bad_tasks != 1)} of {files.evaluation}"),
        ) if n]
        page = render(
            run=str(files.run),
            skipped=self.skipped,
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
            checkpoints=checkpoints,
            evaluation=evaluation,
            evaluation_file=str(files.evaluation),
        )
        out = out or files.report
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
