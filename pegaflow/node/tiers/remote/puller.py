"""Pulling side of remote reads: a local miss becomes LOADING while a peer's pages arrive.

Contracts:
- :meth:`Puller.query` runs inside the Query handler after L1 and SSD. It asks the
  metaserver (bounded by ``META_TIMEOUT``; a failing metaserver is skipped for a while,
  and a "no peer has it" answer is reused for ``NEGATIVE_TTL``) which live peer holds the
  longest prefix (among equals, L1 holders before SSD holders: :func:`choose`), reserves node-owned PENDING pages
  (``reclaimable=True``: pulled copies are evicted first) for the blocks past the local
  prefix, starts the pull and returns True (answer LOADING) iff block ``hit`` is now on
  its way for every namespace of the query. It never returns True for blocks nobody is
  bringing, so LOADING always ends.
- A pull pins the prefix on the peer (from a holder listed with blocks only on its SSD:
  one pin per ``SSD_CHUNK_BYTES``, ``SSD_CHUNKS_IN_FLIGHT`` in flight together, so the
  holder's SSD reads of later chunks, straight into those pins' pages, overlap the
  transfer of earlier ones), reads the pages straight into the PENDING pages
  (:class:`~pegaflow.node.tiers.remote.Transport`, in a worker thread) which verifies the
  xxh3_64 of every page against the source's, checks counts and page size, commits the good pages (visible, published as inserts by the index
  listener; their verified checksums kept in ``checksums``, so this node serves them
  without hashing) and discards the rest, then unpins. Any data-plane error discards every
  page of the pull: no partial page is ever visible, the engine just recomputes.
- A peer that fails or answers wrongly (page size, counts, checksums) is skipped for
  ``backoff`` seconds, doubling while it keeps failing (:class:`Backoff`).
- Committed pages (and the local prefix) stay pinned so the engine's next Query finds
  and leases them, as SSD promotion does: a pull's hold on a block ends when a Query
  leases that block (:meth:`Puller.leased`, called by the node's Query: the lease pins it
  from then on), and on the blocks no Query leased after ``HOLD_SECONDS``. Held pages
  cannot be evicted, so a hold outliving its purpose costs L1 room: on a small pool,
  requests stored after a pull found no page for blocks they computed.

Runs on the node's event loop like the rest of the node; only the transport read and
the checksum loop run in worker threads, on PENDING pages nobody else touches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, cast

import grpc
import structlog

from pegaflow._proto import meta_pb2, meta_pb2_grpc, peer_pb2, peer_pb2_grpc
from pegaflow.common.backoff import Backoff
from pegaflow.common.security import Security, aio_channel
from pegaflow.core.block_index import Block, BlockIndex, Namespace
from pegaflow.core.tiers import Tier
from pegaflow.node.tiers.remote import TCP, RemotePages, TransferError, Transport
from pegaflow.node.tiers.remote.checksums import PageChecksums
from pegaflow.node.tiers.remote.metrics import PeerMetrics

log = structlog.get_logger("pegaflow.p2p")

META_TIMEOUT = 0.25  # seconds a Query waits for the metaserver before answering with local hits
PIN_TIMEOUT = 5.0  # seconds for PinForTransfer (checksums of a large prefix take a few ms)
UNPIN_TIMEOUT = 2.0
HOLD_SECONDS = 2.0  # pulled blocks stay pinned this long for the engine's next Query
BACKOFF_MIN = 5.0  # first skip after a failure; doubles up to BACKOFF_MAX while failures repeat
BACKOFF_MAX = 120.0
META_KEY = "<metaserver>"  # backoff entry of the metaserver itself
RECONNECT_FIRST_MS = 100  # the first wait of a channel to the metaserver or a peer before reconnecting (grpc's: 1 s)
NEGATIVE_TTL = 0.5  # seconds a "nobody holds it" answer is reused (an engine re-Queries a waiting request)
NEGATIVE_MAX = 65536  # remembered negative answers at most (oldest dropped first)
# A pull from an SSD holder pins this much per chunk, SSD_CHUNKS_IN_FLIGHT at once (see
# Puller.query; the holder's DRAM they hold is bounded by the product). The holder reads
# each chunk from its SSD into pages of that pin (pins.py) while earlier chunks transfer.
# Measured with bench/p2p_ssd.py (1 MiB pages, 2 cores, two rounds each, 256 MiB prefixes):
# 32 x 4 pulled 1.38-1.52 GB/s, 32 x 8 1.45-1.47, 64 x 4 1.26-1.45, 16 x 8 1.37-1.39,
# 8 x 16 1.18-1.32 (the disk's own spread is as wide). Per-chunk costs (pin RPC,
# connections) want few large chunks; the overlap wants several in flight. When the holder
# still promoted each chunk into L1 before sending it, ordering the chunks, smaller first
# and last chunks, and reads at nice 0, 32 in flight or issued inline each changed nothing
# beyond that spread either.
SSD_CHUNK_BYTES = 32 << 20
SSD_CHUNKS_IN_FLIGHT = 4


@dataclass(frozen=True, slots=True)
class Holder:
    """A node that holds ``prefix_len`` leading blocks of a request (metaserver answer), of
    which ``ssd_blocks`` only on its SSD tier."""

    node: str
    address: str
    prefix_len: int
    ssd_blocks: int = 0


def choose(holders: Sequence[Holder], node_id: str, hit: int, end: int,
           skip: Callable[[str], bool]) -> Holder | None:
    """The peer to pull ``hashes[hit:end]`` from: the one covering most of it, and among
    those the one with fewest blocks only on SSD (L1 holders, then SSD holders). Coverage
    comes first: an SSD holder's read (about a millisecond per MiB) beats recomputing the
    blocks an L1 holder lacks."""
    best: Holder | None = None
    key = (0, 0)
    for x in holders:
        if x.node == node_id or x.prefix_len <= hit or skip(x.address):
            continue
        k = (min(x.prefix_len, end), -x.ssd_blocks)
        if best is None or k > key:
            best, key = x, k
    return best


class Lookup(Protocol):
    async def __call__(self, namespace: str, hashes: Sequence[bytes]) -> list[Holder]: ...


class Peers(Protocol):
    """The PegaPeer RPCs the puller needs (gRPC in the node, a fake in unit tests)."""

    async def pin(self, address: str, request: peer_pb2.PinRequest) -> peer_pb2.PinResponse: ...
    async def unpin(self, address: str, pin_id: int) -> None: ...


def reconnect_options(reconnect_max: float) -> list[tuple[str, int]]:
    """Options of the node's channels to the metaserver and to peers: while the server is
    down, the channel waits ``RECONNECT_FIRST_MS`` before its next attempt to connect, then
    longer, up to ``reconnect_max`` seconds (grpc's own waits start at 1 s and grow to 120 s).
    The puller skips a failing metaserver or peer for its backoff (``--peer-backoff``, 5 s
    first) anyway; a channel waiting longer would keep calls failing after the server is back."""
    ms = max(1, round(reconnect_max * 1000))
    return [("grpc.initial_reconnect_backoff_ms", min(ms, RECONNECT_FIRST_MS)), ("grpc.max_reconnect_backoff_ms", ms)]


class MetaLookup:
    """QueryPrefix on the metaserver over one grpc.aio channel.

    :meth:`start` makes the channel and starts connecting, on the node's loop before it
    serves (a grpc.aio channel binds to the loop running at its creation, and the node is
    constructed before its loop starts). Made on the first lookup instead, the channel's
    connection fell inside that lookup's ``META_TIMEOUT``: on a loaded host it could time
    out, and a failed lookup skips the metaserver for the puller's backoff, so the node's
    first remote hits were answered as misses.

    ``reconnect_max``: :func:`reconnect_options`.
    """

    def __init__(self, addr: str, security: Security, reconnect_max: float = BACKOFF_MIN) -> None:
        self.addr = addr
        self.security = security
        self.options = reconnect_options(reconnect_max)
        self.channel: grpc.aio.Channel | None = None
        self.stub: meta_pb2_grpc.MetaServiceStub | None = None

    def start(self) -> None:
        """Make the channel and start connecting (on the running loop)."""
        if self.channel is None:
            self.channel = aio_channel(self.addr, self.security, self.options)
            self.stub = meta_pb2_grpc.MetaServiceStub(self.channel)
            self.channel.get_state(try_to_connect=True)

    async def __call__(self, namespace: str, hashes: Sequence[bytes]) -> list[Holder]:
        if self.stub is None:  # not started (a node's start starts it)
            self.start()
        assert self.stub is not None
        res = await self.stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace=namespace, hashes=hashes),
                                          timeout=META_TIMEOUT)
        return [Holder(n.node, n.address, n.prefix_len, n.ssd_blocks) for n in res.nodes]

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class GrpcPeers:
    """PegaPeer stubs, one grpc.aio channel per peer address (``reconnect_max``:
    :func:`reconnect_options`)."""

    def __init__(self, security: Security, max_message: int = 64 << 20, reconnect_max: float = BACKOFF_MIN) -> None:
        self.security = security
        self._stubs: dict[str, tuple[grpc.aio.Channel, peer_pb2_grpc.PegaPeerStub]] = {}
        self._opts = [("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", max_message),
                      *reconnect_options(reconnect_max)]

    def stub(self, address: str) -> peer_pb2_grpc.PegaPeerStub:
        e = self._stubs.get(address)
        if e is None:
            ch = aio_channel(address, self.security, self._opts)
            e = self._stubs[address] = (ch, peer_pb2_grpc.PegaPeerStub(ch))
        return e[1]

    async def pin(self, address: str, request: peer_pb2.PinRequest) -> peer_pb2.PinResponse:
        resp: peer_pb2.PinResponse = await self.stub(address).PinForTransfer(request, timeout=PIN_TIMEOUT)  # untyped stub
        return resp

    async def unpin(self, address: str, pin_id: int) -> None:
        await self.stub(address).Unpin(peer_pb2.UnpinRequest(pin_id=pin_id), timeout=UNPIN_TIMEOUT)

    async def close(self) -> None:
        for ch, _ in self._stubs.values():
            await ch.close()
        self._stubs.clear()


@dataclass(eq=False)
class _Pull:
    ns: Namespace
    holder: Holder
    hashes: list[bytes]
    blocks: list[Block]
    t0: float
    held: list[Block]  # local prefix pinned while the pull runs
    gate: asyncio.Semaphore | None = None  # chunks of one pull from an SSD holder: SSD_CHUNKS_IN_FLIGHT
    backup: bool = False  # a decode backup's pull: no engine waits for it (no hold, no remote hit)
    pinned: int = -1  # leading blocks the peer pinned (-1: the pull failed before an answer)
    landed: int = 0  # pages committed


@dataclass(eq=False)
class _Hold:
    """A finished pull's pins for the engine's next Query: ``blocks`` it still holds."""

    blocks: list[Block]
    timer: asyncio.TimerHandle | None = None


class Puller:
    """See the module docstring. ``lookup``/``peers``/``transport`` are the edges (fakes in tests)."""

    def __init__(
        self,
        index: BlockIndex,
        pool_view: memoryview,
        node_id: str,
        lookup: Lookup,
        peers: Peers,
        transport: Transport,
        metrics: PeerMetrics,
        pin_ttl: float = 30.0,
        backoff: float = BACKOFF_MIN,
        max_pull: int = 4096,
        on_remote_hits: Callable[[int], None] | None = None,
        hold_seconds: float = HOLD_SECONDS,
        checksums: PageChecksums | None = None,
    ) -> None:
        self.index = index
        self.view = pool_view
        self.node_id = node_id
        self.lookup = lookup
        self.peers = peers
        self.transport = transport
        self.metrics = metrics
        self.pin_ttl = pin_ttl
        self.max_pull = max_pull
        self.backoff = Backoff(backoff, max(backoff, BACKOFF_MAX))
        self.on_remote_hits = on_remote_hits
        self.hold_seconds = hold_seconds
        self.checksums = checksums
        self.inflight: dict[tuple[int, bytes], Block] = {}
        # (ns.id, first missing hash) -> time of a lookup that found no peer: repeated
        # Queries of a request nobody can serve skip the metaserver round trip for a while.
        self._negative: dict[tuple[int, bytes], float] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="p2p-pull")
        self._holding: dict[int, list[_Hold]] = {}  # id(block) -> holds on it (the hold keeps it alive)
        self.held = 0  # block pins the holds keep (pegaflow_node_p2p_held_blocks)
        metrics.backed_off.set_function(self.backoff.active)
        metrics.held_blocks.set_function(lambda: self.held)

    def _on_way(self, ns: Namespace, h: bytes) -> bool:
        return self.index.get(ns, h) is not None or (ns.id, h) in self.inflight

    def expected(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> int:
        """The prefix length once the pulls in flight land: ``hit`` plus the blocks after it
        that every namespace holds or is pulling (the LOADING answer's ``expected_blocks``)."""
        j = hit
        while j < len(hashes) and all(self._on_way(ns, hashes[j]) for ns in nss):
            j += 1
        return j

    async def query(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> bool:
        """Start pulling the continuation of an L1 prefix of length ``hit``; True = answer LOADING."""
        if hit >= len(hashes):
            return False
        h0 = hashes[hit]
        if all(self._on_way(ns, h0) for ns in nss):
            return True
        if self.backoff.skip(META_KEY):
            return False
        end = min(len(hashes), hit + self.max_pull)
        todo = [ns for ns in nss if not self._on_way(ns, h0)]
        now = time.monotonic()
        neg = self._negative
        for ns in todo:
            t = neg.get((ns.id, h0))
            if t is not None:
                if now - t < NEGATIVE_TTL:
                    return False
                del neg[(ns.id, h0)]
        try:
            answers = await asyncio.wait_for(
                asyncio.gather(*(self.lookup(ns.name, hashes[:end]) for ns in todo)), META_TIMEOUT * 2)
        except Exception as exc:  # metaserver down or slow: serve local hits, retry later
            self.metrics.lookups.labels("error").inc()
            period = self.backoff.fail(META_KEY)
            log.warning("p2p_lookup_failed", error=repr(exc), skip_seconds=period)
            return False
        self.backoff.ok(META_KEY)
        plans: list[tuple[Namespace, Holder]] = []
        for ns, holders in zip(todo, answers, strict=True):
            best = choose(holders, self.node_id, hit, end, self.backoff.skip)
            if best is None:
                self.metrics.lookups.labels("none").inc()
                if len(neg) >= NEGATIVE_MAX:
                    del neg[next(iter(neg))]
                neg[(ns.id, h0)] = time.monotonic()
                return False  # one shard nobody can bring: the prefix stops at hit anyway
            self.metrics.lookups.labels("found").inc()
            plans.append((ns, best))
        for ns, best in plans:  # the lookup awaited: the state may have moved meanwhile
            if self._on_way(ns, h0):
                continue
            need: list[bytes] = []
            held = list(self.index.prefix(ns, hashes[:hit], touch=False))
            for h in hashes[hit:min(end, best.prefix_len)]:
                if (ns.id, h) in self.inflight:
                    break
                b = self.index.get(ns, h)
                if b is None:
                    need.append(h)
                else:
                    held.append(b)  # resident already: part of the prefix once the pull lands
            # Pinned before reserving, as the SSD promoter does: the reservation evicts to
            # make room, and must not evict the request's own prefix or the blocks between
            # the pulled ones (the pull would land behind a hole).
            self.index.pin(held)
            blocks = self.index.reserve(ns, need, reclaimable=True) if need else []
            k = next((i for i, b in enumerate(blocks) if b is None), len(blocks))
            self.index.discard([b for b in blocks[k:] if b is not None])
            if k == 0:
                self.index.unpin(held)
                self.metrics.pulls.labels("no_space").inc()
                continue
            got = cast("list[Block]", blocks[:k])  # before the first None
            for b in got:
                self.inflight[b.key] = b
            # From an SSD holder, one pin per chunk, SSD_CHUNKS_IN_FLIGHT at once: the holder
            # reads each chunk from its SSD into the pin's pages before it can send it, so
            # chunks pipeline its SSD reads with the transfer (one pin: the whole read, then
            # the whole transfer), and what the holder reads and holds for us stays bounded.
            step = max(1, SSD_CHUNK_BYTES // ns.page_bytes) if best.ssd_blocks else k
            gate = asyncio.Semaphore(SSD_CHUNKS_IN_FLIGHT) if step < k else None
            t0 = time.perf_counter()
            for j in range(0, k, step):
                pull = _Pull(ns, best, need[j:j + step], got[j:j + step], t0, held if j == 0 else [], gate)
                task = asyncio.get_running_loop().create_task(self._pull(pull))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        return all(self._on_way(ns, h0) for ns in nss)

    async def _pull(self, p: _Pull) -> None:
        addr = p.holder.address
        pin_id = 0
        status = "error"
        committed: list[Block] = []
        gated = False
        try:
            if p.gate is not None:
                await p.gate.acquire()
                gated = True
            try:
                resp = await self.peers.pin(addr, peer_pb2.PinRequest(
                    namespace=p.ns.name, hashes=p.hashes, ttl_seconds=self.pin_ttl,
                    transport=self.transport.name, puller=self.node_id))  # fmt: skip
            except Exception as exc:
                status = "error"
                self._fail(addr, "pin_failed", exc)
                return
            pin_id = resp.pin_id
            why = self._check(p, resp)
            if why:
                status = "bad_answer"
                self._fail(addr, "bad_pin_answer", why)
                return
            k = p.pinned = resp.count
            if k == 0:  # evicted since the metaserver saw it: not the peer's fault
                status = "gone"
                return
            remote = RemotePages(addr, pin_id, resp.page_bytes, tuple(resp.offsets), tuple(resp.checksums),
                                 resp.data_addr, resp.rdma_base, tuple(resp.rkeys))
            blocks = p.blocks[:k]
            moving = asyncio.get_running_loop().run_in_executor(
                self._executor, self._read_verify, remote, [b.offset for b in blocks])
            try:
                sums = await asyncio.shield(moving)
            except asyncio.CancelledError:
                # Cancelled (the node stops): the worker thread still writes into these pages,
                # which the ``finally`` below frees for reuse: only once it returned.
                await asyncio.wait([moving])
                if not moving.cancelled():
                    moving.exception()  # retrieved: its outcome no longer matters
                raise
            except TransferError as exc:
                status = "error"
                self._fail(addr, "transfer_failed", exc)
                return
            good = [b for b, c in zip(blocks, sums, strict=True) if c is not None]
            bad = len(blocks) - len(good)
            self.index.discard([b for b, c in zip(blocks, sums, strict=True) if c is None])
            for b in blocks:
                self.inflight.pop(b.key, None)
            committed = self.index.commit(good)
            self.index.pin(committed)
            if self.checksums is not None and committed:
                verified = {id(b): c for b, c in zip(blocks, sums, strict=True) if c is not None}
                for b in committed:
                    self.checksums.record(b, verified[id(b)])
            nbytes = sum(b.size for b in committed)
            p.landed = len(committed)
            self.metrics.pull_bytes.inc(nbytes)
            if self.on_remote_hits is not None and not p.backup:
                self.on_remote_hits(len(committed))
            self.metrics.pulled_blocks.labels(Tier.SSD if p.holder.ssd_blocks else Tier.L1).inc(len(committed))
            if bad:
                status = "checksum"
                self._fail(addr, "checksum_mismatch", f"{bad} of {len(blocks)} pages")
            else:
                status = "ok" if k == len(p.blocks) else "partial"
                self.backoff.ok(addr)
                self.metrics.pull_latency.observe(time.perf_counter() - p.t0)
            log.debug("p2p_pulled", peer=p.holder.node, blocks=len(committed), bytes=nbytes, status=status,
                      seconds=round(time.perf_counter() - p.t0, 4))
        except asyncio.CancelledError:
            status = "error"
            raise
        finally:
            self.metrics.pulls.labels(status).inc()
            self.index.discard(p.blocks)  # no-op for committed pages; frees all others
            for b in p.blocks:
                self.inflight.pop(b.key, None)
            if pin_id:
                self._spawn(self._unpin(addr, pin_id))
            held = p.held + committed
            if self.hold_seconds > 0 and held and not p.backup:
                self._hold(held)
            else:
                self.index.unpin(held)
            if gated:
                assert p.gate is not None
                p.gate.release()

    async def backup(self, namespace: str, page_bytes: int, node: str, address: str,
                     hashes: Sequence[bytes]) -> tuple[int, int, int]:
        """Copy the named blocks from peer ``node`` at ``address`` into this pool, retained (a
        decode backup's plan, ``pegaflow/node/backup.py``); returns (blocks committed, their
        bytes, blocks the peer no longer held). Blocks held here already are skipped. A pin
        covers the longest prefix the peer holds, so the block after it is missing there and
        the rest is pinned again; a failed pull (peer gone, bad answer, no room here) ends
        the plan, and the blocks it did not bring stay where they were."""
        ns = self.index.namespace(namespace, page_bytes)
        rest = [h for h in hashes if not self._on_way(ns, h)]
        holder = Holder(node, address, len(rest))
        landed = nbytes = missing = 0
        while rest:
            # At most max_pull a pin, as a request's pulls (a peer refuses a pin beyond its
            # --max-batch: a plan larger than that failed every time).
            blocks = self.index.reserve(ns, rest[:self.max_pull], reclaimable=False)
            k = next((i for i, b in enumerate(blocks) if b is None), len(blocks))
            self.index.discard([b for b in blocks[k:] if b is not None])
            if k == 0:
                self.metrics.pulls.labels("no_space").inc()
                break
            got = cast("list[Block]", blocks[:k])
            for b in got:
                self.inflight[b.key] = b
            p = _Pull(ns, holder, rest[:k], got, time.perf_counter(), [], backup=True)
            await self._pull(p)
            landed += p.landed
            nbytes += p.landed * ns.page_bytes
            if p.pinned < 0 or p.landed < p.pinned:  # the pull failed: the peer is backed off
                break
            if p.pinned < k:
                missing += 1
                rest = rest[p.pinned + 1:]
            else:
                rest = rest[k:]
        return landed, nbytes, missing

    def _hold(self, blocks: list[Block]) -> None:
        """Keep a finished pull's pins (taken already) until a Query leases each block or
        ``hold_seconds`` pass."""
        h = _Hold(blocks)
        h.timer = asyncio.get_running_loop().call_later(self.hold_seconds, self._expire, h)
        for b in blocks:
            self._holding.setdefault(id(b), []).append(h)
        self.held += len(blocks)

    def leased(self, blocks: Sequence[Block]) -> None:
        """A Query leased ``blocks``: the holds on them have done their job and end (the
        lease pins them now); a hold's other blocks stay held until its timeout."""
        holding = self._holding
        if not holding:
            return
        ids = {i for b in blocks if (i := id(b)) in holding}
        holds = {id(h): h for i in ids for h in holding[i]}
        for h in holds.values():
            done = [b for b in h.blocks if id(b) in ids]
            h.blocks = [b for b in h.blocks if id(b) not in ids]
            self._release(h, done, "leased")
            if not h.blocks and h.timer is not None:
                h.timer.cancel()
                h.timer = None

    def _expire(self, h: _Hold) -> None:
        h.timer = None
        done, h.blocks = h.blocks, []
        self._release(h, done, "expired")

    def _release(self, h: _Hold, blocks: list[Block], reason: str) -> None:
        for b in blocks:
            lst = self._holding.get(id(b))
            if lst is not None and h in lst:
                lst.remove(h)
                if not lst:
                    del self._holding[id(b)]
        self.held -= len(blocks)
        self.metrics.hold_ended.labels(reason).inc(len(blocks))
        self.index.unpin(blocks)

    def _check(self, p: _Pull, resp: peer_pb2.PinResponse) -> str:
        """Why a pin answer cannot be used ('' if it can)."""
        k = resp.count
        if k > len(p.hashes):
            return f"pinned {k} pages for {len(p.hashes)} hashes"
        if k and resp.page_bytes != p.ns.page_bytes:
            return f"page_bytes {resp.page_bytes} != ours {p.ns.page_bytes} for {p.ns.name!r}"
        sums = len(resp.checksums)
        if len(resp.offsets) != k or sums not in (k, 0) or (sums == 0 and k and self.transport.name != TCP):
            return f"{len(resp.offsets)} offsets and {sums} checksums for {k} pages"
        if k and self.transport.name == TCP and not resp.data_addr:
            return "no data address"
        if k and self.transport.name != TCP and not resp.rkeys:
            return "no RDMA keys"
        return ""

    def _read_verify(self, remote: RemotePages, dests: list[int]) -> list[int | None]:
        """Worker thread: move the pages; the transport checks each one's checksum."""
        return self.transport.read(remote, dests)

    def _fail(self, addr: str, event: str, why: object) -> None:
        period = self.backoff.fail(addr)
        log.warning("p2p_" + event, peer=addr, error=str(why), skip_seconds=period)

    async def _unpin(self, addr: str, pin_id: int) -> None:
        try:
            await self.peers.unpin(addr, pin_id)
        except Exception as exc:  # the pin expires on its own
            log.info("p2p_unpin_failed", peer=addr, pin=pin_id, error=repr(exc))

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        """Cancel pulls and wait for their worker threads (they write pool pages)."""
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
