"""Shared fixtures: real model files (bundled SmolLM2, Gemma-3) and tiny GGUFs written by
the tests themselves (once per session)."""

from __future__ import annotations

from pathlib import Path

import browser
import pytest
import sandboxes
import torch
from gguf_factory import write_f32_copy, write_tiny_model

from retrograd.runtime.bundled import default_model_path, gemma3_path

torch.set_num_threads(2)
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return gemma3_path()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_dir):
    """tiny_model("qwen3") -> path of a random F32 qwen3 GGUF (written once)."""
    made: dict[tuple, Path] = {}

    def make(name: str, **kw) -> Path:
        key = (name, tuple(sorted(kw.items())))
        if key not in made:
            suffix = "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
            made[key] = write_tiny_model(model_dir / f"tiny-{name}{suffix}.gguf", name, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2_f32(model_dir, smollm2) -> Path:
    return write_f32_copy(smollm2, model_dir / "smollm2-f32.gguf")


@pytest.fixture(scope="session")
def ordinary_text() -> str:
    return (DATA / "ordinary_text.txt").read_text()


# ---------------------------------------------------------------- sandbox tests: requirement and count
# Tests marked `container` or `namespace` (see tests/sandboxes.py) skip, or under CI=true fail,
# when their sandbox cannot run; the summary says how many of each ran.

_SANDBOX = {"kinds": {}, "outcomes": {}}  # nodeid -> kind of the selected tests; nodeid -> (kind, outcome)


def _sandbox_kind(item) -> str | None:
    return next((kind for kind in sandboxes.KINDS if item.get_closest_marker(kind)), None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test is set up."""
    kind = _sandbox_kind(item)
    if kind is not None:
        sandboxes.require(kind)
    if item.get_closest_marker("browser") and browser.chromium() is None:
        sandboxes.unavailable("chromium is not installed (apt-get install -y chromium)")


def pytest_collection_finish(session):
    _SANDBOX["kinds"] = {item.nodeid: kind for item in session.items if (kind := _sandbox_kind(item))}
    _SANDBOX["outcomes"] = {}


def pytest_runtest_logreport(report):
    kind = _SANDBOX["kinds"].get(report.nodeid)
    if kind is not None and (report.when == "call" or report.outcome != "passed"):
        # "ran": the test body ran to a pass or a failure; else it skipped (in setup or in its
        # body) or its setup failed
        outcome = "skipped" if report.skipped else "ran" if report.when == "call" else "failed"
        _SANDBOX["outcomes"].setdefault(report.nodeid, (kind, outcome))


def _sandbox_counts() -> dict[str, dict[str, int]]:
    counts = {kind: {"ran": 0, "skipped": 0, "failed": 0} for kind in sandboxes.KINDS}
    for kind, outcome in _SANDBOX["outcomes"].values():
        counts[kind][outcome] += 1
    return counts


def _skipped_in_ci() -> bool:
    return sandboxes.in_ci() and any(c["skipped"] for c in _sandbox_counts().values())


def pytest_sessionfinish(session, exitstatus):
    """Under CI=true a skipped sandbox test, however it came to skip, fails the run."""
    if _skipped_in_ci() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line, read by .ci/run: `sandbox tests: container N ran; namespace M ran`."""
    parts = [f"{kind} {c['ran']} ran" + "".join(f", {c[k]} {k}" for k in ("skipped", "failed") if c[k])
             for kind, c in _sandbox_counts().items()]
    terminalreporter.write_line("sandbox tests: " + "; ".join(parts))
    if _skipped_in_ci():
        terminalreporter.write_line("sandbox tests: CI=true, yet some were skipped: the run fails", red=True)
