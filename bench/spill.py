"""Query latency on a node whose SSD tier spills and whose pool evicts at full rate.

    python bench/spill.py [--seconds 20] [--pool-mb 256] [--ssd-gb 2] [--dir /var/tmp] [--summary F]

One real node (L1 pool of ``--pool-mb``, an SSD tier of ``--ssd-gb`` on ``--dir``). A
writer process saves new 256 KiB pages (Reserve + copy + Commit of 64-block requests,
every one a new prefix) at ``--save-mbps``, so the pool evicts and the SSD tier writes
behind everything at that rate. Paced, because on a 2-core machine an unpaced writer,
the node and this process together need more than the two cores (the node alone used
0.8-0.95 of one): the Query p99 then measures the CPU run queue (4-5 ms flat out, against
1.1-1.4 ms at 0.4-0.8 GB/s, measured 2026-12-01), not the node. ``--save-mbps 0`` runs
flat out. Meanwhile this process Queries a 64-block prefix that stays
resident (it is touched by every Query) over the local socket, with a lease, and releases
it. The peer is the same Query on the same node before the writer starts (same run). The
writer's save rate and the node's SSD write and L1 eviction rates over the window are
printed, so a quiet window (nothing spilled) cannot pass for a loaded one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import cpu_seconds, scrape  # noqa: E402
from pegaflow.client import PegaClient  # noqa: E402
from tests.harness.dirs import temp_dir_removed_at_exit  # noqa: E402
from tests.harness.node import Node  # noqa: E402

PAGE = 256 << 10
BLOCKS = 64
NS = "spill-bench"

WRITER = textwrap.dedent("""
    import os, sys, time, torch
    from pegaflow.client import PegaClient, save_pages
    addr, seconds, rate = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    buf = torch.randn(4, 256, 2, 128, 128).to(torch.float16)  # 256 blocks of 256 KiB
    kv = [buf[i] for i in range(4)]
    c = PegaClient(addr, timeout=30)
    c.register({"spill-bench": 256 << 10})
    start = time.monotonic()
    end = start + seconds
    saved = 0
    while time.monotonic() < end:
        if rate > 0:  # paced: blocks/s
            ahead = saved / rate - (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead)
        r = c.reserve("spill-bench", [os.urandom(16) for _ in range(64)])
        ok = [i for i, o in enumerate(r.offsets) if o >= 0]
        if ok:
            save_pages(kv, ok, r.pool, [r.offsets[i] for i in ok])
        if r.reservation_id:
            c.commit(r.reservation_id, wait=False)
        saved += len(ok)
    print(saved, flush=True)
""")


def query_latencies(c: PegaClient, hashes: list[bytes], seconds: float) -> list[float]:
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        q = c.query([NS], hashes)
        lat.append(time.perf_counter() - t)
        assert q.hit_blocks == len(hashes), f"the queried prefix was evicted ({q.hit_blocks} blocks)"
        c.release(q.lease_id)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window under load")
    ap.add_argument("--pool-mb", type=int, default=256)
    ap.add_argument("--save-mbps", type=float, default=800,
                    help="pace the writer at this many MB/s of saves (0: as fast as it can; see the docstring)")
    ap.add_argument("--ssd-gb", type=float, default=2.0)
    ap.add_argument("--dir", default="/var/tmp", help="file system for the SSD tier's file")
    ap.add_argument("--summary", type=Path, help="write the figures as JSON (python -m bench)")
    args = ap.parse_args()
    tmp = Path(temp_dir_removed_at_exit("pf-bench-spill-"))
    ssd_dir = Path(temp_dir_removed_at_exit("pf-bench-spill-", dir=args.dir))
    extra = ["--log-level", "warning"]
    if args.ssd_gb > 0:
        extra += ["--ssd-cache-path", str(ssd_dir / "cache"), "--ssd-cache-capacity", f"{int(args.ssd_gb * 1024)}mb"]
    node = Node(tmp, f"{args.pool_mb}mb", extra=extra)
    node.start(timeout=120)
    try:
        c = PegaClient(node.addr, timeout=30)
        c.register({NS: PAGE})
        hot = [os.urandom(16) for _ in range(BLOCKS)]
        r = c.reserve(NS, hot)
        # The bytes do not matter here: Query answers from the index.
        c.commit(r.reservation_id)
        idle = query_latencies(c, hot, min(5.0, args.seconds / 2))
        before = scrape(node.http_port)
        w = subprocess.Popen([sys.executable, "-c", WRITER, node.addr, str(args.seconds + 2),
                              str(args.save_mbps * 1e6 / PAGE)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        time.sleep(1.0)  # the writer's start-up (imports, Register) is not load yet
        cpu0 = {n: cpu_seconds(p) for n, p in (("node", node.proc.pid), ("writer", w.pid), ("bench", os.getpid()))}
        t0 = time.monotonic()
        loaded = query_latencies(c, hot, args.seconds)
        window = time.monotonic() - t0
        cpu = {n: (cpu_seconds(p) - cpu0[n]) / window for n, p in (("node", node.proc.pid), ("writer", w.pid),
                                                                  ("bench", os.getpid()))}
        after = scrape(node.http_port)
        out, _ = w.communicate(timeout=120)
        c.close()
    finally:
        node.stop()
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def server_p99(method: str) -> float:
        """p99 of the node's own handler time for ``method`` over the local socket in the
        window, as the upper bound of its histogram bucket (µs)."""
        pre = "pegaflow_node_rpc_duration_seconds_bucket|le="
        buckets = sorted((float(k.split("le=")[1].split("|")[0]), delta(k)) for k in after
                         if k.startswith(pre) and f"method={method}" in k and "status=OK" in k
                         and "transport=local" in k)
        total = buckets[-1][1] if buckets else 0
        for le, n in buckets:
            if n >= 0.99 * total:
                return le * 1e6
        return float("nan")

    res = {
        "idle_query_p50_us": float(np.percentile(idle, 50)) * 1e6,
        "idle_query_p99_us": float(np.percentile(idle, 99)) * 1e6,
        "loaded_query_p50_us": float(np.percentile(loaded, 50)) * 1e6,
        "loaded_query_p99_us": float(np.percentile(loaded, 99)) * 1e6,
        "queries_loaded": len(loaded),
        "saved_blocks": int(out.strip() or 0),
        "ssd_written_mb_per_s": delta("pegaflow_node_ssd_write_bytes_total") / window / 1e6,
        "l1_evicted_blocks_per_s": delta("pegaflow_node_evictions_total|tier=l1") / window,
        "loaded_node_query_p99_us": server_p99("Query"),
        "cpu_cores": cpu,
        "loaded_node_reserve_p99_us": server_p99("Reserve"),
    }
    print(f"# Query p99 on a node that spills to SSD and evicts at full rate ({os.cpu_count()} cores)")
    print(f"idle node: Query p50 / p99 {res['idle_query_p50_us']:.0f} / {res['idle_query_p99_us']:.0f} µs")
    print(f"under load: Query p50 / p99 {res['loaded_query_p50_us']:.0f} / {res['loaded_query_p99_us']:.0f} µs "
          f"({res['queries_loaded']} queries in {window:.1f} s); load: {res['saved_blocks']} blocks saved, "
          f"SSD writes {res['ssd_written_mb_per_s']:.0f} MB/s, L1 evictions {res['l1_evicted_blocks_per_s']:.0f} "
          "blocks/s")
    print("CPU cores used in the window: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    print(f"inside the node under load (histogram bucket bounds): Query p99 <= {res['loaded_node_query_p99_us']:.0f} µs, "
          f"Reserve p99 <= {res['loaded_node_reserve_p99_us']:.0f} µs")
    if args.summary:
        args.summary.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
