"""How long blocks stay in L1: ``pegaflow_node_block_residence_seconds{reason}``.

A block's residence runs from its first insertion into L1 (a commit, a promotion from SSD,
a pull from a peer) to the event that takes it out: ``pressure`` for an eviction that makes
room, ``cleanup`` for a removal the node was told to do (an engine's Reset, ``pegaflow
cache clear``, ``POST /cache/memory/cleanup``). A duplicate insert does not restart it;
a block inserted again after it left starts a new one. Buckets are the original's (1 s to
one day), so its ``pegaflow_cache_residence_duration_seconds`` queries work on the alias.

The stamps and counts are kept here, not in a ``prometheus_client.Histogram``: an eviction
comes as a batch of blocks on the node's event loop (inside a Reserve), and one numpy
bucket count per batch replaces one locked ``observe`` per block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import numpy as np
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from pegaflow.core.block_index import IndexEvent, Namespace

NAME = "pegaflow_node_block_residence_seconds"
# The original's boundaries (pegaflow-core/src/metrics.rs): 1 s .. 24 h, then +Inf.
BOUNDS = np.array([1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1_800.0, 3_600.0, 7_200.0,
                   21_600.0, 43_200.0, 86_400.0])
REASONS = {IndexEvent.EVICT: "pressure", IndexEvent.REMOVE: "cleanup"}


class Residence(Collector):
    """An index listener (``BlockIndex.add_listener(r.on_index_event)``) and the collector
    of the histogram it fills (registered in ``registry``)."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: dict[tuple[int, bytes], float] = {}
        self._counts = {r: np.zeros(len(BOUNDS) + 1, dtype=np.int64) for r in REASONS.values()}
        self._sums = dict.fromkeys(REASONS.values(), 0.0)
        self._lock = threading.Lock()  # the loop writes, the /metrics thread reads
        registry.register(self)

    @property
    def resident(self) -> int:
        """Blocks with an open residence (equals the index's resident blocks)."""
        return len(self._since)

    def on_index_event(self, op: IndexEvent, ns: Namespace, hashes: list[bytes]) -> None:
        nid = ns.id
        if op is IndexEvent.INSERT:
            now = self._clock()
            since = self._since
            for h in hashes:
                since.setdefault((nid, h), now)
            return
        reason = REASONS.get(op)
        if reason is None or not hashes:
            return
        now = self._clock()
        pop = self._since.pop
        took = now - np.fromiter((pop((nid, h), now) for h in hashes), dtype=np.float64, count=len(hashes))
        # Bucket i holds durations in (BOUNDS[i-1], BOUNDS[i]] (Prometheus' le), the last +Inf.
        counts = np.bincount(np.searchsorted(BOUNDS, took, side="left"), minlength=len(BOUNDS) + 1)
        with self._lock:
            self._counts[reason] += counts
            self._sums[reason] += float(took.sum())

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(NAME, "", labels=["reason"])]

    def collect(self) -> Iterable[Metric]:
        fam = HistogramMetricFamily(
            NAME, "Time blocks stayed in L1, from first insertion to leaving it: pressure (evicted to "
            "make room) or cleanup (a Reset, pegaflow cache clear, /cache/memory/cleanup).", labels=["reason"])
        with self._lock:
            snap = {r: (c.copy(), self._sums[r]) for r, c in self._counts.items()}
        for reason, (counts, total) in snap.items():
            cum = np.cumsum(counts)
            buckets = [(f"{b:g}", float(n)) for b, n in zip(BOUNDS, cum[:-1], strict=True)]
            buckets.append(("+Inf", float(cum[-1])))
            fam.add_metric([reason], buckets, total)
        yield fam
