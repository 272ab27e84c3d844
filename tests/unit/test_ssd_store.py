"""SSD tier pieces in-process: record format, file validation, segment log, engines, the
write-behind pin contract, and recovery by scan. Real files in a temp dir, tiny sizes."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from pegaflow.config.commands import NodeConfig, node_config
from pegaflow.config.tiers import SsdConfig
from pegaflow.core.block_index import BlockIndex
from pegaflow.node.metrics import NodeMetrics
from pegaflow.node.pool import SharedPool
from pegaflow.node.tiers.ssd import SsdError, SsdTier, open_cache, promote
from pegaflow.node.tiers.ssd.files import CACHE_FILE_NAME, MIN_SEGMENTS, check_paths, open_files
from pegaflow.node.tiers.ssd.records import BLOCK, aligned_buffer, pack_header, record_bytes, unpack_header
from pegaflow.node.tiers.ssd.store import SsdIndex
from pegaflow.node.tiers.ssd.uring import uring_unavailable_reason
from tests.waiting import wait_until_async

PAGE = 16 << 10
ENGINES = ["threads", "uring"]
WAIT_S = 10.0  # bound of a wait for the tier's own threads (writes, promotions)


def test_header_round_trip_and_any_flipped_byte_is_rejected():
    buf = aligned_buffer(BLOCK)
    h = bytes(range(16))
    pack_header(buf, 7, 9, b"model/tp0", h, 12345, 0xDEADBEEF)
    got = unpack_header(buf)
    assert got is not None
    assert (got.gen, got.seq, got.ns_name, got.hash, got.payload_len, got.payload_csum) == (
        7, 9, "model/tp0", h, 12345, 0xDEADBEEF)
    for i in range(56 + len(b"model/tp0") + 8):  # every byte of the header and its checksum
        bad = bytearray(buf)
        bad[i] ^= 0x01
        assert unpack_header(bad) is None, f"flipped header byte {i} not detected"
    assert unpack_header(bytes(BLOCK)) is None


def test_aligned_buffer_is_aligned():
    import ctypes

    for n in (BLOCK, 3 * BLOCK, 1 << 20):
        b = aligned_buffer(n)
        assert len(b) == n
        assert ctypes.addressof((ctypes.c_char * n).from_buffer(b)) % BLOCK == 0


def test_files_are_allocated_in_full_and_reopened(tmp_path: Path):
    files = open_files([str(tmp_path)], 1 << 20)
    p = tmp_path / CACHE_FILE_NAME
    assert p.stat().st_size == 1 << 20
    for f in files:
        os.close(f.fd)
    files = open_files([str(tmp_path)], 1 << 20)  # our own file: accepted as is
    assert files[0].file_bytes == 1 << 20
    for f in files:
        os.close(f.fd)


def test_a_file_in_the_format_v1_layout_opens_as_is_and_its_records_are_found(tmp_path: Path):
    """The on-disk format is a contract with files already on disk: a file built here from
    the documented v1 layout (struct + xxh3_64, none of the tier's code) must open without
    being re-formatted, and a scan must find its block and honour its reset record."""
    file_bytes, seg_bytes = 1 << 20, 31 * BLOCK  # segment = min(64 MiB, (file - 4 KiB) / 8), 4 KiB-rounded
    data = bytearray(file_bytes)
    struct.pack_into("<16sIIQQQ", data, 0, b"PEGAFLOW-SSDv1\x00\x00", 1, 0, file_bytes, seg_bytes, 1)
    struct.pack_into("<Q", data, 48, xxhash.xxh3_64_intdigest(bytes(data[:48])))

    def record(off: int, seq: int, name: bytes, hash_: bytes, payload: bytes) -> int:
        struct.pack_into("<4sHHQQQQ16s", data, off, b"PFR1", 1, len(name), 5, seq, len(payload),
                         xxhash.xxh3_64_intdigest(payload), hash_)
        data[off + 56:off + 56 + len(name)] = name
        struct.pack_into("<Q", data, off + 56 + len(name), xxhash.xxh3_64_intdigest(bytes(data[off:off + 56 + len(name)])))
        data[off + BLOCK:off + BLOCK + len(payload)] = payload
        return off + BLOCK + -(-len(payload) // BLOCK) * BLOCK

    off = record(BLOCK, 1, b"gone", b"\x01" * 16, b"voided by the reset below")
    off = record(off, 2, b"gone", b"\xff" * 16, b"")  # a reset record of namespace "gone"
    record(off, 3, b"kept", b"\x02" * 16, b"p" * 5000)
    path = tmp_path / CACHE_FILE_NAME
    path.write_bytes(bytes(data))
    files = open_files([str(tmp_path)], file_bytes)
    assert (files[0].segment_bytes, len(files[0].segments)) == (seg_bytes, 8)
    idx = SsdIndex(files, lambda name, pb: {"gone": 1, "kept": 2}[name])
    assert idx.scan() == 1
    e = idx.get((2, b"\x02" * 16))
    assert e is not None and (e.gen, e.seq, e.ns_name, e.payload_len) == (5, 3, "kept", 5000)
    idx.close()
    assert path.read_bytes() == bytes(data), "a file of this format must be opened, never rewritten"


def test_foreign_and_newer_files_are_refused_untouched(tmp_path: Path):
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"x" * 10000)
    with pytest.raises(SsdError, match="not a PegaFlow"):
        open_files([str(foreign)], 1 << 20)
    assert foreign.read_bytes() == b"x" * 10000
    ours = tmp_path / "ours"
    for f in open_files([str(ours)], 1 << 20):
        os.close(f.fd)
    data = bytearray(ours.read_bytes())
    data[16:20] = (99).to_bytes(4, "little")  # format version 99
    ours.write_bytes(bytes(data))
    with pytest.raises(SsdError, match="newer"):
        open_files([str(ours)], 1 << 20)
    assert ours.read_bytes() == bytes(data)


def test_missing_directories_are_created_and_a_path_ending_in_a_slash_is_one(tmp_path: Path):
    """As the original: a path's missing directories are created (ours refused them), and
    ``DIR/`` names a directory to hold the file (ours tried to open a file named ``DIR/``)."""
    deep, slash = tmp_path / "a" / "b" / "c.cache", str(tmp_path / "d" / "e") + "/"
    files = open_files([str(deep), slash], 4 << 20)
    assert [f.path for f in files] == [str(deep), os.path.join(slash, CACHE_FILE_NAME)]
    assert all(os.path.getsize(f.path) == 2 << 20 for f in files)
    for f in files:
        os.close(f.fd)
    with pytest.raises(SsdError, match="is not a directory"):  # a file where a directory must be
        open_files([str(deep / "f")], 1 << 20)


def test_a_start_that_fails_removes_the_files_and_directories_it_created(tmp_path: Path):
    """The second path's failure (its file is in use) left the first path's new file behind,
    allocated in full (a cache file is its share of --ssd-cache-capacity: hundreds of GB)."""
    busy = tmp_path / "busy.cache"
    held = open_files([str(busy)], 2 << 20)  # another node holds it (flock)
    new = tmp_path / "new" / "dir" / "a.cache"
    try:
        with pytest.raises(SsdError, match="in use"):
            open_files([str(new), str(busy)], 4 << 20)
    finally:
        for f in held:
            os.close(f.fd)
    assert not (tmp_path / "new").exists()
    assert busy.exists()  # another's: kept


def test_capacity_beyond_free_space_is_refused_and_creates_nothing(tmp_path: Path):
    with pytest.raises(SsdError, match="free"):
        open_files([str(tmp_path)], 1 << 50)
    assert not (tmp_path / CACHE_FILE_NAME).exists()


def test_segment_log_stripes_reclaims_oldest_first_and_never_exceeds_capacity(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    files = open_files([str(a), str(b)], 2 << 20)
    idx = SsdIndex(files, lambda name, pb: 1)
    rec = record_bytes(PAGE)
    order: list[list[bytes]] = [[], []]  # per file, oldest first
    per_file = [0, 0]
    for i in range(400):  # ~8 MiB of records into a 2 MiB log
        key = (1, i.to_bytes(16, "little"))
        slot, evicted = idx.allocate(PAGE)
        assert slot.offset + rec <= files[slot.file].file_bytes
        per_file[slot.file] += 1
        if evicted:
            fo = order[slot.file]
            assert {k[1] for k in evicted} == set(fo[:len(evicted)]), "segments must be reclaimed oldest first"
            del fo[:len(evicted)]
        assert idx.add(key, slot, "ns", PAGE)
        order[slot.file].append(key[1])
        assert idx.used_bytes <= idx.capacity
        assert idx.used_bytes == len(idx.entries) * rec
    assert abs(per_file[0] - per_file[1]) <= 1, per_file
    assert idx.evicted_blocks > 0
    for f in files:
        os.close(f.fd)


def test_a_write_whose_segment_was_reclaimed_meanwhile_is_not_indexed(tmp_path: Path):
    files = open_files([str(tmp_path)], 1 << 20)
    idx = SsdIndex(files, lambda name, pb: 1)
    slot, _ = idx.allocate(PAGE)
    while True:  # wrap the log until slot's segment is reused
        s2, evicted = idx.allocate(PAGE)
        if s2.segment == slot.segment and s2.gen != slot.gen:
            break
    assert not idx.add((1, b"k" * 16), slot, "ns", PAGE)
    assert (1, b"k" * 16) not in idx.entries
    for f in files:
        os.close(f.fd)


# ---- the tier in-process ----------------------------------------------------------------
def _opts(path: Path, engine: str, capacity: int = 4 << 20, queue: int = 1 << 20) -> NodeConfig:
    return node_config(ssd_cache_path=[str(path)], ssd_cache_capacity=capacity, ssd_queue_depth=4,
                       ssd_write_queue_size=queue, ssd_io_engine=engine)


def _engine_or_skip(engine: str) -> None:
    if engine == "uring":
        why = uring_unavailable_reason()
        if why:
            pytest.skip(f"io_uring engine unavailable here: {why}")


class _Node:
    """Pool + index + tier, as the daemon assembles them."""

    def __init__(self, path: Path, engine: str, **kw: int) -> None:
        files = open_cache(SsdConfig.from_node(_opts(path, engine, **kw)))
        assert files is not None
        self.pool = SharedPool(4 << 20)
        self.index = BlockIndex(self.pool.size)
        self.tier = SsdTier(files, self.index, self.pool.view, NodeMetrics())
        self.tier.start(asyncio.get_running_loop())
        self.ns = self.index.namespace("m", PAGE)

    async def written(self) -> None:
        """Wait (bounded) until the write-behind has written everything it queued."""
        await wait_until_async(self.tier.writer.idle, WAIT_S, "the write-behind to drain")

    def save(self, hashes: list[bytes]) -> list:  # type: ignore[type-arg]
        blocks = [b for b in self.index.reserve(self.ns, hashes) if b is not None]
        for b in blocks:
            self.pool.view[b.offset:b.offset + PAGE] = _page(b.hash)
        return self.index.commit(blocks)

    async def close(self) -> None:
        await self.tier.close()
        self.pool.close()


def _page(h: bytes) -> bytes:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).bytes(PAGE)


@pytest.mark.parametrize("engine", ENGINES)
def test_write_behind_pins_until_written_and_scan_recovers_after_restart(tmp_path: Path, engine: str,
                                                                        monkeypatch: pytest.MonkeyPatch):
    _engine_or_skip(engine)
    monkeypatch.setattr(promote, "HOLD_SECONDS", 0.01)
    hashes = [i.to_bytes(16, "little") for i in range(1, 41)]  # 80 buffers: more than one iovec takes

    async def first() -> None:
        n = _Node(tmp_path, engine)
        blocks = n.save(hashes)
        assert all(b.pins == 1 for b in blocks), "queued blocks must be pinned until written"
        await n.written()
        assert all(b.pins == 0 for b in blocks)
        assert len(n.tier.store.entries) == 40
        await n.close()

    async def second() -> None:
        n = _Node(tmp_path, engine)
        assert len(n.tier.store.entries) == 40, "scan must find every record"
        assert n.tier.promote([n.ns], hashes, 0) == len(hashes)  # LOADING, up to the whole prefix
        await wait_until_async(lambda: all(n.index.get(n.ns, h) is not None for h in hashes), WAIT_S,
                               "every block promoted")
        for h in hashes:
            b = n.index.get(n.ns, h)
            assert bytes(n.pool.view[b.offset:b.offset + PAGE]) == _page(h)
        assert n.tier.promote([n.ns], [b"\xff" * 16], 0) == 0, "nothing on SSD: no LOADING"
        await n.close()

    asyncio.run(first())
    asyncio.run(second())


def test_full_write_queue_skips_and_counts_without_waiting(tmp_path: Path):
    async def run() -> None:
        n = _Node(tmp_path, "threads", queue=2 * PAGE)
        assert n.tier.writer.limit_bytes == 2 * PAGE
        n.save([i.to_bytes(16, "little") for i in range(1, 9)])
        skipped = n.tier.node_metrics.registry.get_sample_value("pegaflow_node_ssd_skipped_writes_total",
                                                                {"reason": "queue_full"})
        assert skipped == 6
        assert n.tier.stats().skipped_writes == {"queue_full": 6}, "the Stats RPC says why"
        await n.written()
        assert len(n.tier.store.entries) == 2
        await n.close()

    asyncio.run(run())


def test_promoted_block_near_the_log_tail_is_written_again_and_a_young_one_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(promote, "HOLD_SECONDS", 0.0)

    async def run() -> None:
        n = _Node(tmp_path, "threads", capacity=1 << 20)  # 8 segments of ~6 records
        store, index = n.tier.store, n.index
        old, *rest = [i.to_bytes(16, "little") for i in range(1, 42)]
        for h in [old, *rest]:
            n.save([h])
            await n.written()
        young = rest[-1]
        e_old, e_young = store.get((n.ns.id, old)), store.get((n.ns.id, young))
        assert e_old is not None and store.age(e_old) >= 0.75, "the first block must be near the tail"
        assert e_young is not None and store.age(e_young) < 0.25
        for h in (old, young):
            index.remove([index.get(n.ns, h)])
            assert n.tier.promote([n.ns], [h], 0)
            await wait_until_async(lambda h=h: index.get(n.ns, h) is not None, WAIT_S, "the block promoted")
            await n.written()
        assert store.get((n.ns.id, old)).seq > e_old.seq, "an aging promoted block goes back to the head"
        assert store.get((n.ns.id, young)) is e_young, "a young one is not written twice"
        await n.close()

    asyncio.run(run())


def test_tp_shards_promote_together_and_loading_needs_every_shard(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(promote, "HOLD_SECONDS", 0.0)

    async def run() -> None:
        n = _Node(tmp_path, "uring" if uring_unavailable_reason() is None else "threads")
        index = n.index
        tp1 = index.namespace("m-tp1", PAGE)
        hs = [i.to_bytes(16, "little") for i in range(1, 6)]
        n.save(hs)
        b1 = [b for b in index.reserve(tp1, hs[:3]) if b is not None]  # shard 1 has only 3 blocks
        for b in b1:
            n.pool.view[b.offset:b.offset + PAGE] = _page(b"\x01" + b.hash[1:])
        index.commit(b1)
        await n.written()
        index.remove(index.resident())
        assert n.tier.promote([n.ns, tp1], hs, 0) == 3, "shard 1 lacks block 3: the prefix stops there"
        await wait_until_async(lambda: not n.tier.promoter.inflight, WAIT_S, "the promotions to end")
        assert [len(index.prefix(ns, hs, touch=False)) for ns in (n.ns, tp1)] == [3, 3], (
            "only the prefix both shards hold is promoted")
        for b in index.prefix(tp1, hs, touch=False):
            assert bytes(n.pool.view[b.offset:b.offset + PAGE]) == _page(b"\x01" + b.hash[1:])
        assert n.tier.promote([n.ns, tp1], hs, 3) == 0, "shard 1 lacks block 3: nothing to wait for"
        await n.close()

    asyncio.run(run())


def test_a_cache_file_in_use_by_another_node_is_refused(tmp_path: Path):
    files = open_files([str(tmp_path)], 1 << 20)
    try:
        with pytest.raises(SsdError, match="in use"):
            open_files([str(tmp_path)], 1 << 20)
    finally:
        for f in files:
            os.close(f.fd)
    for f in open_files([str(tmp_path)], 1 << 20):  # free again once the first one is gone
        os.close(f.fd)


def test_loading_lasts_until_the_whole_continuation_is_in_l1(tmp_path: Path):
    async def run() -> None:
        n = _Node(tmp_path, "threads")
        p, key = n.tier.promoter, (lambda h: (n.ns.id, h))
        hs = [i.to_bytes(16, "little") for i in range(1, 4)]
        n.save(hs[:1])
        p.inflight[key(hs[1])] = p.inflight[key(hs[2])] = n.index.get(n.ns, hs[0])
        assert p._loading([n.ns], hs, 0, 3), "landed block 0 + blocks 1, 2 in flight: LOADING"
        del p.inflight[key(hs[2])]
        assert p._loading([n.ns], hs, 1, 3), "block 1 still in flight"
        del p.inflight[key(hs[1])]
        assert not p._loading([n.ns], hs, 1, 3), "nothing on its way: READY"
        await n.close()

    asyncio.run(run())


def test_completion_drain_yields_to_the_loop_and_keeps_call_order(tmp_path: Path):
    """A burst of posted completions is run in call order, but not in one loop callback:
    after DRAIN_BUDGET_S the drain yields and what the loop has waiting (a Query) runs."""
    import time

    from pegaflow.node.tiers.ssd import tier as tier_mod

    async def run() -> list:  # type: ignore[type-arg]
        n = _Node(tmp_path, "threads")
        order: list = []  # type: ignore[type-arg]

        def slow(i: int) -> None:
            time.sleep(tier_mod.DRAIN_BUDGET_S * 2)
            order.append(i)

        for i in range(20):
            n.tier.call_soon(slow, i)
        asyncio.get_running_loop().call_soon(order.append, "query")  # waiting behind the drain
        await wait_until_async(lambda: len(order) == 21, WAIT_S, "the 20 slow calls and the query")
        await n.close()
        return order

    order = asyncio.run(run())
    assert [x for x in order if x != "query"] == list(range(20))
    assert order.index("query") < 5, order


def test_shards_that_leave_each_file_too_little_are_refused_before_any_path_is_built(tmp_path: Path) -> None:
    """--ssd-cache-capacity 1mb --ssd-cache-shards 2000000 built and resolved two million
    paths (53 s, 550 MB) before it said a file of 0 bytes is too small."""
    import time

    t0 = time.monotonic()
    with pytest.raises(SsdError, match="split into 2000000 cache files"):
        check_paths([str(tmp_path)], 1 << 20, shards=2_000_000)
    assert time.monotonic() - t0 < 1.0
    least = BLOCK + MIN_SEGMENTS * 2 * BLOCK  # a superblock and the fewest segments of two blocks
    assert check_paths([str(tmp_path)], 2 * least, shards=2).file_bytes == least
    with pytest.raises(SsdError, match="leaves"):
        check_paths([str(tmp_path)], 2 * least - 1, shards=2)
