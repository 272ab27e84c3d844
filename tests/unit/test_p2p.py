"""Remote reads in one process: the puller against a real pin table, PegaPeer service and TCP
data port on loopback (or the RDMA transport over the fake verbs layer), with the
metaserver and the peer RPC channel replaced by direct calls.

Each test runs the real code above the network edge: reservation of PENDING pages,
pinning, the data plane into pool pages, checksum verification, commit/discard,
unpin, pin expiry and the backoff table.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from pegaflow._proto import peer_pb2
from pegaflow.core.block_index import RESIDENT, BlockIndex, Namespace
from pegaflow.core.hosts import routability_warning
from pegaflow.node.pool import SharedPool
from pegaflow.node.tiers.remote import RemotePages, TransferError, page_checksum
from pegaflow.node.tiers.remote.checksums import PageChecksums
from pegaflow.node.tiers.remote.metrics import PeerMetrics
from pegaflow.node.tiers.remote.pins import BUSY_RECHECK, PeerService, PinTable, SsdReads
from pegaflow.node.tiers.remote.puller import META_KEY, Holder, Puller
from pegaflow.node.tiers.remote.tcp import TcpDataServer, TcpTransport, sendfile_works
from tests.unit import fake_verbs
from tests.waiting import wait_until, wait_until_async

PAGE = 64 << 10
POOL = 8 << 20
NS = "model|fp16|bs16"


def hashes(tag: str, n: int) -> list[bytes]:
    import xxhash

    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


class Aborted(Exception):
    pass


class Ctx:
    async def abort(self, code: Any, msg: str) -> None:
        raise Aborted(f"{code.name}: {msg}")


class Side:
    """One node's pool, index, pin table, PegaPeer service and TCP data port; ``ssd`` builds
    what its pins read from SSD, on its pool and index."""

    def __init__(self, name: str, background: bool = False, ssd: Callable[[Side], SsdReads] | None = None) -> None:
        self.name = name
        self.pool = SharedPool(POOL, name=f"test-{name}")
        self.index = BlockIndex(POOL, align=4096)
        self.ns = self.index.namespace(NS, PAGE)
        self.registry = CollectorRegistry()
        self.metrics = PeerMetrics(self.registry)
        self.checksums = PageChecksums(self.index, self.pool.view, self.metrics, background=background)
        self.ssd = ssd(self) if ssd is not None else None
        self.table = PinTable(self.index, self.pool.view, 30.0, self.metrics, self.checksums, self.ssd)
        self.data = TcpDataServer("127.0.0.1:0", self.pool.fd, self.pool.view, self.table.acquire, self.table.release_send,
                                  self.metrics.served_bytes.inc, self.checksums.of)
        self.data.start()
        self.service = PeerService(self.table, f"127.0.0.1:{self.data.port}", 16384)
        self.address = f"{name}:50055"

    def sample(self, name: str, **labels: str) -> float:
        """A sample of this side's metrics, as its registry exports it."""
        got = self.registry.get_sample_value(name, labels)
        assert got is not None, f"{name}{labels} is not exported"
        return got

    def store(self, hs: Sequence[bytes]) -> dict[bytes, bytes]:
        """Commit pages of random bytes for ``hs``; returns hash -> page bytes."""
        out = {}
        blocks = self.index.reserve(self.ns, hs)
        for h, b in zip(hs, blocks, strict=True):
            assert b is not None
            data = os.urandom(PAGE)
            self.pool.view[b.offset:b.offset + PAGE] = data
            out[h] = data
        self.index.commit([b for b in blocks if b is not None])
        return out

    def page(self, h: bytes) -> bytes:
        b = self.index.get(self.ns, h)
        assert b is not None
        return bytes(self.pool.view[b.offset:b.offset + b.size])

    def close(self) -> None:
        self.data.close()
        self.table.close()
        self.pool.close()


class FakeMeta:
    def __init__(self) -> None:
        self.holders: list[Holder] = []
        self.fail = False
        self.calls = 0

    async def __call__(self, namespace: str, hs: Sequence[bytes]) -> list[Holder]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("metaserver down")
        return list(self.holders)


class DirectPeers:
    """PegaPeer RPCs as direct handler calls on the peer Side, with answer tampering."""

    def __init__(self, sides: dict[str, Side]) -> None:
        self.sides = sides
        self.tamper: Any = None
        self.unpinned: list[int] = []

    async def pin(self, address: str, request: peer_pb2.PinRequest) -> peer_pb2.PinResponse:
        resp = await self.sides[address].service.PinForTransfer(request, Ctx())
        if self.tamper is not None:
            self.tamper(resp)
        return resp

    async def unpin(self, address: str, pin_id: int) -> None:
        self.unpinned.append(pin_id)
        await self.sides[address].service.Unpin(peer_pb2.UnpinRequest(pin_id=pin_id), Ctx())


Pair = tuple[Side, Side, FakeMeta, DirectPeers, Puller]


@contextlib.contextmanager
def pulling_from(a: Side) -> Iterator[Pair]:
    """``a`` and a side ``b`` whose puller pulls from it (lookups answered by FakeMeta)."""
    b = Side("b")
    meta = FakeMeta()
    peers = DirectPeers({a.address: a})
    transport = TcpTransport(b.pool.view)
    puller = Puller(b.index, b.pool.view, "b", meta, peers, transport, b.metrics, pin_ttl=5.0, backoff=30.0,
                    checksums=b.checksums)
    try:
        yield a, b, meta, peers, puller
    finally:
        transport.close()
        a.close()
        b.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    with pulling_from(Side("a")) as p:
        yield p


async def settle(puller: Puller) -> None:
    while puller.tasks:
        await asyncio.gather(*list(puller.tasks), return_exceptions=True)


def pull(a: Side, b: Side, puller: Puller, hs: list[bytes], hit: int, drain: bool = False) -> None:
    """B misses after ``hit`` blocks and pulls the rest from A; returns when the pull ended,
    and with ``drain`` once A released its pins too (its data thread may release a send just
    after the puller has every byte; the release runs on this loop, gone once this returns)."""

    async def run() -> None:
        a.table.loop = asyncio.get_running_loop()
        assert await puller.query([b.ns], hs, hit)
        await settle(puller)
        if drain:
            await drained(a)

    asyncio.run(run())


async def drained(side: Side, timeout: float = 5.0) -> None:
    """Wait (bounded) until the side's pins are gone: a data thread may release its send
    just after the puller has every byte and has unpinned."""
    await wait_until_async(lambda: not side.table.pins, timeout, f"{side.name}'s pins to be released")


def pulls(side: Side, status: str) -> float:
    return side.sample("pegaflow_node_p2p_pulls_total", status=status)


def test_prefix_pulled_from_peer_is_byte_identical_reclaimable_and_unpinned(pair):
    a, b, meta, peers, puller = pair
    hs = hashes("p", 24)
    want = a.store(hs)
    meta.holders = [Holder("b", "b:1", 0), Holder("a", a.address, 24)]  # itself listed: skipped

    async def run() -> bool:
        a.table.loop = asyncio.get_running_loop()
        loading = await puller.query([b.ns], hs, 0)
        assert b.index.get(b.ns, hs[0]) is None  # PENDING until verified: invisible
        assert await puller.query([b.ns], hs, 0)  # a second Query while it runs: LOADING, no new pull
        await settle(puller)
        await drained(a)
        return loading

    assert asyncio.run(run())
    assert meta.calls == 1
    for h in hs:
        blk = b.index.get(b.ns, h)
        assert blk is not None and blk.state == RESIDENT and blk.reclaimable
        assert b.page(h) == want[h]
    assert pulls(b, "ok") == 1
    assert b.sample("pegaflow_node_p2p_pull_bytes_total") == 24 * PAGE
    # The sender counts its bytes before it sends the checksums that end the pull: counted
    # by the time the pull is over (it counted after them, and a read here could miss it).
    assert a.sample("pegaflow_node_p2p_served_bytes_total") == 24 * PAGE
    assert len(peers.unpinned) == 1 and not a.table.pins  # pin released after the pull
    assert all(blk.pins == 0 for blk in a.index.resident(a.ns))


def test_pull_continues_after_local_prefix_and_only_fetches_missing_blocks(pair):
    a, b, meta, peers, puller = pair
    hs = hashes("q", 16)
    want = a.store(hs)
    local = b.store(hs[:5])
    meta.holders = [Holder("a", a.address, 16)]

    pull(a, b, puller, hs, 5)
    assert [b.page(h) for h in hs[:5]] == [local[h] for h in hs[:5]]
    assert [b.page(h) for h in hs[5:]] == [want[h] for h in hs[5:]]
    # As above: the sender counts once its last send returns, maybe after the receiver has it all.
    wait_until(lambda: a.sample("pegaflow_node_p2p_served_bytes_total") >= 11 * PAGE, 5, "the sender's byte count",
               every=0.01)
    assert a.sample("pegaflow_node_p2p_served_bytes_total") == 11 * PAGE


def test_no_holder_beyond_local_prefix_answers_ready_without_reserving(pair):
    a, b, meta, peers, puller = pair
    hs = hashes("r", 8)
    meta.holders = [Holder("a", a.address, 3)]
    free = b.index.alloc.free_bytes

    async def run() -> bool:
        return await puller.query([b.ns], hs, 3)

    assert not asyncio.run(run())
    assert b.index.alloc.free_bytes == free


@pytest.mark.parametrize("where", ["sent", "stored"])
def test_bad_checksum_discards_pages_and_backs_the_peer_off(pair, where):
    a, b, meta, peers, puller = pair
    hs = hashes("c", 10)
    a.store(hs)
    meta.holders = [Holder("a", a.address, 10)]
    block3 = a.index.get(a.ns, hs[3])
    if where == "sent":  # the data port's answer for page 3 is wrong

        def lying_checksum(p: Any) -> int:
            c = a.checksums.of(p)
            return c ^ 1 if p.offset == block3.offset else c

        a.data.checksum_of = lying_checksum
    else:  # the sender's kept checksum of page 3 does not match the page
        a.checksums.record(block3, page_checksum(a.pool.view[block3.offset:block3.offset + PAGE]) ^ 1)
    free = b.index.alloc.free_bytes

    async def run() -> bool:
        a.table.loop = asyncio.get_running_loop()
        assert await puller.query([b.ns], hs, 0)
        await settle(puller)
        await drained(a)
        return await puller.query([b.ns], hs, 3)  # page 3 missing: the peer is skipped now

    assert not asyncio.run(run())
    assert b.index.get(b.ns, hs[3]) is None  # the wrong page never became visible
    assert b.index.get(b.ns, hs[2]) is not None and b.index.get(b.ns, hs[4]) is not None
    assert b.index.alloc.free_bytes == free - 9 * PAGE
    assert pulls(b, "checksum") == 1
    assert puller.backoff.skip(a.address)
    assert not a.table.pins


@pytest.mark.parametrize("tamper", ["page_bytes", "count", "offsets"])
def test_wrong_pin_answer_is_a_miss_and_backs_the_peer_off(pair, tamper):
    a, b, meta, peers, puller = pair
    hs = hashes("w", 6)
    a.store(hs)
    meta.holders = [Holder("a", a.address, 6)]

    def bad(resp: peer_pb2.PinResponse) -> None:
        if tamper == "page_bytes":
            resp.page_bytes = PAGE * 2
        elif tamper == "count":
            resp.count = 99
        else:
            del resp.offsets[-1]

    peers.tamper = bad
    free = b.index.alloc.free_bytes

    pull(a, b, puller, hs, 0, drain=True)
    assert all(b.index.get(b.ns, h) is None for h in hs)
    assert b.index.alloc.free_bytes == free  # every PENDING page discarded
    assert pulls(b, "bad_answer") == 1 and puller.backoff.skip(a.address)
    assert not a.table.pins  # unpinned anyway


def test_peer_gone_mid_pull_leaves_no_partial_page(pair):
    a, b, meta, peers, puller = pair
    hs = hashes("g", 32)
    a.store(hs)
    meta.holders = [Holder("a", a.address, 32)]

    def kill_data_port(resp: peer_pb2.PinResponse) -> None:
        a.data.close()  # the peer's data plane dies after answering the pin

    peers.tamper = kill_data_port
    free = b.index.alloc.free_bytes

    pull(a, b, puller, hs, 0)
    assert all(b.index.get(b.ns, h) is None for h in hs)
    assert b.index.alloc.free_bytes == free
    assert not puller.inflight
    assert pulls(b, "error") == 1 and puller.backoff.skip(a.address)


def test_metaserver_failure_serves_local_hits_and_is_skipped_for_a_while(pair):
    a, b, meta, peers, puller = pair
    meta.fail = True

    async def run() -> tuple[bool, bool]:
        return await puller.query([b.ns], hashes("m", 4), 0), await puller.query([b.ns], hashes("m", 4), 0)

    assert asyncio.run(run()) == (False, False)
    assert meta.calls == 1 and puller.backoff.skip(META_KEY)
    assert b.sample("pegaflow_node_p2p_lookups_total", result="error") == 1


def test_pins_expire_without_unpin_and_unpin_their_blocks():
    a = Side("e")
    try:
        hs = hashes("e", 4)
        a.store(hs)
        a.table.max_ttl = 0.2

        async def run() -> None:
            a.table.loop = asyncio.get_running_loop()
            resp = await a.service.PinForTransfer(peer_pb2.PinRequest(namespace=NS, hashes=hs, ttl_seconds=60, transport="tcp"), Ctx())
            assert resp.count == 4 and 0 < resp.expires_in <= 0.2
            assert all(blk.pins == 1 for blk in a.index.resident(a.ns))
            assert a.index.lru_order() == []  # pinned: not evictable
            await wait_until_async(lambda: not a.table.pins, 5.0, "the pin's TTL to end it")

        asyncio.run(run())
        assert not a.table.pins
        assert a.sample("pegaflow_node_p2p_pins_expired_total") == 1
        assert all(blk.pins == 0 for blk in a.index.resident(a.ns))
        assert len(a.index.lru_order()) == 4
    finally:
        a.close()


def test_expired_pin_is_refused_on_the_data_port():
    a, b = Side("x"), Side("y")
    t = TcpTransport(b.pool.view)
    try:
        hs = hashes("x", 3)
        a.store(hs)

        async def run() -> RemotePages:
            a.table.loop = asyncio.get_running_loop()
            r = await a.service.PinForTransfer(peer_pb2.PinRequest(namespace=NS, hashes=hs, transport="tcp"), Ctx())
            a.table.unpin(r.pin_id)
            return RemotePages("x", r.pin_id, r.page_bytes, tuple(r.offsets), tuple(r.checksums), r.data_addr)

        remote = asyncio.run(run())
        with pytest.raises(TransferError, match="refused"):
            t.read(remote, [0, PAGE, 2 * PAGE])
    finally:
        t.close()
        a.close()
        b.close()


def test_pin_is_not_released_while_its_pages_are_being_sent():
    a = Side("s")
    try:
        hs = hashes("s", 2)
        a.store(hs)

        async def run() -> None:
            a.table.loop = asyncio.get_running_loop()
            p = await a.table.pin_for_transfer(NS, hs, 0.05)
            assert p is not None
            assert a.table.acquire(p.id, 0, 2) == p.blocks  # a data thread starts sending
            await wait_until_async(lambda: p.ended, 5.0, "the TTL to end the pin")
            assert p.id in a.table.pins and all(blk.pins == 1 for blk in p.blocks)
            assert a.table.acquire(p.id, 0, 1) != p.blocks[:1]  # but no new sends start
            a.table.release_send(p.id)
            # The last send's end unpins at once, not at the next recheck (BUSY_RECHECK later).
            await wait_until_async(lambda: p.id not in a.table.pins, BUSY_RECHECK * 0.8, "the unpin at the send's end")
            assert all(blk.pins == 0 for blk in p.blocks)

        asyncio.run(run())
    finally:
        a.close()


def test_routability_warning_for_wildcard_and_loopback_only():
    assert routability_warning("0.0.0.0:50055")
    assert routability_warning("127.0.0.1:50055")
    assert routability_warning("[::]:50055")
    assert routability_warning("10.1.2.3:50055") == ""


# ---- RDMA over the fake verbs layer --------------------------------------------------------

class RdmaPair:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        from pegaflow.node.tiers.remote.rdma import RdmaEngine, RdmaResponder, RdmaTransport

        self.fabric = fake_verbs.Fabric(["a_0", "a_1", "b_0", "b_1"])
        v = self.fabric.verbs()
        self.a, self.b = Side("ra"), Side("rb")
        self.ea = RdmaEngine(["a_0", "a_1"], self.a.pool.mm, v)
        self.eb = RdmaEngine(["b_0", "b_1"], self.b.pool.mm, v)
        self.responder = RdmaResponder(self.ea, clock)
        self.a.service.rdma = self.responder
        self.handshakes = 0

        def handshake(peer: str, req: peer_pb2.RdmaConnectRequest) -> peer_pb2.RdmaConnectResponse:
            self.handshakes += 1
            return self.responder.accept(req)

        self.transport = RdmaTransport(self.eb, handshake, "rb", clock=clock)
        self.meta = FakeMeta()
        self.peers = DirectPeers({self.a.address: self.a})
        self.puller = Puller(self.b.index, self.b.pool.view, "rb", self.meta, self.peers, self.transport,
                             self.b.metrics, backoff=30.0, hold_seconds=0)

    def close(self) -> None:
        self.transport.close()
        self.ea.close()
        self.eb.close()
        self.a.close()
        self.b.close()


def test_rdma_pull_reads_pages_one_sided_over_every_nic():
    r = RdmaPair()
    try:
        hs = hashes("rd", 40)
        want = r.a.store(hs)
        r.meta.holders = [Holder("ra", r.a.address, 40)]

        async def run() -> None:
            r.a.table.loop = asyncio.get_running_loop()
            assert await r.puller.query([r.b.ns], hs, 0)
            await settle(r.puller)

        asyncio.run(run())
        assert all(r.b.page(h) == want[h] for h in hs)
        assert r.fabric.reads == 40 and r.fabric.read_bytes == 40 * PAGE
        assert r.handshakes == 2  # one RC QP per NIC, striped
        assert r.a.sample("pegaflow_node_p2p_served_bytes_total") == 0  # the peer's CPU did not send
        assert pulls(r.b, "ok") == 1 and not r.a.table.pins
    finally:
        r.close()


def test_rdma_qps_are_reused_and_a_dead_peer_qp_fails_the_pull_cleanly():
    r = RdmaPair()
    try:
        hs = hashes("rq", 8)
        r.a.store(hs)
        r.meta.holders = [Holder("ra", r.a.address, 8)]
        free = r.b.index.alloc.free_bytes

        async def pull(start: int) -> None:
            r.a.table.loop = asyncio.get_running_loop()
            assert await r.puller.query([r.b.ns], hs, start)
            await settle(r.puller)

        asyncio.run(pull(0))
        assert r.handshakes == 2
        # drop what we pulled, then pull again: same QPs
        r.b.index.remove(r.b.index.resident(r.b.ns))
        asyncio.run(pull(0))
        assert r.handshakes == 2
        r.b.index.remove(r.b.index.resident(r.b.ns))
        for qp, _ in r.responder.qps.values():  # the peer's side of every QP dies
            r.fabric.kill_qp(qp.qp_num)
        asyncio.run(pull(0))
        assert all(r.b.index.get(r.b.ns, h) is None for h in hs)
        assert r.b.index.alloc.free_bytes == free
        assert pulls(r.b, "error") == 1 and r.puller.backoff.skip(r.a.address)
        assert not r.transport._conns  # broken QPs dropped: the next pull handshakes again
    finally:
        r.close()


def test_rdma_read_with_wrong_rkey_completes_in_error():
    r = RdmaPair()
    try:
        hs = hashes("rk", 2)
        r.a.store(hs)

        async def pin() -> peer_pb2.PinResponse:
            r.a.table.loop = asyncio.get_running_loop()
            return await r.a.service.PinForTransfer(
                peer_pb2.PinRequest(namespace=NS, hashes=hs, transport="rdma"), Ctx())

        resp = asyncio.run(pin())
        assert list(resp.rkeys) == r.ea.rkeys and resp.rdma_base == r.ea.base
        remote = RemotePages(r.a.address, resp.pin_id, resp.page_bytes, tuple(resp.offsets),
                             tuple(resp.checksums), rdma_base=resp.rdma_base, rkeys=(12345, 12346))
        with pytest.raises(TransferError, match="failed"):
            r.transport.read(remote, [0, PAGE])
        good = RemotePages(r.a.address, resp.pin_id, resp.page_bytes, tuple(resp.offsets),
                           tuple(resp.checksums), rdma_base=resp.rdma_base, rkeys=tuple(resp.rkeys))
        assert r.transport.read(good, [0, PAGE]) == list(resp.checksums)
        assert [page_checksum(r.b.pool.view[o:o + PAGE]) for o in (0, PAGE)] == list(resp.checksums)
    finally:
        r.close()


def test_namespace_mismatch_between_nodes_pins_nothing():
    a = Side("n")
    try:
        a.store(hashes("n", 2))

        async def run() -> peer_pb2.PinResponse:
            a.table.loop = asyncio.get_running_loop()
            return await a.service.PinForTransfer(peer_pb2.PinRequest(namespace="other", hashes=hashes("n", 2), transport="tcp"),
                                                       Ctx())

        resp = asyncio.run(run())
        assert resp.count == 0 and resp.pin_id == 0 and not a.table.pins
    finally:
        a.close()


_ = Namespace  # re-exported type used in annotations of helpers


def test_pooled_connection_closed_by_the_peer_is_replaced_transparently(pair):
    a, b, meta, peers, puller = pair
    hs = hashes("idle", 8)
    want = a.store(hs)
    meta.holders = [Holder("a", a.address, 8)]
    puller.hold_seconds = 0

    async def pull() -> None:
        a.table.loop = asyncio.get_running_loop()
        assert await puller.query([b.ns], hs, 0)
        await settle(puller)

    asyncio.run(pull())
    assert puller.transport._idle  # the connection was kept for the next pull
    b.index.remove(b.index.resident(b.ns))
    for c in list(a.data._conns):  # the peer drops its side of every idle connection
        c.shutdown(2)
    idle = [s for socks in puller.transport._idle.values() for s in socks]
    readable, _, _ = select.select(idle, [], [], 5.0)  # the FIN has reached every pooled socket
    assert len(readable) == len(idle)
    asyncio.run(pull())
    assert pulls(b, "ok") == 2 and pulls(b, "error") == 0
    assert all(b.page(h) == want[h] for h in hs)


def test_rdma_page_not_matching_the_pin_checksum_is_discarded():
    r = RdmaPair()
    try:
        hs = hashes("rc", 6)
        r.a.store(hs)
        r.meta.holders = [Holder("ra", r.a.address, 6)]

        def corrupt(resp: peer_pb2.PinResponse) -> None:
            assert len(resp.checksums) == 6  # RDMA pullers get checksums with the pin
            resp.checksums[0] ^= 1

        r.peers.tamper = corrupt

        async def run() -> None:
            r.a.table.loop = asyncio.get_running_loop()
            assert await r.puller.query([r.b.ns], hs, 0)
            await settle(r.puller)

        asyncio.run(run())
        assert r.b.index.get(r.b.ns, hs[0]) is None
        assert all(r.b.index.get(r.b.ns, h) is not None for h in hs[1:])
        assert pulls(r.b, "checksum") == 1 and r.puller.backoff.skip(r.a.address)
    finally:
        r.close()


def test_rdma_engine_with_a_missing_device_fails_in_one_line_and_leaves_the_pool_closable():
    from pegaflow.node.tiers.remote.rdma import RdmaEngine, RdmaUnavailable

    fabric = fake_verbs.Fabric(["mlx5_0"])
    pool = SharedPool(POOL, name="test-rdma-missing")
    with pytest.raises(RdmaUnavailable, match="mlx5_9"):
        RdmaEngine(["mlx5_0", "mlx5_9"], pool.mm, fabric.verbs())
    pool.close()  # no exported pointer left behind


def test_a_prefix_nobody_holds_is_not_looked_up_again_for_a_moment(pair, monkeypatch):
    from pegaflow.node.tiers.remote import puller as puller_mod

    a, b, meta, peers, puller = pair
    hs = hashes("neg", 4)
    meta.holders = []

    async def q() -> bool:
        return await puller.query([b.ns], hs, 0)

    assert not asyncio.run(q()) and not asyncio.run(q())
    assert meta.calls == 1  # the engine's repeated Query did not cost a second round trip
    monkeypatch.setattr(puller_mod, "NEGATIVE_TTL", 0.0)
    a.store(hs)
    meta.holders = [Holder("a", a.address, 4)]

    async def pulled() -> bool:
        a.table.loop = asyncio.get_running_loop()
        r = await q()
        await settle(puller)
        return r

    assert asyncio.run(pulled()) and meta.calls == 2  # once stale, the metaserver is asked again
    assert all(b.index.get(b.ns, h) is not None for h in hs)


def hashed(side: Side, when: str) -> float:
    return side.sample("pegaflow_node_p2p_hashed_bytes_total", when=when)


def test_a_published_node_hashes_each_committed_page_once_and_every_pull_reuses_it():
    a, b = Side("ha", background=True), Side("hb", background=True)
    meta, peers = FakeMeta(), DirectPeers({a.address: a})
    transport = TcpTransport(b.pool.view)
    puller = Puller(b.index, b.pool.view, "hb", meta, peers, transport, b.metrics, pin_ttl=5.0,
                    checksums=b.checksums)
    hs = hashes("h", 12)
    meta.holders = [Holder("ha", a.address, 12)]
    try:

        async def run() -> tuple[dict[bytes, bytes], peer_pb2.PinResponse]:
            a.table.loop = asyncio.get_running_loop()
            a.checksums.start()
            b.checksums.start()
            want = a.store(hs)
            await wait_until_async(lambda: len(a.checksums) >= 12, 10, "a's hasher to know every stored page")
            assert await puller.query([b.ns], hs, 0)
            await settle(puller)
            await drained(a)
            # an RDMA pin carries every checksum: a stand-in responder plays a node with --nics
            a.service.rdma = SimpleNamespace(seen=lambda puller: None, base_addr=0, rkeys=[])
            pin = await a.service.PinForTransfer(peer_pb2.PinRequest(namespace=NS, hashes=hs, transport="rdma"), Ctx())
            a.table.unpin(pin.pin_id)
            # b's hasher has seen the pulled pages' inserts: its queue is empty and it pins nothing.
            await wait_until_async(lambda: not b.checksums._queue and all(blk.pins == 0 for blk in b.index.resident(b.ns)),
                                   5.0, "b's hasher to be idle")
            await a.checksums.close()
            await b.checksums.close()
            return want, pin

        want, pin = asyncio.run(run())
        sums = [page_checksum(want[h]) for h in hs]
        assert all(b.page(h) == want[h] for h in hs)
        assert [a.checksums.get(a.index.get(a.ns, h)) for h in hs] == sums
        assert hashed(a, "commit") == 12 * PAGE
        assert hashed(a, "transfer") == 0  # the TCP send and the RDMA pin re-read no page
        assert list(pin.checksums) == sums
        assert [b.checksums.get(b.index.get(b.ns, h)) for h in hs] == sums  # kept as verified on the pull
        assert hashed(b, "commit") == hashed(b, "transfer") == 0  # not hashed again after the pull
        assert all(blk.pins == 0 for blk in a.index.resident(a.ns))  # the hasher's pins are gone
    finally:
        transport.close()
        a.close()
        b.close()


def test_an_unknown_checksum_is_computed_when_first_sent_and_forgotten_with_its_block(pair):
    a, b, meta, peers, puller = pair
    hs = hashes("k", 4)
    want = a.store(hs)
    meta.holders = [Holder("a", a.address, 4)]

    async def run() -> None:
        a.table.loop = asyncio.get_running_loop()
        assert await puller.query([b.ns], hs, 0)
        await settle(puller)
        await drained(a)

    asyncio.run(run())
    assert all(b.page(h) == want[h] for h in hs)
    assert hashed(a, "transfer") == 4 * PAGE and len(a.checksums) == 4  # no background hasher here
    blk = a.index.get(a.ns, hs[0])
    assert a.checksums.of(blk) == page_checksum(want[hs[0]]) and hashed(a, "transfer") == 4 * PAGE
    assert a.index.remove([blk]) == [blk]
    assert a.checksums.get(blk) is None and len(a.checksums) == 3  # evicted: its page may be reused


def test_a_huge_page_pool_cannot_be_spliced_and_its_pages_are_sent_from_the_mapping(pair):
    hugetlb = os.memfd_create("test-hugetlb", os.MFD_HUGETLB | os.MFD_CLOEXEC)  # no huge page needed to probe
    try:
        os.ftruncate(hugetlb, 2 << 20)
        assert not sendfile_works(hugetlb)
    finally:
        os.close(hugetlb)
    a, b, meta, peers, puller = pair
    assert a.data.sendfile  # a plain memfd pool
    a.data.sendfile = False  # what a node with --use-hugepages does
    hs = hashes("hp", 8)
    want = a.store(hs)
    meta.holders = [Holder("a", a.address, 8)]

    pull(a, b, puller, hs, 0)
    assert all(b.page(h) == want[h] for h in hs)
    assert pulls(b, "ok") == 1


def test_a_pin_request_with_a_bad_batch_is_refused_and_pins_nothing():
    a = Side("v")
    try:
        hs = hashes("v", 4)
        a.store(hs)

        async def refused(req: peer_pb2.PinRequest) -> str:
            a.table.loop = asyncio.get_running_loop()
            with pytest.raises(Aborted) as err:
                await a.service.PinForTransfer(req, Ctx())
            return str(err.value)

        short = asyncio.run(refused(peer_pb2.PinRequest(namespace=NS, hashes=[hs[0], b"short"], transport="tcp")))
        assert short.startswith("INVALID_ARGUMENT") and "hash 1 has 5 bytes" in short
        # the transport and the TTL were ignored: a pigeon pinned pages, nan pinned for the whole --pin-ttl
        for transport in ("pigeon", "", "TCP"):
            bad = asyncio.run(refused(peer_pb2.PinRequest(namespace=NS, hashes=hs, transport=transport)))
            assert bad.startswith("INVALID_ARGUMENT") and f"unknown transport {transport!r}" in bad, bad
        rdma = asyncio.run(refused(peer_pb2.PinRequest(namespace=NS, hashes=hs, transport="rdma")))
        assert rdma.startswith("FAILED_PRECONDITION") and "without --nics" in rdma, rdma
        for ttl in (-1.0, math.nan, math.inf, -math.inf):
            bad = asyncio.run(refused(peer_pb2.PinRequest(namespace=NS, hashes=hs, transport="tcp", ttl_seconds=ttl)))
            assert bad.startswith("INVALID_ARGUMENT") and "ttl_seconds" in bad, (ttl, bad)
        a.service.max_batch = 2
        many = asyncio.run(refused(peer_pb2.PinRequest(namespace=NS, hashes=hs, transport="tcp")))
        assert many.startswith("INVALID_ARGUMENT") and "exceeds --max-batch 2" in many
        assert not a.table.pins and all(blk.pins == 0 for blk in a.index.resident(a.ns))
    finally:
        a.close()


def test_a_checksum_kept_for_a_block_a_reset_dropped_is_never_its_successors():
    """Work that pinned a block (an SSD write, a send) may keep its checksum after a Reset
    dropped the block; the engine then saves the same hash again, with other bytes."""
    side = Side("c")
    try:
        (h,) = hashes("reset", 1)
        old = side.store([h])[h]
        b1 = side.index.get(side.ns, h)
        assert b1 is not None
        side.index.pin([b1])
        side.index.clear(side.ns)
        side.checksums.record(b1, page_checksum(old))
        side.index.unpin([b1])
        new = side.store([h])[h]
        b2 = side.index.get(side.ns, h)
        assert b2 is not None and b2 is not b1 and new != old
        assert side.checksums.get(b2) is None, "another block's checksum"
        assert side.checksums.of(b2) == page_checksum(new)
    finally:
        side.close()


def test_a_pull_into_a_full_pool_evicts_neither_the_prefix_nor_the_resident_blocks_between(pair):
    """Reserving the pulled pages evicts the oldest blocks: never the request's own prefix,
    nor the blocks it skipped because this node holds them (as the SSD promoter pins first)."""
    a, b, meta, peers, puller = pair
    hs = hashes("full", 8)
    want = a.store(hs)
    mine = b.store([hs[0], hs[1], hs[4]])  # the oldest in b's LRU
    b.store(hashes("filler", POOL // PAGE - 3))
    assert b.index.alloc.free_bytes < PAGE, "b's pool must be full"
    meta.holders = [Holder("a", a.address, 8)]
    pull(a, b, puller, hs, 2)
    assert all(b.index.get(b.ns, h) is not None for h in hs), "the whole prefix is resident after the pull"
    assert [b.page(h) for h in hs] == [mine.get(h, want[h]) for h in hs]


class BlockedTransport:
    """A transport whose reads wait until the test lets them write the pages."""

    name = "tcp"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.dests: list[int] = []

    def read(self, remote: RemotePages, dests: Sequence[int]) -> list[int | None]:
        self.dests = list(dests)
        self.entered.set()
        assert self.go.wait(10)
        return list(remote.checksums)

    def close(self) -> None:
        pass


def test_a_pull_cancelled_mid_transfer_keeps_its_pages_until_the_transfer_stopped():
    """At the node's stop pulls are cancelled; their pages may be handed out again only once
    the worker thread that writes them returned."""
    a, b = Side("a"), Side("b")
    transport = BlockedTransport()
    meta = FakeMeta()
    puller = Puller(b.index, b.pool.view, "b", meta, DirectPeers({a.address: a}), transport, b.metrics,
                    pin_ttl=5.0, backoff=30.0, checksums=b.checksums)
    hs = hashes("cancel", 4)
    a.store(hs)
    meta.holders = [Holder("a", a.address, 4)]

    async def run() -> None:
        a.table.loop = asyncio.get_running_loop()
        free = b.index.alloc.free_bytes
        assert await puller.query([b.ns], hs, 0)
        await asyncio.get_running_loop().run_in_executor(None, transport.entered.wait, 10)
        closing = asyncio.ensure_future(puller.close())
        for _ in range(10):  # the cancellation delivered, and whatever it runs up to its next wait
            await asyncio.sleep(0)
        assert b.index.alloc.free_bytes == free - 4 * PAGE, "pages freed while the transfer still writes them"
        transport.go.set()
        await asyncio.wait_for(closing, 10)
        assert b.index.alloc.free_bytes == free and not puller.inflight

    try:
        asyncio.run(run())
    finally:
        transport.go.set()
        a.close()
        b.close()


def test_the_data_port_keeps_accepting_after_an_accept_error(pair):  # type: ignore[no-untyped-def]
    """EMFILE (descriptors short anywhere in the process) ended the accept loop for good,
    while the port stayed open: every later puller's connection waited out its timeout."""
    import errno

    a, b, meta, peers, puller = pair
    real = a.data.sock
    calls: list[int] = []

    class Flaky:
        def accept(self):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return real.accept()

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    a.data.sock = Flaky()  # the loop, blocked in the real accept, uses it from its next turn
    hs = hashes("emfile", 4)
    want = a.store(hs)
    meta.holders = [Holder("a", a.address, 4)]
    pull(a, b, puller, hs, 0)  # its connection wakes the loop
    assert [b.page(h) for h in hs] == [want[h] for h in hs]
    wait_until(lambda: len(calls) >= 2, 5, "the accept loop to accept again after the error", every=0.01)
    assert a.data._thread.is_alive()


def test_forgetting_a_pins_checksums_keeps_another_blocks_value_of_the_same_hash():
    side = Side("f")
    try:
        (h,) = hashes("forget", 1)
        b1 = side.index.reserve(side.ns, [h])[0]
        assert b1 is not None
        side.checksums.record(b1, 1)  # staged for pin A
        side.index.discard([b1])
        b2 = side.index.reserve(side.ns, [h])[0]  # staged again, for pin B
        assert b2 is not None and b2 is not b1
        side.checksums.record(b2, 2)
        side.checksums.forget([b1])  # pin A ends
        assert side.checksums.get(b2) == 2, "pin B's page lost its value (its bytes would be hashed as sent)"
        side.index.discard([b2])
    finally:
        side.close()


def test_a_connection_that_sends_no_request_is_closed_by_the_data_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that connects and says nothing (or half a header) held a thread and a
    descriptor of the holder for good."""
    from pegaflow.node.tiers.remote import tcp

    monkeypatch.setattr(tcp, "IDLE_TIMEOUT", 0.3, raising=False)
    a = Side("idle")
    try:
        socks = [socket.create_connection(("127.0.0.1", a.data.port)) for _ in range(3)]
        socks[0].sendall(b"PF")  # half a header
        wait_until(lambda: len(a.data._conns) == 3, 5, "the port to take the connections", every=0.01)
        wait_until(lambda: not a.data._conns, 5, "the silent connections to be closed", every=0.05)
        for s in socks:
            s.close()
    finally:
        a.close()


def test_a_backup_plan_larger_than_the_peers_batch_is_pulled_in_pins_it_takes():
    """A decode-backup plan may hold more blocks than a peer's --max-batch allows in one pin:
    pinned whole, it was refused (INVALID_ARGUMENT) every time, and never landed."""
    a, b = Side("a"), Side("b")
    a.service = PeerService(a.table, f"127.0.0.1:{a.data.port}", 4)  # --max-batch 4
    transport = TcpTransport(b.pool.view)
    puller = Puller(b.index, b.pool.view, "b", FakeMeta(), DirectPeers({a.address: a}), transport, b.metrics,
                    pin_ttl=5.0, backoff=30.0, checksums=b.checksums, max_pull=4)
    hs = hashes("plan", 10)
    want = a.store(hs)

    async def run() -> tuple[int, int, int]:
        a.table.loop = asyncio.get_running_loop()
        return await puller.backup(NS, PAGE, "a", a.address, hs)

    try:
        landed, nbytes, missing = asyncio.run(run())
        assert (landed, nbytes, missing) == (10, 10 * PAGE, 0)
        assert all(b.page(h) == want[h] for h in hs)
    finally:
        transport.close()
        a.close()
        b.close()


def test_a_puller_that_reads_its_pages_too_slowly_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """IO_TIMEOUT bounds only a send that makes no progress: a puller reading a little every
    few seconds held the pin, past its TTL, for as long as it liked."""
    import time

    from pegaflow.node.tiers.remote import tcp

    monkeypatch.setattr(tcp, "IO_TIMEOUT", 2.0)  # each call progresses sooner: only the deadline can cut
    monkeypatch.setattr(tcp, "MIN_RATE", 1 << 30, raising=False)  # the deadline: ~IO_TIMEOUT
    monkeypatch.setattr(tcp, "SOCK_BUF", 64 << 10)  # the 4 MiB must not fit the kernel's buffers
    a = Side("slow")
    try:
        hs = hashes("slow", 64)  # 4 MiB
        a.store(hs)

        async def pin() -> int:
            a.table.loop = asyncio.get_running_loop()
            p = await a.table.pin_for_transfer(NS, hs, 30.0)
            assert p is not None
            return p.id

        pin_id = asyncio.run(pin())
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        s.connect(("127.0.0.1", a.data.port))
        s.sendall(tcp.REQ.pack(tcp.REQ_MAGIC, pin_id, 0, len(hs)))
        t0, cut = time.monotonic(), False
        while time.monotonic() - t0 < 10 and not cut:  # the slow reader under test: 16 KiB every 0.2 s
            try:
                cut = not s.recv(16 << 10)
            except ConnectionResetError:
                cut = True
            time.sleep(0.2)
        s.close()
        assert cut, "a puller reading at ~80 KiB/s kept the transfer going"
    finally:
        a.close()
