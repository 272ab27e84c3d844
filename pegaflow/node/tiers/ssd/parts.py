"""What the SSD tier's writer and promoter use of the tier (``SsdTier`` implements it), and
what the tier uses of the node's page checksums.

Kept apart so ``writer.py`` and ``promote.py`` depend on this contract, not on ``tier.py``
(which builds them): the import graph has no cycle. :class:`KnownChecksums` keeps the SSD
tier from importing the remote tier (which imports the SSD tier to serve pins from it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, TypeVarTuple

from pegaflow.core.block_index import Block, BlockIndex, Namespace
from pegaflow.node.tiers.ssd.gate import IoGate
from pegaflow.node.tiers.ssd.metrics import SsdMetrics
from pegaflow.node.tiers.ssd.store import Entry, SsdIndex
from pegaflow.node.tiers.ssd.uring import Engine

Ts = TypeVarTuple("Ts")  # a posted call's arguments


class KnownChecksums(Protocol):
    """Page checksums of resident blocks, kept once for the whole node (``PageChecksums``,
    pegaflow/node/tiers/remote/checksums.py, in a cluster): the writer uses a known value for
    its record and adds the ones it computes; a promotion adds the ones it verified."""

    def get(self, b: Block) -> int | None: ...

    def record(self, b: Block, checksum: int) -> None: ...


class TierParts(Protocol):
    index: BlockIndex
    store: SsdIndex
    engine: Engine
    writes: IoGate  # --ssd-write-inflight / --ssd-write-queue-depth in front of the engine
    reads: IoGate  # --ssd-prefetch-inflight / --ssd-prefetch-queue-depth
    metrics: SsdMetrics
    pool_view: memoryview
    loop: asyncio.AbstractEventLoop | None
    promoting: set[tuple[int, bytes]]
    checksums: KnownChecksums | None  # when the node joins a cluster

    def call_soon(self, fn: Callable[[*Ts], object], *args: *Ts) -> None:
        """Run ``fn(*args)`` on the node's event loop (from any thread), in call order."""
        ...

    def defer(self, fn: Callable[[*Ts], object], *args: *Ts) -> None:
        """Run ``fn(*args)`` on the node's event loop once the data path pauses (bounded)."""
        ...

    def on_ssd_evicted(self, keys: list[tuple[int, bytes]], dropped: bool = False) -> None: ...

    def ssd_stored(self, ns: Namespace, hashes: list[bytes]) -> None: ...

    def log_io_error(self, what: str, n: int) -> None: ...

    def log_checksum_failure(self, e: Entry) -> None: ...

    def metrics_node_hits(self, n: int) -> None: ...
