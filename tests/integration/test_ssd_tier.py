"""The SSD tier through real `pegaflow-node` processes: spill, promote, restart, corruption.

Pages are 64 KiB of per-block random bytes; the L1 pool is tiny (1 MiB = 16 pages) so
saved blocks are evicted from L1 and can only come back from SSD.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from pegaflow.client import NodeError, PegaClient, QueryResult
from pegaflow.node.tiers.ssd.files import open_files
from pegaflow.node.tiers.ssd.records import BLOCK, SB_MAGIC, TOMBSTONE, record_bytes, unpack_header
from tests.integration.redis_fixtures import redis_server  # noqa: F401
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

NS = "ssd-model"
PAGE = 64 << 10
POOL = "1mb"  # 16 pages: anything older than the last ~16 blocks is only on SSD
SSD_WAIT_S = 20.0  # bound of every wait for the tier (writes, promotions) on a loaded 2-core machine


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def page_of(h: bytes) -> bytes:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).bytes(PAGE)


def save(c: PegaClient, hs: list[bytes], batch: int = 4, node=None) -> None:  # type: ignore[no-untyped-def]
    """Save blocks in small batches (as an engine does per step). With ``node``, wait after
    each batch until the write-behind queue is empty, so no save is skipped for lack of
    unpinned pages in the tiny pool."""
    for i in range(0, len(hs), batch):
        if node is not None and i:
            wait_until(lambda: node.metric("pegaflow_node_ssd_write_queue_blocks") == 0, SSD_WAIT_S,
                       "write queue drained")
        part = hs[i:i + batch]
        r = c.reserve(NS, part)
        for h, off in zip(part, r.offsets, strict=True):
            if off >= 0:
                r.pool[off:off + PAGE] = torch.frombuffer(bytearray(page_of(h)), dtype=torch.uint8)
        if r.reservation_id:
            c.commit(r.reservation_id)


def ask_until_ready(c: PegaClient, hs: list[bytes], timeout: float = SSD_WAIT_S,
                    **query: Any) -> tuple[QueryResult, int]:
    """Query as the connector does until READY; returns the answer and the LOADING answers seen
    before it (each one saying the blocks come from SSD)."""
    loading = 0

    def ready() -> QueryResult | None:
        nonlocal loading
        q = c.query([NS], hs, **query)
        if q.status == "READY":
            return q
        assert q.loading_from == "ssd", q
        loading += 1
        return None

    return wait_until(ready, timeout, "the promotion to finish", every=0.005), loading


def load(c: PegaClient, hs: list[bytes], timeout: float = SSD_WAIT_S) -> tuple[int, int]:
    """Query until READY; returns (hit blocks, LOADING answers seen) after checking every hit's bytes."""
    q, loading = ask_until_ready(c, hs, timeout)
    try:
        for h, off in zip(hs, q.offsets[NS], strict=False):
            got = q.pool[off:off + PAGE].numpy().tobytes()
            assert got == page_of(h), "served page differs from the saved one"
    finally:
        c.release(q.lease_id)
    return q.hit_blocks, loading


def ssd_args(*paths: Path, capacity: str = "16mb") -> list[str]:
    out = []
    for p in paths:
        out += ["--ssd-cache-path", str(p)]
    return out + ["--ssd-cache-capacity", capacity, "--ssd-queue-depth", "8"]


def records(path: Path) -> list[tuple[int, object]]:
    """(offset, header) of every record header found in a cache file (brute-force scan)."""
    data = path.read_bytes()
    out = []
    for off in range(BLOCK, len(data), BLOCK):
        if data[off:off + 4] == b"PFR1":
            h = unpack_header(data[off:off + BLOCK])
            if h is not None:
                out.append((off, h))
    return out


def test_evicted_blocks_come_back_from_ssd_with_identical_bytes(node_factory, tmp_path):
    node = node_factory(POOL, ssd_args(tmp_path))
    hs = hashes("a", 48)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 48, SSD_WAIT_S, "48 blocks on SSD")
        assert node.metric("pegaflow_node_evictions_total") > 0, "the pool must have evicted blocks"
        hit, loading = load(c, hs[:12])
        assert hit == 12
        assert loading >= 1, "blocks only on SSD must first answer LOADING"
        assert node.metric("pegaflow_node_ssd_promoted_blocks_total") >= 12
        assert node.metric("pegaflow_node_ssd_promotion_seconds_count") >= 1
        assert node.metric("pegaflow_node_ssd_read_bytes_total") >= 12 * PAGE
        assert node.metric("pegaflow_node_ssd_write_bytes_total") >= 48 * PAGE
        # a second query is an L1 hit: READY at once
        q = c.query([NS], hs[:12])
        assert (q.status, q.hit_blocks) == ("READY", 12)
        c.release(q.lease_id)
        # never-saved blocks are a miss, not LOADING
        q = c.query([NS], hashes("never", 3))
        assert (q.status, q.hit_blocks) == ("READY", 0)


def test_each_ssd_write_and_read_io_is_observed_in_the_throughput_histograms(node_factory, tmp_path):
    """One observation per SSD I/O (a writev or readv of adjacent records): its bytes over the
    time from its issue to its completion; under the original's names with its 1 GB/s buckets."""
    from pegaflow.node.metrics import ORIGINAL_SSD_THROUGHPUT_BUCKETS, SSD_IO_THROUGHPUT_BUCKETS
    from tests.integration.metrics_stack import scrape, value

    node = node_factory(POOL, ssd_args(tmp_path))
    ours = {"write": "pegaflow_node_ssd_write_io_throughput_bytes_per_second",
            "read": "pegaflow_node_ssd_read_io_throughput_bytes_per_second"}
    assert node.metric(ours["write"] + "_count") == node.metric(ours["read"] + "_count") == 0
    hs = hashes("tput", 32)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_written_blocks_total") >= 32, SSD_WAIT_S, "32 blocks on SSD")
        assert load(c, hs[:8])[0] == 8
    _, s = scrape(node.http_port)
    writes, reads = value(s, ours["write"] + "_count"), value(s, ours["read"] + "_count")
    # Adjacent records go out together: at least one I/O, at most one per block.
    assert 1 <= writes <= value(s, "pegaflow_node_ssd_written_blocks_total")
    assert 1 <= reads <= value(s, "pegaflow_node_ssd_promoted_blocks_total")
    for kind, n in (("write", writes), ("read", reads)):
        mean = value(s, ours[kind] + "_sum") / n
        assert 1e6 < mean < 1e12, f"{kind}: {mean} bytes/s is no disk's"  # 1 MB/s .. 1 TB/s
        assert sorted(float(lb["le"]) for lb, _ in s[ours[kind] + "_bucket"]) == [*SSD_IO_THROUGHPUT_BUCKETS, math.inf]
    for orig, kind in (("pegaflow_ssd_write_throughput", "write"), ("pegaflow_ssd_prefetch_throughput", "read")):
        # 0.25.1's exporter's name, and the one its dashboard queries.
        for name in (orig + "_per_second", orig + "_bytes_per_second_per_second"):
            assert value(s, name + "_count") == value(s, ours[kind] + "_count"), name
            assert value(s, name + "_sum") == value(s, ours[kind] + "_sum"), name
            assert sorted(float(lb["le"]) for lb, _ in s[name + "_bucket"]) == [*ORIGINAL_SSD_THROUGHPUT_BUCKETS,
                                                                                   math.inf]


def test_a_node_serving_peers_shares_page_checksums_with_its_ssd_records(node_factory, tmp_path, redis_server):  # noqa: F811
    """With --redis-url the node keeps each page's checksum once (for pulls by peers) and
    the SSD writer takes it from there instead of hashing again: the records it writes
    must still verify when the pages come back."""
    node = node_factory(POOL, [*ssd_args(tmp_path), "--redis-url", redis_server.url])
    _spill_and_load(node, "shared")
    assert node.metric("pegaflow_node_ssd_promoted_blocks_total") >= 12
    assert node.metric("pegaflow_node_ssd_checksum_failures_total") == 0


def _spill_and_load(node, tag: str) -> None:  # type: ignore[no-untyped-def]
    """Save 48 blocks through ``node``, wait until all are on its SSD, and load 12 back
    (``load`` compares every page's bytes)."""
    hs = hashes(tag, 48)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 48, SSD_WAIT_S, "48 blocks on SSD")
        hit, _ = load(c, hs[:12])
        assert hit == 12


def test_sigkill_mid_write_then_restart_serves_only_intact_pages(node_factory, tmp_path):
    node = node_factory(POOL, ssd_args(tmp_path))
    early, burst = hashes("early", 24), hashes("burst", 64)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, early, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 24, SSD_WAIT_S, "early blocks on SSD")
        save(c, burst, batch=16)
        wait_until(lambda: node.metric("pegaflow_node_ssd_written_blocks_total") >= 25, SSD_WAIT_S, "a burst write")
        node.kill(signal.SIGKILL)  # other writes of the burst are in flight or queued
    # A torn write leaves a valid header over a half-written page: make one for certain.
    path = tmp_path / "pegaflow-ssd.cache"
    off, newest = max((r for r in records(path) if r[1].hash in set(burst)), key=lambda r: r[1].seq)
    with open(path, "r+b") as f:
        f.seek(off + BLOCK + PAGE // 2)
        f.write(bytes(PAGE // 2))
    node.pool_size = "4mb"  # room for the whole early prefix at once
    node.start()
    with PegaClient(node.addr) as other:  # the page size of a namespace survives the restart
        with pytest.raises(NodeError, match="page_bytes"):
            other.register({NS: 2 * PAGE})
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        hit, loading = load(c, early)  # load() checks every served byte
        assert hit == 24 and loading >= 1
        # each burst block is either served intact (load checks bytes) or a miss
        served = sum(load(c, [h])[0] for h in burst)
        assert served < 64
        assert load(c, [newest.hash])[0] == 0, "the torn page is a miss"
        assert node.metric("pegaflow_node_ssd_checksum_failures_total") >= 1
    assert "ssd_scan_done" in node.log()


def test_flipped_bytes_on_disk_are_detected_and_never_served(node_factory, tmp_path):
    node = node_factory(POOL, ssd_args(tmp_path))
    hs = hashes("flip", 24)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 24, SSD_WAIT_S, "blocks on SSD")
    node.stop()
    path = tmp_path / "pegaflow-ssd.cache"
    recs = {h.hash: off for off, h in records(path)}
    victim = hs[5]
    with open(path, "r+b") as f:
        f.seek(recs[victim] + BLOCK + 1000)
        b = f.read(1)
        f.seek(recs[victim] + BLOCK + 1000)
        f.write(bytes([b[0] ^ 0x40]))
    node.start()
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        hit, _ = load(c, hs[:10])
        assert hit == 5, "the prefix must stop at the corrupted block"
        assert node.metric("pegaflow_node_ssd_checksum_failures_total") == 1
        hit, _ = load(c, hs[:10])
        assert hit == 5, "a corrupted block stays a miss"


def test_requests_promoted_one_after_another_on_a_small_pool_all_hit(node_factory, tmp_path):
    # Promoted pages were held (pinned) for HOLD_SECONDS even after the engine leased them:
    # on a 16-page pool, the 17th request within 2 s found no room and missed blocks that
    # were on SSD. The hold now ends when a Query leases the batch.
    node = node_factory(POOL, ssd_args(tmp_path))
    hs = hashes("seq", 48)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 48, SSD_WAIT_S, "blocks on SSD")
    node.stop()
    node.start()  # L1 empty: every block comes from SSD
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        missed = [i for i, h in enumerate(hs) if load(c, [h])[0] != 1]
    assert not missed, f"blocks on SSD that missed: {missed}"


@pytest.mark.parametrize("where", ["mid-segment", "segment-start"])
def test_a_damaged_record_header_loses_only_its_own_block_after_a_restart(node_factory, tmp_path, where):
    # The scan used to stop at the first bad header of a segment: every later record of it
    # was lost at the restart. It now resynchronises at the next header of the segment,
    # also when the damaged header is the segment's first (only zeros there mean "empty").
    node = node_factory(POOL, ssd_args(tmp_path))
    hs = hashes("hdr", 48)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 48, SSD_WAIT_S, "blocks on SSD")
    node.stop()
    path = tmp_path / "pegaflow-ssd.cache"
    recs = {h.hash: off for off, h in records(path)}
    assert set(hs) <= set(recs)
    victim = hs[5] if where == "mid-segment" else min(hs, key=recs.__getitem__)  # the first record on disk
    same_segment_after = [h for h in hs if h != victim and recs[victim] < recs[h] < recs[victim] + (1 << 20)]
    assert same_segment_after, "the test needs records after the damaged one in its segment"
    with open(path, "r+b") as f:
        f.seek(recs[victim])  # the header's magic: it is no header any more
        f.write(b"\xff" * 8)
    node.start()
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        served = {h for h in hs if load(c, [h])[0] == 1}  # load() checks every served byte
    assert victim not in served
    missing = [hs.index(h) for h in hs if h not in served and h != victim]
    assert not missing, f"intact blocks lost after the restart: {missing}"
    assert "ssd_scan_resynced" in node.log()


def test_two_paths_stripe_pages_across_both_files(node_factory, tmp_path):
    a, b = tmp_path / "disk0", tmp_path / "disk1"
    a.mkdir()
    b.mkdir()
    node = node_factory(POOL, ssd_args(a, b))
    hs = hashes("stripe", 32)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 32, SSD_WAIT_S, "blocks on SSD")
        hit, _ = load(c, hs[:8])
        assert hit == 8
    node.stop()
    ra, rb = records(a / "pegaflow-ssd.cache"), records(b / "pegaflow-ssd.cache")
    assert len(ra) == len(rb) == 16, (len(ra), len(rb))
    assert {h.hash for _, h in ra} | {h.hash for _, h in rb} == set(hs)


def test_capacity_is_never_exceeded_and_oldest_blocks_go_first(node_factory, tmp_path):
    cap = 2 << 20
    node = node_factory(POOL, ssd_args(tmp_path, capacity="2mb"))
    hs = hashes("cap", 80)  # 80 * 68 KiB records = 5.3 MiB of writes into a 2 MiB tier
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        for i in range(0, 80, 8):
            save(c, hs[i:i + 8], node=node)
            wait_until(lambda i=i: node.metric("pegaflow_node_ssd_written_blocks_total") >= i + 8, SSD_WAIT_S,
                       "writes")
            assert node.metric("pegaflow_node_ssd_used_bytes") <= cap
        path = tmp_path / "pegaflow-ssd.cache"
        assert path.stat().st_size <= cap  # allocated in full at start-up, never grown
        assert node.metric("pegaflow_node_ssd_evicted_blocks_total") > 0
        assert node.metric("pegaflow_node_ssd_blocks") * record_bytes(PAGE) <= cap
        assert load(c, hs[-8:])[0] == 8, "the newest blocks are on SSD"
        assert load(c, hs[:1])[0] == 0, "the oldest block was reclaimed"


def _node_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pegaflow.node.cli", "--addr", "127.0.0.1:0", "--pool-size",
                           "1mb", "--http-addr", "off", *args], capture_output=True, text=True, timeout=60)


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pegaflow-node: error:"), r.stderr[-2000:]
    for w in words:
        assert w in err[0], err[0]


def test_bad_ssd_configuration_is_rejected_in_one_line_and_nothing_is_overwritten(tmp_path):
    (tmp_path / "plain").write_text("a file, not a directory")
    _one_line_error(_node_cli(tmp_path, "--ssd-cache-path", str(tmp_path / "plain" / "f")),
                    "is not a directory")
    _one_line_error(_node_cli(tmp_path, "--ssd-cache-path", "/proc/pegaflow-ssd.cache"), "/proc")
    _one_line_error(_node_cli(tmp_path, "--ssd-cache-path", str(tmp_path), "--ssd-cache-capacity", "900tb"),
                    "free")
    _one_line_error(_node_cli(tmp_path, "--ssd-cache-path", str(tmp_path), "--ssd-cache-capacity", "1mb",
                              "--ssd-cache-shards", "2000000"), "into 2000000 cache files", "leaves 0 bytes each")
    assert not (tmp_path / "pegaflow-ssd.cache").exists()
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"my precious data" * 1000)
    _one_line_error(_node_cli(tmp_path, "--ssd-cache-path", str(foreign)), "not a PegaFlow")
    assert foreign.read_bytes() == b"my precious data" * 1000
    newer = tmp_path / "newer.cache"
    import struct

    sb = bytearray(BLOCK)
    struct.pack_into("<16sIIQQQ", sb, 0, SB_MAGIC, 99, 0, 16 << 20, 1 << 20, 0)
    newer.write_bytes(bytes(sb) + b"\x07" * 100_000)
    before = newer.read_bytes()
    _one_line_error(_node_cli(tmp_path, "--ssd-cache-path", str(newer)), "newer")
    assert newer.read_bytes() == before
    assert os.path.getsize(newer) == len(before)


def test_a_start_that_fails_after_the_ssd_files_leaves_none_it_created(tmp_path):
    """The cache files are made (allocated in full) before the rest is checked: a start that
    failed later (a flag conflict, a port in use) left them and their new directories."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    existing = tmp_path / "existing.cache"
    _one_line_error(_node_cli(tmp_path, "--ssd-cache-path", str(existing), "--ssd-cache-capacity", "16mb",
                              "--no-auth", "--auth-token-file", str(token)), "--no-auth")
    assert not existing.exists()
    for f in open_files([str(existing)], 16 << 20):  # a cache of an earlier run: kept
        os.close(f.fd)
    new = str(tmp_path / "new" / "dir") + "/"
    r = _node_cli(tmp_path, "--ssd-cache-path", new, str(existing), "--ssd-cache-capacity", "32mb",
                  "--no-auth", "--auth-token-file", str(token))
    _one_line_error(r, "--no-auth")
    assert not (tmp_path / "new").exists() and existing.exists()
    with socket.socket() as taken:  # failing in the async start: the gRPC port is taken
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "pegaflow.node.cli", "--addr", f"127.0.0.1:{taken.getsockname()[1]}",
                            "--pool-size", "1mb", "--http-addr", "off", "--ssd-cache-path", new,
                            "--ssd-cache-capacity", "16mb"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "cannot listen" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert not (tmp_path / "new").exists()


def test_reset_drops_a_namespace_from_dram_and_ssd_and_keeps_the_others(node_factory, tmp_path):
    node = node_factory(POOL, ssd_args(tmp_path))
    hs, other = hashes("reset", 24), hashes("other", 4)
    with PegaClient(node.addr) as c, PegaClient(node.addr) as d:
        c.register({NS: PAGE})
        d.register({"other-model": PAGE})
        save(c, hs, node=node)
        r = d.reserve("other-model", other)
        d.commit(r.reservation_id)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 28, SSD_WAIT_S, "28 blocks on SSD")
        q = c.query([NS], hs[-2:])  # a lease held across the reset
        assert q.hit_blocks == 2
        with pytest.raises(NodeError) as exc:
            c.reset(["other-model"])  # not registered by this session
        assert exc.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(NodeError) as exc:
            c.reset([])
        assert exc.value.code.name == "INVALID_ARGUMENT"

        res = c.reset([NS])
        assert res.ssd_blocks == 24 and res.busy_blocks >= 2 and res.dropped_blocks >= 2
        assert node.metric("pegaflow_node_resets_total") == 1
        for part in (hs[:12], hs[12:]):
            assert load(c, part)[0] == 0, "nothing of the namespace is served, from DRAM or SSD"
        c.release(q.lease_id)
        wait_until(lambda: c.stats().used_bytes == PAGE * len(other), SSD_WAIT_S, "the leased pages freed")
        q = d.query(["other-model"], other)
        assert q.hit_blocks == 4, "another namespace keeps its blocks"
        d.release(q.lease_id)
        assert "namespaces_reset" in node.log()
        after = hashes("after-reset", 4)  # saved after the reset: must survive it
        save(c, after, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 8, SSD_WAIT_S, "the new blocks on SSD")

    # The reset is durable: the records stay on disk, but a restarted node (even after a
    # crash right after the reset) finds a reset record newer than them and skips them.
    node.kill(signal.SIGKILL)
    tombs = [h for _, h in records(tmp_path / "pegaflow-ssd.cache") if h.hash == TOMBSTONE]
    assert [h.ns_name for h in tombs] == [NS]
    node.start()
    with PegaClient(node.addr) as c, PegaClient(node.addr) as d:
        c.register({NS: PAGE})
        d.register({"other-model": PAGE})
        assert load(c, hs[:12])[0] == 0 and load(c, hs[12:])[0] == 0, "reset blocks came back after a restart"
        assert load(c, after)[0] == 4, "blocks saved after the reset were lost"
        wait_until(lambda: d.query(["other-model"], other, lease=False).hit_blocks == 4, SSD_WAIT_S,
                   "the other namespace back from SSD")
    voided = re.findall(r'"voided_by_reset": (\d+)', node.log())
    assert voided and int(voided[-1]) == len(hs), voided  # the restarted node's scan


def test_a_watching_session_gets_its_namespaces_block_events(node_factory, tmp_path):
    """RegisterRequest.watch_blocks: DRAM evictions, SSD writes and resets of the session's
    namespaces arrive on its Session stream; another namespace's do not."""
    import threading

    node = node_factory(POOL, ssd_args(tmp_path))
    got: list = []
    lock = threading.Lock()

    def on_blocks(events, dropped):  # type: ignore[no-untyped-def]
        with lock:
            got.extend(events)
        assert dropped == 0

    def seen(medium: str, stored: bool) -> set[bytes]:
        with lock:
            return {h for e in got if e.namespace == NS and e.medium == medium and e.stored == stored for h in e.hashes}

    hs = hashes("watched", 24)
    with PegaClient(node.addr, on_blocks=on_blocks) as c, PegaClient(node.addr) as other:
        c.register({NS: PAGE})
        other.register({"unwatched": PAGE})
        save(c, hs, node=node)
        r = other.reserve("unwatched", hashes("u", 2))
        other.commit(r.reservation_id)
        wait_until(lambda: seen("ssd", True) == set(hs), SSD_WAIT_S, "every SSD write reported")
        wait_until(lambda: len(seen("dram", False)) >= 8, SSD_WAIT_S, "DRAM evictions reported")
        assert seen("dram", False) <= set(hs)
        c.reset([NS])
        wait_until(lambda: seen("ssd", False) == set(hs), SSD_WAIT_S, "the reset's SSD removals reported")
        with lock:
            assert all(e.namespace == NS for e in got), "events of a namespace this session did not register"


def _threads(pid: int) -> list[tuple[int, str, int]]:
    """(tid, OS thread name, nice) of every thread of process ``pid``."""
    out = []
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (t / "comm").read_text().strip()
            stat = (t / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        out.append((int(t.name), comm, int(stat.rsplit(")", 1)[1].split()[16])))
    return out


def test_background_threads_run_below_the_loop_that_serves_engines(node_factory, tmp_path, redis_server):  # noqa: F811
    """The SSD tier's I/O thread and io_uring's workers it starts, the event publisher, the
    /metrics server and the peer checksum hasher run at nice +10 (pegaflow/common/priority.py);
    the thread that answers engines keeps the node's own priority."""
    node = node_factory(POOL, [*ssd_args(tmp_path), "--redis-url", redis_server.url])
    _spill_and_load(node, "prio")  # SSD writes and reads, events, checksums: every thread has started
    threads = _threads(node.proc.pid)
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the node starts at this process's nice
    bg = min(19, base + 10)
    niced = {name for _, name, n in threads if n == bg}
    for name in ("pegaflow-ssd-ur", "pf-http", "pf-publisher-", "p2p-checksum_0"):  # OS names: 15 bytes
        assert any(x.startswith(name) for x in niced), f"{name} not at nice {bg}: {sorted(threads)}"
    workers = [(name, n) for _, name, n in threads if name.startswith("iou-wrk-")]
    assert workers, f"no io_uring worker threads: {sorted(threads)}"
    assert all(n == bg for _, n in workers), workers
    # The loop that answers engines and gRPC's own threads keep the node's priority.
    assert next(n for tid, _, n in threads if tid == node.proc.pid) == base
    grpc_threads = [n for _, name, n in threads if name.startswith(("event_engine", "grpc_global"))]
    assert grpc_threads and set(grpc_threads) == {base}, sorted(threads)
