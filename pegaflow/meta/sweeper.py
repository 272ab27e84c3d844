"""Background sweep: retire dead nodes, drop their streams, remove retired incarnations' entries.

Readers never see these entries (lookups filter by the visible nids), so sweeping is
about memory, not correctness, and may lag. One replica sweeps at a time (``SWEEP_LOCK``).
A retired nid is swept once soon after it retires and once more when it is forgotten,
the grace later (``--ttl-minutes``, the original's TTL of a dead node's records; ``RETIRED_GRACE_MS``
when called without one); by then no consumer still applies its events (they skip retired
nids), so a pass costs nothing while nothing retires.
"""

from __future__ import annotations

import threading
import time
from typing import cast

import structlog

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import Client
from pegaflow.meta.index import Index
from pegaflow.meta.metrics import MetaMetrics

log = structlog.get_logger("pegaflow.meta.sweeper")

RETIRED_GRACE_MS = 600_000


def sweep_once(
    r: Client, owner: str = "sweeper", lock_ms: int = 60_000, metrics: MetaMetrics | None = None,
    grace_ms: int | None = None,
) -> tuple[int, int] | None:
    """One pass; returns (nodes reaped, entries removed), or None if another replica sweeps."""
    if not r.set(keys.SWEEP_LOCK, owner, nx=True, px=lock_ms):
        return None
    grace = RETIRED_GRACE_MS if grace_ms is None else grace_ms
    try:
        t0_ms = int(time.time() * 1000)
        gone = registry.reap(r, sorted(registry.nodes(r)))
        for node in gone:
            # A dead node's stream is void (its nid is retired). A node coming back re-registers
            # first, so only delete while it is still unregistered.
            if not r.hexists(keys.NODES, node):
                r.delete(stream_key(node), keys.owner_key(node))
        reaped = len(gone)
        # Each retired nid is swept twice: once soon after it retired, once more when it is
        # forgotten (a lagging consumer may have applied a late event of it in between).
        scored = cast("list[tuple[bytes, float]]", r.zrange(keys.RETIRED, 0, -1, withscores=True))
        retired = {int(m): int(sc) for m, sc in scored}
        swept = {int(m) for m in cast("set[bytes]", r.smembers(keys.SWEPT))}
        old = {n for n, t in retired.items() if t < t0_ms - grace}
        todo = {n for n in retired if n not in swept} | old
        tags = sorted(registry.namespace_tags(r))
        removed = Index(r).sweep(tags, todo) if todo else 0
        if todo - old:
            r.sadd(keys.SWEPT, *(todo - old))
        if old:
            r.zrem(keys.RETIRED, *old)
            r.srem(keys.SWEPT, *old)
        dead = todo
        if metrics is not None:
            metrics.reaped.inc(reaped)
            metrics.swept.inc(removed)
        if reaped or removed:
            log.info("swept", reaped=reaped, removed=removed, retired=len(dead))
        return reaped, removed
    finally:
        if r.get(keys.SWEEP_LOCK) == owner.encode():
            r.delete(keys.SWEEP_LOCK)


def run(r: Client, stop: threading.Event, interval: float, owner: str, metrics: MetaMetrics | None = None,
        grace_ms: int | None = None) -> None:
    while not stop.wait(interval):
        try:
            sweep_once(r, owner, metrics=metrics, grace_ms=grace_ms)
        except Exception as exc:  # a failed pass is retried next interval
            log.warning("sweep failed", error=repr(exc))
