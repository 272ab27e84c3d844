"""The L3 SSD tier of one node: cache files (:mod:`files`, laid out as :mod:`records` says)
+ index (:mod:`store`), I/O engine, write-behind, promotion. A block's path: commit into
L1 -> :mod:`writer` -> disk; Query miss in L1 -> :mod:`promote` -> disk -> L1 page -> commit.

Lifecycle: :func:`open_cache` validates the paths and opens the files at start-up, before
the pool is allocated (bad paths and capacities fail with :class:`SsdError`, one line);
:class:`SsdTier` is then built once, with every collaborator, on the node's block index
(it scans the files and registers their namespaces there); :meth:`SsdTier.start` binds it
to the node's event loop; :meth:`SsdTier.close` lets queued writes finish (bounded) and
must run before the pool is unmapped. Everything except the I/O engine threads runs on the
node's event loop, like the rest of the node.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVarTuple

import structlog

from pegaflow.config.tiers import SsdConfig
from pegaflow.core.block_index import Block, BlockIndex, Namespace
from pegaflow.core.tiers import Tier
from pegaflow.node.block_events import TierListener
from pegaflow.node.idle import DataPathIdle
from pegaflow.node.metrics import NodeMetrics, value_of
from pegaflow.node.tiers.ssd.files import SsdError, discard_created, open_files
from pegaflow.node.tiers.ssd.gate import IoGate
from pegaflow.node.tiers.ssd.metrics import SsdMetrics, SsdStats
from pegaflow.node.tiers.ssd.parts import KnownChecksums
from pegaflow.node.tiers.ssd.promote import Promoter
from pegaflow.node.tiers.ssd.store import CacheFile, Entry, SsdIndex
from pegaflow.node.tiers.ssd.uring import make_engine
from pegaflow.node.tiers.ssd.writer import WriteBehind

log = structlog.get_logger("pegaflow.ssd")
Ts = TypeVarTuple("Ts")  # a posted call's arguments

DRAIN_BUDGET_S = 0.0003  # loop time one drain of posted calls may take before yielding
CLOSE_DRAIN_SECONDS = 10.0  # at shutdown, wait this long at most for queued writes
STATS_INTERVAL = 1.0  # seconds between throughput gauge updates
IO_ALIGN = 4096


@dataclass(frozen=True, slots=True)
class SsdFiles:
    """The cache files of ``config``, validated and opened (:func:`open_cache`), not scanned yet."""

    config: SsdConfig
    files: tuple[CacheFile, ...]

    def discard(self) -> None:
        """Remove the files and directories this start created: the start failed."""
        discard_created(self.files)


def open_cache(config: SsdConfig) -> SsdFiles | None:
    """Validate and open the cache files named by the options (None: no SSD tier).

    Raises SsdError with a one-line reason; nothing is overwritten in that case.
    """
    if not config.ssd_cache_path:
        return None
    return SsdFiles(config, tuple(open_files(config.ssd_cache_path, config.ssd_cache_capacity,
                                             config.ssd_cache_shards)))


class SsdTier:
    """The SSD tier on the node's block index and pool.

    ``feed`` hears every store and removal of an SSD record (the node's ``BlockEventFeed``:
    engines that watch blocks, the cluster publisher); ``checksums``, in a cluster, are the
    node's page checksums, shared with remote reads (:class:`KnownChecksums`); ``idle``
    (pegaflow/node/idle.py) holds background hand-offs until the data path pauses (None: at
    the next turn of the loop).
    """

    def __init__(self, cache: SsdFiles, index: BlockIndex, pool_view: memoryview, metrics: NodeMetrics, *,
                 feed: TierListener | None = None, checksums: KnownChecksums | None = None,
                 idle: DataPathIdle | None = None) -> None:
        """Scan the files, register their namespaces in ``index`` and start the I/O engine."""
        if index.alloc.align % IO_ALIGN:
            raise SsdError(f"--ssd-cache-path needs --page-align to be a multiple of {IO_ALIGN} (O_DIRECT)")
        c = self.config = cache.config
        self.files = list(cache.files)
        self.index = index
        self.pool_view = pool_view
        self.node_metrics = metrics
        self.block_events = feed
        self.checksums = checksums
        self.idle = idle
        self.loop: asyncio.AbstractEventLoop | None = None
        self.promoting: set[tuple[int, bytes]] = set()
        self._posted: collections.deque[tuple[Callable[..., object], tuple[object, ...]]] = collections.deque()
        self._drain_scheduled = False
        self._stats_task: asyncio.Task[None] | None = None
        self.metrics = SsdMetrics(metrics.registry)
        self.store = SsdIndex(self.files, self._ns_id)
        self.store.scan()
        self.engine = make_engine(c.ssd_io_engine, c.ssd_queue_depth)
        self.metrics.dir_inflight.labels("write").set_function(lambda: self.writes.inflight)
        self.metrics.dir_inflight.labels("prefetch").set_function(lambda: self.reads.inflight)
        self.metrics.dir_waiting.labels("write").set_function(lambda: self.writes.waiting())
        self.metrics.dir_waiting.labels("prefetch").set_function(lambda: self.reads.waiting())
        self.writes = IoGate(self.engine, self.call_soon, c.ssd_write_inflight, c.ssd_write_queue_depth,
                             self._gate_peak("write"))
        self.reads = IoGate(self.engine, self.call_soon, c.ssd_prefetch_inflight, c.ssd_prefetch_queue_depth,
                            self._gate_peak("prefetch"))
        # Queued writes pin their L1 pages: never let them hold more than half the pool.
        self.writer = WriteBehind(self, min(c.ssd_write_queue_size, index.alloc.capacity // 2))
        self.promoter = Promoter(self, c.max_prefetch_blocks)
        index.add_listener(self.writer.on_index_event)
        m = self.metrics
        m.capacity.set(self.store.capacity)
        m.used.set_function(lambda: self.store.used_bytes)
        m.blocks.set_function(lambda: len(self.store.entries))
        m.queue_blocks.set_function(lambda: len(self.writer.pending))
        m.queue_bytes.set_function(lambda: self.writer.queued_bytes)
        m.inflight.set_function(lambda: self.engine.inflight())
        log.info("ssd_tier_ready", files=[f.path for f in self.files], capacity=self.store.capacity,
                 blocks=len(self.store.entries), engine=self.engine.name, queue_depth=self.engine.depth,
                 write_inflight=self.writes.limit, write_queue_depth=self.writes.queue_depth,
                 prefetch_inflight=self.reads.limit, prefetch_queue_depth=self.reads.queue_depth)

    def _gate_peak(self, direction: str) -> Callable[[IoGate], None]:
        peak = self.metrics.dir_peak.labels(direction)
        return lambda gate: peak.set(gate.peak)

    def _ns_id(self, name: str, page_bytes: int) -> int | None:
        try:
            return self.index.namespace(name, page_bytes).id
        except ValueError:
            log.warning("ssd_namespace_conflict", namespace=name, page_bytes=page_bytes)
            return None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._stats_task = loop.create_task(self._stats())

    def call_soon(self, fn: Callable[[*Ts], object], *args: *Ts) -> None:
        """Run ``fn(*args)`` on the node's event loop (from any thread), in call order.

        Completions are queued and drained in one loop callback: one wake-up of the loop
        per burst of completions instead of one per I/O.
        """
        self._posted.append((fn, args))
        if not self._drain_scheduled:
            self._drain_scheduled = True
            assert self.loop is not None
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # loop closed during shutdown
                pass

    def defer(self, fn: Callable[[*Ts], object], *args: *Ts) -> None:
        """Run ``fn(*args)`` on the loop once the data path pauses (``idle``:
        pegaflow/node/idle.py); at the next turn of the loop without one."""
        assert self.loop is not None
        if self.idle is None:
            self.loop.call_soon(fn, *args)
        else:
            self.idle.call(self.loop, fn, *args)

    def _drain(self) -> None:
        """Run posted calls for at most ``DRAIN_BUDGET_S``, then yield to the loop (a Query
        that arrived meanwhile is answered before the rest): under a full-rate spill asyncio's
        debug mode flagged single drains of every completion at 2-7 ms (bench/spill.py)."""
        self._drain_scheduled = False  # before draining: a racing append schedules again
        posted = self._posted
        deadline = time.perf_counter() + DRAIN_BUDGET_S
        while posted:
            fn, args = posted.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("ssd_completion_failed")
            if posted and time.perf_counter() > deadline:
                if not self._drain_scheduled:
                    self._drain_scheduled = True
                    assert self.loop is not None
                    self.loop.call_soon(self._drain)
                return

    # ---- hooks used by the node -------------------------------------------------------
    def promote(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> int:
        """Query hook: > 0 = answer LOADING (blocks after ``hit`` are on their way to L1); the
        prefix length the node will hold once they landed."""
        if self.loop is None or self.writer.closing:
            return 0
        return self.promoter.query(nss, hashes, hit)

    def leased(self, blocks: Sequence[Block]) -> None:
        """A Query leased ``blocks``: promotion holds on them may end (``Promoter.leased``)."""
        self.promoter.leased(blocks)

    def metrics_node_hits(self, n: int) -> None:
        self.node_metrics.hits.labels(Tier.SSD).inc(n)

    def clear(self, ns: Namespace) -> int:
        """Forget every SSD record of ``ns`` (a reset); writes in flight are not indexed when
        they land. Returns the records forgotten. The reset is durable: a reset record in
        every cache file voids the namespace's older records for the scan of a restarted
        node (``SsdIndex.tombstone``), found by that scan even if the node dies before the
        writes in flight land (each then opens a segment of its own)."""
        store = self.store
        keys = [k for k in store.entries if k[0] == ns.id]
        for k in keys:
            store.remove(k)
        pending = [k for k in self.writer.pending if k[0] == ns.id]
        self.writer.voided.update(pending)
        if keys or pending:
            try:
                evicted = store.tombstone(ns.name, fresh_segment=self.writer.writing > 0)
            except OSError as exc:
                log.warning("ssd_reset_not_durable", namespace=ns.name, error=str(exc))
            else:
                if evicted:
                    self.on_ssd_evicted(evicted)
        if keys and self.block_events is not None:
            self.block_events.ssd_removed(ns, [h for _, h in keys])
        return len(keys)

    def ssd_stored(self, ns: Namespace, hashes: list[bytes]) -> None:
        if self.block_events is not None and hashes:
            self.block_events.ssd_stored(ns, hashes)

    def on_ssd_evicted(self, keys: list[tuple[int, bytes]], dropped: bool = False) -> None:
        """Records gone from the SSD index: evicted, or (``dropped``) found corrupt."""
        if not dropped:
            self.metrics.evicted.inc(len(keys))
        if self.block_events is not None:
            by_ns: dict[int, list[bytes]] = {}
            for nid, h in keys:
                by_ns.setdefault(nid, []).append(h)
            for nid, hs in by_ns.items():
                ns = self.index.namespace_by_id(nid)
                if ns is not None:
                    self.block_events.ssd_removed(ns, hs)

    def log_io_error(self, what: str, n: int) -> None:
        log.warning("ssd_io_error", op=what, blocks=n)

    def log_checksum_failure(self, e: Entry) -> None:
        log.warning("ssd_checksum_mismatch", file=self.files[e.file].path, offset=e.offset,
                    namespace=e.ns_name)

    def stats(self) -> SsdStats:
        """What the Stats RPC reports of this tier: what its metrics export now."""
        return self.metrics.stats()

    async def _stats(self) -> None:
        m = self.metrics
        last_w = last_r = 0.0
        t_last = time.perf_counter()
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            now = time.perf_counter()
            w = value_of(m.write_bytes)
            r = value_of(m.read_bytes)
            dt = max(now - t_last, 1e-9)
            m.write_throughput.set((w - last_w) / dt)
            m.read_throughput.set((r - last_r) / dt)
            last_w, last_r, t_last = w, r, now

    async def close(self) -> None:
        """Stop taking writes, let queued ones finish (bounded), stop the engine, close files."""
        self.writer.closing = True
        deadline = time.monotonic() + CLOSE_DRAIN_SECONDS
        while not self.writer.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._stats_task is not None:
            self._stats_task.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)
        await asyncio.sleep(0)  # run completions posted by the engine's last I/Os
        self.store.close()
        log.info("ssd_tier_closed", blocks=len(self.store.entries), used_bytes=self.store.used_bytes)

