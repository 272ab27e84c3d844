"""Exact references for the HLL hit-rate ceiling (``pegaflow/policy/ceiling.py``).

``CeilingEstimator`` counts distinct keys with HyperLogLog sketches; these count them with
Python sets, so tests (and bench/policy.py) can hold the estimate against the truth.
Memory grows with the distinct keys: never in a daemon.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pegaflow.policy.ceiling import DEFAULT_BUCKETS, DEFAULT_WINDOWS, MIN_LG_K, CeilingEstimator


def exact_ceiling(keys: Iterable[int]) -> float:
    """r* of one batch of requests, counted exactly: (N - distinct) / N; 0.0 when empty."""
    n = 0
    seen: set[int] = set()
    for k in keys:
        n += 1
        seen.add(k)
    return (n - len(seen)) / n if n else 0.0


class ExactCeiling(CeilingEstimator):
    """The same windows and buckets with Python sets instead of sketches: exact U.

    ``serialize``/``merge`` are not supported.
    """

    def __init__(
        self,
        windows: Sequence[float] = DEFAULT_WINDOWS,
        buckets: int = DEFAULT_BUCKETS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(windows, buckets, lg_k=MIN_LG_K, clock=clock, max_bytes=1 << 62)

    def _new_distinct(self) -> set[int]:
        return set()

    def _add_keys(self, d: set[int], keys: Sequence[int]) -> None:
        d.update(keys)

    def _union(self, parts: Sequence[set[int]]) -> set[int]:
        return set().union(*parts)

    def _count(self, parts: Sequence[set[int]]) -> float:
        return float(len(self._union(parts)))

    def _dump(self, d: Any) -> bytes:
        raise TypeError("ExactCeiling cannot be serialized")

    def _load(self, data: bytes) -> Any:
        raise TypeError("ExactCeiling cannot be merged")
