"""Sizes and rules as ``pegaflow replay`` users write them; light enough for the option table.

- a capacity: ``20000blocks``, ``500gb`` (binary units, as everywhere in PegaFlow),
  ``25%`` of the trace's distinct blocks, or ``inf`` (= 100%: nothing is ever evicted);
- a sweep: ``auto``, ``none`` or a comma-separated list of capacities;
- a routing rule: ``round-robin`` or ``field:NAME``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pegaflow.core.units import format_size, parse_size

ROUND_ROBIN = "round-robin"
KV_AWARE = "kv-aware"  # pegaflow router's policy with no queue: the pool holding the longest prefix
# The automatic sweep: L1 from 1/64 of the distinct blocks to all of them, doubling.
AUTO_SWEEP_PERCENT = (100 / 64, 100 / 32, 100 / 16, 100 / 8, 100 / 4, 100 / 2, 100.0)


@dataclass(frozen=True)
class Capacity:
    """A tier size as written by the user: ``20000blocks``, ``500gb``, ``25%`` or ``inf``.

    ``percent`` is of the trace's distinct blocks (U), split between isolated pools like
    every size; ``inf`` gives *every* pool U blocks, so nothing is ever evicted.
    """

    value: float
    unit: str  # "blocks" | "bytes" | "percent" | "inf"

    @classmethod
    def parse(cls, text: str | Capacity) -> Capacity:
        if isinstance(text, Capacity):
            return text
        t = str(text).strip().lower()
        if t in ("inf", "unlimited"):
            return cls(math.inf, "inf")
        if t.endswith("%"):
            v = float(t[:-1])
            if not math.isfinite(v) or v < 0:  # 'inf' is the word for unbounded, 'inf%' no percentage
                raise ValueError(f"capacity must be a finite percentage >= 0, got {text!r}")
            return cls(v, "percent")
        m = re.fullmatch(r"(\d+)\s*(blocks?|blk)", t)
        if m:
            if not math.isfinite(blocks := float(m.group(1))):
                raise ValueError(f"capacity {text!r} is too large")
            return cls(blocks, "blocks")
        return cls(float(parse_size(t)), "bytes")

    def blocks_or_bytes(self, unique: int, storable: int | None = None) -> tuple[int, bool]:
        """(amount, in_blocks) for a trace with ``unique`` distinct blocks requested and
        ``storable`` distinct blocks requested or saved (default ``unique``): ``inf`` holds
        every block the trace stores, a percentage is of ``unique``."""
        if self.unit == "inf":
            return unique if storable is None else max(unique, storable), True
        if self.unit == "percent":
            return int(round(unique * self.value / 100.0)), True
        return int(self.value), self.unit == "blocks"

    @property
    def is_unbounded(self) -> bool:
        return self.unit == "inf"

    def __str__(self) -> str:
        if self.unit == "inf":
            return "inf"
        if self.unit == "percent":
            return f"{self.value:g}%"
        if self.unit == "blocks":
            return f"{int(self.value)}blocks"
        return format_size(int(self.value))

    @property
    def is_zero(self) -> bool:
        return self.value == 0


def parse_capacity(text: str) -> Capacity:
    """``Capacity.parse`` for the option table."""
    return Capacity.parse(text)


def parse_sweep(text: str) -> list[Capacity]:
    """``auto`` (see AUTO_SWEEP_PERCENT), ``none`` (no sweep) or a list of capacities."""
    t = text.strip().lower()
    if t == "auto":
        return [Capacity(p, "percent") for p in AUTO_SWEEP_PERCENT]
    if t in ("none", "off", "", "0"):
        return []
    parts = [p for p in (x.strip() for x in t.split(",")) if p]
    return [Capacity.parse(p) for p in parts]


def route_field(route: str) -> str | None:
    """The trace field a routing rule reads, or None for round-robin."""
    if route in (ROUND_ROBIN, KV_AWARE):
        return None
    if route.startswith("field:") and len(route) > 6:
        return route[6:]
    raise ValueError(f"invalid route {route!r} (expected round-robin, kv-aware or field:NAME)")


def parse_route(text: str) -> str:
    """Validate a routing rule, or a comma-separated list of them (replay runs each), for
    the option table; at most one ``field:NAME`` (the trace is read once)."""
    routes = split_routes(text)
    if sum(route_field(r) is not None for r in routes) > 1:
        raise ValueError("at most one field:NAME route")
    return ",".join(routes)


def split_routes(text: str) -> list[str]:
    """The routing rules of a comma-separated list, each validated, duplicates dropped."""
    routes = list(dict.fromkeys(r.strip() for r in text.split(",") if r.strip()))
    if not routes:
        raise ValueError("no route given")
    for r in routes:
        route_field(r)
    return routes
