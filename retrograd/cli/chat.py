"""`retrograd chat`."""

from __future__ import annotations

from retrograd.cli import app  # noqa: F401
