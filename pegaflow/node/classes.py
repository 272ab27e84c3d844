"""The node's replacement classes: what it is told about the classes of its blocks, applied.

Every resident block of L1 is *retained* or *reclaimable* (evicted first); the block index
keeps the two orders (``BlockIndex.reclassify``). The node reserves pulled copies
reclaimable itself; the metaserver tells it when enough nodes hold one of its blocks, or
no other node does any more (docs/architecture.md, "Replacement classes").

:class:`Classes` applies those changes on the node's event loop, the index's only thread,
and counts what moved for ``pegaflow_node_class_demotions_total{reason}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pegaflow.core.block_index import BlockIndex, Namespace
from pegaflow.node.metrics import DEMOTION_REASONS


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
