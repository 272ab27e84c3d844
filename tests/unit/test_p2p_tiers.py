"""The puller with SSD holders: which holder it picks, and a pull from an SSD holder split
into pins of SSD_CHUNK_BYTES (SSD_CHUNKS_IN_FLIGHT at once) that still lands byte-identical;
the holder side: a pin of blocks only on SSD promotes them (round after round when the
promoter's slots are fewer) and serves them, and without room serves its resident prefix at
once."""

from __future__ import annotations

import asyncio

from pegaflow.node.tiers.remote import puller as puller_mod
from pegaflow.node.tiers.remote.puller import Holder, choose
from tests.unit.test_p2p import PAGE, hashes, pair, pull  # noqa: F401  (pair: the fixture)


def test_choose_prefers_coverage_then_l1_holders() -> None:
    never = lambda addr: False  # noqa: E731
    l1 = Holder("l1", "l1:1", 10)
    ssd = Holder("ssd", "ssd:1", 10, ssd_blocks=10)
    longer_ssd = Holder("ssd2", "ssd2:1", 16, ssd_blocks=16)
    assert choose([ssd, l1], "me", 2, 16, never) is l1  # same coverage: the L1 holder
    assert choose([l1, longer_ssd], "me", 2, 16, never) is longer_ssd  # covers more
    assert choose([l1, longer_ssd], "me", 2, 10, never) is l1  # beyond the pull's end it does not count
    assert choose([Holder("me", "me:1", 16), ssd], "me", 2, 16, never) is ssd  # never itself
    assert choose([l1, ssd], "me", 2, 16, lambda addr: addr == "l1:1") is ssd  # backed off
    assert choose([l1], "me", 10, 16, never) is None  # holds nothing past the local prefix


def test_a_pull_from_an_ssd_holder_pins_in_chunks_and_lands_byte_identical(pair, monkeypatch):  # noqa: F811
    a, b, meta, peers, puller = pair
    monkeypatch.setattr(puller_mod, "SSD_CHUNK_BYTES", 8 * PAGE)
    monkeypatch.setattr(puller_mod, "SSD_CHUNKS_IN_FLIGHT", 2)
    most = now = 0
    pin = peers.pin

    async def counting_pin(address, request):  # noqa: ANN001, ANN202
        nonlocal most, now
        now += 1
        most = max(most, now)
        await asyncio.sleep(0.05)  # a slow holder: without the gate all three would wait here
        try:
            return await pin(address, request)
        finally:
            now -= 1

    peers.pin = counting_pin
    hs = hashes("ssd-chunks", 24)
    want = a.store(hs)
    meta.holders = [Holder("a", a.address, 24, ssd_blocks=24)]
    pull(a, b, puller, hs, 0)
    assert [b.page(h) for h in hs] == [want[h] for h in hs]
    assert len(peers.unpinned) == 3  # three pins of 8 pages
    assert most == 2  # at most SSD_CHUNKS_IN_FLIGHT chunks at the holder at once
    assert b.sample("pegaflow_node_p2p_pulled_blocks_total", holder_tier="ssd") == 24
    assert b.sample("pegaflow_node_p2p_pulls_total", status="ok") == 3


class FakeSsd:
    """The SSD tier as pins.py sees it: records in ``store.entries``; ``promote`` reads
    (after ``delay`` s) at most ``slots`` blocks into L1 pages with the recorded bytes, then
    wakes ``promoter.landed()`` waiters."""

    def __init__(self, side, delay: float | None = 0.01, slots: int = 4, room: bool = True) -> None:  # noqa: ANN001
        self.side = side
        self.unlanded: list = []  # with delay None: reads the test lands
        self.delay = delay
        self.slots = slots
        self.room = room
        self.pages: dict[bytes, bytes] = {}

        class _Store:
            entries: dict = {}

        class _Promoter:
            inflight: dict = {}
            waiters: list = []

            def landed(self) -> asyncio.Future:
                f = asyncio.get_running_loop().create_future()
                self.waiters.append(f)
                return f

        self.store, self.promoter = _Store(), _Promoter()
        self.store.entries, self.promoter.inflight, self.promoter.waiters = {}, {}, []
        self.promoted = 0
        self.leased_blocks = 0

    def put(self, h: bytes, data: bytes) -> None:
        self.store.entries[(self.side.ns.id, h)] = object()
        self.pages[h] = data

    def promote(self, nss, hashes, hit: int) -> int:  # noqa: ANN001
        ns, idx, inflight = nss[0], self.side.index, self.promoter.inflight
        j = hit
        while j < len(hashes) and ((ns.id, hashes[j]) in self.store.entries or (ns.id, hashes[j]) in inflight):
            j += 1
        free = self.slots - len(inflight)
        todo = [h for h in hashes[hit:j] if (ns.id, h) not in inflight][:max(0, free)]
        if not todo or not self.room:
            return j if any((ns.id, h) in inflight for h in hashes[hit:j]) else 0
        blocks = idx.reserve(ns, todo)
        for h in todo:
            inflight[(ns.id, h)] = True

        def land() -> None:
            for h, b in zip(todo, blocks, strict=True):
                self.side.pool.view[b.offset:b.offset + b.size] = self.pages[h]
                del inflight[(ns.id, h)]
            idx.commit(blocks)
            self.promoted += len(todo)
            waiters, self.promoter.waiters = self.promoter.waiters, []
            for f in waiters:
                if not f.done():
                    f.set_result(None)

        if self.delay is None:
            self.unlanded.append(land)  # the test lands it
        else:
            asyncio.get_running_loop().call_later(self.delay, land)
        return j

    def leased(self, blocks) -> None:  # noqa: ANN001
        self.leased_blocks += len(blocks)


def test_an_ssd_holder_promotes_in_rounds_then_serves_byte_identical(pair):  # noqa: F811
    import os

    a, b, meta, peers, puller = pair
    hs = hashes("on-ssd", 12)
    want = a.store(hs[:2])  # the holder has 2 blocks in DRAM, 10 only on SSD
    ssd = FakeSsd(a, slots=4)  # at most 4 reads at once: three rounds
    for h in hs[2:]:
        want[h] = os.urandom(PAGE)
        ssd.put(h, want[h])
    a.table.ssd = ssd
    meta.holders = [Holder("a", a.address, 12, ssd_blocks=10)]
    pull(a, b, puller, hs, 0)
    assert [b.page(h) for h in hs] == [want[h] for h in hs]
    assert ssd.promoted == 10 and ssd.leased_blocks == 12
    assert a.sample("pegaflow_node_p2p_ssd_served_blocks_total") == 10


def test_an_ssd_holder_without_room_serves_what_is_resident_at_once(pair):  # noqa: F811
    import time

    a, b, meta, peers, puller = pair
    hs = hashes("no-room", 6)
    want = a.store(hs[:3])
    ssd = FakeSsd(a, room=False)
    for h in hs[3:]:
        ssd.put(h, b"x" * PAGE)
    a.table.ssd = ssd
    meta.holders = [Holder("a", a.address, 6, ssd_blocks=3)]
    t0 = time.monotonic()
    pull(a, b, puller, hs, 0)
    assert time.monotonic() - t0 < 1.0  # no wait for the 3 s bound
    assert [b.page(h) for h in hs[:3]] == [want[h] for h in hs[:3]]
    assert all(b.index.get(b.ns, h) is None for h in hs[3:])  # a miss, never wrong bytes
    assert a.sample("pegaflow_node_p2p_ssd_served_blocks_total") == 0


def test_an_ssd_holder_answers_a_pin_as_soon_as_its_reads_land(pair):  # noqa: F811
    """The pin handler wakes on the promoter's landed() rather than polling: once the last
    read landed, the fill ends within a few loop turns, with no time passing for a poll."""
    a, b, meta, peers, puller = pair
    hs = hashes("woken", 4)
    ssd = FakeSsd(a, delay=None)
    for h in hs:
        ssd.put(h, b"y" * PAGE)
    a.table.ssd = ssd

    async def run() -> int:
        fill = asyncio.ensure_future(a.table.fill_from_ssd(a.ns.name, hs, timeout=5.0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not fill.done() and len(ssd.unlanded) == 1  # one read of the 4 blocks, in flight
        ssd.unlanded.pop()()
        for _ in range(10):
            if fill.done():
                break
            await asyncio.sleep(0)
        assert fill.done()
        return fill.result()

    assert asyncio.run(run()) == 4
