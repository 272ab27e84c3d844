"""Owner counts for the replacement classes: which holders count, and notices when that changes.

A block's owner count is the number of its holders in the index whose incarnation is live
(docs/architecture.md, "Replacement classes"). The index's scripts count and send notices
as they change holder lists (``pegaflow/meta/index.py``); this module keeps the two things
they read from Redis and covers the changes no holder list sees:

- ``keys.OWNER_COUNT``: the threshold, ``--min-reclaimable-owner-count``, published by every
  replica at start (:func:`publish_threshold`; replicas must agree, a different one is logged).
- ``keys.UNCOUNTED``: the nids whose entries count as no owner: retired incarnations and
  registered nodes that are not visible (live key expired, or silent for ``--node-stale-secs``).
  A node that dies, comes back or restarts changes it without changing any holder list, so
  each pass (:func:`recount_once`, one replica at a time) brings the notices up to date:
  it recounts the blocks of the nids that moved (``Index.recount``), from the set the last
  recount used (``keys.RECOUNTED``) to the one stored one pass before, which every
  consumer reads by then (``index.OWNERS_REFRESH_S`` < :data:`INTERVAL_S`); then it stores
  the set as it is now. A death reaches the survivors' classes within the node's
  ``--liveness-ttl`` (or ``--node-stale-secs``) and two passes.

A recount reads every bucket of every namespace (as a sweep does), only when the set changed.
"""

from __future__ import annotations

import threading
from typing import cast

import structlog

from pegaflow.cluster import keys, registry
from pegaflow.cluster.redis_conn import Client, held
from pegaflow.meta.index import Index

log = structlog.get_logger("pegaflow.meta.owners")

INTERVAL_S = 2.0  # between passes; above index.OWNERS_REFRESH_S, so a stored set is in use at the next pass
LOCK_MS = 120_000


def publish_threshold(r: Client, threshold: int) -> None:
    """Make ``threshold`` the one the index's scripts apply (every replica calls it at start)."""
    old = r.get(keys.OWNER_COUNT)
    r.set(keys.OWNER_COUNT, threshold)
    if old is not None and int(old) != threshold:
        log.warning("min_reclaimable_owner_count_changed", was=int(old), now=threshold,
                    detail="every metaserver replica should be given the same --min-reclaimable-owner-count")


def uncounted(r: Client, stale_ms: int | None) -> set[int]:
    """The nids whose entries count as no owner now: retired ones, and the newest incarnation
    of every registered node that is not visible (``registry.visible``)."""
    nodes = registry.nodes(r)
    visible = registry.visible(r, sorted(nodes), stale_ms)
    return (registry.retired(r) | {info.nid for info in nodes.values()}) - set(visible)


def _members(r: Client, key: str) -> set[int]:
    return {int(m) for m in cast("set[bytes]", r.smembers(key))}


def _store(r: Client, key: str, nids: set[int]) -> None:
    p = r.pipeline(transaction=True)
    p.delete(key)
    if nids:
        p.sadd(key, *sorted(nids))
    p.execute()


def recount_once(r: Client, owner: str, stale_ms: int | None) -> int | None:
    """One pass (the module docstring); returns the blocks recounted, or None when another
    replica holds the pass or no threshold is published."""
    with held(r, keys.RECOUNT_LOCK, owner, LOCK_MS) as mine:
        return _recount(r, stale_ms) if mine else None


def _recount(r: Client, stale_ms: int | None) -> int | None:
    threshold = r.get(keys.OWNER_COUNT)
    if threshold is None:
        return None
    done, stored = _members(r, keys.RECOUNTED), _members(r, keys.UNCOUNTED)
    fields = 0
    if stored != done:
        tags = sorted(registry.namespace_tags(r))
        fields = Index(r).recount(tags, done, stored, int(threshold))
        _store(r, keys.RECOUNTED, stored)
        log.info("owners_recounted", counted_again=sorted(done - stored), uncounted=sorted(stored - done),
                 blocks=fields)
    now = uncounted(r, stale_ms)
    if now != stored:
        _store(r, keys.UNCOUNTED, now)
    return fields


def run(r: Client, stop: threading.Event, owner: str, threshold: int, stale_ms: int | None,
        interval: float = INTERVAL_S) -> None:
    """Publish ``threshold``, then :func:`recount_once` every ``interval`` seconds until ``stop``;
    Redis errors are logged and retried at the next pass."""
    published = False
    while True:
        try:
            if not published:
                publish_threshold(r, threshold)
                published = True
            recount_once(r, owner, stale_ms)
        except Exception as exc:
            log.warning("owner recount failed", error=repr(exc))
        if stop.wait(interval):
            return
