"""Trace files on disk: the I/O half of :mod:`pegaflow.core.trace` (which parses lines)."""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator
from pathlib import Path


def open_trace(path: str | Path) -> gzip.GzipFile | io.BufferedReader:
    """Open a trace file for reading bytes; ``.gz`` files are decompressed."""
    p = Path(path)
    return gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb")


def iter_lines(path: str | Path) -> Iterator[str]:
    """The file's lines as text. Each line is decoded on its own, so bytes that are not UTF-8
    fail at their own line (``read_trace`` names it)."""
    with open_trace(path) as f:
        for raw in f:
            yield raw.decode("utf-8")
