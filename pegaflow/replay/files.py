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


def iter_lines(path: str | Path) -> Iterator[bytes]:
    """The file's lines, as bytes: ``read_trace`` decodes each on its own, so bytes that are
    not UTF-8 fail at their own line (named, or skipped with ``--skip-bad``)."""
    with open_trace(path) as f:
        yield from f
