"""What a promotion hands on, in a real SSD tier on both I/O engines: ``Promoter.landed()``
wakes a waiter on each read that lands (a peer's stage waiting for read slots waits on it rather
than polling), and each promoted page's verified payload checksum is kept in the node's page
checksums (as each written page's is), so a peer pulling the page gets it without the page
being hashed again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pegaflow.core.block_index import Block
from pegaflow.node.pool import page_checksum
from pegaflow.node.tiers.ssd import promote
from tests.unit.test_ssd_gates import _Tier
from tests.unit.test_ssd_store import ENGINES, WAIT_S, _engine_or_skip
from tests.waiting import wait_until_async


class Sums:
    """The part of PageChecksums the SSD tier uses: ``get`` and ``record``."""

    def __init__(self) -> None:
        self.recorded: dict[tuple[int, bytes], int] = {}

    def get(self, b: Block) -> int | None:
        return self.recorded.get((b.ns.id, b.hash))

    def record(self, b: Block, checksum: int) -> None:
        self.recorded[(b.ns.id, b.hash)] = checksum


@pytest.mark.serial  # one wake per read: a read landing before the test asks again goes uncounted
@pytest.mark.parametrize("engine", ENGINES)
def test_landed_wakes_on_each_read_and_promoted_checksums_are_kept(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _engine_or_skip(engine)
    monkeypatch.setattr(promote, "HOLD_SECONDS", 0.0)

    async def run() -> None:
        sums = Sums()
        t = _Tier(tmp_path, engine, checksums=sums, ssd_prefetch_inflight=1)
        hs = [i.to_bytes(16, "little") for i in range(1, 9)]
        t.save(hs)
        await wait_until_async(t.tier.writer.idle, WAIT_S, "the write-behind to drain")
        assert set(sums.recorded) == {(t.ns.id, h) for h in hs}  # the writer shares its records' checksums
        t.index.remove(t.index.resident())
        sums.recorded.clear()  # from here, only the promotions' values
        promoter = t.tier.promoter
        # Every other block: records apart on disk, one read each, one read in flight at once.
        even = hs[0::2]
        first = promoter.landed()
        assert t.tier.promote([t.ns], even, 0) == len(even)
        assert not first.done()  # nothing landed yet
        await asyncio.wait_for(first, WAIT_S)
        landed = 1
        while promoter.inflight:
            f = promoter.landed()
            await asyncio.wait_for(f, WAIT_S)  # each read that lands wakes the waiters of that moment
            landed += 1
        assert landed == len(even)  # one wake per read: one read per record here
        later = promoter.landed()
        await asyncio.sleep(0.05)
        assert not later.done()  # no read in flight: nothing wakes it
        later.cancel()
        blocks = t.index.prefix(t.ns, even, touch=False)
        assert len(blocks) == len(even)
        assert {(b.ns.id, b.hash): page_checksum(t.pool.view[b.offset:b.offset + b.size]) for b in blocks} \
            == sums.recorded
        await t.close()

    asyncio.run(run())
