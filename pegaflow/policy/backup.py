"""Which blocks a busy node offers for the decode backup (docs/architecture.md, "Decode backup").

The rule the node's backup tick applies (``pegaflow/node/backup.py``'s ``pick_candidates``)
and ``pegaflow replay``'s cluster model applies (``pegaflow/replay/cluster.py``); a test holds
the two equal. A pool is full when its free bytes are below ``FULL_FREE_SHARE`` of it; a full
pool offers its oldest retained blocks (the LRU tail), at most ``most`` of them, until their
bytes and its reclaimable class together reach ``percent`` of the pool.
"""

from __future__ import annotations

from pegaflow.core.block_index import Block, BlockIndex

FULL_FREE_SHARE = 0.05  # a pool with less free than this share of it is full: it offers


def backup_candidates(index: BlockIndex, percent: int, most: int) -> list[Block]:
    """The blocks ``index``'s node offers now, oldest first (none while its pool is not full)."""
    cap = index.alloc.capacity
    if cap <= 0 or index.alloc.free_bytes > cap * FULL_FREE_SHARE:
        return []
    need = cap * percent // 100 - index.reclaimable_bytes
    out: list[Block] = []
    for b in index.oldest_retained():
        if need <= 0 or len(out) >= most:
            break
        out.append(b)
        need -= b.size
    return out
