"""Byte sizes as operators type them: ``30gb``, ``512MiB``, ``4096``."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size. Units are binary (``1gb`` = 2**30 bytes), as in the original."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"invalid size {text!r} (expected e.g. 512mb, 30gb, 1tb)")
    number, unit = m.groups()
    mult = _UNITS.get(unit.lower())
    if mult is None:
        raise ValueError(f"invalid size unit {unit!r} in {text!r} (use kb, mb, gb or tb)")
    size = float(number) * mult
    if not math.isfinite(size):  # a number of hundreds of digits: int(inf) would raise OverflowError
        raise ValueError(f"size {text!r} is too large")
    return int(size)


def format_size(n: int) -> str:
    for unit, mult in (("tb", 1 << 40), ("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
