"""SSD tier throughput against fio on the same filesystem, in the same run.

Drives the real tier in-process (block index, write-behind, promotion, checksums, the
chosen I/O engine) without gRPC: the write phase commits blocks into L1 as fast as the
bounded write queue takes them, the read phase promotes them back from SSD into L1 pages.
Then ``fio --ioengine=io_uring --direct=1`` writes and reads the same number of bytes
with the same I/O size and queue depth in the same directory. CPU seconds per GB are
process CPU time (all threads) for the tier and fio's usr+sys for fio.

    python bench/ssd.py --dir /var/tmp --size 2gb --page 2mb --queue-depth 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from pegaflow.config.commands import node_config
from pegaflow.config.tiers import SsdConfig
from pegaflow.core.block_index import BlockIndex
from pegaflow.core.units import parse_size
from pegaflow.node import metrics as node_metrics
from pegaflow.node.pool import SharedPool
from pegaflow.node.tiers.ssd import SsdTier, open_cache, promote
from pegaflow.node.tiers.ssd.records import record_bytes


def fio(path: str, rw: str, size: int, bs: int, depth: int) -> dict[str, float]:
    out = subprocess.run(
        ["fio", "--name=pf", f"--filename={path}", "--ioengine=io_uring", "--direct=1", f"--rw={rw}",
         f"--bs={bs}", f"--iodepth={depth}", f"--size={size}", "--output-format=json"],
        capture_output=True, text=True, check=True,
    ).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    secs = job["job_runtime"] / 1000
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * secs
    return {"gbps": side["io_bytes"] / secs / 1e9, "cpu_s_per_gb": cpu / (side["io_bytes"] / 1e9)}


async def tier_run(directory: str, size: int, page: int, depth: int, engine: str) -> dict[str, Any]:
    n = size // page
    pool_bytes = min(1 << 30, max(64 * page, 256 << 20))
    config = node_config(ssd_cache_path=[directory], ssd_cache_capacity=n * record_bytes(page) * 2,
                         ssd_queue_depth=depth, ssd_write_queue_size=pool_bytes // 2, ssd_io_engine=engine)
    files = open_cache(SsdConfig.from_node(config))
    assert files is not None
    pool = SharedPool(pool_bytes)
    pool.prefault()  # the bench measures the disk, not first touches
    np.frombuffer(pool.mm, dtype=np.uint8)[:] = np.random.default_rng(1).integers(0, 255, pool.size, dtype=np.uint8)
    index = BlockIndex(pool.size)
    tier = SsdTier(files, index, pool.view, node_metrics.NodeMetrics())
    loop = asyncio.get_running_loop()
    tier.start(loop)
    ns = index.namespace("bench", page)
    rng = np.random.default_rng(2)
    hashes = [rng.bytes(16) for _ in range(n)]
    w = tier.writer
    batch = 16
    # ---- write: commit as fast as the bounded queue accepts ---------------------------
    c0, t0 = time.process_time(), time.perf_counter()
    i = 0
    while i < n:
        if w.queued_bytes + batch * page > w.limit_bytes:
            await asyncio.sleep(0.0005)
            continue
        blocks = [b for b in index.reserve(ns, hashes[i:i + batch]) if b is not None]
        index.commit(blocks)
        i += batch
    while not w.idle():
        await asyncio.sleep(0.0005)
    wt, wc = time.perf_counter() - t0, time.process_time() - c0
    written = node_metrics.value_of(tier.metrics.written)
    assert written == n, f"only {written} of {n} blocks written (skipped writes?)"
    # ---- read: promote everything back (L1 emptied first) -----------------------------
    index.remove(index.resident())
    promote.HOLD_SECONDS = 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    rbatch = max(1, min(64, (pool_bytes // page) // 3))
    pending: list[list[bytes]] = []
    i = 0
    while i < n or pending:
        while i < n and len(pending) < 2:
            part = hashes[i:i + rbatch]
            tier.promote([ns], part, 0)
            pending.append(part)
            i += rbatch
        part = pending[0]
        if all(index.get(ns, h) is not None for h in part) or not any(
                (ns.id, h) in tier.promoter.inflight for h in part):
            pending.pop(0)
            await asyncio.sleep(0)
            index.remove([b for h in part if (b := index.get(ns, h)) is not None and b.pins == 0])
        else:
            await asyncio.sleep(0.001)
    rt, rc = time.perf_counter() - t0, time.process_time() - c0
    promoted = node_metrics.value_of(tier.metrics.promoted)
    fails = node_metrics.value_of(tier.metrics.checksum_failures)
    name = tier.engine.name
    await tier.close()
    pool.close()
    gb = n * page / 1e9
    return {"engine": name, "blocks": n, "write_gbps": gb / wt, "write_cpu_s_per_gb": wc / gb,
            "read_gbps": promoted * page / 1e9 / rt, "read_cpu_s_per_gb": rc / (promoted * page / 1e9),
            "promoted": int(promoted), "checksum_failures": int(fails)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/var/tmp", help="directory on the filesystem to test")
    p.add_argument("--size", default="2gb")
    p.add_argument("--page", default="2mb", help="page (block) size; fio uses the same I/O size")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--engines", default="uring,threads")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--summary", help="write the figures as JSON (python -m bench)")
    a = p.parse_args()
    size, page = parse_size(a.size), parse_size(a.page)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    work = tempfile.mkdtemp(prefix="pegaflow-bench-ssd-", dir=a.dir)
    engines = a.engines.split(",")
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    fios: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {e: [] for e in engines}
    try:
        # Pair every tier run with its own fio runs right before it (fio write then read,
        # tier write then read: each reads data it has just written, as a virtual disk may
        # cache recent writes) so each pair sees the same background load: the disk and
        # the CPUs here are shared and their speed moves from minute to minute. Ratios
        # are per pair, then the median over --repeat.
        for _ in range(a.repeat):
            for eng in engines:
                fpath = os.path.join(work, "fio.dat")
                fw = fio(fpath, "write", size, page, a.queue_depth)
                fr = fio(fpath, "read", size, page, a.queue_depth)
                os.unlink(fpath)
                fios[eng].append((fw, fr))
                d = os.path.join(work, eng)
                os.mkdir(d)
                runs[eng].append(asyncio.run(tier_run(d, size, page, a.queue_depth, eng)))
                shutil.rmtree(d)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    print(f"# python {sys.argv[0]} --dir {a.dir} --size {a.size} --page {a.page} --queue-depth {a.queue_depth} "
          f"--repeat {a.repeat}  (medians of {a.repeat} paired runs)")
    print("| engine | tier write GB/s | fio write GB/s | **write vs fio** | tier read GB/s | fio read GB/s "
          "| **read vs fio** | tier CPU s/GB (w / r) | fio CPU s/GB (w / r) |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary: dict[str, float] = {}
    for eng in engines:
        rs, fs = runs[eng], fios[eng]
        for r in rs:
            assert r["checksum_failures"] == 0 and r["promoted"] == r["blocks"], r
        wr = med(r["write_gbps"] / f[0]["gbps"] for r, f in zip(rs, fs, strict=True))
        rr = med(r["read_gbps"] / f[1]["gbps"] for r, f in zip(rs, fs, strict=True))
        summary.update({f"{eng}_write_gbps": med(r["write_gbps"] for r in rs),
                        f"{eng}_fio_write_gbps": med(f[0]["gbps"] for f in fs), f"{eng}_write_ratio": wr,
                        f"{eng}_read_gbps": med(r["read_gbps"] for r in rs),
                        f"{eng}_fio_read_gbps": med(f[1]["gbps"] for f in fs), f"{eng}_read_ratio": rr})
        print(f"| {rs[0]['engine']} | {med(r['write_gbps'] for r in rs):.2f} | {med(f[0]['gbps'] for f in fs):.2f} "
              f"| **{wr:.2f}** | {med(r['read_gbps'] for r in rs):.2f} | {med(f[1]['gbps'] for f in fs):.2f} "
              f"| **{rr:.2f}** | {med(r['write_cpu_s_per_gb'] for r in rs):.3f} / "
              f"{med(r['read_cpu_s_per_gb'] for r in rs):.3f} | {med(f[0]['cpu_s_per_gb'] for f in fs):.3f} / "
              f"{med(f[1]['cpu_s_per_gb'] for f in fs):.3f} |")

    if a.summary:
        with open(a.summary, "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main()
