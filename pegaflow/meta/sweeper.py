"""Background sweep (the original's lifecycle sweep): reap silent nodes, drop their streams,
remove retired incarnations' entries.

- A node is reaped once it has been silent for ``idle_ms`` (``--ttl-minutes``: "minutes
  without node activity before lifecycle cleanup", not block age): its live key expired and
  neither a heartbeat nor an event in its stream came for that long (Redis's clock: the
  registry's ``SEEN`` stamps and the stream's entry ids). Its nid is retired, its
  registration, stream and lease go. Before that the node is only hidden (its live key,
  ``--node-stale-secs``), and a heartbeat brings it back with its entries
  (``registry.heartbeat``).
- A retired nid (reaped, or superseded when its node restarted) has its entries removed
  once soon after it retires and once more when it is forgotten, ``RETIRED_GRACE_MS``
  later; by then no consumer still applies its events (they skip retired nids). So a pass
  costs nothing while nothing retires.

Readers never see these entries (lookups filter by the visible nids), so sweeping is about
memory, not correctness, and may lag. One replica sweeps at a time (``SWEEP_LOCK``).
"""

from __future__ import annotations

import threading
from typing import cast

import structlog

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import Client, Script, error_text, held, parallel
from pegaflow.meta.index import Index
from pegaflow.meta.metrics import MetaMetrics

log = structlog.get_logger("pegaflow.meta.sweeper")

RETIRED_GRACE_MS = 600_000  # a retired nid's second sweep, when it is forgotten


def last_event_ms(r: Client, node: str) -> int | None:
    """When ``node`` last wrote to its stream (the newest entry's id, Redis's clock), or None."""
    newest = cast("list[tuple[bytes, object]]", r.xrevrange(stream_key(node), "+", "-", count=1))
    return int(newest[0][0].split(b"-")[0]) if newest else None


def silent_nodes(r: Client, idle_ms: int) -> dict[str, int | None]:
    """The registered nodes whose live key expired and that sent nothing (heartbeat, event)
    for more than ``idle_ms``: name -> ms since their last activity (None: never stamped)."""
    names = sorted(registry.nodes(r))
    if not names:
        return {}
    (replies,) = parallel(r, [(keys.VERSION, registry.visibility_commands(names))])
    for rep in replies:
        if isinstance(rep, Exception):
            raise rep
    live, seen, now = replies
    now_ms = registry.redis_ms(now)
    out: dict[str, int | None] = {}
    for name, key, stamp in zip(names, live, seen, strict=True):
        if key is not None:
            continue
        times = [t for t in (None if stamp is None else int(stamp), last_event_ms(r, name)) if t is not None]
        age = now_ms - max(times) if times else None
        if age is None or idle_ms <= 0 or age > idle_ms:
            out[name] = age
    return out


# Delete a reaped node's stream only if nothing was written to it since the sweeper looked
# (ARGV[1]: its last entry id then, '' for none): the stream and the registry are in
# different slots, so the node may re-register and publish its new RESET in between, and a
# plain DEL took that with it (its snapshot then never reached the index, and the view never
# saw the new incarnation complete).
_DELETE_STREAM = Script("""
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local id = ''
if #last > 0 then id = last[1][1] end
if id == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")


def _last_id(r: Client, node: str) -> str:
    last = cast("list[tuple[bytes, object]]", r.xrevrange(stream_key(node), count=1))
    return last[0][0].decode() if last else ""


def sweep_once(
    r: Client, owner: str = "sweeper", lock_ms: int = 60_000, metrics: MetaMetrics | None = None,
    idle_ms: int = 0,
) -> tuple[int, int] | None:
    """One pass; returns (nodes reaped, entries removed), or None if another replica sweeps.
    ``idle_ms``: how long a node must have been silent to be reaped (0: once its live key expired)."""
    with held(r, keys.SWEEP_LOCK, owner, lock_ms) as mine:
        return _sweep(r, metrics, idle_ms) if mine else None


def _sweep(r: Client, metrics: MetaMetrics | None, idle_ms: int) -> tuple[int, int]:
    t0_ms = registry.redis_ms(r.time())  # the retirements' clock: Redis's TIME, not this host's
    silent = silent_nodes(r, idle_ms)
    nids = {name: info.nid for name, info in registry.nodes(r).items() if name in silent}
    lasts = {name: _last_id(r, name) for name in silent}  # before the reap: see _DELETE_STREAM
    gone = registry.reap(r, sorted(silent), idle_ms)  # re-checked there against a heartbeat meanwhile
    for node in gone:
        age = silent[node]
        log.info("node_swept", node=node, nid=nids.get(node),
                 last_seen_age_secs=None if age is None else round(age / 1000, 1))
        # A reaped node's stream is void (its nid is retired). A node coming back re-registers
        # first, so only delete while it is still unregistered.
        if not r.hexists(keys.NODES, node):
            _DELETE_STREAM(r, [stream_key(node)], [lasts.get(node) or ""])
            r.delete(keys.owner_key(node))
    reaped = len(gone)
    # Each retired nid is swept twice: once soon after it retired, once more when it is
    # forgotten (a lagging consumer may have applied a late event of it in between).
    scored = cast("list[tuple[bytes, float]]", r.zrange(keys.RETIRED, 0, -1, withscores=True))
    retired = {int(m): int(sc) for m, sc in scored}
    swept = {int(m) for m in cast("set[bytes]", r.smembers(keys.SWEPT))}
    old = {n for n, t in retired.items() if t < t0_ms - RETIRED_GRACE_MS}
    todo = {n for n in retired if n not in swept} | old
    tags = sorted(registry.namespace_tags(r))
    removed = Index(r).sweep(tags, todo) if todo else 0
    if todo - old:
        r.sadd(keys.SWEPT, *(todo - old))
    if old:
        r.zrem(keys.RETIRED, *old)
        r.srem(keys.SWEPT, *old)
    if metrics is not None:
        metrics.reaped.inc(reaped)
        metrics.swept.inc(removed)
    if reaped or removed:
        log.info("swept", reaped=reaped, removed=removed, retired=len(todo))
    return reaped, removed


def run(r: Client, stop: threading.Event, interval: float, owner: str, metrics: MetaMetrics | None = None,
        idle_ms: int = 0) -> None:
    """Sweep every ``interval`` seconds until ``stop`` (``idle_ms``: ``--ttl-minutes``)."""
    while not stop.wait(interval):
        try:
            sweep_once(r, owner, metrics=metrics, idle_ms=idle_ms)
        except Exception as exc:  # a failed pass is retried next interval
            log.warning("sweep failed", error=error_text(exc))
