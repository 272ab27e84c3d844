"""``Promoter.stage``, in a real SSD tier on both I/O engines: how a holder reads blocks it has
only on SSD straight into a peer's transfer (pegaflow/node/tiers/remote/pins.py).

The staged pages hold the saved bytes, come with their records' checksums, stay PENDING
(never visible, never promoted) until the caller frees them; the holder does not hash them,
so a record whose payload went bad is staged with its old checksum (the puller rejects it),
while one whose header does not match is not staged and is dropped from the SSD index; a
stage cancelled while its reads are in flight frees its pages as they land; stages count
against ``--max-prefetch-blocks``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from pegaflow.node.pool import page_checksum
from pegaflow.node.tiers.ssd.files import CACHE_FILE_NAME
from pegaflow.node.tiers.ssd.records import BLOCK
from tests.unit.test_ssd_gates import _Tier
from tests.unit.test_ssd_store import ENGINES, PAGE, WAIT_S, _engine_or_skip, _page
from tests.waiting import wait_until_async


async def _on_ssd_only(t: _Tier, n: int) -> list[bytes]:
    hs = [i.to_bytes(16, "little") for i in range(1, n + 1)]
    t.save(hs)
    await wait_until_async(t.tier.writer.idle, WAIT_S, "the write-behind to drain")
    t.index.remove(t.index.resident())
    assert all((t.ns.id, h) in t.tier.store.entries for h in hs)
    return hs


def _overwrite(tmp_path: Path, t: _Tier, h: bytes, at: int, data: bytes) -> None:
    """Change bytes of ``h``'s record on disk, ``at`` bytes into it (0: its header)."""
    e = t.tier.store.entries[(t.ns.id, h)]
    fd = os.open(tmp_path / CACHE_FILE_NAME, os.O_WRONLY)
    try:
        os.pwrite(fd, data, e.offset + at)
        os.fsync(fd)
    finally:
        os.close(fd)


class Held:
    """Holds the I/Os the tier submits until :meth:`release` (reads in flight, on demand)."""

    def __init__(self, t: _Tier) -> None:
        self.submit = t.tier.engine.submit
        self.ops: list = []
        t.tier.engine.submit = self.hold  # type: ignore[method-assign]

    def hold(self, ops: list) -> None:
        self.ops.extend(ops)

    def release(self) -> None:
        ops, self.ops = self.ops, []
        self.submit(ops)


@pytest.mark.parametrize("engine", ENGINES)
def test_staged_pages_hold_the_saved_bytes_stay_pending_and_free_on_discard(tmp_path: Path, engine: str) -> None:
    _engine_or_skip(engine)

    async def run() -> None:
        t = _Tier(tmp_path, engine)
        hs = await _on_ssd_only(t, 6)
        free = t.index.alloc.free_bytes
        got = await t.tier.promoter.stage(t.ns, hs, timeout=WAIT_S)
        assert [b.hash for b, _ in got] == hs
        for b, c in got:
            page = bytes(t.pool.view[b.offset:b.offset + PAGE])
            assert page == _page(b.hash) and c == page_checksum(page)
            assert t.index.get(t.ns, b.hash) is None  # PENDING: invisible here
        scraped = t.scrape()
        assert scraped.get("pegaflow_node_ssd_promoted_blocks_total", 0) == 0  # read, not promoted
        assert scraped["pegaflow_node_ssd_read_bytes_total"] == 6 * PAGE
        assert t.tier.promoter.staging == 0 and not t.tier.promoter.inflight
        # While staged, the keys are taken: a local promotion of them waits for the pin's end.
        assert await t.tier.promoter.stage(t.ns, hs, timeout=0.05) == []
        assert t.index.discard([b for b, _ in got]) == 6
        assert t.index.alloc.free_bytes == free
        again = await t.tier.promoter.stage(t.ns, hs[2:], timeout=WAIT_S)  # still on SSD, staged again
        assert [b.hash for b, _ in again] == hs[2:]
        t.index.discard([b for b, _ in again])
        await t.close()

    asyncio.run(run())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_bad_payload_is_staged_unhashed_and_a_bad_header_ends_the_stage(tmp_path: Path, engine: str) -> None:
    _engine_or_skip(engine)

    async def run() -> None:
        t = _Tier(tmp_path, engine)
        hs = await _on_ssd_only(t, 6)
        _overwrite(tmp_path, t, hs[1], BLOCK + 100, b"\xff" * 64)  # payload bytes
        _overwrite(tmp_path, t, hs[4], 0, b"\x00" * 64)  # header
        got = await t.tier.promoter.stage(t.ns, hs, timeout=WAIT_S)
        assert [b.hash for b, _ in got] == hs[:4]  # stops before the bad header
        b1, c1 = got[1]
        page = bytes(t.pool.view[b1.offset:b1.offset + PAGE])
        assert page != _page(hs[1]) and c1 == page_checksum(_page(hs[1])) != page_checksum(page)
        assert (t.ns.id, hs[4]) not in t.tier.store.entries  # a bad record is dropped
        assert (t.ns.id, hs[5]) in t.tier.store.entries  # the one after it is not read, kept
        assert t.scrape()["pegaflow_node_ssd_checksum_failures_total"] == 1
        t.index.discard([b for b, _ in got])
        assert t.index.alloc.free_bytes == t.index.alloc.usable  # hs[5]'s page was freed too
        await t.close()

    asyncio.run(run())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_cancelled_stage_frees_its_pages_as_they_land(tmp_path: Path, engine: str) -> None:
    _engine_or_skip(engine)

    async def run() -> None:
        t = _Tier(tmp_path, engine, ssd_prefetch_inflight=1)
        hs = await _on_ssd_only(t, 8)
        free = t.index.alloc.free_bytes
        p = t.tier.promoter
        held = Held(t)
        task = asyncio.ensure_future(p.stage(t.ns, hs[0::2], timeout=WAIT_S))  # four reads, one at a time
        await wait_until_async(lambda: held.ops, WAIT_S, "the stage's first read")
        assert p.staging == 4
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert t.index.alloc.free_bytes < free  # the pages are being read into: not freed yet
        while held.ops or p.staging:
            held.release()
            await asyncio.sleep(0.01)
        assert p.staging == 0
        assert t.index.alloc.free_bytes == free
        assert all(t.index.get(t.ns, h) is None for h in hs)
        await t.close()

    asyncio.run(run())


@pytest.mark.parametrize("engine", ENGINES)
def test_stages_count_against_max_prefetch_blocks(tmp_path: Path, engine: str) -> None:
    _engine_or_skip(engine)

    async def run() -> None:
        t = _Tier(tmp_path, engine, max_prefetch_blocks=3)
        hs = await _on_ssd_only(t, 6)
        p = t.tier.promoter
        held = Held(t)
        first = asyncio.ensure_future(p.stage(t.ns, hs, timeout=WAIT_S))
        await wait_until_async(lambda: held.ops, WAIT_S, "the first stage's reads")
        assert p.staging == 3
        assert p.query([t.ns], hs[3:], 0) == 0  # a Query finds no room: promotes nothing now
        assert await asyncio.wait_for(p.stage(t.ns, [b"not-on-ssd" * 2], timeout=WAIT_S), 0.5) == []  # no wait
        second = asyncio.ensure_future(p.stage(t.ns, hs[3:], timeout=WAIT_S))
        await asyncio.sleep(0.05)
        assert p.staging == 3 and not second.done()  # waits for room
        t.tier.engine.submit = held.submit  # type: ignore[method-assign]
        held.release()
        got = await first
        assert [b.hash for b, _ in got] == hs[:3]
        rest = await second
        assert [b.hash for b, _ in rest] == hs[3:]
        t.index.discard([b for b, _ in got + rest])
        await t.close()

    asyncio.run(run())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stage_ends_where_another_pin_staged_a_block_and_never_shifts_the_rest(tmp_path: Path, engine: str) -> None:
    """Two peers pull overlapping runs from this holder: the second stage must not skip the
    blocks the first one holds and hand out the later ones in their place (the pin serves
    the result position by position: another hash's bytes under its own, matching checksum)."""
    _engine_or_skip(engine)

    async def run() -> None:
        t = _Tier(tmp_path, engine)
        hs = await _on_ssd_only(t, 6)
        first = await t.tier.promoter.stage(t.ns, hs[:3], timeout=WAIT_S)
        assert [b.hash for b, _ in first] == hs[:3]
        free = t.index.alloc.free_bytes
        got = await t.tier.promoter.stage(t.ns, hs[1:], timeout=WAIT_S)
        assert [b.hash for b, _ in got] == hs[1:1 + len(got)], "blocks staged for other hashes"
        assert got == [] and t.index.alloc.free_bytes == free, "pages reserved past the gap were kept"
        t.index.discard([b for b, _ in first + got])
        await t.close()

    asyncio.run(run())
