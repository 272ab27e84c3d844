"""The node fails under load: killed, hung (SIGSTOP), killed mid-SSD-write, its disk flipped.

* Connector links (``NodeLink``, what vLLM's scheduler calls) keep calling while the node is
  SIGKILLed and restarted and while it is frozen: no call may take longer than its RPC
  timeout, none may raise, and hits come back once the node does.
* A node with an SSD tier is SIGKILLed while writers save, its cache file gets random bit
  flips (headers and payloads) between runs; after every restart each block is served
  byte-identical or is a miss.
"""

from __future__ import annotations

import random
import signal
import threading
import time

from pegaflow.client import PegaClient
from pegaflow.connector.link import RPC_TIMEOUT_S, NodeLink
from tests.chaos.common import NS, PAGE, Report, block_hash, page_ok, pick, store, tracebacks_in
from tests.chaos.procs import Worker
from tests.integration.meta_harness import wait_until

CALL_SLACK_S = 0.5  # scheduling noise on a loaded 2-core machine, on top of the RPC timeout


def test_calls_stay_bounded_while_the_node_is_killed_and_hung(node_factory):  # type: ignore[no-untyped-def]
    rep = Report("node SIGKILLed and SIGSTOPped under connector load")
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
    try:
        for _ in range(rounds):
            wait_until(lambda: all(lk.ready for lk in links), 30, "links ready")
            node.proc.send_signal(signal.SIGSTOP)  # hung: calls must time out, not pile up
            time.sleep(RPC_TIMEOUT_S + 1.5)
            node.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: all(lk.ready for lk in links), 60, "links back after the hang")
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
    f.crashes = calls[2]  # an exception out of the link would crash vLLM's scheduler
    f.tracebacks = tracebacks_in(node.log())
    f.notes.update(rounds=rounds, worst_call_s=round(max(worst), 3), rpc_timeout_s=RPC_TIMEOUT_S)
    rep.done()
    assert not f.bad(), f
    assert max(worst) <= RPC_TIMEOUT_S + CALL_SLACK_S, f"a call took {max(worst):.2f}s"


def test_ssd_kills_and_bit_flips_never_serve_a_wrong_byte(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    rep = Report("node SIGKILLed mid-SSD-write, bit flips on disk")
    universe = 512
    ssd = ["--ssd-cache-path", str(tmp_path), "--ssd-cache-capacity", "48mb", "--ssd-queue-depth", "8"]
    node = node_factory(f"{32 * PAGE >> 20}mb", ssd)  # L1 of 32 pages: most blocks live on SSD only
    rng = random.Random(11)
    path = tmp_path / "pegaflow-ssd.cache"
    rounds, flips_per_round = int(pick(2, 8)), int(pick(40, 200))
    flips = served = misses = wrong = 0
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
        size = path.stat().st_size
        with open(path, "r+b") as fh:
            for _ in range(flips_per_round):
                pos = rng.randrange(4096, size)  # anywhere past the superblock: headers, payloads, free space
                fh.seek(pos)
                b = fh.read(1)
                fh.seek(pos)
                fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                flips += 1
        node.start()
        with PegaClient(node.addr) as c:
            c.register({NS: PAGE})
            for i in range((rnd + 1) * universe):  # every round's blocks, after every round's flips
                h = block_hash(i)
                deadline = time.monotonic() + 20
                while True:
                    q = c.query([NS], [h], req_id=f"v{rnd}-{i}")
                    if q.status == "READY":
                        break
                    assert time.monotonic() < deadline, "promotion never finished"
                    time.sleep(0.002)
                if q.hit_blocks:
                    off = q.offsets[NS][0]
                    if page_ok(h, q.pool[off:off + PAGE].numpy()):
                        served += 1
                    else:
                        wrong += 1
                    c.release(q.lease_id)
                else:
                    misses += 1
    f = rep.fig
    f.tried = served + misses + wrong
    f.failed = misses
    f.wrong = wrong
    f.tracebacks = tracebacks_in(node.log())
    f.notes.update(rounds=rounds, bit_flips=flips, served_intact=served,
                   checksum_failures=int(node.metric("pegaflow_node_ssd_checksum_failures_total")))
    rep.done()
    assert not f.bad() and served > 0, f
