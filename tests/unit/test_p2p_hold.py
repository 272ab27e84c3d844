"""The puller's hold on a finished pull's pages (the pulled pages and the local prefix
before them), pinned for the engine's next Query: it ends on a block when a Query leases
that block (``Puller.leased``, which the node's Query calls), never earlier, and on the
blocks no Query leased after ``hold_seconds``. The real puller, pin table and TCP data
port of tests/unit/test_p2p.py; the Query path through a live node is in
tests/integration/test_p2p_cluster.py."""

from __future__ import annotations

import asyncio

from pegaflow.core.block_index import Block
from pegaflow.node.tiers.remote.puller import Holder
from tests.unit.test_p2p import Side, hashes, pair, settle  # noqa: F401  (pair: the fixture)
from tests.waiting import wait_until_async


def held(side: Side) -> float:
    return side.sample("pegaflow_node_p2p_held_blocks")


def ended(side: Side, reason: str) -> float:
    return side.sample("pegaflow_node_p2p_hold_ended_blocks_total", reason=reason)


def pins(blocks: list[Block]) -> list[int]:
    return [b.pins for b in blocks]


def test_a_pulled_blocks_hold_ends_when_a_query_leases_it_and_not_before(pair):  # noqa: F811
    a, b, meta, peers, puller = pair
    hs = hashes("hold", 8)
    a.store(hs)
    b.store(hs[:2])  # the local prefix: the pull brings hs[2:]
    other = hashes("other", 3)
    b.store(other)
    meta.holders = [Holder("a", a.address, 8)]
    puller.hold_seconds = 60.0  # within the test only a lease can end the hold

    async def run() -> None:
        a.table.loop = asyncio.get_running_loop()
        prefix = b.index.prefix(b.ns, hs[:2], touch=False)
        assert await puller.query([b.ns], hs, 2)
        # Another request's Query leases the prefix while the pull runs: nothing is held
        # for the engine yet, so nothing ends (the prefix stays pinned for the pull).
        puller.leased(prefix)
        assert pins(prefix) == [1, 1]
        await settle(puller)
        blocks = b.index.prefix(b.ns, hs, touch=False)
        assert len(blocks) == 8
        assert pins(blocks) == [1] * 8, "the finished pull holds the prefix and the pulled pages"
        assert held(b) == 8 and ended(b, "leased") == 0 and ended(b, "expired") == 0

        puller.leased(b.index.prefix(b.ns, other, touch=False))  # blocks no pull holds
        assert pins(blocks) == [1] * 8 and held(b) == 8

        # The engine's Query leases the first 5 (the lease pins them): the hold ends on
        # those 5 and only those; the other 3 stay held.
        b.index.pin(blocks[:5])
        puller.leased(blocks[:5])
        assert pins(blocks) == [1] * 8
        assert held(b) == 3 and ended(b, "leased") == 5
        b.index.unpin(blocks[:5])  # Release: evictable again
        assert pins(blocks) == [0] * 5 + [1] * 3

        puller.leased(blocks[:5])  # leased again: nothing held there any more
        assert held(b) == 3 and ended(b, "leased") == 5

        b.index.pin(blocks)
        puller.leased(blocks)  # the rest
        b.index.unpin(blocks)
        assert pins(blocks) == [0] * 8
        assert held(b) == 0 and ended(b, "leased") == 8 and ended(b, "expired") == 0
        assert not puller._holding  # noqa: SLF001 - no hold (and no timer) left behind

    asyncio.run(run())


def test_a_pull_no_query_leases_is_released_at_its_timeout(pair):  # noqa: F811
    a, b, meta, peers, puller = pair
    hs = hashes("unqueried", 6)
    a.store(hs)
    meta.holders = [Holder("a", a.address, 6)]
    puller.hold_seconds = 0.3

    async def run() -> None:
        a.table.loop = asyncio.get_running_loop()
        assert await puller.query([b.ns], hs, 0)
        await settle(puller)
        blocks = b.index.prefix(b.ns, hs, touch=False)
        assert pins(blocks) == [1] * 6 and held(b) == 6
        b.index.pin(blocks[:2])
        puller.leased(blocks[:2])  # a Query that leased only the first two
        b.index.unpin(blocks[:2])
        assert pins(blocks) == [0, 0] + [1] * 4 and held(b) == 4
        await wait_until_async(lambda: held(b) == 0, 5, "the hold's timeout")
        assert pins(blocks) == [0] * 6
        assert ended(b, "leased") == 2 and ended(b, "expired") == 4
        assert not puller._holding  # noqa: SLF001

    asyncio.run(run())


def test_two_pulls_holding_one_prefix_each_end_at_the_lease(pair):  # noqa: F811
    a, b, meta, peers, puller = pair
    hs = hashes("shared", 6)
    a.store(hs)
    b.store(hs[:2])
    longer = hs[:2] + hashes("longer", 3)
    a.store(longer[2:])
    meta.holders = [Holder("a", a.address, 6)]
    puller.hold_seconds = 60.0

    async def run() -> None:
        a.table.loop = asyncio.get_running_loop()
        assert await puller.query([b.ns], hs, 2)
        assert await puller.query([b.ns], longer, 2)  # a second request behind the same prefix
        await settle(puller)
        prefix = b.index.prefix(b.ns, hs[:2], touch=False)
        assert pins(prefix) == [2, 2], "each pull holds the local prefix"
        assert held(b) == 4 + 3 + 2 * 2
        blocks = b.index.prefix(b.ns, hs, touch=False)
        puller.leased(blocks)  # one Query leases its request: both holds end on the prefix
        assert pins(prefix) == [0, 0] and held(b) == 3
        assert ended(b, "leased") == 8

    asyncio.run(run())
