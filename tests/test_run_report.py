"""`retrograd report` and the report `train` keeps: built from real tiny runs (SFT in process
with the train command's console, GRPO through `retrograd train`), its data checked against
the run's own records, its rollout text escaped, and the page loaded in headless Chromium."""

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import browser
import pytest
from markupsafe import escape
from test_cli_resume import write_run
from test_grpo import write_config

from retrograd.cli.train import ReportingConsole
from retrograd.config import load_config
from retrograd.recipes import sft
from retrograd.reports.run_report import ROLLOUT_ROWS_CAP, RolloutLog, _browsable, browser as browsable, latest_attempt

RETROGRAD = [sys.executable, "-m", "retrograd"]
HOSTILE = '</script><script>document.title="pwned"</script><img src=x onerror="document.title=\'pwned\'">'


def cli(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*RETROGRAD, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600, check=False)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def figures(page: str) -> dict[str, list[dict]]:
    """The page's plotly figures by title: their traces as the browser gets them."""
    found = re.search(r'<script type="application/json" id="figures">(.*?)</script>', page, re.DOTALL)
    return {fig["layout"]["title"]["text"]: fig["data"] for fig in json.loads(found.group(1))}


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model) -> Path:
    """A tiny SFT run with an evaluation, a checkpoint per step, reported as `train` does."""
    folder = tmp_path_factory.mktemp("sft")
    cfg = write_run(folder, tiny_model("llama"))
    cfg.write_text(cfg.read_text().replace('mode = "steps"', 'mode = "steps_and_best_eval"') + '[evaluation]\ndata = "train.jsonl"\n')
    sft.run(load_config(cfg), ReportingConsole(load_config(cfg)))
    return folder


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_model) -> tuple[Path, str]:
    """A tiny GRPO run through `retrograd train`, with evaluations and a checkpoint per step; its stdout."""
    folder = tmp_path_factory.mktemp("grpo")
    cfg = write_config(folder, tiny_model("llama"), updates=3, reward_name="length",
                       extra='[evaluation]\ndata = "prompts.jsonl"\nmax_examples = 4\n'
                             '[checkpoint]\ndirectory = "out/ckpt"\nmode = "steps"\nevery_steps = 1\n')
    cfg.write_text(cfg.read_text().replace("kl_coefficient = 0.0", "kl_coefficient = 0.02"))  # a KL to draw
    result = cli("train", cfg, cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder, result.stdout


def test_checkpoints_refresh_the_report_with_every_curve(sft_run):
    """Written by the checkpoints alone (the recipe ran without the command's final write),
    after the last step: every loss, learning rate and evaluation point is on the page."""
    page = (sft_run / "out/adapter.report.html").read_text()
    metrics = records(sft_run / "out/adapter.metrics.jsonl")
    curves = figures(page)
    train_loss = next(t for t in curves["Loss"] if t["name"] == "train/loss")
    assert train_loss["y"] == [r["train/loss"] for r in metrics if "train/loss" in r]
    evaluation = next(t for t in curves["Loss"] if t["name"] == "eval/loss")
    assert evaluation["mode"] == "markers" and evaluation["y"] == [r["eval/loss"] for r in metrics if "eval/loss" in r]
    assert next(t for t in curves["Learning rate"])["y"] == [r["train/lr"] for r in metrics if "train/lr" in r]
    assert "Timeline of updates" not in curves and 'id="rollouts"' not in page  # SFT samples nothing
    for step in (r["step"] for r in metrics if "train/loss" in r):
        assert f"ckpt/step-{step:012d}.state" in page


def test_train_prints_the_report_of_a_rollout_run(grpo_run):
    folder, stdout = grpo_run
    report = folder / "out/adapter.report.html"
    assert stdout.strip().splitlines()[-1] == f"report: {report}"
    page = report.read_text()
    assert "<script src" not in page and "<link" not in page  # nothing to fetch: plotly.js is inline
    metrics = records(folder / "out/adapter.metrics.jsonl")
    updates = [r for r in metrics if "timing/update_seconds" in r]
    curves = figures(page)
    assert next(t for t in curves["Reward"] if t["name"] == "reward/mean")["y"] == [r["reward/mean"] for r in updates]
    assert next(t for t in curves["Reward"] if t["name"] == "eval/mean_reward")["y"] == [
        r["eval/mean_reward"] for r in metrics if "eval/mean_reward" in r]
    assert next(t for t in curves["KL"] if t["name"] == "policy/kl")["y"] == [r["policy/kl"] for r in updates]

    bars = {t["name"]: t for t in curves["Timeline of updates"]}
    assert bars["generation"]["x"] == [r["timing/generation_seconds"] for r in updates]
    assert bars["optimizer"]["x"] == [r["timing/optimizer_seconds"] for r in updates]
    assert bars["waiting for batch"]["x"] == [0.0] * len(updates)  # synchronous: recorded as 0
    assert all(r["rollouts/canceled"] == 0 and r["timing/waiting_for_batch_seconds"] == 0.0 for r in updates)
    ends = [start + width for start, width in zip(bars["other"]["base"], bars["other"]["x"])]
    starts = [r["time"] - r["timing/update_seconds"] - (updates[0]["time"] - updates[0]["timing/update_seconds"]) for r in updates]
    assert ends == pytest.approx([s + r["timing/update_seconds"] for s, r in zip(starts, updates)], abs=1e-6)

    rollouts = records(folder / "out/adapter.rollouts.jsonl")
    assert page.count('<tr data-update="') == len(rollouts) == 3 * 2 * 4
    counters = re.search(r'<table id="counters">.*?</table>', page, re.DOTALL).group(0)
    assert counters.count("<tr>") == 1 + len(updates)
    truncated = sum(r["truncated"] for r in rollouts if r["update"] == 1)
    assert f"{truncated} / 8" in counters


def test_report_command_from_the_config_and_bad_folders(grpo_run, tmp_path):
    folder, _ = grpo_run
    out = tmp_path / "elsewhere.html"
    result = cli("report", folder / "grpo.toml", "--out", out)
    assert result.returncode == 0 and result.stdout.strip() == f"report: {out}", result.stderr
    assert figures(out.read_text()).keys() == figures((folder / "out/adapter.report.html").read_text()).keys()
    for bad in (tmp_path, tmp_path / "missing"):
        result = cli("report", bad)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {bad}"), result.stderr


@pytest.fixture(scope="module")
def hostile_report(grpo_run, tmp_path_factory) -> tuple[Path, str]:
    """The GRPO run's report once a completion and a prompt carry markup and script."""
    folder = tmp_path_factory.mktemp("hostile") / "out"
    shutil.copytree(grpo_run[0] / "out", folder)
    rows = records(folder / "adapter.rollouts.jsonl")
    rows[0] |= {"completion": HOSTILE, "prompt": HOSTILE}
    (folder / "adapter.rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli("report", folder).returncode == 0
    return folder / "adapter.report.html", rows[0]["completion"]


def test_rollout_text_is_text_not_markup(hostile_report):
    report, hostile = hostile_report
    page = report.read_text()
    assert hostile not in page and "<img" not in page
    assert page.count(escape(hostile)) == 2  # prompt and completion cells, as Jinja escapes them


@pytest.mark.browser
def test_report_loads_draws_and_shows_in_chromium(grpo_run, hostile_report, tmp_path):
    report, hostile = hostile_report
    loaded = browser.load(report, tmp_path / "profile")
    assert loaded.console == []  # no error, warning or message of any kind
    drawn = loaded.dom.count('class="main-svg"')
    assert drawn >= 2 * len(figures(report.read_text()))  # plotly draws two main-svg layers per figure
    assert "<title>retrograd report" in loaded.dom and "pwned" not in loaded.dom.split("</title>")[0]
    assert loaded.dom.count("<script") == 3 and html.escape(hostile, quote=False) in loaded.dom
    assert re.search(r'id="f-status">\d+ matching, page 1 of \d+<', loaded.dom)  # the browser's script ran
    pixels = browser.screenshot(report, tmp_path / "profile")
    assert pixels.shape[:2] == browser.WINDOW[::-1] and browser.distinct_colours(pixels) > 200


@pytest.mark.browser
def test_the_console_check_catches_a_page_error(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<html><body><p>broken</p><script>notAFunction();</script></body></html>")
    console = browser.load(page, tmp_path / "profile").console
    assert len(console) == 1 and console[0].startswith("Uncaught ReferenceError: notAFunction")


def test_browser_keeps_whole_updates_spread_over_a_long_run(tmp_path):
    """Past the cap, whole updates, the first and the last among them; a line still being
    written is read once it is complete."""
    path = tmp_path / "rollouts.jsonl"
    per_update, updates = 16, 2 * ROLLOUT_ROWS_CAP // 16 + 7
    lines = [json.dumps({"update": u, "group": k // 4, "completion": f"c{u}.{k}", "reward": k / 10, "completion_ids": [1, 2]}) + "\n"
             for u in range(1, updates + 1) for k in range(per_update)]
    text = "".join(lines)
    path.write_text(text[:-10])
    log = RolloutLog(path)
    assert len(log.read()) == len(lines) - 1
    path.write_text(text)
    rows = log.read()
    assert len(rows) == len(lines) and "completion_ids" not in rows[0]
    shown = browsable(rows)
    kept = sorted({r["update"] for r in shown["shown"]})
    assert len(shown["shown"]) <= ROLLOUT_ROWS_CAP and len(shown["shown"]) == per_update * len(kept)
    assert kept == shown["updates_shown"] and kept[0] == 1 and kept[-1] == updates and len(kept) > updates // 3


def test_a_resumed_runs_repeated_steps_are_kept_once():
    first = [{"step": s, "train/loss": 1.0} for s in (1, 2, 3, 4)]
    resumed = [{"step": s, "train/loss": 2.0} for s in (3, 4, 5)]
    kept = latest_attempt([*first, {"step": 4, "eval/loss": 0.5}, *resumed])
    assert [(r["step"], r["train/loss"]) for r in kept] == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0), (5, 2.0)]


def test_two_runs_sharing_a_folder_keep_their_own_records(tmp_path, tiny_model):
    """Two configs whose outputs share out/ (as the Rust retrograd's examples share one
    folder), trained one after another: each keeps its own NAME.metrics.jsonl and
    NAME.report.html, `--resume` appends to its own, a rerun starts its own afresh, and
    `retrograd report out/` names both runs rather than pick one."""
    first = write_run(tmp_path, tiny_model("llama"))  # out/adapter.gguf, checkpoints in ckpt/
    second = tmp_path / "second.toml"
    second.write_text(first.read_text().replace("out/adapter.gguf", "out/second.gguf").replace('"ckpt"', '"ckpt2"')
                      .replace("lr = 5e-3", "lr = 1e-3"))
    for cfg in (first, second):
        sft.run(load_config(cfg), ReportingConsole(load_config(cfg)))
    out = tmp_path / "out"
    kept = {name: (out / f"{name}.metrics.jsonl").read_text() for name in ("adapter", "second")}
    losses = {name: [r["train/loss"] for r in records(out / f"{name}.metrics.jsonl") if "train/loss" in r] for name in kept}
    assert len(losses["adapter"]) == len(losses["second"]) == 6 and losses["adapter"] != losses["second"]
    for name, own in losses.items():
        drawn = figures((out / f"{name}.report.html").read_text())["Loss"]
        assert next(t for t in drawn if t["name"] == "train/loss")["y"] == own

    for late in ("step-000000000004", "step-000000000005", "step-000000000006"):  # the first run stopped after step 3
        shutil.rmtree(tmp_path / f"ckpt/{late}.state")
        (tmp_path / f"ckpt/{late}.gguf").unlink()
    sft.run(load_config(first), ReportingConsole(load_config(first)), resume=True)
    resumed = (out / "adapter.metrics.jsonl").read_text()
    assert resumed.startswith(kept["adapter"])
    assert [r["step"] for r in map(json.loads, resumed[len(kept["adapter"]):].splitlines()) if "train/loss" in r] == [4, 5, 6]
    assert (out / "second.metrics.jsonl").read_text() == kept["second"]
    sft.run(load_config(second), ReportingConsole(load_config(second)))  # without --resume: afresh, as before
    assert len([r for r in records(out / "second.metrics.jsonl") if "train/loss" in r]) == 6

    result = cli("report", out)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "2 runs (adapter.metrics.jsonl, second.metrics.jsonl)" in lines[0], result.stderr
    for run in (second, out / "second.gguf", out / "second.metrics.jsonl"):
        result = cli("report", run)
        assert result.returncode == 0 and result.stdout.strip() == f"report: {out / 'second.report.html'}", result.stderr


DEEP = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError


def change_line(first_with: str, change: dict):
    """A change to the first JSONL line holding key `first_with`."""
    def corrupt(text: str) -> str:
        lines = text.splitlines()
        k = next(i for i, line in enumerate(lines) if first_with in json.loads(line))
        lines[k] = json.dumps(json.loads(lines[k]) | change)
        return "\n".join(lines) + "\n"
    return corrupt


METRICS, ROLLOUTS, PROGRESS = "adapter.metrics.jsonl", "adapter.rollouts.jsonl", "ckpt/step-000000000001.state/progress.json"
MALFORMED = {
    "metrics nested too deep": (METRICS, lambda text: text + DEEP + "\n"),
    "metrics null timing": (METRICS, change_line("timing/update_seconds", {"timing/update_seconds": None})),
    "metrics string time": (METRICS, change_line("timing/update_seconds", {"time": "soon"})),
    "metrics number beyond float": (METRICS, change_line("timing/update_seconds", {"timing/generation_seconds": 10**400})),
    "metrics not an object": (METRICS, lambda text: text + "[1, 2]\n"),
    "rollouts nested too deep": (ROLLOUTS, lambda text: text + DEEP + "\n"),
    "rollouts list update": (ROLLOUTS, change_line("update", {"update": [1]})),
    "rollouts calls not a list": (ROLLOUTS, change_line("update", {"turns": [{"assistant": "x", "calls": 5}]})),
    "progress best_eval string": (PROGRESS, lambda text: json.dumps(json.loads(text) | {"best_eval": "high"})),
    "progress null step": (PROGRESS, lambda text: json.dumps(json.loads(text) | {"global_step": None})),
    "progress nested too deep": (PROGRESS, lambda text: DEEP),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_record_is_left_out_and_counted(grpo_run, tmp_path, case):
    """Each file the report reads, damaged one way: `retrograd report` still writes the page
    (exit 0), leaves the bad line or checkpoint out and says so on the page and in one note."""
    name, corrupt = MALFORMED[case]
    folder = tmp_path / "out"
    shutil.copytree(grpo_run[0] / "out", folder)
    (folder / name).write_text(corrupt((folder / name).read_text()))
    result = cli("report", folder)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    left_out = "1 checkpoint (progress.json)" if name == PROGRESS else f"1 line of {folder / name}"
    assert result.stderr.strip() == f"note: left out as malformed: {left_out}"
    page = (folder / "adapter.report.html").read_text()
    assert re.search(rf'<p id="skipped" class="error">Left out as malformed[^<]*{re.escape(left_out)}\.</p>', page)


def test_a_rollout_too_deep_to_print_is_left_out():
    """json.loads stops about where printing would: a value just within its reach must not
    take the page down when it is printed (str and json.dumps recurse too)."""
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert _browsable({"update": 1, "group": 0, "prompt": deep}) is None
    assert _browsable({"update": 1, "group": 0, "turns": [{"calls": [{"arguments": deep}]}]}) is None
    assert _browsable({"update": 1, "group": 0, "prompt": "2 + 2?"})["prompt"] == "2 + 2?"
