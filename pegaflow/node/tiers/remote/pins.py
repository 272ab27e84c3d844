"""Serving side of remote reads: pins with a TTL, and the ``PegaPeer`` gRPC service.

Contracts:
- ``PinForTransfer`` pins the longest RESIDENT prefix of the requested hashes (pins keep
  blocks out of the eviction order, so their pages neither move nor change) and returns
  their offsets and, for RDMA pullers, their xxh3_64 checksums (TCP pullers get them
  in-band from the data port). Known checksums come from :class:`PageChecksums`; only
  pages whose checksum is not known yet are hashed, after pinning.
- A holder that has the requested blocks only on its SSD tier (the index lists it with
  tier SSD) reads them from SSD straight into the transfer (:meth:`PinTable.pin_for_transfer`,
  ``Promoter.stage``): O_DIRECT into PENDING pool pages (invisible here, never
  committed), each record's header checked, and its stored payload checksum handed to the
  puller, which verifies every page against it; the pages are freed when the pin ends.
  The holder does not hash them (the puller does), does not publish or evict for them,
  and keeps no second copy in its DRAM: the puller's copy is published as an L1 holder,
  which later pullers prefer. Promoting first and serving from L1 (until 2026-12) cost a
  hash of every page on the holder, its commit and events: measured with
  ``bench/p2p_ssd.py`` (1 GiB prefixes), 1.23-1.25 GB/s against 1.53-1.56 reading into
  the transfer (docs/p2p.md). The pages are pool pages, registered for RDMA like any other.
- A pin ends at ``Unpin`` or after its TTL (capped by ``--pin-ttl``), whichever is first,
  so a puller that dies mid-pull leaks nothing. A pin whose pages are being sent right
  now (TCP data plane thread) ends when that send ends, never under it.
- The pin table lives on the node's event loop; only :meth:`PinTable.acquire` and
  :meth:`PinTable.release_send` are called from data-plane threads, under ``_lock``.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc
import structlog

from pegaflow._proto import peer_pb2, peer_pb2_grpc
from pegaflow.common.errors import FailedPrecondition, InvalidArgument
from pegaflow.common.rpc_errors import RpcErrors, aio_rpc
from pegaflow.common.validate import check_hashes
from pegaflow.core.block_index import Block, BlockIndex, Namespace
from pegaflow.node.tiers.remote import RDMA, TCP
from pegaflow.node.tiers.remote.checksums import PageChecksums
from pegaflow.node.tiers.remote.metrics import PeerMetrics
from pegaflow.node.tiers.remote.tcp import BAD_RANGE, UNKNOWN_PIN

if TYPE_CHECKING:  # pyverbs behind it: imported only with --nics
    from pegaflow.node.tiers.remote.rdma import RdmaResponder

log = structlog.get_logger("pegaflow.p2p")
errors = RpcErrors(log)

BUSY_RECHECK = 0.5  # seconds: an expired pin still being sent is looked at again this often
SSD_FILL_SECONDS = 3.0  # at most this long waiting for SSD read slots for a pin (the puller's pin RPC waits 5 s)
CHECKSUM_INLINE_BYTES = 1 << 20  # below this, checksum on the loop (a thread hop costs more)


@dataclass(eq=False)
class Pin:
    id: int
    blocks: list[Block]
    spans: list[tuple[int, int]]  # (offset, size) per block, read by data-plane threads
    expires: float
    puller: str = ""
    staged: int = 0  # the last ``staged`` blocks are PENDING pages read from SSD for this pin (freed at its end)
    sending: int = 0
    ended: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class SsdReads(Protocol):
    """What a pin needs of the node's SSD tier: its promoter's ``stage``
    (pegaflow/node/tiers/ssd/promote.py), which reads blocks found only on SSD into PENDING
    pages for a pin."""

    async def stage(self, ns: Namespace, hashes: Sequence[bytes], timeout: float) -> list[tuple[Block, int]]: ...


class PinTable:
    """Pins of this node's pages held for pullers; see the module docstring. ``ssd``: the
    node's SSD tier's reads (``SsdTier.promoter``), None without an SSD tier."""

    def __init__(self, index: BlockIndex, pool_view: memoryview, max_ttl: float, metrics: PeerMetrics,
                 checksums: PageChecksums, ssd: SsdReads | None = None) -> None:
        self.index = index
        self.view = pool_view
        self.checksums = checksums
        self.max_ttl = max_ttl
        self.metrics = metrics
        self.ssd = ssd
        self.pins: dict[int, Pin] = {}

        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None  # the node's, bound by P2P.start
        metrics.active_pins.set_function(lambda: len(self.pins))

    def _new_id(self) -> int:
        """A random 63-bit pin id: the data port serves whoever names a live pin, so the id is
        the capability (only PinForTransfer, behind the token, hands one out)."""
        while True:
            i = secrets.randbits(63)
            if i and i not in self.pins:
                return i

    async def pin_for_transfer(self, ns_name: str, hashes: Sequence[bytes], ttl: float, puller: str = "",
                               timeout: float = SSD_FILL_SECONDS) -> Pin | None:
        """Pin the resident prefix and, with an SSD tier, the blocks after it that are on SSD
        only, read into PENDING pages for this pin (``Promoter.stage``: at most ``timeout``
        seconds waiting for read slots; their checksums are the records'); None when neither
        block 0 nor anything after it is here."""
        ns = self.index.get_namespace(ns_name)
        if ns is None:
            return None
        blocks = self.index.prefix(ns, hashes, touch=True)
        self.index.pin(blocks)  # while the SSD reads run: the resident prefix stays put
        staged: list[Block] = []
        if self.ssd is not None and len(blocks) < len(hashes):
            try:
                got = await self.ssd.stage(ns, hashes[len(blocks):], timeout)
            except BaseException:
                self.index.unpin(blocks)
                raise
            rest = hashes[len(blocks):]
            if any(b.hash != h for (b, _), h in zip(got, rest, strict=False)):  # Promoter.stage's contract
                self.index.unpin(blocks)
                self.index.discard([b for b, _ in got])
                raise RuntimeError("staged blocks out of order with the pin's hashes")
            for b, c in got:
                self.checksums.record(b, c)
            staged = [b for b, _ in got]
            if staged:
                self.metrics.ssd_served.inc(len(staged))
        if not blocks and not staged:
            return None
        ttl = min(ttl if ttl > 0 else self.max_ttl, self.max_ttl)
        every = blocks + staged
        p = Pin(self._new_id(), every, [(b.offset, b.size) for b in every], time.monotonic() + ttl, puller,
                len(staged))
        self.pins[p.id] = p
        loop = self.loop or asyncio.get_running_loop()
        p.timer = loop.call_later(ttl, self._expire, p.id)
        return p

    def _free(self, p: Pin) -> None:
        """Release a pin's pages: unpin the resident ones, free the ones read from SSD for it
        (their checksums go with them: the key may later be committed with other bytes)."""
        k = len(p.blocks) - p.staged
        self.index.unpin(p.blocks[:k])
        if p.staged:
            self.checksums.forget(p.blocks[k:])
            self.index.discard(p.blocks[k:])

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
            self._free(p)

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
            if self.pins.pop(p.id, None) is not None:
                self._free(p)


class PeerService(peer_pb2_grpc.PegaPeerServicer):
    """``PegaPeer`` on the node's gRPC server (same port as the engine service).

    ``data_addr`` is the advertised TCP data port; ``rdma`` (an ``RdmaResponder``) is set
    when the node runs with ``--nics``.
    """

    def __init__(self, table: PinTable, data_addr: str, max_batch: int, rdma: RdmaResponder | None = None) -> None:
        self.table = table
        self.data_addr = data_addr
        self.max_batch = max_batch
        self.rdma = rdma

    @aio_rpc(errors)
    async def PinForTransfer(  # noqa: N802
        self, request: peer_pb2.PinRequest,
        context: grpc.aio.ServicerContext[peer_pb2.PinRequest, peer_pb2.PinResponse],
    ) -> peer_pb2.PinResponse:
        hashes = list(request.hashes)
        check_hashes(hashes, self.max_batch, "--max-batch")
        if request.transport not in (TCP, RDMA):
            raise InvalidArgument(f"unknown transport {request.transport!r} (expected {TCP!r} or {RDMA!r})")
        if request.transport == RDMA and self.rdma is None:
            raise FailedPrecondition("this node runs without --nics (no RDMA)")
        if not math.isfinite(request.ttl_seconds) or request.ttl_seconds < 0:
            raise InvalidArgument(f"ttl_seconds must be a finite number >= 0 (0: --pin-ttl), got {request.ttl_seconds}")
        if self.rdma is not None and request.transport == RDMA:
            self.rdma.seen(request.puller)  # its QPs here stay open
        p = await self.table.pin_for_transfer(request.namespace, hashes, request.ttl_seconds, request.puller)
        if p is None:
            return peer_pb2.PinResponse()
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
        if self.rdma is not None and request.transport == RDMA:
            resp.rdma_base = self.rdma.base_addr
            resp.rkeys.extend(self.rdma.rkeys)
        return resp

    @aio_rpc(errors)
    async def Unpin(  # noqa: N802
        self, request: peer_pb2.UnpinRequest,
        context: grpc.aio.ServicerContext[peer_pb2.UnpinRequest, peer_pb2.UnpinResponse],
    ) -> peer_pb2.UnpinResponse:
        return peer_pb2.UnpinResponse(released=self.table.unpin(request.pin_id))

    @aio_rpc(errors)
    async def RdmaConnect(  # noqa: N802
        self, request: peer_pb2.RdmaConnectRequest,
        context: grpc.aio.ServicerContext[peer_pb2.RdmaConnectRequest, peer_pb2.RdmaConnectResponse],
    ) -> peer_pb2.RdmaConnectResponse:
        if self.rdma is None:
            raise FailedPrecondition("this node runs without --nics (no RDMA)")
        try:
            return self.rdma.accept(request)
        except (ValueError, IndexError) as exc:
            raise InvalidArgument(str(exc)) from exc
