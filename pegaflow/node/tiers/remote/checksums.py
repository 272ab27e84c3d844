"""Page checksums computed once per resident block and reused by every pull of it.

A committed page never changes while its block is resident, so its xxh3_64 is a fact
about the block, not about one transfer. Hashing it again for every pull costs the
serving node a read of the page from DRAM on the pull's critical path: measured on the
TCP data plane, ~0.1 CPU-s per GB, ~40% of the sender's CPU and ~20% of both ends'
(bench/p2p.py, docs/benchmarks.md "p2p"). RDMA pins were worse: every page was hashed
before the pin was even answered.

Contracts:
- An entry is keyed by block key (namespace id, block hash), holds the block it was
  computed for, and is dropped when the block leaves the index (``evict`` event). A value
  is only ever given for that same block: work that pinned a block a Reset dropped may
  still record its value afterwards, and the engine may save the same hash again with
  other bytes (a new block). Should one ever be stale anyway, a puller would reject a good
  page (a miss), never accept a wrong one: it checks the bytes it received against the value.
- Where values come from, cheapest first: a pulled page's value is the one it was
  verified against (:meth:`record`, no extra pass); a block committed on a node that
  serves peers is hashed in the background, off the engine's save path and before any
  pull is likely (``insert`` events, pinned while hashed, one worker thread, batches of
  ``HASH_BATCH_BYTES`` or 1/16 of the pool, at most ``HASH_QUEUE_BYTES`` waiting); a page
  sent before that is hashed by the sender as it goes out (:meth:`of`) and kept.
- The SSD tier's writer (``pegaflow/node/tiers/ssd/writer.py``) uses a known value for its
  record's payload checksum (the same function, ``pool.page_checksum``) and adds the
  ones it computes, so a page is hashed once for both.
- :meth:`get`, :meth:`of` and :meth:`record` may be called from data-plane threads for
  blocks pinned by the caller (one dict operation each, atomic under the GIL); the
  listener and the background hasher run on the node's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from pegaflow.common.priority import background_thread
from pegaflow.core.block_index import Block, BlockIndex, IndexEvent, Namespace
from pegaflow.node.idle import DataPathIdle
from pegaflow.node.tiers.remote import page_checksum
from pegaflow.node.tiers.remote.metrics import PeerMetrics

log = structlog.get_logger("pegaflow.p2p")

HASH_BATCH_BYTES = 64 << 20  # pages hashed per worker hop (~6 ms here): few hops, short pins
HASH_BATCH_POOL_SHARE = 16  # ... and at most 1/16 of the pool pinned by the hasher (small pools)
HASH_QUEUE_BYTES = 4 << 30  # committed bytes waiting at most; beyond, pages are hashed when sent


class PageChecksums:
    """xxh3_64 of resident pages by block key; see the module docstring.

    ``background=True`` (a node that publishes its blocks to peers) hashes newly
    committed blocks ahead of any pull; call :meth:`start` on the node's loop then. With
    ``idle`` (the node's, pegaflow/node/idle.py), each batch waits for a pause of the data path.
    """

    def __init__(self, index: BlockIndex, pool_view: memoryview, metrics: PeerMetrics,
                 background: bool = False, idle: DataPathIdle | None = None) -> None:
        self.index = index
        self.view = pool_view
        self.metrics = metrics
        self.background = background
        self._sums: dict[tuple[int, bytes], tuple[Block, int]] = {}  # key -> (the block hashed, its value)
        self._batch_bytes = max(1, min(HASH_BATCH_BYTES, index.alloc.capacity // HASH_BATCH_POOL_SHARE))
        self._queue: deque[tuple[Namespace, bytes]] = deque()
        self._queued_bytes = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.idle = idle
        index.add_listener(self._on_index_event)
        metrics.known_checksums.set_function(lambda: len(self._sums))

    # ---- any thread (pinned blocks) ---------------------------------------------------------
    def get(self, b: Block) -> int | None:
        got = self._sums.get((b.ns.id, b.hash))
        return got[1] if got is not None and got[0] is b else None

    def record(self, b: Block, checksum: int) -> None:
        """Keep a value computed elsewhere for ``b``'s current page (e.g. verified on a pull)."""
        self._sums[(b.ns.id, b.hash)] = (b, checksum)

    def forget(self, blocks: Sequence[Block]) -> None:
        """Drop the values of pages that never became resident (read from SSD for a pin);
        a value since recorded for another block of the same key (staged again for another
        pin, after a reset) stays."""
        sums = self._sums
        for b in blocks:
            key = (b.ns.id, b.hash)
            got = sums.get(key)
            if got is not None and got[0] is b:
                del sums[key]

    def of(self, b: Block) -> int:
        """``b``'s value, hashing its page now (and keeping the value) if it is not known."""
        c = self.get(b)
        if c is None:
            c = page_checksum(self.view[b.offset:b.offset + b.size])
            self.record(b, c)
            self.metrics.hashed_bytes.labels("transfer").inc(b.size)
        return c

    # ---- the node's loop ----------------------------------------------------------------------
    def _on_index_event(self, op: IndexEvent, ns: Namespace, hashes: list[bytes]) -> None:
        if op is IndexEvent.EVICT or op is IndexEvent.REMOVE:
            pop = self._sums.pop
            nid = ns.id
            for h in hashes:
                pop((nid, h), None)
        elif op is IndexEvent.INSERT and self._wake is not None:
            room = (HASH_QUEUE_BYTES - self._queued_bytes) // max(1, ns.page_bytes)
            if room < len(hashes):
                self.metrics.hash_skipped_bytes.inc((len(hashes) - max(0, room)) * ns.page_bytes)
                hashes = hashes[:max(0, room)]
            if hashes:
                self._queue.extend((ns, h) for h in hashes)
                self._queued_bytes += len(hashes) * ns.page_bytes
                self._wake.set()

    def start(self) -> None:
        """Start the background hasher (``background=True``); on the node's running loop."""
        if not self.background or self._task is not None:
            return
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2p-checksum",
                                            initializer=background_thread)
        self._task = asyncio.get_running_loop().create_task(self._hash_committed())

    async def _hash_committed(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch: list[Block] = []
                size = 0
                while self._queue and size < self._batch_bytes:
                    ns, h = self._queue.popleft()
                    self._queued_bytes -= ns.page_bytes
                    b = self.index.get(ns, h)
                    if b is not None and self.get(b) is None:
                        batch.append(b)
                        size += b.size
                if not batch:
                    continue
                self.index.pin(batch)  # the page must not be evicted and reused under the hash
                try:
                    if self.idle is not None:  # after the data path's burst (pegaflow/node/idle.py)
                        await self.idle.pause()
                    t0 = time.perf_counter()
                    sums = await loop.run_in_executor(self._executor, self._hash, batch)
                    for b, c in zip(batch, sums, strict=True):
                        self.record(b, c)
                    self.metrics.hashed_bytes.labels("commit").inc(size)
                    log.debug("p2p_checksums", blocks=len(batch), bytes=size,
                              seconds=round(time.perf_counter() - t0, 4))
                except Exception as exc:  # noqa: BLE001 - those pages are hashed when sent instead
                    log.warning("p2p_checksums_failed", blocks=len(batch), error=repr(exc))
                finally:
                    self.index.unpin(batch)

    def _hash(self, blocks: Sequence[Block]) -> list[int]:
        view = self.view
        return [page_checksum(view[b.offset:b.offset + b.size]) for b in blocks]

    async def close(self) -> None:
        """Stop the background hasher and wait for its worker (it reads pool pages)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
            self._executor = None

    def __len__(self) -> int:
        return len(self._sums)

    def __repr__(self) -> str:
        return f"PageChecksums(known={len(self._sums)}, queued={len(self._queue)})"
