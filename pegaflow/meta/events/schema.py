"""The node event: what one node tells the global index about the blocks it holds.

An event is one entry of the node's own Redis Stream (``pf:ev:{<node>}``). Events of one
node are totally ordered by ``(epoch, seq)``; ``seq`` restarts at 0 in every epoch.

Contract (schema version 1):

- ``INSERT`` / ``EVICT``: the node now holds / no longer holds these blocks of ``namespace``.
- Tier (one of ``pegaflow.core.tiers.LOCAL_TIERS``): an ``INSERT`` or ``SNAPSHOT`` carrying
  ``FLAG_SSD`` says the node holds these blocks only on its SSD tier (not in DRAM); without
  it (every event of older nodes) they are in DRAM (L1). A block's newest add sets its
  tier: a block leaving DRAM for the SSD is an ``INSERT`` with ``FLAG_SSD`` (a tier change,
  not an ``EVICT``), one promoted back an ``INSERT`` without it. ``EVICT`` means gone from
  every tier. Readers that predate the flag ignore it (it is a bit of ``flags``; the layout
  is unchanged), seeing SSD copies as DRAM ones.
- ``RESET``: first event of an epoch (``seq == 0``, no namespace, no hashes). Everything
  the node said in older epochs is void; what it holds is what follows.
- ``SNAPSHOT``: blocks held at the start of the epoch, in chunks, applied like ``INSERT``.
  The last chunk of a snapshot carries ``FLAG_LAST`` (possibly with no hashes): once it
  is applied, the index holds the node's full state and the epoch becomes the one readers
  see.

One writer besides the node: the operator's manual cleanup (``pegaflow/meta/cleanup.py``)
appends ``EVICT`` events to a node's stream, under the nid and epoch they apply to and that
epoch's last ``seq``, only while the stream still ends where it read it. Readers apply them
as any ``EVICT`` (in stream order); ``seq`` is informative, readers order by stream position.

``nid`` is the integer id of the incarnation ``(node, epoch)``, handed out by Redis when
the node registers (``pegaflow.cluster.registry``); the index stores nids, never names,
because small integers are what make the index compact.

An applied event becomes an :class:`Update` of the index: INSERT and SNAPSHOT add ``nid``
to each block's holders (or change its tier), EVICT removes it; RESET changes no block.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pegaflow.core.identity import HASH_BYTES
from pegaflow.core.tiers import Tier

SCHEMA_VERSION = 1

FLAG_LAST = 0x01  # last chunk of a snapshot
FLAG_SSD = 0x02  # INSERT/SNAPSHOT: held on the node's SSD tier only (else in DRAM)


class Op(enum.IntEnum):
    INSERT = 1
    EVICT = 2
    SNAPSHOT = 3
    RESET = 4


@dataclass(frozen=True, slots=True)
class Event:
    """One decoded node event. ``blob`` is the concatenation of the 16-byte block hashes.

    The hashes travel as one blob because every consumer step (codec, Lua apply) works on
    the batch, never on single blocks; ``hashes`` splits it for callers that need a list.
    """

    node: str
    nid: int
    epoch: int
    seq: int
    op: Op
    namespace: str = ""
    blob: bytes = b""
    flags: int = 0

    @property
    def count(self) -> int:
        return len(self.blob) // HASH_BYTES

    @property
    def hashes(self) -> list[bytes]:
        b = self.blob
        return [b[i : i + HASH_BYTES] for i in range(0, len(b), HASH_BYTES)]

    @property
    def last(self) -> bool:
        return bool(self.flags & FLAG_LAST)

    @property
    def tier(self) -> Tier:
        return Tier.SSD if self.flags & FLAG_SSD and self.op in (Op.INSERT, Op.SNAPSHOT) else Tier.L1

    @classmethod
    def make(
        cls,
        node: str,
        nid: int,
        epoch: int,
        seq: int,
        op: Op,
        namespace: str = "",
        hashes: Sequence[bytes] = (),
        flags: int = 0,
    ) -> Event:
        """Build an event from a list of hashes; raises ValueError unless each is 16 bytes."""
        for h in hashes:
            if len(h) != HASH_BYTES:
                raise ValueError(f"block hash must be {HASH_BYTES} bytes, got {len(h)}")
        return cls(node, nid, epoch, seq, Op(op), namespace, b"".join(hashes), flags)


@dataclass(frozen=True, slots=True)
class Update:
    """One event's change to the index: ``op`` of the 16-byte hashes in ``blob`` for ``nid``,
    held in ``tier`` (adds only)."""

    op: Op
    namespace: str
    nid: int
    blob: bytes
    tier: Tier = Tier.L1

    @classmethod
    def of(cls, ev: Event) -> Update:
        return cls(ev.op, ev.namespace, ev.nid, ev.blob, ev.tier)

    @property
    def adds(self) -> bool:
        return self.op != Op.EVICT
