"""``pegaflow-meta rebuild``: recompute the index from the node streams.

The index is a projection of the streams: each stream holds, for the node's current
epoch, a RESET, the snapshot and every later update (older epochs are trimmed once the
new one is visible). Rebuild:

1. sets the pause key, so replicas release their stream leases and stop applying;
   waits until no lease is held;
2. replays every stream's entries of the visible and the newest incarnation of each node
   into a scratch index (``pf:t:``);
3. moves the scratch buckets over the live ones, bucket by bucket, and lifts the pause.

Entries past the consumer group's position are replayed too; replicas will apply them
again afterwards, which is harmless (suffix replay, see ``index.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

import structlog

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import Client
from pegaflow.meta.events.codec import MalformedEvent, decode_entry
from pegaflow.meta.events.schema import Op
from pegaflow.meta.index import Index, Update

log = structlog.get_logger("pegaflow.meta.rebuild")

XRANGE_COUNT = 512


@dataclass
class RebuildReport:
    nodes: int
    entries: int
    blocks: int
    malformed: int
    seconds: float


def rebuild(r: Client, wait_leases: float = 30.0) -> RebuildReport:
    t0 = time.monotonic()
    token = f"rebuild-{time.time()}"
    r.set(keys.PAUSE, token, px=int((wait_leases + 600) * 1000))
    try:
        info = registry.nodes(r)
        deadline = time.monotonic() + wait_leases
        while any(r.exists(keys.owner_key(n)) for n in info) and time.monotonic() < deadline:
            time.sleep(0.05)
        vis = registry.visible(r, sorted(info))
        allowed = set(vis) | {i.nid for i in info.values()}
        scratch = Index(r, keys.REBUILD_PREFIX)
        live = Index(r)
        tags = set(registry.namespace_tags(r))
        scratch.clear(tags)
        entries = blocks = malformed = 0
        new_tags: dict[str, str] = {}
        for node in sorted(info):
            start = "-"
            while True:
                chunk = cast("list[tuple[bytes, dict[bytes, bytes]]]",  # (entry id, fields): bytes
                             r.xrange(stream_key(node), min=start, max="+", count=XRANGE_COUNT))
                if not chunk:
                    break
                updates: list[Update] = []
                for _eid, fields in chunk:
                    try:
                        ev = decode_entry(fields)
                    except MalformedEvent:
                        malformed += 1
                        continue
                    entries += 1
                    if ev.node != node or ev.nid not in allowed or not ev.blob or ev.op == Op.RESET:
                        continue
                    updates.append(Update.of(ev))
                    blocks += ev.count
                    new_tags.setdefault(keys.ns_tag(ev.namespace), ev.namespace)
                scratch.apply_many(updates)
                last = chunk[-1][0].decode()
                ms, seq = last.split("-")
                start = f"{ms}-{int(seq) + 1}"
        if new_tags:
            registry.add_namespace_tags(r, new_tags)
        scratch.swap_into(live, tags | set(new_tags))
        report = RebuildReport(len(info), entries, blocks, malformed, time.monotonic() - t0)
        log.info("rebuilt index", **report.__dict__)
        return report
    finally:
        if r.get(keys.PAUSE) == token.encode():
            r.delete(keys.PAUSE)
