"""Benchmark: ``pegaflow replay`` block accesses per second, against a plain LRU loop.

The replay drives the node's own ``BlockIndex`` (and TinyLFU); the peer is the smallest
honest Python LRU with the same prefix semantics (an ``OrderedDict``, one dict operation
per block), measured in the same process, on the same requests, interleaved with ours so
that machine noise hits both alike, with the cyclic GC off for both (as ``replay`` runs).
Each number is the best of ``--repeat`` runs, in wall time and in this process's CPU time
(the steadier one when other jobs share the cores).

    python bench/replay.py [TRACE] [--repeat 5] [--json]

TRACE defaults to traces/mooncake_synthetic_trace.jsonl.gz (Mooncake's public synthetic
trace, shipped in the repository; see traces/README.md). The target is >= 1M block accesses/s in every case.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pegaflow.config.capacity import Capacity  # noqa: E402
from pegaflow.core.trace import Trace, read_trace  # noqa: E402
from pegaflow.replay.command import freeze_heap  # noqa: E402
from pegaflow.replay.files import iter_lines  # noqa: E402
from pegaflow.replay.model import ISOLATED, SHARED, Scenario  # noqa: E402
from pegaflow.replay.run import replay  # noqa: E402

TARGET = 1_000_000  # block accesses per second
DEFAULT_TRACE = ROOT / "traces" / "mooncake_synthetic_trace.jsonl.gz"


def dict_lru(trace: Trace, capacity: int) -> tuple[int, float, float]:
    """The peer: prefix hits of an OrderedDict LRU of ``capacity`` blocks; (hits, wall s, cpu s)."""
    od: OrderedDict[bytes, None] = OrderedDict()
    move = od.move_to_end
    hits = 0
    gc.disable()
    t0 = time.perf_counter()
    c0 = time.process_time()
    for r in trace.requests:
        hs = r.hashes
        n = len(hs)
        i = 0
        while i < n and hs[i] in od:
            move(hs[i])
            i += 1
        hits += i
        for k in hs[i:]:
            if k in od:
                move(k)
                continue
            od[k] = None
            if len(od) > capacity:
                od.popitem(last=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    gc.enable()
    return hits, wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--summary", type=Path, help="write the figures as JSON (python -m bench)")
    args = ap.parse_args()
    path = Path(args.trace) if args.trace else DEFAULT_TRACE
    t0 = time.perf_counter()
    trace = read_trace(iter_lines(path))
    parse_s = time.perf_counter() - t0
    freeze_heap()  # as `pegaflow replay` does after reading its trace
    n = trace.blocks
    cases = [
        ("L1 LRU 12.5% of U", Scenario(Capacity.parse("12.5%")), True),
        ("L1 LRU 50% of U", Scenario(Capacity.parse("50%")), True),
        ("L1 LRU inf", Scenario(Capacity.parse("inf")), True),
        ("L1 LRU 25%, isolated x4", Scenario(Capacity.parse("25%"), instances=4, pools=ISOLATED), False),
        ("L1 TinyLFU 12.5%", Scenario(Capacity.parse("12.5%"), tinylfu=True), False),
        ("L1 12.5% + SSD 50%", Scenario(Capacity.parse("12.5%"), ssd=Capacity.parse("50%")), False),
    ]
    rows = []
    for name, sc, peer in cases:
        best = best_cpu = best_peer = best_peer_cpu = float("inf")
        hit = peer_hits = 0
        cap = sc.l1.blocks_or_bytes(trace.unique)[0]
        for _ in range(args.repeat):
            r = replay(trace, sc)
            best = min(best, r.seconds)
            best_cpu = min(best_cpu, r.cpu_seconds)
            hit = r.hit_blocks
            if peer:
                peer_hits, s, c = dict_lru(trace, cap)
                best_peer = min(best_peer, s)
                best_peer_cpu = min(best_peer_cpu, c)
        row = {
            "case": name,
            "pools": sc.pools if sc.instances > 1 else SHARED,
            "accesses": n,
            "hit_rate": hit / n,
            "seconds": best,
            "cpu_seconds": best_cpu,
            "accesses_per_s": n / best,
            "accesses_per_cpu_s": n / best_cpu,
            "meets_target": n / best >= TARGET,
        }
        if peer:
            row.update(
                peer_hit_rate=peer_hits / n,
                peer_seconds=best_peer,
                peer_accesses_per_s=n / best_peer,
                peer_accesses_per_cpu_s=n / best_peer_cpu,
                ratio_vs_peer=best_peer / best,
                cpu_ratio_vs_peer=best_peer_cpu / best_cpu,
            )
        rows.append(row)
    out = {
        "trace": str(path),
        "requests": len(trace.requests),
        "accesses": n,
        "unique": trace.unique,
        "parse_seconds": parse_s,
        "parse_accesses_per_s": n / parse_s,
        "repeat": args.repeat,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
        "rows": rows,
    }
    if args.summary:
        slowest = min(rows, key=lambda r: r["accesses_per_s"])
        peers = [r for r in rows if "ratio_vs_peer" in r]
        args.summary.write_text(json.dumps({
            "slowest_case": slowest["case"], "slowest_accesses_per_s": slowest["accesses_per_s"],
            "target_accesses_per_s": TARGET,
            "hit_rates": {r["case"]: r["hit_rate"] for r in rows},
            "ratio_vs_dict_lru_min": min(r["ratio_vs_peer"] for r in peers) if peers else None}))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"trace {path.name}: {len(trace.requests):,} requests, {n:,} block accesses, U {trace.unique:,}; "
        f"parsed in {parse_s:.2f}s ({n / parse_s / 1e6:.2f}M/s); best of {args.repeat}; "
        f"load avg {out['loadavg_1m']:.1f} on {out['cpus']} cpus"
    )
    print("M/s = million block accesses per second: wall (cpu); ratio = replay / dict LRU peer")
    print(f"{'case':26} {'hit rate':>8} {'replay M/s':>14} {'dict LRU M/s':>14} {'ratio':>11}  >=1M/s")
    for r in rows:
        ours = f"{r['accesses_per_s'] / 1e6:5.2f} ({r['accesses_per_cpu_s'] / 1e6:5.2f})"
        if "peer_seconds" in r:
            peer = f"{r['peer_accesses_per_s'] / 1e6:5.2f} ({r['peer_accesses_per_cpu_s'] / 1e6:5.2f})"
            ratio = f"{r['ratio_vs_peer']:.2f} ({r['cpu_ratio_vs_peer']:.2f})"
        else:
            peer = ratio = ""
        ok = "yes" if r["meets_target"] else "no"
        print(f"{r['case']:26} {100 * r['hit_rate']:7.2f}% {ours:>14} {peer:>14} {ratio:>11}  {ok}")


if __name__ == "__main__":
    main()
