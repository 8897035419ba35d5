"""The `retrograd` command: app.py holds the Typer app and `main`; importing this package
imports each command module, which registers its commands on the app."""

from __future__ import annotations

from retrograd.cli import (
    bench as _bench,  # noqa: F401  (registers bench)
    chat as _chat,  # noqa: F401  (registers chat)
    collect as _collect,  # noqa: F401  (registers collect)
    distill as _distill,  # noqa: F401  (registers distill-teacher)
    eval as _eval,  # noqa: F401  (registers eval)
    judge as _judge,  # noqa: F401  (registers judge eval)
    merge as _merge,  # noqa: F401  (registers merge)
    model as _model,  # noqa: F401  (registers inspect, preflight)
    profile as _profile,  # noqa: F401  (registers profile)
    report as _report,  # noqa: F401  (registers report)
    rollout_worker as _rollout_worker,  # noqa: F401  (registers rollout-worker)
    serve as _serve,  # noqa: F401  (registers serve)
    tools as _tools,  # noqa: F401  (registers tools list)
    train as _train,  # noqa: F401  (registers train)
)
from retrograd.cli.app import app, main  # noqa: F401  (the entry point and the app, for tests)
