"""Namespace quotas: one namespace scans, another keeps its working set (a real node and replay).

    python bench/quota.py [--pool-blocks 256] [--steps 160] [--scan-per-step 8] [--summary F]

Two namespaces share one L1 pool of ``--pool-blocks`` pages of 16 KiB. ``hot`` has a
working set of ``--hot-share`` of the pool (documents of 8 blocks, each request one whole
document, chosen at random); ``scan`` writes ``--scan-per-step`` requests of 8 new blocks
(never reused) for every ``hot`` request: a scan at full rate, 8x the hot traffic. The
same request sequence (seeded) runs three ways:

- **alone**: only the hot requests, on a pool of the same size;
- **shared**: both namespaces, no quota (the problem: the scan flushes the working set);
- **quota**: both, with ``--namespace-quota hot=<--quota>``, a guarantee that covers the
  working set.

Each way runs on a real ``pegaflow-node`` started with the flag, over the real client API
(``PegaClient``: Query with a lease, the hit pages' first bytes checked, Release; Reserve,
the missing pages written into the mapped pool, Commit), and through ``pegaflow replay``'s
model (the same trace as a query-trace file, read by ``read_trace`` and replayed with the
same ``Scenario.quotas``). The figure is hot's prefix hit rate in blocks; the goal is
``|alone - quota| <= 1 pp`` for each. This measures hit rates, not time: a busy machine
changes nothing but how long it takes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pegaflow.client import PegaClient  # noqa: E402
from pegaflow.config.capacity import Capacity  # noqa: E402
from pegaflow.core.trace import encode_query, read_trace  # noqa: E402
from pegaflow.policy.quota import parse_quota  # noqa: E402
from pegaflow.replay.files import iter_lines  # noqa: E402
from pegaflow.replay.model import Scenario  # noqa: E402
from pegaflow.replay.run import replay  # noqa: E402
from tests.harness.dirs import temp_dir_removed_at_exit  # noqa: E402
from tests.harness.node import Node  # noqa: E402

PAGE = 16 << 10  # small pages: a pool of a few hundred blocks is a few MiB
CHAIN = 8  # blocks per request (a document's prefix chain)
HOT, SCAN = "hot", "scan"
Request = tuple[str, list[bytes]]


def workload(pool_blocks: int, hot_share: float, steps: int, scan_per_step: int, seed: int = 7) -> list[Request]:
    """Per step one hot request (a random document of the working set), then
    ``scan_per_step`` scan requests of new blocks. Deterministic for a seed."""
    rng = random.Random(seed)
    docs = [[rng.randbytes(16) for _ in range(CHAIN)] for _ in range(max(1, int(pool_blocks * hot_share) // CHAIN))]
    out: list[Request] = []
    for _ in range(steps):
        out.append((HOT, docs[rng.randrange(len(docs))]))
        out += [(SCAN, [rng.randbytes(16) for _ in range(CHAIN)]) for _ in range(scan_per_step)]
    return out


def on_node(reqs: list[Request], pool_blocks: int, quota: list[str], tmp: Path) -> dict[str, list[int]]:
    """[block accesses, prefix hit blocks] per namespace on a real node."""
    extra = ["--log-level", "warning"]
    for q in quota:
        extra += ["--namespace-quota", q]
    node = Node(tmp, f"{pool_blocks * PAGE // 1024}kb", extra=extra).start(timeout=120)
    counts = {HOT: [0, 0], SCAN: [0, 0]}
    try:
        with PegaClient(node.addr, timeout=30) as c:
            c.register({HOT: PAGE, SCAN: PAGE})
            for ns, hashes in reqs:
                q = c.query([ns], hashes)
                hit = q.hit_blocks
                if hit:
                    pool = q.pool
                    assert pool is not None
                    for h, off in zip(hashes, q.offsets[ns][:hit], strict=True):  # the pages are the ones saved
                        if bytes(pool[off : off + 16].numpy()) != h:
                            raise AssertionError(f"page at {off} does not hold block {h.hex()}")
                    c.release(q.lease_id)
                counts[ns][0] += len(hashes)
                counts[ns][1] += hit
                if hit == len(hashes):
                    continue
                r = c.reserve(ns, hashes[hit:])
                pool = r.pool
                assert pool is not None
                for h, off in zip(hashes[hit:], r.offsets, strict=True):
                    if off >= 0:  # a real page: its first bytes are the block's hash, the rest a pattern
                        pool[off : off + PAGE] = h[0]
                        pool[off : off + 16] = _tensor(h)
                if r.reservation_id:
                    c.commit(r.reservation_id)
    finally:
        node.stop()
    return counts


def _tensor(b: bytes):  # type: ignore[no-untyped-def]
    import torch

    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def in_replay(reqs: list[Request], pool_blocks: int, quota: list[str], tmp: Path) -> dict[str, list[int]]:
    """The same requests as a query-trace file through ``pegaflow replay``'s model."""
    path = tmp / f"quota-{len(reqs)}-{'-'.join(quota) or 'none'}.jsonl"
    with open(path, "w") as f:
        for i, (ns, hashes) in enumerate(reqs):
            f.write(encode_query(float(i), ns, hashes, page_bytes=PAGE) + "\n")
    trace = read_trace(iter_lines(path), "pegaflow")
    sc = Scenario(l1=Capacity(float(pool_blocks * PAGE), "bytes"), page_bytes=PAGE,
                  quotas=tuple(parse_quota(q) for q in quota))
    res = replay(trace, sc)
    return {n: list(v) for n, v in res.namespaces.items()}


def rate(counts: dict[str, list[int]], ns: str = HOT) -> float:
    n, hit = counts.get(ns, (0, 0))
    return hit / n if n else 0.0


def measure(run, reqs: list[Request], pool_blocks: int, quota: str, tmp: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    alone = run([r for r in reqs if r[0] == HOT], pool_blocks, [], tmp)
    shared = run(reqs, pool_blocks, [], tmp)
    quota_run = run(reqs, pool_blocks, [f"{HOT}={quota}"], tmp)
    out = {
        "alone_hit_rate": rate(alone),
        "shared_hit_rate": rate(shared),
        "quota_hit_rate": rate(quota_run),
        "scan_hit_rate_shared": rate(shared, SCAN),
        "scan_hit_rate_quota": rate(quota_run, SCAN),
        "hot_blocks": alone[HOT][0],
    }
    out["quota_gap_pp"] = abs(out["alone_hit_rate"] - out["quota_hit_rate"]) * 100
    out["shared_gap_pp"] = abs(out["alone_hit_rate"] - out["shared_hit_rate"]) * 100
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-blocks", type=int, default=256, help="L1 pool size in 16 KiB pages")
    ap.add_argument("--hot-share", type=float, default=0.25, help="hot's working set, share of the pool")
    ap.add_argument("--quota", default="min:0.3", help="hot's --namespace-quota SPEC (covering its working set)")
    ap.add_argument("--steps", type=int, default=160, help="hot requests")
    ap.add_argument("--scan-per-step", type=int, default=8, help="scan requests per hot request")
    ap.add_argument("--skip-node", action="store_true", help="replay only")
    ap.add_argument("--summary", type=Path, help="write the figures as JSON (python -m bench)")
    a = ap.parse_args()
    parse_quota(f"{HOT}={a.quota}")  # a bad SPEC fails here, in one line
    reqs = workload(a.pool_blocks, a.hot_share, a.steps, a.scan_per_step)
    tmp = Path(temp_dir_removed_at_exit("pf-bench-quota-"))
    t0 = time.monotonic()
    res: dict[str, object] = {
        "pool_blocks": a.pool_blocks, "page_bytes": PAGE, "hot_working_set_blocks": int(a.pool_blocks * a.hot_share),
        "quota": f"{HOT}={a.quota}", "requests": len(reqs), "scan_per_step": a.scan_per_step,
    }
    res["replay"] = measure(in_replay, reqs, a.pool_blocks, a.quota, tmp)
    if not a.skip_node:
        res["node"] = measure(on_node, reqs, a.pool_blocks, a.quota, tmp)
    res["seconds"] = time.monotonic() - t0
    print(f"# namespace quotas: {len(reqs)} requests, hot working set {res['hot_working_set_blocks']} of "
          f"{a.pool_blocks} blocks, scan {a.scan_per_step}x hot's requests of new blocks; quota {res['quota']}")
    print("| where | hot alone | hot shared, no quota | hot shared, quota | gap alone vs quota | scan hit, quota |")
    print("|---|---|---|---|---|---|")
    for where in ("node", "replay"):
        m = res.get(where)
        if isinstance(m, dict):
            print(f"| {where} | {m['alone_hit_rate']:.2%} | {m['shared_hit_rate']:.2%} | {m['quota_hit_rate']:.2%} | "
                  f"{m['quota_gap_pp']:.2f} pp | {m['scan_hit_rate_quota']:.2%} |")
    if isinstance(res.get("node"), dict) and isinstance(res.get("replay"), dict):
        node, rep = res["node"], res["replay"]
        res["node_vs_replay_pp"] = max(abs(node[k] - rep[k]) * 100  # type: ignore[index]
                                       for k in ("alone_hit_rate", "shared_hit_rate", "quota_hit_rate"))
        print(f"node vs replay, worst of the three: {res['node_vs_replay_pp']:.2f} pp")
    print(f"took {res['seconds']:.1f} s")
    if a.summary:
        a.summary.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
