"""The node fails under load: killed, hung (SIGSTOP), killed mid-SSD-write, its disk flipped.

* Connector links (``NodeLink``, what vLLM's scheduler calls) keep calling while the node is
  SIGKILLed and restarted and while it is frozen: no call may take longer than its RPC
  timeout, none may raise, and hits come back once the node does. A hang must not cost a
  block: what was stored before the SIGSTOP is read back after the SIGCONT (``lost``). A
  kill empties the pool (it has no SSD tier): those blocks are stored again.
* A node with an SSD tier is SIGKILLed while writers save, its cache file gets random bit
  flips (headers and payloads) between runs; after every restart each block is served
  byte-identical or is a miss. ``lost``: a block whose newest record on disk was whole
  after the flips (read with the format's header decoder, its payload compared byte for
  byte, independently of the node's recovery scan) and that the restarted node missed.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pegaflow.client import PegaClient, QueryResult
from pegaflow.connector.link import RPC_TIMEOUT_S, NodeLink
from pegaflow.node.tiers.ssd.records import BLOCK, REC_MAGIC, record_bytes, unpack_header
from tests.chaos.common import NS, PAGE, Report, block_hash, page_ok, pick, read_back, store, tracebacks_in
from tests.chaos.procs import Worker
from tests.waiting import wait_until

CALL_SLACK_S = 0.5  # scheduling noise on a loaded 2-core machine, on top of the RPC timeout
SCAN_CHUNK = 8 << 20  # bytes of the cache file read at a time when looking for records


@pytest.mark.serial  # every call within the RPC timeout + 0.5 s
def test_calls_stay_bounded_while_the_node_is_killed_and_hung(node_factory):  # type: ignore[no-untyped-def]
    rep = Report("node SIGKILLed and SIGSTOPped under connector load", expected_failures=True)
    node = node_factory()
    hs = [block_hash(i) for i in range(4)]
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        store(c, hs)
    links = [NodeLink(node.addr, {NS: PAGE}, f"chaos-{i}") for i in range(3)]
    stop = threading.Event()
    worst: list[float] = []
    calls = [0, 0, 0]  # tried, answered (a hit), unexpected exceptions

    def hammer(link: NodeLink) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                q = link.call(lambda cl: cl.query([NS], hs, lease=False))
            except Exception:  # noqa: BLE001 - the contract: never raises
                calls[2] += 1
                q = None
            worst.append(time.monotonic() - t0)
            calls[0] += 1
            if q is not None and q.hit_blocks:
                calls[1] += 1
            time.sleep(0.005)

    threads = [threading.Thread(target=hammer, args=(lk,), daemon=True) for lk in links]
    for t in threads:
        t.start()
    rounds = int(pick(1, 5))
    lost = wrong = checked = 0
    try:
        for _ in range(rounds):
            wait_until(lambda: all(lk.ready for lk in links), 30, "links ready")
            node.proc.send_signal(signal.SIGSTOP)  # hung: calls must time out, not pile up
            time.sleep(RPC_TIMEOUT_S + 1.5)
            node.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: all(lk.ready for lk in links), 60, "links back after the hang")
            with PegaClient(node.addr) as c:  # a hang removes nothing: every stored block is still there
                c.register({NS: PAGE})
                gone, bad = read_back(c, hs)
            lost, wrong, checked = lost + gone, wrong + bad, checked + len(hs)
            node.kill()  # dead: calls must fail fast
            node.start()  # same port, empty pool
            with PegaClient(node.addr) as c:  # refill, so hits can resume
                c.register({NS: PAGE})
                store(c, hs)
            answered = calls[1]
            wait_until(lambda a=answered: calls[1] > a + 10, 60, "hits after the restart")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for lk in links:
            lk.close()
    f = rep.fig
    f.tried = calls[0]
    f.failed = calls[0] - calls[1]
    f.lost, f.wrong = lost, wrong
    f.crashes = calls[2]  # an exception out of the link would crash vLLM's scheduler
    f.tracebacks = tracebacks_in(node.log())
    f.notes.update(rounds=rounds, worst_call_s=round(max(worst), 3), rpc_timeout_s=RPC_TIMEOUT_S,
                   blocks_read_back_after_hangs=checked)
    rep.done()
    assert not f.bad() and checked, f
    assert max(worst) <= RPC_TIMEOUT_S + CALL_SLACK_S, f"a call took {max(worst):.2f}s"


def test_ssd_kills_and_bit_flips_never_serve_a_wrong_byte(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    rep = Report("node SIGKILLed mid-SSD-write, bit flips on disk", expected_failures=True)
    universe = 512
    rounds, flips_per_round = int(pick(2, 8)), int(pick(40, 200))
    # Every node lifetime (rounds + 1) opens a fresh segment and writes at most one
    # universe of records (< 64 MiB, one segment). With twice as many segments as
    # lifetimes the log never wraps and no promoted block is old enough to be written
    # again: nothing leaves the tier but what the kills and flips destroy, so every block
    # whole on disk must come back (``lost``). The test checks that the log did not wrap.
    capacity = 64 * max(8, 2 * (rounds + 2))
    ssd = ["--ssd-cache-path", str(tmp_path), "--ssd-cache-capacity", f"{capacity}mb", "--ssd-queue-depth", "8"]
    node = node_factory(f"{32 * PAGE >> 20}mb", ssd)  # L1 of 32 pages: most blocks live on SSD only
    rng = random.Random(11)
    path = tmp_path / "pegaflow-ssd.cache"
    flips = served = misses = wrong = lost = whole = reclaimed = 0
    for rnd in range(rounds):
        # Each round writes blocks of its own (blocks already on SSD are not saved again).
        writers = [Worker("writer", node.addr, 1000 * rnd + k, universe, "--blocks", "4", "--base",
                          str(rnd * universe)) for k in range(2)]
        for w in writers:
            w.wait_ready()
        wait_until(lambda: node.metric("pegaflow_node_ssd_written_blocks_total") >= 64, 60, "SSD writes")
        time.sleep(rng.uniform(0.0, 0.5))  # the chaos: the node dies at a random point of the writes
        node.kill()
        for w in writers:
            w.kill()
        written_end = max((r.end for r in records_on_disk(path)), default=BLOCK)
        with open(path, "r+b") as fh:
            for _ in range(flips_per_round):
                # Anywhere past the superblock up to the last record: headers, payloads, and
                # the free tails of the segments earlier lifetimes left.
                pos = rng.randrange(BLOCK, written_end)
                fh.seek(pos)
                b = fh.read(1)
                fh.seek(pos)
                fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                flips += 1
        expected = whole_blocks(records_on_disk(path))
        whole += len(expected)
        node.start()
        with PegaClient(node.addr) as c:
            c.register({NS: PAGE})
            for i in range((rnd + 1) * universe):  # every round's blocks, after every round's flips
                h, rid = block_hash(i), f"v{rnd}-{i}"
                q = wait_until(lambda h=h, rid=rid: ready(c.query([NS], [h], req_id=rid)), 20,
                               "the promotion to finish", every=0.002)
                if q.hit_blocks:
                    off = q.offsets[NS][0]
                    if page_ok(h, q.pool[off:off + PAGE].numpy()):
                        served += 1
                    else:
                        wrong += 1
                    c.release(q.lease_id)
                else:
                    misses += 1
                    lost += h in expected
        reclaimed += int(node.metric("pegaflow_node_ssd_evicted_blocks_total"))
    f = rep.fig
    f.tried = served + misses + wrong
    f.failed = misses
    f.lost = lost
    f.wrong = wrong
    f.tracebacks = tracebacks_in(node.log())
    f.notes.update(rounds=rounds, bit_flips=flips, whole_on_disk=whole, served_intact=served,
                   checksum_failures=int(node.metric("pegaflow_node_ssd_checksum_failures_total")))
    rep.done()
    assert reclaimed == 0, f"the log wrapped ({reclaimed} blocks reclaimed): lost would count evictions"
    assert not f.bad() and served > 0, f


def ready(q: QueryResult) -> QueryResult | None:
    return q if q.status == "READY" else None


@dataclass(frozen=True)
class Record:
    hash: bytes
    seq: int
    end: int  # file offset past the record
    whole: bool  # its payload is the block's page, byte for byte


def records_on_disk(path: Path) -> list[Record]:
    """Every record of the chaos namespace in the cache file, found with the format's header
    decoder at each 4 KiB block of written data (not with the node's recovery scan)."""
    out = []
    magic = np.frombuffer(REC_MAGIC, dtype=np.uint8)
    with open(path, "rb") as fh:
        fd = fh.fileno()
        for start, stop in data_ranges(fd, BLOCK):
            for base in range(start, stop, SCAN_CHUNK):
                buf = os.pread(fd, min(SCAN_CHUNK, stop - base), base)
                heads = np.frombuffer(buf, dtype=np.uint8)[:len(buf) // BLOCK * BLOCK].reshape(-1, BLOCK)[:, :len(magic)]
                for i in np.flatnonzero((heads == magic).all(axis=1)):
                    h = unpack_header(buf[i * BLOCK:(i + 1) * BLOCK])
                    if h is None or h.ns_name != NS or h.payload_len != PAGE:
                        continue
                    off = base + int(i) * BLOCK
                    out.append(Record(h.hash, h.seq, off + record_bytes(PAGE),
                                      page_ok(h.hash, os.pread(fd, PAGE, off + BLOCK))))
    return out


def whole_blocks(records: list[Record]) -> set[bytes]:
    """Blocks whose newest record (the one a reader is served) is whole."""
    newest: dict[bytes, Record] = {}
    for r in records:
        if r.hash not in newest or r.seq > newest[r.hash].seq:
            newest[r.hash] = r
    return {h for h, r in newest.items() if r.whole}


def data_ranges(fd: int, start: int) -> list[tuple[int, int]]:
    """The 4 KiB-aligned ranges of the file from ``start`` that hold data: the cache file is
    allocated in full, and its unwritten extents read as holes where the file system says so."""
    size = os.fstat(fd).st_size
    out = []
    pos = start
    while pos < size:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past pos
            break
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), size)
        out.append((data // BLOCK * BLOCK, -(-hole // BLOCK) * BLOCK))
        pos = hole
    return out
