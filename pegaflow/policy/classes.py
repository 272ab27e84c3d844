"""Replacement classes by owner count: when a holder of a block is told to demote or restore it.

A resident block is *reclaimable* (evicted first) when the cluster holds it elsewhere. The
metaserver counts each block's holders in the global index (nodes holding it in DRAM or on
SSD whose incarnation is live) and, whenever a change moves that count, tells holders what
changed (docs/architecture.md, "Replacement classes"). With ``n0``/``n1`` the count before
and after one change and ``T`` the threshold (``--min-reclaimable-owner-count``, >= 2):

- ``n1 >= T > n0``: *demote* to every holder;
- ``n1 >= T`` otherwise: *demote* to the holders that joined (added the block, moved it from
  their SSD back into DRAM, or came back to life);
- ``n1 < T <= n0``: *restore* to every holder;
- ``n1 == 1 < n0``: *restore* to the one left (it lost every other copy: a copy it pulled,
  reclaimable from the start, is retained again).

Notices are edges, sent in the order of the changes, so the last one a holder gets for a
block is its class at the current count. The index's Lua scripts (``pegaflow/meta/index.py``)
apply this rule inside Redis; ``pegaflow replay``'s cluster model applies this function.
Tests hold the two equal.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

MIN_OWNER_THRESHOLD = 2  # the original's lower bound: a threshold of 1 would demote every block


def class_notices(
    n0: int, holders: Collection[int], joined: Iterable[int], threshold: int
) -> tuple[list[int], list[int]]:
    """(holders to demote, holders to restore) after one change of a block's holders.

    ``n0``: holders counted before the change; ``holders``: those counted after it (``n1`` of
    them); ``joined``: the ones among them that joined with it. ``threshold`` < 2: no notices.
    """
    if threshold < MIN_OWNER_THRESHOLD:
        return [], []
    n1 = len(holders)
    if n1 >= threshold:
        return (list(holders) if n0 < threshold else [j for j in joined if j in holders]), []
    if n0 >= threshold or (n1 == 1 and n0 > 1):
        return [], list(holders)
    return [], []
