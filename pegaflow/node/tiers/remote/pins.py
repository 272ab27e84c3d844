"""Serving side of remote reads: pins with a TTL, and the ``PegaPeer`` gRPC service.

Contracts:
- ``PinForTransfer`` pins the longest RESIDENT prefix of the requested hashes (pins keep
  blocks out of the eviction order, so their pages neither move nor change) and returns
  their offsets and, for RDMA pullers, their xxh3_64 checksums (TCP pullers get them
  in-band from the data port). Known checksums come from :class:`PageChecksums`; only
  pages whose checksum is not known yet are hashed, after pinning.
- A holder that has the requested blocks only on its SSD tier (the index lists it with
  tier SSD) serves them by promoting them into L1 first (:meth:`PinTable.fill_from_ssd`,
  the SSD tier's own verified reads into pool pages, bounded by ``SSD_FILL_SECONDS``),
  then pinning and sending from the pool like any resident page. Why not read from SSD
  straight into the transfer: the promoter already reads O_DIRECT into pool pages and
  checks each record's header and checksum, so promoting costs no extra copy of the
  bytes; both transports then send unchanged (RDMA needs registered memory, which the
  pool is and a read buffer would have to be); and the promoted copy serves this node's
  next hits and the next puller. The price is L1 room for the promoted pages, which the
  pool's eviction order reclaims like any other.
- A pin ends at ``Unpin`` or after its TTL (capped by ``--pin-ttl``), whichever is first,
  so a puller that dies mid-pull leaks nothing. A pin whose pages are being sent right
  now (TCP data plane thread) ends when that send ends, never under it.
- The pin table lives on the node's event loop; only :meth:`PinTable.acquire` and
  :meth:`PinTable.release_send` are called from data-plane threads, under ``_lock``.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from pegaflow._proto import peer_pb2, peer_pb2_grpc
from pegaflow.common.errors import InvalidArgument
from pegaflow.common.validate import check_hashes
from pegaflow.core.block_index import Block, BlockIndex
from pegaflow.node.tiers.remote import TCP
from pegaflow.node.tiers.remote.checksums import PageChecksums
from pegaflow.node.tiers.remote.metrics import PeerMetrics
from pegaflow.node.tiers.remote.tcp import BAD_RANGE, UNKNOWN_PIN

log = structlog.get_logger("pegaflow.p2p")

BUSY_RECHECK = 0.5  # seconds: an expired pin still being sent is looked at again this often
SSD_FILL_SECONDS = 3.0  # at most this long promoting a pin's SSD blocks (the puller's pin RPC waits 5 s)
CHECKSUM_INLINE_BYTES = 1 << 20  # below this, checksum on the loop (a thread hop costs more)


@dataclass(eq=False)
class Pin:
    id: int
    blocks: list[Block]
    spans: list[tuple[int, int]]  # (offset, size) per block, read by data-plane threads
    expires: float
    puller: str = ""
    sending: int = 0
    ended: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


async def _until(f: asyncio.Future[None], timeout: float) -> None:
    """Wait for ``f`` at most ``timeout`` seconds (then drop it)."""
    if timeout > 0:
        await asyncio.wait((f,), timeout=timeout)
    if not f.done():
        f.cancel()


class PinTable:
    """Pins of this node's pages held for pullers; see the module docstring."""

    def __init__(self, index: BlockIndex, pool_view: memoryview, max_ttl: float, metrics: PeerMetrics,
                 checksums: PageChecksums) -> None:
        self.index = index
        self.view = pool_view
        self.checksums = checksums
        self.max_ttl = max_ttl
        self.metrics = metrics
        self.pins: dict[int, Pin] = {}

        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ssd: Any = None  # the node's SSD tier (pegaflow/node/tiers/ssd/tier.py), set by the node
        metrics.active_pins.set_function(lambda: len(self.pins))

    def _new_id(self) -> int:
        """A random 63-bit pin id: the data port serves whoever names a live pin, so the id is
        the capability (only PinForTransfer, behind the token, hands one out)."""
        while True:
            i = secrets.randbits(63)
            if i and i not in self.pins:
                return i

    def pin(self, ns_name: str, hashes: Sequence[bytes], ttl: float, puller: str = "") -> Pin | None:
        """Pin the resident prefix; None when the namespace or block 0 is not here."""
        ns = self.index.get_namespace(ns_name)
        if ns is None:
            return None
        blocks = self.index.prefix(ns, hashes, touch=True)
        if not blocks:
            return None
        self.index.pin(blocks)
        ttl = min(ttl if ttl > 0 else self.max_ttl, self.max_ttl)
        p = Pin(self._new_id(), blocks, [(b.offset, b.size) for b in blocks], time.monotonic() + ttl, puller)
        self.pins[p.id] = p
        loop = self.loop or asyncio.get_running_loop()
        p.timer = loop.call_later(ttl, self._expire, p.id)
        return p

    async def fill_from_ssd(self, ns_name: str, hashes: Sequence[bytes], timeout: float = SSD_FILL_SECONDS) -> int:
        """Promote the SSD continuation of the resident prefix of ``hashes`` into L1 and wait
        for it (the SSD tier promotes at most ``--max-prefetch-blocks`` at once: round after
        round while it makes progress). Returns the blocks promoted. The promoted pages stay
        held by the promoter until :meth:`pin` pins them (``ssd.leased`` ends the hold)."""
        ssd = self.ssd
        ns = self.index.get_namespace(ns_name)
        if ssd is None or ns is None:
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        start = hit = len(self.index.prefix(ns, hashes, touch=False))
        promoter = ssd.promoter
        inflight, on_ssd = promoter.inflight, ssd.store.entries
        while hit < len(hashes) and loop.time() < deadline:
            key = (ns.id, hashes[hit])
            if key not in on_ssd and key not in inflight:
                break  # not on SSD: serve what is resident
            if ssd.promote([ns], hashes, hit) <= hit and key not in inflight:
                if not inflight:
                    break  # nothing promotes anywhere: no L1 room, or the read gate dropped it
                # Other pins' reads fill --max-prefetch-blocks: ours start when they land.
                await _until(promoter.landed(), deadline - loop.time())
                continue
            # Wake on each landed read rather than poll: a chunk of a pipelined pull is
            # answered as soon as its last read lands (polling added ~5 ms per chunk).
            while any((ns.id, h) in inflight for h in hashes[hit:]) and loop.time() < deadline:
                await _until(promoter.landed(), deadline - loop.time())
            now = len(self.index.prefix(ns, hashes, touch=False))
            if now <= hit:  # read errors, or no room: serve what is resident
                break
            hit = now
        if hit > start:
            self.metrics.ssd_served.inc(hit - start)
        return hit - start

    def unpin(self, pin_id: int) -> bool:
        p = self.pins.get(pin_id)
        if p is None:
            return False
        if p.timer is not None:
            p.timer.cancel()
        self._end(p)
        return True

    def _expire(self, pin_id: int) -> None:
        p = self.pins.get(pin_id)
        if p is None:
            return
        self.metrics.pins_expired.inc()
        log.info("p2p_pin_expired", pin=pin_id, puller=p.puller, blocks=len(p.blocks))
        self._end(p)

    def _end(self, p: Pin) -> None:
        with self._lock:
            p.ended = True
            busy = p.sending > 0
        if busy:  # a data thread reads these pages now: unpin when it is done
            assert self.loop is not None
            p.timer = self.loop.call_later(BUSY_RECHECK, self._end, p)
            return
        if self.pins.pop(p.id, None) is not None:
            self.index.unpin(p.blocks)

    # ---- data-plane threads ---------------------------------------------------------------
    def acquire(self, pin_id: int, start: int, count: int) -> list[Block] | int:
        """Blocks ``start..start+count`` of a live pin, marked busy; or an error status."""
        with self._lock:
            p = self.pins.get(pin_id)
            if p is None or p.ended:
                return UNKNOWN_PIN
            if count == 0 or start + count > len(p.spans):
                return BAD_RANGE
            p.sending += 1
            return p.blocks[start:start + count]

    def release_send(self, pin_id: int) -> None:
        with self._lock:
            p = self.pins.get(pin_id)
            if p is None:
                return
            p.sending -= 1
            done = p.ended and p.sending == 0
        if done and self.loop is not None:  # ended while busy: unpin now, not at the next recheck
            try:
                self.loop.call_soon_threadsafe(self._end, p)
            except RuntimeError:  # the loop is closed: the node is stopping and close() unpins
                pass

    def close(self) -> None:
        for p in list(self.pins.values()):
            if p.timer is not None:
                p.timer.cancel()
            self.pins.pop(p.id, None)
            self.index.unpin(p.blocks)


class PeerService(peer_pb2_grpc.PegaPeerServicer):
    """``PegaPeer`` on the node's gRPC server (same port as the engine service).

    ``data_addr`` is the advertised TCP data port; ``rdma`` (an ``RdmaResponder``) is set
    when the node runs with ``--nics``.
    """

    def __init__(self, table: PinTable, data_addr: str, max_batch: int, rdma: Any = None) -> None:
        self.table = table
        self.data_addr = data_addr
        self.max_batch = max_batch
        self.rdma = rdma

    async def PinForTransfer(self, request: peer_pb2.PinRequest, context: Any) -> peer_pb2.PinResponse:  # noqa: N802
        hashes = list(request.hashes)
        try:
            check_hashes(hashes, self.max_batch, "--max-batch")
        except InvalidArgument as exc:
            await context.abort(exc.code, str(exc))
        if self.table.ssd is not None:
            await self.table.fill_from_ssd(request.namespace, hashes)
        p = self.table.pin(request.namespace, hashes, request.ttl_seconds, request.puller)
        if p is None:
            return peer_pb2.PinResponse()
        if self.table.ssd is not None:
            self.table.ssd.leased(p.blocks)  # the pin holds them now: end the promoter's hold
        sums: list[int] = []
        if request.transport != TCP:
            t0 = time.perf_counter()
            cs = self.table.checksums
            unknown = sum(b.size for b in p.blocks if cs.get(b) is None)
            if unknown <= CHECKSUM_INLINE_BYTES:
                sums = [cs.of(b) for b in p.blocks]
            else:  # pinned pages cannot change: hashing them off the loop is safe
                sums = await asyncio.get_running_loop().run_in_executor(None, lambda: [cs.of(b) for b in p.blocks])
            self.table.metrics.pin_checksum_seconds.observe(time.perf_counter() - t0)
        resp = peer_pb2.PinResponse(
            pin_id=p.id, count=len(p.blocks), page_bytes=p.blocks[0].size, offsets=[o for o, _ in p.spans],
            checksums=sums, data_addr=self.data_addr, expires_in=max(0.0, p.expires - time.monotonic()),
        )  # fmt: skip
        if self.rdma is not None and request.transport == "rdma":
            resp.rdma_base = self.rdma.base_addr
            resp.rkeys.extend(self.rdma.rkeys)
        return resp

    async def Unpin(self, request: peer_pb2.UnpinRequest, context: Any) -> peer_pb2.UnpinResponse:  # noqa: N802
        return peer_pb2.UnpinResponse(released=self.table.unpin(request.pin_id))

    async def RdmaConnect(self, request: peer_pb2.RdmaConnectRequest, context: Any) -> peer_pb2.RdmaConnectResponse:  # noqa: N802
        if self.rdma is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node runs without --nics (no RDMA)")
        try:
            return self.rdma.accept(request)
        except (ValueError, IndexError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable
