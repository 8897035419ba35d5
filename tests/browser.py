"""Headless Chromium (Debian's `chromium` package) for tests that look at a page as a user's
browser shows it: the DOM after the page's scripts ran, what it wrote to the console, and a
screenshot as pixels.

Tests that need it carry `@pytest.mark.browser`; conftest.py skips them when chromium is not
installed, and fails them under CI=true, where `.ci/run` installs it."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WINDOW = (1200, 1500)
# headless Chromium prints each console message (log, warning, error, uncaught exception
# alike, all at INFO level) to stderr as: [...:INFO:CONSOLE(12)] "text", source: URL (12)
CONSOLE_LINE = re.compile(r':CONSOLE[:(]\d*\)?\] "(?P<text>.*)", source: (?P<source>\S*)')


def chromium() -> str | None:
    return shutil.which("chromium")


@dataclass(frozen=True)
class Loaded:
    dom: str  # the document after its scripts ran
    console: list[str]  # every message the page wrote to the console


def _run(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--disable-gpu", "--hide-scrollbars", "--no-first-run", "--enable-logging=stderr", "--v=0",
             f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=10000"]
    if os.geteuid() == 0:
        flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
    return subprocess.run([chromium(), *flags, *args, page.resolve().as_uri()], capture_output=True, text=True,
                          timeout=180, check=True)


def load(page: Path, profile: Path) -> Loaded:
    result = _run(page, profile, "--dump-dom")
    console = [m["text"] for m in map(CONSOLE_LINE.search, result.stderr.splitlines()) if m]
    return Loaded(result.stdout, console)


def screenshot(page: Path, profile: Path) -> np.ndarray:
    """The page's first WINDOW of pixels, [height, width, channels] uint8."""
    shot = profile / "screenshot.png"
    _run(page, profile, f"--screenshot={shot}")
    return decode_png(shot.read_bytes())


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit, non-interlaced grey/RGB/RGBA PNG (what Chromium writes) as an array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        chunks.setdefault(kind, []).append(data[pos + 8:pos + 8 + n])
        pos += 12 + n
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    assert depth == 8 and interlace == 0 and colour in (0, 2, 6), (depth, colour, interlace)
    channels = {0: 1, 2: 3, 6: 4}[colour]
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(b"".join(chunks[b"IDAT"])), np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), np.uint8)
    previous = np.zeros(stride, np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            row = line.copy()
        elif kind == 1:  # Sub: a running sum per channel
            row = np.cumsum(line.reshape(width, channels), axis=0, dtype=np.uint64).astype(np.uint8).reshape(stride)
        elif kind == 2:  # Up
            row = line + previous
        else:  # Average, Paeth: each byte needs the one reconstructed to its left
            row = _sequential(kind, line.tolist(), previous.tolist(), channels)
        out[y] = row
        previous = out[y]
    return out.reshape(height, width, channels)


def _sequential(kind: int, line: list[int], up: list[int], bpp: int) -> np.ndarray:
    row = [0] * len(line)
    for i, x in enumerate(line):
        a = row[i - bpp] if i >= bpp else 0
        b = up[i]
        if kind == 3:
            row[i] = (x + (a + b) // 2) & 0xFF
        else:
            c = up[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            row[i] = (x + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return np.array(row, np.uint8)


def distinct_colours(pixels: np.ndarray) -> int:
    flat = pixels.reshape(-1, pixels.shape[-1]).astype(np.uint32)
    keys = sum(flat[:, k] << (8 * k) for k in range(flat.shape[1]))
    return len(np.unique(keys))
