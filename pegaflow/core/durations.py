"""Durations as operators type them: ``90s``, ``15m``, ``1h``, ``1d``, ``7d``, ``300``."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``text``; a bare number is seconds. Must be > 0."""
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        m = _DURATION_RE.match(text)
        if not m:
            raise ValueError(f"invalid duration {text!r} (expected e.g. 90s, 15m, 1h, 1d)")
        number, unit = m.groups()
        mult = _UNITS.get(unit.lower())
        if mult is None:
            raise ValueError(f"invalid duration unit {unit!r} in {text!r} (use s, m, h or d)")
        seconds = float(number) * mult
    if not math.isfinite(seconds):
        raise ValueError(f"duration must be a finite number of seconds, got {text!r}")
    if seconds <= 0:
        raise ValueError(f"duration must be > 0, got {text!r}")
    return seconds


def parse_windows(text: str) -> tuple[float, ...]:
    """A comma-separated list of distinct durations, e.g. ``15m,1h,1d`` → ``(900.0, 3600.0, 86400.0)``.

    Returned sorted, shortest first; a repeated window is an error (it is surely a typo).
    """
    parts = [p for p in (x.strip() for x in text.split(",")) if p]
    if not parts:
        raise ValueError("expected at least one window, e.g. 15m,1h,1d")
    windows = sorted(parse_duration(p) for p in parts)
    if len(set(windows)) != len(windows):
        raise ValueError(f"repeated window in {text!r}")
    return tuple(windows)


def format_duration(seconds: float) -> str:
    """A window's label, as the original renders ``--metric-hll-windows``: in the largest unit
    that divides it exactly (900 → ``15m``, 60m → ``1h``, 24h → ``1d``, 36h → ``36h``), so a
    dashboard's ``window="1d"`` finds the same series whichever way the window was typed."""
    for unit, mult in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= mult and seconds % mult == 0:
            return f"{int(seconds // mult)}{unit}"
    return f"{seconds:g}s"
