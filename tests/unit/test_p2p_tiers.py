"""The puller with SSD holders: which holder it picks, and a pull from an SSD holder split
into pins of SSD_CHUNK_BYTES (SSD_CHUNKS_IN_FLIGHT at once) that still lands byte-identical;
the holder side: a pin of blocks only on SSD reads them into pages of that pin (never made
visible) and serves them with the records' checksums, freeing them when the pin ends; a page
that does not match its record's checksum is a miss on the puller; without room the holder
serves its resident prefix at once. The real ``Promoter.stage`` is tested in
tests/unit/test_ssd_stage.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

from pegaflow.node.tiers.remote import puller as puller_mod
from pegaflow.node.tiers.remote.puller import Holder, choose
from tests.unit.test_p2p import PAGE, Pair, Side, hashes, pair, pull, pulling_from  # noqa: F401  (pair: the fixture)


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
    """The SSD tier as pins.py sees it (``SsdReads``): ``stage`` reads (after ``delay`` s) at most
    ``slots`` leading blocks of the records in ``pages`` into PENDING pages and returns them
    with the records' checksums (``sums`` overrides one: a record whose bytes went bad)."""

    def __init__(self, side, delay: float = 0.01, slots: int = 64, room: bool = True) -> None:  # noqa: ANN001
        self.side = side
        self.delay = delay
        self.slots = slots
        self.room = room
        self.pages: dict[bytes, bytes] = {}
        self.sums: dict[bytes, int] = {}
        self.staged = 0

    def put(self, h: bytes, data: bytes) -> None:
        self.pages[h] = data

    async def stage(self, ns, hashes, timeout: float):  # noqa: ANN001, ANN201
        from pegaflow.node.pool import page_checksum

        idx = self.side.index
        todo = []
        for h in hashes[:self.slots]:
            if h not in self.pages or idx.get(ns, h) is not None:
                break
            todo.append(h)
        if not todo or not self.room:
            return []
        await asyncio.sleep(self.delay)
        out = []
        for h, b in zip(todo, idx.reserve(ns, todo), strict=True):
            assert b is not None
            self.side.pool.view[b.offset:b.offset + b.size] = self.pages[h]
            out.append((b, self.sums.get(h, page_checksum(self.pages[h]))))
        self.staged += len(out)
        return out


@contextlib.contextmanager
def ssd_holder(**fake: float | int | bool) -> Iterator[tuple[Pair, FakeSsd]]:
    """:func:`pulling_from` a holder ``a`` whose pins read from a :class:`FakeSsd` (``fake``: its options)."""
    a = Side("a", ssd=lambda side: FakeSsd(side, **fake))
    assert isinstance(a.ssd, FakeSsd)
    with pulling_from(a) as p:
        yield p, a.ssd


def test_an_ssd_holder_serves_blocks_read_for_the_pin_byte_identical_and_frees_them() -> None:
    import os

    with ssd_holder() as ((a, b, meta, peers, puller), ssd):
        hs = hashes("on-ssd", 12)
        want = a.store(hs[:2])  # the holder has 2 blocks in DRAM, 10 only on SSD
        for h in hs[2:]:
            want[h] = os.urandom(PAGE)
            ssd.put(h, want[h])
        meta.holders = [Holder("a", a.address, 12, ssd_blocks=10)]
        free = a.index.alloc.free_bytes
        pull(a, b, puller, hs, 0, drain=True)
        assert [b.page(h) for h in hs] == [want[h] for h in hs]
        assert ssd.staged == 10
        assert a.sample("pegaflow_node_p2p_ssd_served_blocks_total") == 10
        # The holder promoted nothing: its pin's pages were freed with the pin, checksums too.
        assert peers.unpinned and not a.table.pins
        assert all(a.index.get(a.ns, h) is None for h in hs[2:])
        assert a.index.alloc.free_bytes == free
        assert all(a.checksums.get(SimpleNamespace(ns=a.ns, hash=h)) is None for h in hs[2:])  # type: ignore[arg-type]
        # ... and it can stage the same blocks again for the next puller.
        assert asyncio.run(ssd.stage(a.ns, hs[2:], 1.0)) and ssd.staged == 20


def test_a_page_not_matching_its_records_checksum_is_a_miss_on_the_puller() -> None:
    with ssd_holder() as ((a, b, meta, peers, puller), ssd):
        hs = hashes("bad-record", 4)
        for h in hs:
            ssd.put(h, b"z" * PAGE)
        ssd.sums[hs[2]] = 12345  # the holder does not hash: the puller must catch it
        meta.holders = [Holder("a", a.address, 4, ssd_blocks=4)]
        pull(a, b, puller, hs, 0, drain=True)
        assert b.index.get(b.ns, hs[2]) is None  # never committed with bytes that do not match
        assert [b.index.get(b.ns, h) is not None for h in (hs[0], hs[1], hs[3])] == [True, True, True]
        assert b.sample("pegaflow_node_p2p_pulls_total", status="checksum") == 1
        assert not a.table.pins and all(a.index.get(a.ns, h) is None for h in hs)


def test_an_ssd_holder_without_room_serves_what_is_resident_at_once() -> None:
    import time

    with ssd_holder(room=False) as ((a, b, meta, peers, puller), ssd):
        hs = hashes("no-room", 6)
        want = a.store(hs[:3])
        for h in hs[3:]:
            ssd.put(h, b"x" * PAGE)
        meta.holders = [Holder("a", a.address, 6, ssd_blocks=3)]
        t0 = time.monotonic()
        pull(a, b, puller, hs, 0)
        assert time.monotonic() - t0 < 1.0  # no wait for the 3 s bound
        assert [b.page(h) for h in hs[:3]] == [want[h] for h in hs[:3]]
        assert all(b.index.get(b.ns, h) is None for h in hs[3:])  # a miss, never wrong bytes
        assert a.sample("pegaflow_node_p2p_ssd_served_blocks_total") == 0
