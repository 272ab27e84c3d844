"""An in-memory view of the global prefix index, for a metaserver replica's lookups (issue #55).

:class:`PrefixView` holds, per (namespace id, 16-byte block hash), the node slots holding
the block in DRAM (L1) and those holding it only on their SSD tier: the same facts
``pegaflow/meta/index.py`` keeps in Redis per nid, fed by the same events (INSERT and
SNAPSHOT add or change a holder's tier, EVICT removes it, a new incarnation's RESET voids its
old one's). The table and its loops are C (``pegaflow.meta._metaview``, built by the install
from pegaflow/native/metaview.c; its header gives the layout); this module adds the typed
event entry point. Redis stays the durable index; the view is a projection a replica
rebuilds from it and the streams.

Contracts:

- Node slots are 0..``MAX_SLOTS`` - 1 (64: one bit each of a mask). The caller maps each
  incarnation (nid) it sees to a slot and frees a slot with :meth:`clear_slot` (a reset or a
  retired node) before reusing it; with more incarnations than slots it must answer from
  Redis instead (``ValueError`` names the slot). Namespace ids are small ints, 0..65535.
- :meth:`apply` of one event's hashes (the concatenated blob, or a sequence of 16-byte
  ``bytes``) is one C call; per (block, slot) it does what ``index._APPLY`` does and returns
  the same count of changed pairs. Bad input (a blob not a multiple of 16 bytes, a hash of
  another length, a slot or namespace id out of range) raises ``ValueError`` before anything
  changes.
- :meth:`walk` answers ``index.prefix_tiers`` for the same state: per slot of ``live_mask``
  holding block 0, ``(slot, prefix_len, ssd_blocks)`` (leading blocks it holds in any tier,
  how many of them only on SSD), in slot order; one C call straight from the request's hashes.
  :meth:`held` gives the same as ``index.Held`` by slot.
- The table grows by doubling its index before its load passes 0.7; evictions use
  backward-shift deletion (no tombstones), so lookups never slow down with churn.
- Memory: 32 B per block plus 4 B per index slot plus the entries' growth slack (<= 1/8):
  38-48 B per block whatever the load; measured 40.1 at 1M blocks and 41.4 at 8M (RSS
  growth 39.5 / 43.1), against 106-136 for a dict view.
- Threads: every call holds the GIL from start to end (none is released), so each is atomic
  to other Python threads, and is as long as what it does. Measured by bench/meta_view.py on
  the 2-core dev machine (shared, so p99s are noisy), at 1M / 8M blocks: a 128-hash walk
  4-6 / 8 us p50 (30-46 / 62 ns a hash with the hashes as a list of ``bytes``, ~25 / ~52 ns
  as one blob); applying a 512-hash entry ~30-100 us (5-19M inserted pairs/s, 6-12M evicted);
  :meth:`clear_slot` one pass over every entry, 10 ms at 1M and 130-230 ms at 8M: a
  replica clears in steps instead (``clear_slot_part``: at most ``budget`` entries visited a
  call, ~10-20 ns each, other slots' updates allowed between steps; ``view_feed.py``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Final

from pegaflow.core.identity import HASH_BYTES
from pegaflow.core.tiers import Tier
from pegaflow.meta._metaview import HASH_BYTES as _C_HASH_BYTES  # built by the install (metaview.c)
from pegaflow.meta._metaview import MAX_NAMESPACES as _C_MAX_NAMESPACES
from pegaflow.meta._metaview import MAX_SLOTS as _C_MAX_SLOTS
from pegaflow.meta._metaview import View
from pegaflow.meta.events.schema import Op
from pegaflow.meta.index import Held

if _C_HASH_BYTES != HASH_BYTES:  # the C table's key width is a compile-time constant
    raise ImportError(f"pegaflow.meta._metaview keys {_C_HASH_BYTES}-byte hashes, PegaFlow's are {HASH_BYTES}: rebuild")

MAX_SLOTS: Final[int] = _C_MAX_SLOTS
"""Node slots a view tells apart (bits of a uint64 mask)."""

ALL_SLOTS: Final[int] = (1 << MAX_SLOTS) - 1
"""A ``live_mask`` with every slot live."""

MAX_NAMESPACES: Final[int] = _C_MAX_NAMESPACES
"""Namespace ids a view holds (0 .. MAX_NAMESPACES - 1)."""


class PrefixView(View):
    """The C view (``update``, ``clear_slot``, ``clear_slot_part``, ``walk``, ``holders``, ``dump``, ``nbytes``, ``len``)
    with events applied by their :class:`Op` and :class:`Tier`."""

    __slots__ = ()

    def __init__(self, seed: int | None = None) -> None:
        # A per-view hash seed: the table's layout is unpredictable to whoever sends hashes.
        super().__init__(secrets.randbits(64) if seed is None else seed)

    def apply(self, ns: int, slot: int, op: Op, hashes: bytes | Sequence[bytes], tier: Tier = Tier.L1) -> int:
        """Apply one event's hashes for ``slot``: INSERT / SNAPSHOT hold them in ``tier`` (a
        tier change for blocks already held), EVICT drops them from every tier. Returns the
        (block, slot) pairs that changed. RESET changes no block: :meth:`clear_slot` the old
        incarnation's slot."""
        if op == Op.EVICT:
            return self.update(ns, slot, False, False, hashes)
        if op not in (Op.INSERT, Op.SNAPSHOT):
            raise ValueError(f"{op.name} changes no block: clear_slot() the incarnation it replaces")
        if tier not in (Tier.L1, Tier.SSD):
            raise ValueError(f"a holder keeps blocks in l1 or ssd, not {tier}")
        return self.update(ns, slot, True, tier == Tier.SSD, hashes)

    def held(self, ns: int, hashes: bytes | Sequence[bytes], live_mask: int = ALL_SLOTS) -> dict[int, Held]:
        """:meth:`walk` as slot -> :class:`~pegaflow.meta.index.Held` (``Index.query_tiers``' shape)."""
        return {slot: Held(n, ssd) for slot, n, ssd in self.walk(ns, hashes, live_mask)}
