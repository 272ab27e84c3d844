"""Background sweep: retire dead nodes, drop their streams, remove retired incarnations' entries.

Readers never see these entries (lookups filter by the visible nids), so sweeping is
about memory, not correctness, and may lag. One replica sweeps at a time (``SWEEP_LOCK``).
A retired nid is forgotten ``RETIRED_GRACE_MS`` after the first sweep that covered it;
by then no consumer still applies its events (they skip retired nids).
"""

from __future__ import annotations

import threading
import time

import structlog

from pegaflow.meta import keys, metrics, registry
from pegaflow.meta.events.streams import stream_key
from pegaflow.meta.index import Index
from pegaflow.meta.redis_conn import Client

log = structlog.get_logger("pegaflow.meta.sweeper")

RETIRED_GRACE_MS = 600_000


def sweep_once(r: Client, owner: str = "sweeper", lock_ms: int = 60_000) -> tuple[int, int] | None:
    """One pass; returns (nodes reaped, entries removed), or None if another replica sweeps."""
    if not r.set(keys.SWEEP_LOCK, owner, nx=True, px=lock_ms):
        return None
    try:
        t0_ms = int(time.time() * 1000)
        gone = registry.reap(r, sorted(registry.nodes(r)))
        for node in gone:
            # A dead node's stream is void (its nid is retired). A node coming back re-registers
            # first, so only delete while it is still unregistered.
            if not r.hexists(keys.NODES, node):
                r.delete(stream_key(node), keys.owner_key(node))
        reaped = len(gone)
        dead = registry.retired(r)
        tags = sorted(t.decode() for t in r.hkeys(keys.NAMESPACES))
        removed = Index(r).sweep(tags, dead) if dead else 0
        # Forget nids retired long enough ago that no consumer can still be applying them.
        r.zremrangebyscore(keys.RETIRED, "-inf", t0_ms - RETIRED_GRACE_MS)
        metrics.REAPED.inc(reaped)
        metrics.SWEPT.inc(removed)
        if reaped or removed:
            log.info("swept", reaped=reaped, removed=removed, retired=len(dead))
        return reaped, removed
    finally:
        if r.get(keys.SWEEP_LOCK) == owner.encode():
            r.delete(keys.SWEEP_LOCK)


def run(r: Client, stop: threading.Event, interval: float, owner: str) -> None:
    while not stop.wait(interval):
        try:
            sweep_once(r, owner)
        except Exception as exc:  # a failed pass is retried next interval
            log.warning("sweep failed", error=repr(exc))
