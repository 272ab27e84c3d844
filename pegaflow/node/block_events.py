"""Block events for engines: which blocks of a namespace left the node's DRAM, reached its
SSD tier, or left that too.

An engine that asks for them (``RegisterRequest.watch_blocks``) gets them on its Session
stream (``SessionEvent.blocks``), so its connector can tell vLLM's KV-event publisher what
the external tier no longer holds (``BlockRemoved``) and what moved to SSD. Inserts into
DRAM are not sent: the engine that stored a block knows it did.

The same SSD stores and removals also go to tier listeners (:meth:`BlockEventFeed.add_tier_listener`):
the cluster publisher, which tells the global index which blocks the node holds on SSD.

Events are produced on the node's event loop (block-index listener, SSD completions) and
buffered per watching session until its stream sends them. A session that does not read
loses the oldest batches beyond ``MAX_BUFFERED_HASHES`` and is told how many hashes it
lost (``dropped_hashes``), never more memory.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pegaflow._proto import node_pb2
from pegaflow.core.block_index import IndexEvent, Namespace

MAX_BUFFERED_HASHES = 1 << 18  # per session: 4 MiB of hashes
DRAM = node_pb2.MEDIUM_DRAM
SSD = node_pb2.MEDIUM_SSD


class TierListener(Protocol):
    def ssd_stored(self, ns: Namespace, hashes: Sequence[bytes]) -> None: ...
    def ssd_removed(self, ns: Namespace, hashes: Sequence[bytes]) -> None: ...


@dataclass(eq=False)
class Watcher:
    session_id: int
    namespaces: frozenset[int]  # namespace ids
    batches: collections.deque[node_pb2.BlockEvent] = field(default_factory=collections.deque)
    buffered: int = 0  # hashes in ``batches``
    dropped: int = 0  # hashes lost to the bound since the last send
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self) -> tuple[list[node_pb2.BlockEvent], int]:
        out, dropped = list(self.batches), self.dropped
        self.batches.clear()
        self.buffered = self.dropped = 0
        self.ready.clear()
        return out, dropped


class BlockEventFeed:
    def __init__(self, max_buffered: int = MAX_BUFFERED_HASHES) -> None:
        self.max_buffered = max_buffered
        self._by_ns: dict[int, set[Watcher]] = {}
        self._tier_listeners: list[TierListener] = []

    def add_tier_listener(self, listener: TierListener) -> None:
        """Also hand every SSD store / removal to ``listener`` (the node's cluster publisher,
        ``pegaflow.node.publishing.HolderTiers``), watched or not."""
        self._tier_listeners.append(listener)

    def watch(self, session_id: int, nss: Iterable[Namespace]) -> Watcher:
        w = Watcher(session_id, frozenset(ns.id for ns in nss))
        for nid in w.namespaces:
            self._by_ns.setdefault(nid, set()).add(w)
        return w

    def unwatch(self, w: Watcher) -> None:
        for nid in w.namespaces:
            ws = self._by_ns.get(nid)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del self._by_ns[nid]

    def on_index_event(self, op: IndexEvent, ns: Namespace, hashes: list[bytes]) -> None:
        """Block-index listener: DRAM evictions and removals (resets, clears) of watched namespaces."""
        if op is not IndexEvent.INSERT and ns.id in self._by_ns:
            self._push(ns, DRAM, False, hashes)

    def ssd_stored(self, ns: Namespace, hashes: Sequence[bytes]) -> None:
        for t in self._tier_listeners:
            t.ssd_stored(ns, hashes)
        if ns.id in self._by_ns:
            self._push(ns, SSD, True, hashes)

    def ssd_removed(self, ns: Namespace, hashes: Sequence[bytes]) -> None:
        for t in self._tier_listeners:
            t.ssd_removed(ns, hashes)
        if ns.id in self._by_ns:
            self._push(ns, SSD, False, hashes)

    def _push(self, ns: Namespace, medium: node_pb2.Medium, stored: bool, hashes: Sequence[bytes]) -> None:
        ev = node_pb2.BlockEvent(namespace=ns.name, medium=medium, stored=stored, hashes=list(hashes))
        for w in self._by_ns[ns.id]:
            w.batches.append(ev)
            w.buffered += len(hashes)
            while w.buffered > self.max_buffered and len(w.batches) > 1:
                old = w.batches.popleft()
                w.buffered -= len(old.hashes)
                w.dropped += len(old.hashes)
            w.ready.set()
