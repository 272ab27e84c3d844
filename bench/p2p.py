"""Remote-read benchmark: pull throughput between network namespaces vs iperf3 on the same
link in the same run, and the latency of a 64-block prefix pull.

    python bench/p2p.py [--page-kib 1024] [--blocks 1024] [--rounds 3] [--latency-pages 128,1024]
                        [--poll-ms 2]

Two real pegaflow-node processes in two namespaces (veth + bridge, tests/harness/
netns.py), redis-server + pegaflow-meta in the hub namespace. Node 0 holds the pages
(written by an engine-like client); a client of node 1 queries until READY with every
block, re-Querying every ``--poll-ms`` while LOADING: the time from its first Query (a
local miss that starts the pull) to READY covers the metaserver lookup, the pin, the
transfer, verification and commit. Every pulled page is compared with what was saved
(xxh3 of the expected bytes). Per round it also prints the CPU seconds per GiB pulled of
both nodes and the client over that window (utime + stime from /proc: softirq work is
counted where the kernel ran it, so compare the sum, and runs with each other).
iperf3 runs on the same link in the same direction (node 0 -> node 1), one TCP stream,
right before and right after every pull; the pull is compared with the mean of the two
(the machine is shared, so the link's speed drifts between rounds). Root is needed for
namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import cpu_seconds, machine_busy  # noqa: E402

IPERF_SECONDS = 2  # per measurement; one right before and one right after each pull
# Client re-Query interval while LOADING. The connector's 5 ms would round a 0.3 s pull up
# by up to 2%; 2 ms rounds by < 1% while each LOADING answer (a Query of 1024 hashes) still
# costs little next to the pull (0.5 ms measured the same within noise).
POLL_MS = 2.0


def _hashes(tag: str, n: int) -> list[bytes]:
    import xxhash

    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def _page(tag: str, i: int, size: int) -> bytes:
    import numpy as np
    import xxhash

    return np.random.default_rng(xxhash.xxh64_intdigest(f"{tag}:{i}".encode())).bytes(size)


def _driver(argv: list[str]) -> None:
    """Runs inside a host namespace: ``save`` or ``pull`` ADDR NS TAG N PAGE [POLL_S PID0,PID1]."""
    import xxhash

    from pegaflow.client import PegaClient

    cmd, addr, ns, tag, n, page = argv[0], argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])
    hs = _hashes(tag, n)
    c = PegaClient(addr, timeout=30)
    c.register({ns: page})
    if cmd == "save":
        r = c.reserve(ns, hs)
        pool = memoryview(c.pool.numpy())
        for i, off in enumerate(r.offsets):
            pool[off:off + page] = _page(tag, i, page)
        print(json.dumps({"committed": c.commit(r.reservation_id)}), flush=True)
        return
    poll = float(argv[6])
    pids = [int(x) for x in argv[7].split(",")]  # the nodes share our PID namespace (not our netns)
    cpu0 = [cpu_seconds(p) for p in pids]
    busy0 = machine_busy()
    me0 = os.times()
    queries = 0
    t0 = time.perf_counter()
    first = None
    while True:
        q = c.query([ns], hs, lease=True)
        queries += 1
        if first is None:
            first = q.status
        if q.status == "READY" and q.hit_blocks == n:
            break
        if q.status == "READY":
            if q.lease_id:
                c.release(q.lease_id)
            if time.perf_counter() - t0 > 120:
                raise SystemExit(f"pull incomplete: {q.hit_blocks}/{n}")
        time.sleep(poll)
    dt = time.perf_counter() - t0
    cpu = [cpu_seconds(p) - c0 for p, c0 in zip(pids, cpu0, strict=True)]
    me1 = os.times()
    cpu.append(me1.user - me0.user + me1.system - me0.system)
    busy1 = machine_busy()
    busy = (busy1[0] - busy0[0]) / max(1e-9, busy1[1] - busy0[1])
    pool = memoryview(c.pool.numpy())
    bad = sum(1 for i, off in enumerate(q.offsets[ns])
              if xxhash.xxh3_64_intdigest(pool[off:off + page]) != xxhash.xxh3_64_intdigest(_page(tag, i, page)))
    c.release(q.lease_id)
    print(json.dumps({"seconds": dt, "first": first, "bad_pages": bad, "queries": queries,
                      "cpu": cpu, "busy": busy}), flush=True)


def _run(cluster, i: int, *args: str) -> dict:  # type: ignore[no-untyped-def]
    node = cluster.nodes[i]
    r = node.host.run([sys.executable, str(Path(__file__).resolve()), "_driver", args[0], node.addr, *args[1:]],
                      timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"driver on node-{i} failed: {r.stdout}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def iperf(cluster) -> float:  # type: ignore[no-untyped-def]
    """Bytes/s of one iperf3 TCP stream node 0 -> node 1 (server on 0 sends: -R)."""
    a, b = cluster.nodes[0].host, cluster.nodes[1].host
    srv = subprocess.Popen(a.argv(["iperf3", "-s", "-1", "-B", a.ip, "-p", "5201"]), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        r = b.run(["iperf3", "-c", a.ip, "-p", "5201", "-R", "-t", str(IPERF_SECONDS), "-J"], timeout=60)
        out = json.loads(r.stdout)
        return out["end"]["sum_received"]["bits_per_second"] / 8
    finally:
        srv.kill()
        srv.wait()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_driver":
        _driver(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-kib", type=int, default=1024, help="page size of the throughput pulls")
    p.add_argument("--blocks", type=int, default=1024, help="blocks per throughput pull")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--latency-pages", default="128,1024", help="page sizes (KiB) of the 64-block latency pulls")
    p.add_argument("--latency-rounds", type=int, default=5)
    p.add_argument("--pool", default="2gb")
    p.add_argument("--poll-ms", type=float, default=POLL_MS,
                   help="client re-Query interval while LOADING (the connector's is 5 ms)")
    p.add_argument("--hugepages", action="store_true",
                   help="pools on huge pages (needs 2 x --pool of free ones: /proc/sys/vm/nr_hugepages)")
    p.add_argument("--summary", type=Path, help="write the figures as JSON (python -m bench)")
    a = p.parse_args()

    from tests.harness.dirs import temp_dir_removed_at_exit
    from tests.harness.p2p import P2PCluster

    tmp = Path(temp_dir_removed_at_exit("pegaflow-bench-p2p-"))
    node_args = ("--log-level", "warning", *(("--use-hugepages",) if a.hugepages else ()))
    cluster = P2PCluster(tmp, 2, pool=a.pool, node_args=node_args)
    if cluster.fallback_reason:
        print(f"network namespaces unavailable ({cluster.fallback_reason}): loopback addresses instead")
    try:
        page = a.page_kib << 10
        ns = f"bench|p{a.page_kib}k"
        pids = f"{cluster.nodes[0].proc.pid},{cluster.nodes[1].proc.pid}"
        poll = str(a.poll_ms / 1e3)
        rates, iperfs = [], []
        for r in range(a.rounds):
            tag = f"tp{r}"
            _run(cluster, 0, "save", ns, tag, str(a.blocks), str(page))
            cluster.wait_indexed(ns, tag, a.blocks, "node-0", timeout=60)
            before = iperf(cluster)
            out = _run(cluster, 1, "pull", ns, tag, str(a.blocks), str(page), poll, pids)
            iperfs.append((before + iperf(cluster)) / 2)
            assert out["first"] == "LOADING" and out["bad_pages"] == 0, out
            rates.append(a.blocks * page / out["seconds"])
            gib = a.blocks * page / (1 << 30)
            sender, puller, client = (x / gib for x in out["cpu"])
            print(f"round {r}: pull {rates[-1] / 1e9:.3f} GB/s ({out['seconds']:.3f} s for "
                  f"{a.blocks * page >> 20} MiB), iperf3 {iperfs[-1] / 1e9:.3f} GB/s; CPU s/GiB: sender node "
                  f"{sender:.2f}, pulling node {puller:.2f}, client {client:.2f} ({out['queries']} queries)",
                  flush=True)
        ratios = [x / y for x, y in zip(rates, iperfs, strict=True)]
        print(f"\nthroughput: pull median {statistics.median(rates) / 1e9:.3f} GB/s, iperf3 median "
              f"{statistics.median(iperfs) / 1e9:.3f} GB/s, ratio median {statistics.median(ratios):.2f}x "
              f"(best {max(ratios):.2f}x)")
        if a.summary:
            a.summary.write_text(json.dumps({
                "pull_gbps_median": statistics.median(rates) / 1e9, "iperf3_gbps_median": statistics.median(iperfs) / 1e9,
                "ratio_median": statistics.median(ratios), "ratios": ratios}))
        for kib in [int(x) for x in a.latency_pages.split(",")]:
            lns = f"bench|lat{kib}k"
            lats = []
            for r in range(a.latency_rounds):
                tag = f"lat{kib}-{r}"
                _run(cluster, 0, "save", lns, tag, "64", str(kib << 10))
                cluster.wait_indexed(lns, tag, 64, "node-0", timeout=60)
                out = _run(cluster, 1, "pull", lns, tag, "64", str(kib << 10), poll, pids)
                assert out["bad_pages"] == 0, out
                lats.append(out["seconds"])
            print(f"64-block prefix pull, {kib} KiB pages ({64 * kib >> 10} MiB): p50 "
                  f"{statistics.median(lats) * 1e3:.1f} ms, min {min(lats) * 1e3:.1f} ms, max {max(lats) * 1e3:.1f} ms")
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
