"""The puller with SSD holders: which holder it picks, and a pull from an SSD holder split
into pins of SSD_CHUNK_BYTES (SSD_CHUNKS_IN_FLIGHT at once) that still lands byte-identical."""

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
