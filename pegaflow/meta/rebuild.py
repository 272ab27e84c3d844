"""``pegaflow-meta rebuild``: recompute the index from the node streams.

The index is a projection of the streams: each stream holds, for the node's current
epoch, a RESET, the snapshot and every later update (older epochs are trimmed once the
new one is visible). Rebuild:

1. sets the pause key, so replicas release their stream leases and stop applying;
   waits until no lease is held (``RebuildError`` if some still is after ``wait_leases``);
   the pause lives ``PAUSE_TTL_S`` and is renewed while the rebuild runs, so a rebuild that
   dies leaves the replicas paused that long at most, and one that lost its pause (expired
   under a stall, lifted by hand) stops before step 3 (``RebuildError``): replicas may have
   applied updates since, which the swap would drop though they are acknowledged;
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
from pegaflow.cluster.redis_conn import RELEASE_IF_HELD, RENEW_IF_HELD, Client
from pegaflow.meta.events.codec import MalformedEvent, decode_entry
from pegaflow.meta.events.schema import Op
from pegaflow.meta.index import Index, Update

log = structlog.get_logger("pegaflow.meta.rebuild")

XRANGE_COUNT = 512
PAUSE_TTL_S = 60.0  # the pause outlives a rebuild that died by at most this
PAUSE_RENEW_S = 10.0  # renewed at least this often while the rebuild runs

class RebuildError(Exception):
    """The rebuild cannot be trusted to finish: nothing was swapped (one line for the operator)."""


class _Pause:
    """The pause key, held while the rebuild runs (the module's step 1)."""

    def __init__(self, r: Client) -> None:
        self.r = r
        self.token = f"rebuild-{time.time()}"
        self._renewed = time.monotonic()
        r.set(keys.PAUSE, self.token, px=int(PAUSE_TTL_S * 1000))

    def hold(self, now: bool = False) -> None:
        """Renew the pause when due (``now``: at once); ``RebuildError`` when it is no longer
        this rebuild's."""
        if not now and time.monotonic() - self._renewed < PAUSE_RENEW_S:
            return
        if not RENEW_IF_HELD(self.r, [keys.PAUSE], [self.token, int(PAUSE_TTL_S * 1000)]):
            raise RebuildError("the pause ended while rebuilding (it expired, or was lifted): replicas may have "
                               "applied updates meanwhile, which the swap would drop; nothing was changed, run it again")
        self._renewed = time.monotonic()

    def lift(self) -> None:
        RELEASE_IF_HELD(self.r, [keys.PAUSE], [self.token])


@dataclass
class RebuildReport:
    nodes: int
    entries: int
    blocks: int
    malformed: int
    seconds: float


def rebuild(r: Client, wait_leases: float = 30.0) -> RebuildReport:
    t0 = time.monotonic()
    pause = _Pause(r)
    try:
        info = registry.nodes(r)
        deadline = time.monotonic() + wait_leases
        while held := [n for n in info if r.exists(keys.owner_key(n))]:
            if time.monotonic() >= deadline:
                raise RebuildError(f"replicas still hold the stream leases of {len(held)} nodes after {wait_leases:g} s "
                                   f"(e.g. {held[0]!r}): they are still applying; nothing was changed")
            pause.hold()
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
                pause.hold()
                last = chunk[-1][0].decode()
                ms, seq = last.split("-")
                start = f"{ms}-{int(seq) + 1}"
        if new_tags:
            registry.add_namespace_tags(r, new_tags)
        pause.hold(now=True)  # still paused right before the swap
        scratch.swap_into(live, tags | set(new_tags))
        report = RebuildReport(len(info), entries, blocks, malformed, time.monotonic() - t0)
        log.info("rebuilt index", **report.__dict__)
        return report
    finally:
        pause.lift()
