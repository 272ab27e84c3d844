"""Dropping whole namespaces from L1 and the SSD tier: an engine's ``Reset``
(pegaflow/node/service.py) and an operator's ``pegaflow cache clear`` (pegaflow/node/admin.py)
do it alike, through :func:`drop_namespaces`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pegaflow.core.block_index import BlockIndex, Namespace


class ClearableTier(Protocol):
    """The SSD tier as a clear sees it (``pegaflow.node.tiers.ssd.SsdTier``)."""

    def clear(self, ns: Namespace) -> int:
        """Forget every SSD record of ``ns``; returns how many."""
        ...


def drop_namespaces(index: BlockIndex, ssd: ClearableTier | None, nss: Sequence[Namespace],
                    before: Callable[[Namespace], None] | None = None) -> tuple[int, int, int]:
    """Drop every block of ``nss`` from L1 and the SSD tier (an engine's Reset, an operator's
    clear): (blocks dropped, of those still held by a lease, blocks dropped from SSD)."""
    dropped = busy = on_ssd = 0
    for ns in nss:
        if before is not None:
            before(ns)
        hashes, pinned = index.clear(ns)
        dropped += len(hashes)
        busy += pinned
        if ssd is not None:
            on_ssd += ssd.clear(ns)
    return dropped, busy, on_ssd
