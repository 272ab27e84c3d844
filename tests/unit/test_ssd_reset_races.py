"""A namespace's reset (an engine's Reset, ``pegaflow cache clear``) stays durable when it
races the SSD tier's own work: writes still queued when it came, and writes in flight when
the node died right after it. After a restart, no record of the namespace older than
the reset may come back (it would be a hit on KV the engine threw away)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import xxhash

import pegaflow.node.tiers.ssd.tier as tier_mod
from pegaflow.node.tiers.ssd.files import open_files
from pegaflow.node.tiers.ssd.records import BLOCK, aligned_buffer, pack_header, record_bytes
from pegaflow.node.tiers.ssd.store import SsdIndex
from pegaflow.node.tiers.ssd.uring import IoOp
from tests.unit.test_ssd_store import ENGINES, PAGE, WAIT_S, _engine_or_skip, _Node
from tests.waiting import wait_until_async


@pytest.mark.parametrize("engine", ENGINES)
def test_a_reset_before_a_queued_write_went_out_keeps_that_write_off_disk(tmp_path: Path, engine: str) -> None:
    _engine_or_skip(engine)
    hashes = [i.to_bytes(16, "little") for i in range(1, 9)]

    async def first() -> None:
        n = _Node(tmp_path, engine)
        blocks = n.save(hashes)  # queued for SSD: issued at the data path's next pause
        assert n.tier.writer.pending, "the writes must still be queued when the reset comes"
        n.index.clear(n.ns)  # the reset, in the same tick (pegaflow/node/clearing.py's order)
        n.tier.clear(n.ns)
        await n.written()
        assert all(b.pins == 0 for b in blocks) and not n.tier.store.entries
        await n.close()

    async def second() -> None:
        n = _Node(tmp_path, engine)
        assert not n.tier.store.entries, "a block reset before its write must not come back"
        await n.close()

    asyncio.run(first())
    asyncio.run(second())


def _write(idx: SsdIndex, ns: str, h: bytes, payload: bytes, land: bool = True) -> None:
    """A record through the index's allocator, as the writer lays it out; ``land=False``: the
    slot is handed out but its write never reaches the disk (the node died first)."""
    slot, _ = idx.allocate(len(payload))
    if not land:
        return
    buf = aligned_buffer(record_bytes(len(payload)))
    pack_header(buf, slot.gen, slot.seq, ns.encode(), h, len(payload), xxhash.xxh3_64_intdigest(payload))
    buf[BLOCK:BLOCK + len(payload)] = payload
    os.pwritev(idx.files[slot.file].fd, [buf], slot.offset)
    assert idx.add((1 if ns == "gone" else 2, h), slot, ns, len(payload))


@pytest.mark.parametrize("first_lands", [True, False], ids=["after-a-record", "first-in-segment"])
def test_a_reset_record_behind_a_write_that_never_landed_is_found_after_a_crash(tmp_path: Path,
                                                                                first_lands: bool) -> None:
    """The log wrapped, so the open segment's old records lie where its new ones go. A reset
    record written behind a slot whose write was in flight when the node died sits past
    that slot's stale header, of the segment's previous generation."""
    files = open_files([str(tmp_path)], 1 << 20)
    nss = {"gone": 1, "kept": 2}
    idx = SsdIndex(files, lambda name, pb: nss[name])
    per_segment = files[0].segment_bytes // record_bytes(PAGE)
    segments = len(files[0].segments)
    for n in range(segments * per_segment):  # every segment full: the next record reuses segment 0
        _write(idx, "gone", n.to_bytes(16, "little"), os.urandom(PAGE))
    assert files[0].cursor == segments - 1
    gone_before = {k for k in idx.entries if k[0] == 1}
    assert gone_before
    # Segment 0 again, of a new generation: its first record, then a slot whose write is in
    # flight at the crash, then the reset.
    if first_lands:
        _write(idx, "kept", b"k" * 16, os.urandom(PAGE))
    _write(idx, "gone", b"lost" * 4, os.urandom(PAGE), land=False)
    idx.tombstone("gone")
    for f in files:
        os.close(f.fd)

    files = open_files([str(tmp_path)], 1 << 20)
    idx = SsdIndex(files, lambda name, pb: nss[name])
    idx.scan()
    assert not {k for k in idx.entries if k[0] == 1}, "the reset must void every older record of its namespace"
    assert ((2, b"k" * 16) in idx.entries) == first_lands, "a record written after the segment was reused is kept"
    for f in files:
        os.close(f.fd)


def test_a_reset_while_a_write_is_in_flight_is_found_after_a_crash_before_it_lands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the file was never written, a slot whose write never lands holds zeros, which a
    scan reads as the end of its segment: a reset record behind it would be lost. With a
    write in flight the reset record opens a segment of its own."""
    monkeypatch.setattr(tier_mod, "CLOSE_DRAIN_SECONDS", 0.0)  # the node dies: nothing drains

    async def first() -> None:
        n = _Node(tmp_path, "threads")
        per_segment = n.tier.store.files[0].segment_bytes // record_bytes(PAGE)
        n.save([i.to_bytes(16, "little") for i in range(1, per_segment + 1)])
        await n.written()
        assert n.tier.store.files[0].cursor == 0 and len(n.tier.store.entries) == per_segment
        held: list[IoOp] = []
        n.tier.engine.submit = held.extend  # type: ignore[method-assign]  # issued, never lands
        n.save([b"\xee" * 16])
        await wait_until_async(lambda: held, WAIT_S, "the next write to be issued")
        assert n.tier.store.files[0].cursor == 1, "the write in flight opened the next segment"
        n.index.clear(n.ns)
        n.tier.clear(n.ns)
        held.clear()  # the lost write's views of the pool: the pool closes only without them
        await n.close()

    async def second() -> None:
        n = _Node(tmp_path, "threads")
        assert not n.tier.store.entries, "records older than the reset came back"
        await n.close()

    asyncio.run(first())
    asyncio.run(second())
