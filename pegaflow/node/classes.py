"""The node's replacement classes: what it is told about the classes of its blocks, applied.

Every resident block of L1 is *retained* or *reclaimable* (evicted first); the block index
keeps the two orders (``BlockIndex.reclassify``). The node reserves pulled copies
reclaimable itself; the metaserver tells it when enough nodes hold one of its blocks, or
no other node does any more (docs/architecture.md, "Replacement classes").

:class:`Classes` applies those changes on the node's event loop, the index's only thread,
and counts what moved for ``pegaflow_node_class_demotions_total{reason}``.
:class:`NoticeReader` takes the metaserver's notices for this node out of Redis (the
publisher thread calls it every ``NOTICE_POLL_S``, ``pegaflow/node/publishing.py``) and
hands them to the loop in the order they were sent (``pegaflow/cluster/notices.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import structlog

from pegaflow.cluster import keys, notices
from pegaflow.core.block_index import BlockIndex, Namespace
from pegaflow.node.metrics import DEMOTION_REASONS

if TYPE_CHECKING:  # a type only: a node that never publishes does not import redis-py
    from pegaflow.cluster.redis_conn import Client

log = structlog.get_logger("pegaflow.node.classes")

# How often the node pops its notices: one pipelined LPOP round trip for the namespaces it holds.
# A backup notice waits for it, and until then the copy is held twice (pegaflow/meta/backup.py).
NOTICE_POLL_S = 0.05


class Classes:
    """Class changes of the block index, by reason. Event loop only."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.demoted: dict[str, int] = dict.fromkeys(DEMOTION_REASONS, 0)
        self.restored = 0

    def demote(self, ns: Namespace, hashes: Sequence[bytes], reason: str) -> int:
        """Make these blocks reclaimable (those resident and retained); returns how many moved."""
        if reason not in self.demoted:
            raise ValueError(f"unknown demotion reason {reason!r}")
        n = self.index.reclassify(ns, hashes, True)
        self.demoted[reason] += n
        return n

    def restore(self, ns: Namespace, hashes: Sequence[bytes]) -> int:
        """Make these blocks retained again (those resident and reclaimable); returns how many moved."""
        n = self.index.reclassify(ns, hashes, False)
        self.restored += n
        return n

    def figures(self) -> tuple[int, int, Mapping[str, int]]:
        """(resident bytes, of them reclaimable, demotions by reason): ``ClassMetrics``' source,
        read at scrape time from another thread (ints: a consistent enough snapshot)."""
        return self.index.resident_bytes, self.index.reclaimable_bytes, dict(self.demoted)

    def apply(self, ns: Namespace, elements: Sequence[bytes]) -> None:
        """Apply the metaserver's notices for ``ns``, oldest first (event loop)."""
        for element in elements:
            try:
                notice = notices.decode(element)
            except notices.MalformedNotice as exc:
                log.warning("class_notice_malformed", namespace=ns.name, error=str(exc))
                continue
            if notice.reclaimable:
                self.demote(ns, notice.hashes, "backup_hint" if notice.backup else "reclaim_hint")
            else:
                self.restore(ns, notice.hashes)


class NoticeReader:
    """Pops this node's class notices (``pegaflow/cluster/notices.py``) and hands them to
    ``classes`` on ``loop``. Called from the publisher thread with its Redis client and the
    node's current nid: notices sent to an older incarnation are not read (the new one's
    snapshot brings its own)."""

    def __init__(self, classes: Classes, loop: asyncio.AbstractEventLoop) -> None:
        self.classes = classes
        self.loop = loop
        self.popped = 0  # elements taken out of Redis

    def __call__(self, r: Client, nid: int) -> None:
        by_tag = {keys.ns_tag(ns.name): ns for ns in self.classes.index.namespaces()}
        got = notices.pop(r, nid, by_tag)
        if got:
            self.popped += sum(map(len, got.values()))
            batch = [(by_tag[tag], elements) for tag, elements in got.items()]
            self.loop.call_soon_threadsafe(self._apply, batch)

    def _apply(self, batch: list[tuple[Namespace, list[bytes]]]) -> None:
        for ns, elements in batch:
            self.classes.apply(ns, elements)
