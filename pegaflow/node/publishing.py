"""Node side: batch the node's block inserts/evictions into its Redis Stream.

Hook-up is one call: the node's block index calls :meth:`EventPublisher.on_insert` and
:meth:`EventPublisher.on_evict` (or the generic :meth:`EventPublisher.listener`) after it
changed its own index, from the thread that changed it. Those calls only append to a
bounded in-memory buffer under a lock: they never wait on Redis.

With an SSD tier, :class:`HolderTiers` stands between the node and the publisher: it
hears the block index (DRAM) and the SSD tier (through the node's ``BlockEventFeed``)
and publishes the tier the node holds each block in, the best one (``schema.py``):

- DRAM insert: ``INSERT`` (L1). DRAM eviction of a block the SSD holds: ``INSERT`` with
  ``FLAG_SSD`` (a tier change, peers can still pull it); of one it does not: ``EVICT``.
- SSD store of a block not in DRAM: ``INSERT`` SSD (in DRAM: nothing, L1 is better).
- SSD eviction of a block not in DRAM: ``EVICT`` (in DRAM: nothing).
- Snapshots (start, re-sync, restart with the SSD intact): DRAM blocks as L1, blocks only
  on SSD as SSD chunks.

Contracts:

- Order: events are published in the order the listener was called. Per block, that
  order must be the order of the node's own mutations (true when one thread mutates).
- Bounded: at most ``buffer_blocks`` block updates wait in memory. When the buffer is
  full, or Redis stays unreachable longer than ``retry_seconds``, updates are dropped and
  counted, never blocking the node; the publisher then re-syncs: a new epoch, a full
  snapshot, and the index converges again.
- Snapshot cut: ``snapshot()`` runs together with clearing the buffer, on the node's
  event loop when ``loop`` is given (so no listener call interleaves), otherwise in the
  publisher thread under the buffer lock. Every update after the cut is published after
  the snapshot, so snapshot + later updates equals the node's state.
- Start and every re-sync: ``RESET``, ``SNAPSHOT`` chunks, a last chunk with ``FLAG_LAST``.
  On start (a restarted node lost its memory) readers switch to the new epoch at once; on
  an in-process re-sync they keep the old epoch until the metaserver applied the snapshot.
- Liveness: the TTL key is refreshed every ``ttl_seconds / 3`` (set again if it expired
  while the registration lasts: ``registry.heartbeat``). If the registration is gone (reaped
  after the metaserver's ``--ttl-minutes`` of silence, Redis restarted empty) the publisher
  re-registers and re-syncs.
- Lost tail: the publisher keeps the id of its last entry. Every XADD round trip first reads
  that entry back (``XRANGE last last``, in the same pipeline) and every heartbeat does too
  while nothing is written. Gone means Redis lost what was acknowledged while keeping the
  registration (a restart from an older RDB or AOF, a failover to a lagging replica): the
  publisher re-syncs. No legitimate change of the stream removes it: the metaserver trims
  only entries older than the visible epoch's ``RESET`` and deletes the stream of a node it
  reaped (whose registration is gone too), a manual cleanup appends after it. Another live
  node given the same name trims it at its own start: that is the conflict below, reported
  as such (``_lost`` asks ``registry.rival`` first).
- One name, two nodes: a re-registration (the registration lost, or the stream's end) first
  asks whether another live node with another address took the name (``registry.rival``:
  two nodes given one ``--node-id``; the one that registered last holds it). If so this one
  logs one error naming both addresses, sets ``pegaflow_node_events_node_id_conflict``, drops
  its updates and asks again every ``ttl_seconds / 3`` instead of taking the name back (each
  used to retire the other at every heartbeat, a full snapshot each time); once the other is
  gone it registers anew (``START``).
- Stop: what is buffered is flushed, then the live key deleted (``registry.leave``): readers
  skip the node at once instead of for its TTL.
- Class notices: with ``poll`` (``pegaflow/node/classes.py``'s ``NoticeReader``), the
  thread also hands its client and the current nid to it every ``poll_interval``; its
  errors are logged and never re-sync anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import redis
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from pegaflow.cluster import registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import Client, connect, error_text
from pegaflow.cluster.registry import NodeInfo
from pegaflow.common.priority import background_thread
from pegaflow.config.commands import NodeConfig
from pegaflow.core.block_index import Block, BlockIndex, IndexEvent, Namespace
from pegaflow.core.hosts import advertised
from pegaflow.core.identity import HASH_BYTES
from pegaflow.core.tiers import Tier
from pegaflow.meta.events.codec import FIELD, encode
from pegaflow.meta.events.schema import FLAG_LAST, FLAG_SSD, Event, Op
from pegaflow.meta.events.streams import GROUP
from pegaflow.node.block_events import BlockEventFeed
from pegaflow.node.classes import NOTICE_POLL_S
from pegaflow.node.idle import DataPathIdle

_log = structlog.get_logger("pegaflow.meta.publisher")


class _SafeLog:
    """Logging from the publisher thread must never break publishing (e.g. a closed stderr)."""

    def __getattr__(self, level: str) -> Callable[..., None]:
        def emit(event: str, **kw: object) -> None:
            with contextlib.suppress(Exception):
                getattr(_log, level)(event, **kw)

        return emit


log = _SafeLog()

BATCH_BLOCKS = 512  # hashes per stream entry: ~8 KB entries amortise Redis per-entry cost
XADD_PIPELINE = 64  # entries per pipeline round trip
FLUSH_INTERVAL = 0.02  # seconds a partial batch may wait: index lag vs. entry count
COMPACT_MIN_BLOCKS = 4_000_000  # re-snapshot (and trim) once the stream carries this many updates...
COMPACT_FACTOR = 4  # ...and more than this many times the snapshot size

# (namespace, hashes) held in DRAM, or (namespace, hashes, tier)
SnapshotItem = tuple[str, Sequence[bytes]] | tuple[str, Sequence[bytes], Tier]
# Called on the node's loop at the cut; the iterable it returns is read in the publisher thread,
# so it must hold a copy of the state at the cut (HolderTiers.snapshot: the loop only copies).
SnapshotFn = Callable[[], Iterable[SnapshotItem]]


class PublisherMetrics:
    """The publisher's Prometheus series, on the node's registry (a private one when none is given)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.published = Counter(
            "pegaflow_node_events_published_blocks_total", "Block updates written to the node stream", ["op"],
            registry=registry,
        )  # fmt: skip
        self.dropped = Counter(
            "pegaflow_node_events_dropped_blocks_total", "Block updates dropped (buffer full or Redis down)",
            registry=registry,
        )  # fmt: skip
        self.resyncs = Counter(
            "pegaflow_node_events_resyncs_total",
            "Snapshots published (start, new epoch, re-sync)",
            registry=registry,
        )
        self.errors = Counter(
            "pegaflow_node_events_publish_errors_total",
            "Redis errors seen by the publisher",
            registry=registry,
        )
        self.buffered = Gauge(
            "pegaflow_node_events_buffered_blocks", "Block updates waiting to be published", registry=registry
        )
        self.conflict = Gauge(
            "pegaflow_node_events_node_id_conflict",
            "1 while another live node (another address) holds this node's --node-id: this one stays out of the index",
            registry=registry,
        )


class Resync(enum.Enum):
    """Why a new epoch is due: START switches readers to it at once (the node lost its memory,
    or its registration), RESYNC keeps the old one until the snapshot is applied."""

    START = enum.auto()
    RESYNC = enum.auto()


class StreamLost(Exception):
    """The node's stream no longer holds the last entry the publisher wrote to it."""


_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError, OSError)


@dataclass
class PublisherStats:
    published_blocks: int = 0
    published_entries: int = 0
    dropped_blocks: int = 0
    resyncs: int = 0
    errors: int = 0


class EventPublisher:
    """Publishes one node's block events to ``pf:ev:{node}``, in a background thread."""

    def __init__(
        self,
        r: Client | None,
        node: str,
        addr: str,
        snapshot: SnapshotFn,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        ttl_seconds: float = 10.0,
        buffer_blocks: int = 1_000_000,
        batch_blocks: int = BATCH_BLOCKS,
        retry_seconds: float = 5.0,
        flush_interval: float = FLUSH_INTERVAL,
        registry: CollectorRegistry | None = None,
        idle: DataPathIdle | None = None,
        connect: Callable[[], Client] | None = None,
        poll: Callable[[Client, int], None] | None = None,
        poll_interval: float = NOTICE_POLL_S,
    ) -> None:
        self._r = r
        self._connect = connect  # makes the client when ``r`` is None (see ``r``)
        self.poll = poll  # the node's class notices, read with this client under the current nid
        self.poll_interval = poll_interval
        self.node = node
        self.addr = addr
        self.stream = stream_key(node)
        self._snapshot = snapshot
        self._loop = loop
        self.ttl_ms = int(ttl_seconds * 1000)
        self.buffer_blocks = buffer_blocks
        self.batch_blocks = batch_blocks
        self.retry_seconds = retry_seconds
        self.flush_interval = flush_interval
        self.idle = idle  # the node's (pegaflow/node/idle.py): flushes wait for a pause of its data path
        self.nid = 0
        self.epoch = 0
        self.stats = PublisherStats()
        self.metrics = PublisherMetrics(registry if registry is not None else CollectorRegistry())
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._buf: list[tuple[Op, str, Sequence[bytes], Tier]] = []
        self._buf_blocks = 0
        self._dropping = False  # set on the first drop; everything until the next cut is void
        self._need: Resync | None = Resync.START  # the pending re-sync, if any
        self._seq = 0
        self._last_id: bytes | None = None  # the id of the last entry written (see "Lost tail")
        self._since_snapshot = 0
        self._snapshot_blocks = 0
        self._rival: NodeInfo | None = None  # another live node that took our name
        self._rival_next = 0.0  # when to ask again whether it is gone (publisher thread)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # --- node side (any thread; never blocks on Redis) -------------------------------------

    def on_insert(self, namespace: str, hashes: Sequence[bytes]) -> None:
        self._push(Op.INSERT, namespace, hashes)

    def on_evict(self, namespace: str, hashes: Sequence[bytes]) -> None:
        self._push(Op.EVICT, namespace, hashes)

    def on_tier(self, namespace: str, hashes: Sequence[bytes], tier: Tier) -> None:
        """The node now holds these blocks in ``tier`` (an add, or a tier change)."""
        self._push(Op.INSERT, namespace, hashes, tier)

    def listener(self, op: IndexEvent, namespace: Namespace, hashes: Sequence[bytes]) -> None:
        """The block-index hook (``BlockIndex.add_listener``)."""
        self._push(Op.INSERT if op is IndexEvent.INSERT else Op.EVICT, namespace.name, hashes)

    def _push(self, op: Op, namespace: str, hashes: Sequence[bytes], tier: Tier = Tier.L1) -> None:
        n = len(hashes)
        if not n:
            return
        with self._lock:
            if self._dropping or self._buf_blocks + n > self.buffer_blocks:
                self._drop(n)
                return
            self._buf.append((op, namespace, hashes, tier))
            self._buf_blocks += n
            if self._buf_blocks >= self.batch_blocks * XADD_PIPELINE:
                self._wake.notify()

    def _drop(self, n: int) -> None:
        if not self._dropping:
            log.warning("event buffer full or redis unreachable: dropping until re-sync", node=self.node)
        self._dropping = True
        if self._need is None:
            self._need = Resync.RESYNC
        self._dropped(n)

    def _dropped(self, n: int) -> None:
        """Count ``n`` block updates that never reached the stream (under the lock)."""
        self.stats.dropped_blocks += n
        self.metrics.dropped.inc(n)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, wait: float | None = None) -> EventPublisher:
        """Start the thread; with ``wait``, block up to that long for the first snapshot."""
        self._thread = threading.Thread(target=self._run, name=f"pf-publisher-{self.node}", daemon=True)
        self._thread.start()
        if wait:
            self._ready.wait(wait)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Flush what is buffered (best effort within ``timeout``), withdraw the node's liveness
        and stop the thread."""
        self._stop.set()
        with self._lock:
            self._wake.notify()
        if self._thread:
            self._thread.join(timeout)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once everything buffered so far is published (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._buf and self._need is None and self._ready.is_set() and not self._busy:
                    return True
            time.sleep(0.005)
        return False

    _busy = False
    _reached = False  # Redis has answered once (publisher thread)
    _next_beat = 0.0  # when the liveness key is next refreshed (publisher thread)

    @property
    def r(self) -> Client:
        """The Redis client; made by ``connect`` on first use when none was given (a Redis
        Cluster client reaches a seed as it is made: made here, in the publisher thread and
        retried as any Redis call, a node whose seeds are all down starts and keeps serving)."""
        if self._r is None:
            if self._connect is None:
                raise redis.ConnectionError("the publisher has no Redis client")
            self._r = self._retrying()(self._connect)
        return self._r
    _next_poll = 0.0  # when the class notices are next read (publisher thread)

    # --- publisher thread ----------------------------------------------------------------------

    def _retrying(self) -> Retrying:
        return Retrying(
            stop=stop_after_delay(self.retry_seconds),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception_type(_TRANSIENT),
            reraise=True,
        )

    def _run(self) -> None:
        background_thread()  # pegaflow/common/priority.py: below the loop that serves engines
        while True:
            stopping = self._stop.is_set()
            try:
                if self._need is not None and not stopping and self._resync(self._need is Resync.START):
                    self._next_beat = time.monotonic() + self.ttl_ms / 3000
                if self._rival is None:  # else: the name is another node's, nothing to publish
                    if not stopping and not self._beat_if_due():
                        log.warning("registration lost; re-registering", node=self.node, nid=self.nid)
                        continue
                    self._flush()
                    if not stopping:
                        self._poll_if_due()
            except Exception as exc:  # keep the thread alive whatever Redis does
                self.stats.errors += 1
                self.metrics.errors.inc()
                log.warning("publish failed; will re-sync", node=self.node, error=error_text(exc))
                with self._lock:
                    self._dropped(self._buf_blocks)  # void: the re-sync's snapshot replaces them
                    self._buf.clear()
                    self._buf_blocks = 0
                    self._dropping = True
                    if self._need is None:
                        self._need = Resync.RESYNC
                self._stop.wait(0.2)
            if stopping:
                self._leave()
                return
            with self._lock:
                if not self._buf and not self._stop.is_set():
                    self._wake.wait(self.flush_interval)
                self.metrics.buffered.set(self._buf_blocks)

    def _take(self) -> list[tuple[Op, str, Sequence[bytes], Tier]]:
        with self._lock:
            buf, self._buf, self._buf_blocks = self._buf, [], 0
            self._busy = bool(buf)
            return buf

    def _flush(self) -> None:
        if self.idle is not None and self._buf:
            self.idle.wait_blocking()  # encoding and XADDs run Python: after the data path's burst
        buf = self._take()
        if not buf:
            return
        entries: list[Event] = []
        before = self.stats.published_entries
        try:
            # Merge runs of the same (op, namespace, tier) into entries of at most batch_blocks hashes.
            i = 0
            while i < len(buf):
                op, ns, _, tier = buf[i]
                parts: list[bytes] = []
                while i < len(buf) and buf[i][0] == op and buf[i][1] == ns and buf[i][3] == tier:
                    parts.extend(buf[i][2])
                    i += 1
                flags = FLAG_SSD if tier == Tier.SSD else 0
                for j in range(0, len(parts), self.batch_blocks):
                    chunk = parts[j : j + self.batch_blocks]
                    blob = b"".join(chunk)
                    if len(blob) != len(chunk) * HASH_BYTES:
                        raise ValueError("block hash of wrong length passed to the publisher")
                    entries.append(self._event(op, ns, blob, flags))
            self._xadd(entries)
            self._published(entries)
            if self._since_snapshot > max(COMPACT_MIN_BLOCKS, COMPACT_FACTOR * self._snapshot_blocks):
                with self._lock:
                    if self._need is None:
                        self._need = Resync.RESYNC  # compact: new epoch, snapshot, trim the old one
        except BaseException:
            # What the failed round trips did not write is lost (the re-sync replaces it): counted.
            sent = entries[: self.stats.published_entries - before]
            self._published(sent)
            with self._lock:
                self._dropped(sum(len(b[2]) for b in buf) - sum(e.count for e in sent))
            raise
        finally:
            self._busy = False

    def _published(self, entries: Sequence[Event]) -> None:
        counts: dict[Op, int] = {}
        for e in entries:
            counts[e.op] = counts.get(e.op, 0) + e.count
        for op, n in counts.items():
            self.metrics.published.labels(op.name.lower()).inc(n)
            self.stats.published_blocks += n
            self._since_snapshot += n

    def _event(self, op: Op, ns: str, blob: bytes, flags: int = 0) -> Event:
        ev = Event(self.node, self.nid, self.epoch, self._seq, op, ns, blob, flags)
        self._seq += 1
        return ev

    def _xadd(self, entries: list[Event]) -> list[bytes]:
        ids: list[bytes] = []
        for i in range(0, len(entries), XADD_PIPELINE):
            chunk = [encode(e) for e in entries[i : i + XADD_PIPELINE]]

            def send(chunk: list[bytes] = chunk) -> list[bytes]:
                p = self.r.pipeline(transaction=False)
                last = self._last_id
                if last is not None:
                    p.xrange(self.stream, last, last)  # still there? (module docstring, "Lost tail")
                for data in chunk:
                    p.xadd(self.stream, {FIELD: data})
                got = p.execute()
                if last is not None:
                    if not got[0]:
                        self._lost(last)
                    got = got[1:]
                return got

            sent = self._retrying()(send)
            ids.extend(sent)
            self._last_id = sent[-1]
            self.stats.published_entries += len(chunk)
            self._beat_if_due()  # a long snapshot or backlog must not let the liveness key lapse
        return ids

    def _beat_if_due(self) -> bool:
        """Refresh the liveness key if a third of its TTL passed; False if the registration is
        gone (then a re-sync is due). Heartbeats come from this thread only, between batches."""
        now = time.monotonic()
        if now < self._next_beat or not self.nid:
            return True
        ok = bool(self._retrying()(registry.heartbeat, self.r, self.node, self.nid, self.ttl_ms))
        self._next_beat = now + self.ttl_ms / 3000
        if not ok:
            with self._lock:
                self._need = Resync.START
            return False
        last = self._last_id
        if last is not None and not self._retrying()(self.r.xrange, self.stream, last, last):
            self._lost(last)
        return True

    def _lost(self, last: bytes) -> None:
        """The stream no longer holds this node's last entry: another live node that took its
        name trimmed it at its own start (then a re-registration finds it: one error naming
        the conflict), else Redis lost acknowledged writes (raises :class:`StreamLost`)."""
        if self._retrying()(registry.rival, self.r, self.node, self.nid, self.addr) is not None:
            with self._lock:
                self._need = Resync.START
            return
        raise StreamLost(f"{self.stream} no longer holds its last entry {last.decode()}: Redis lost "
                         "writes it had acknowledged (restarted from an older save, failed over)")

    def _leave(self) -> None:
        """After the last flush: hide this node now (``registry.leave``), not after its TTL."""
        if not self.nid:
            return
        try:
            self._retrying()(registry.leave, self.r, self.node, self.nid)
        except Exception as exc:  # the live key then expires with its TTL
            log.warning("liveness not withdrawn", node=self.node, error=error_text(exc))

    def _poll_if_due(self) -> None:
        now = time.monotonic()
        if self.poll is None or not self.nid or now < self._next_poll:
            return
        self._next_poll = now + self.poll_interval
        try:
            self.poll(self.r, self.nid)
        except Exception as exc:  # notices wait for the next poll; publishing goes on
            log.warning("class notices unread", node=self.node, error=repr(exc))

    def _cut(self) -> Iterable[SnapshotItem]:
        with self._lock:
            self._buf.clear()
            self._buf_blocks = 0
            self._dropping = False
            return self._snapshot()

    def _take_snapshot(self) -> list[SnapshotItem]:
        """The state at the cut (taken on the loop), read here in the publisher thread."""
        if self._loop is None:
            return list(self._cut())

        async def cut() -> Iterable[SnapshotItem]:
            return self._cut()

        return list(asyncio.run_coroutine_threadsafe(cut(), self._loop).result(timeout=60))

    def _name_free(self) -> bool:
        """Whether this node may register again: no other live node took its name since it
        last registered (module docstring, "One name, two nodes"); asked every third of the
        TTL while one holds it."""
        now = time.monotonic()
        if self._rival is not None and now < self._rival_next:
            return False
        other = self._retrying()(registry.rival, self.r, self.node, self.nid, self.addr)
        if other is None:
            if self._rival is not None:
                log.info("node id free again; registering", node=self.node, other_addr=self._rival.addr)
                self._rival = None
                self.metrics.conflict.set(0)
            return True
        self._rival_next = now + self.ttl_ms / 3000
        if self._rival is None:
            log.error("another live node uses this node id; staying out of the index until it is gone",
                      node=self.node, addr=self.addr, other_addr=other.addr,
                      fix="give each node its own --node-id")
            self.metrics.conflict.set(1)
            with self._lock:  # what it holds goes in the snapshot once the name is free again
                self._dropped(self._buf_blocks)
                self._buf.clear()
                self._buf_blocks = 0
                self._dropping = True
                self._need = Resync.START
        self._rival = other
        return False

    def _resync(self, switch: bool) -> bool:
        """New epoch: register, cut, publish RESET + snapshot; False (nothing done) while
        another node holds the name. Raises on Redis failure."""
        if self.nid and not self._name_free():
            return False
        retry = self._retrying()
        self.nid, self.epoch = retry(registry.register, self.r, self.node, self.addr, self.ttl_ms, switch)
        if not self._reached:  # Redis answered (a standalone client connects at its first command)
            self._reached = True
            log.info("redis_reached", node=self.node)
        with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: it exists
            retry(self.r.xgroup_create, self.stream, GROUP, id="0", mkstream=True)
        self._seq = 0
        self._last_id = None  # a new epoch: what the old one wrote no longer matters
        with self._lock:
            self._need = None
            # Updates from here to the cut are buffered, not dropped: the cut discards the
            # buffer and its snapshot holds them (dropped, they would call a second re-sync).
            self._dropping = False
            self._busy = True  # wait_idle: not idle until the snapshot is out
        try:
            self._publish_snapshot(switch)
        finally:
            self._busy = False
        return True

    def _publish_snapshot(self, switch: bool) -> None:
        retry = self._retrying()
        snap = self._take_snapshot()
        entries = [self._event(Op.RESET, "", b"")]
        total = 0
        for item in snap:
            ns, hashes = item[0], item[1]
            flags = FLAG_SSD if len(item) > 2 and item[2] == Tier.SSD else 0
            for j in range(0, len(hashes), self.batch_blocks):
                chunk = hashes[j : j + self.batch_blocks]
                entries.append(self._event(Op.SNAPSHOT, ns, b"".join(chunk), flags))
                total += len(chunk)
        entries.append(self._event(Op.SNAPSHOT, "", b"", FLAG_LAST))
        ids = self._xadd(entries)
        if switch:
            # Older epochs are void for readers already; drop them from the stream.
            retry(self.r.xtrim, self.stream, minid=ids[0], approximate=False)
        self._snapshot_blocks = total
        self._since_snapshot = 0
        self.stats.resyncs += 1
        self.metrics.resyncs.inc()
        self.metrics.published.labels("snapshot").inc(total)
        self._ready.set()
        log.info(
            "published snapshot", node=self.node, nid=self.nid, epoch=self.epoch, blocks=total, switch=switch
        )


class HolderTiers:
    """Publishes the best tier this node holds each block in (the module docstring's rules).

    ``ssd_entries`` is the SSD tier's record map, keyed ``(namespace id, hash)`` (None: no
    SSD tier). Every call runs on the node's event loop, where the block index and the SSD
    tier change, so "is it in DRAM / on SSD" is asked of the state the change left.
    """

    def __init__(self, pub: EventPublisher, index: BlockIndex,
                 ssd_entries: Mapping[tuple[int, bytes], object] | None = None) -> None:
        self.pub = pub
        self.index = index
        self.ssd = ssd_entries

    def on_index_event(self, op: IndexEvent, ns: Namespace, hashes: Sequence[bytes]) -> None:
        """Block-index listener (DRAM)."""
        if op is IndexEvent.INSERT:
            self.pub.on_tier(ns.name, hashes, Tier.L1)
            return
        ssd = self.ssd
        if not ssd:
            self.pub.on_evict(ns.name, hashes)
            return
        moved = [h for h in hashes if (ns.id, h) in ssd]
        if len(moved) < len(hashes):
            kept = set(moved)
            self.pub.on_evict(ns.name, [h for h in hashes if h not in kept])
        if moved:
            self.pub.on_tier(ns.name, moved, Tier.SSD)

    def ssd_stored(self, ns: Namespace, hashes: Sequence[bytes]) -> None:
        only = [h for h in hashes if not self.index.contains(ns, h)]
        if only:
            self.pub.on_tier(ns.name, only, Tier.SSD)

    def ssd_removed(self, ns: Namespace, hashes: Sequence[bytes]) -> None:
        gone = [h for h in hashes if not self.index.contains(ns, h)]
        if gone:
            self.pub.on_evict(ns.name, gone)

    def snapshot(self) -> Iterator[SnapshotItem]:
        """DRAM blocks as L1, blocks only on SSD as SSD, per namespace.

        On the loop (the cut) it only copies: the resident blocks (a block's namespace and
        hash never change) and the SSD tier's keys; the returned iterator groups and filters
        them where it is read, in the publisher thread. Grouped on the loop, a re-sync of
        500k DRAM and 500k SSD blocks held every engine's requests for 0.23 s."""
        blocks = self.index.resident()
        ssd_keys = list(self.ssd) if self.ssd else []
        return self._items(blocks, ssd_keys)

    def _items(self, blocks: list[Block], ssd_keys: list[tuple[int, bytes]]) -> Iterator[SnapshotItem]:
        by_ns: dict[str, list[bytes]] = {}
        held: dict[int, set[bytes]] = {}
        for b in blocks:
            by_ns.setdefault(b.ns.name, []).append(b.hash)
            held.setdefault(b.ns.id, set()).add(b.hash)
        yield from by_ns.items()
        ssd: dict[int, list[bytes]] = {}
        for ns_id, h in ssd_keys:
            if h not in held.get(ns_id, ()):
                ssd.setdefault(ns_id, []).append(h)
        for ns_id, only in ssd.items():
            ns = self.index.namespace_by_id(ns_id)  # one dict lookup: safe beside the loop
            if ns is not None:
                yield ns.name, only, Tier.SSD


def publish_block_index(
    config: NodeConfig,
    index: BlockIndex,
    node_id: str,
    loop: asyncio.AbstractEventLoop,
    registry: CollectorRegistry | None = None,
    *,
    ssd_entries: Mapping[tuple[int, bytes], object] | None = None,
    feed: BlockEventFeed | None = None,
    idle: DataPathIdle | None = None,
    notices: Callable[[Client, int], None] | None = None,
) -> EventPublisher:
    """Hook a node's block index (and SSD tier) to its stream: one call from the node, on
    its event loop.

    Publishes to ``config.redis_url`` as :func:`pegaflow.core.hosts.advertised` (the address
    peers pull from). ``ssd_entries``: the node's SSD tier's records (``store.entries``),
    whose stores and evictions ``feed`` (the node's ``BlockEventFeed``, which the tier
    reports them to) hands to :class:`HolderTiers`. ``idle``: the node's (its flushes wait
    for a pause of the data path). ``notices``: the node's reader of its class notices
    (``pegaflow/node/classes.py``), called by the publisher thread. Returns the started
    publisher; call ``stop()`` on shutdown.
    """
    addr = advertised(config.addr, config.advertise_addr)
    tiers: HolderTiers | None = None

    def snapshot() -> Iterator[SnapshotItem]:
        assert tiers is not None
        return tiers.snapshot()

    pub = EventPublisher(
        None, node_id, addr, snapshot, loop=loop, ttl_seconds=config.liveness_ttl,
        buffer_blocks=config.event_buffer, registry=registry, idle=idle, poll=notices,
        connect=lambda: connect(config.redis_url, config.redis_cluster),  # in the publisher thread (``r``)
    )  # fmt: skip
    tiers = HolderTiers(pub, index, ssd_entries)
    index.add_listener(tiers.on_index_event)
    if ssd_entries is not None and feed is not None:
        feed.add_tier_listener(tiers)
    return pub.start()
