"""The decode backup, measured (docs/architecture.md, "Decode backup"; issue #56).

    python bench/backup.py [--pages 256] [--page-kib 512] [--reclaimable-percent 25]
                           [--bandwidth-mb 10] [--accesses 2048] [--rate 40] [--seed 1] [--summary OUT]

Three real nodes in network namespaces (tests/harness/p2p.py: redis-server and pegaflow-meta
on the hub), each with a pool of ``--pages`` pages. node-0 and node-1 are busy (an engine
session is registered on each), node-2 is idle (none). Each busy node has its own working
set of twice its pool. The same run is made twice at once, each on a fresh cluster: backup
off (pegaflow-meta without --enable-decode-backup) and on (with it, --backup-target-delay-secs
1). Both warm up, then measure from the same moment, their requests interleaved (the on run's
half a request later): this host's latency tail moved more between minutes than between the
modes, so run one after the other the p99 ratio said more about the minute than the backup.

1. **Warm-up**: each busy node stores its whole working set, in batches, oldest first. With
   the backup on, once a node's pool is full each batch waits (bounded) until the node has
   that many reclaimable (backed-up) pages to evict, so what the pool evicts is on node-2
   first; meanwhile node-2's ``pegaflow_node_backup_pulled_bytes_total`` is sampled every
   ``SAMPLE_S``: the backup's bandwidth is the bytes it pulled between the end of its first
   plan (the token bucket's burst) and the end of its last, over that time.
2. **Measure** (once both runs are warm): ``--accesses`` single-block requests, uniformly at random over each busy
   node's working set (the same seeded sequence in both runs), alternating nodes, paced at
   ``--rate`` per second: Query until READY (LOADING while a block is pulled back from
   node-2), count the hit, release, store a miss as an engine would. Every Query call's
   latency is kept (the busy nodes' Query p99).

The prediction: replay's cluster model (``pegaflow.replay.cluster``, docs/replay.md) runs the
same warm-up and accesses on three modelled nodes of ``--pages`` blocks (node-2 idle, the
backup on and off, pegaflow-meta's default owner threshold): its hit rate with the backup on
is what the measured one is held to (``hit_rate_error_pp``). The model has no clock: the
bench paces it as the live run (:func:`replay_prediction`). Beside it, the share the idle pool
can hold: node-2's pool holds copies of the busy nodes' overflow (the working-set pages beyond
their pools); the busy nodes keep up to ``--reclaimable-percent`` of their pools as backed-up
pages, which node-2 holds too, so what node-2 adds is the busy nodes' working-set pages that
only node-2 holds: counted from the three pools (``CacheInspect``, which touches nothing) every
``KEPT_S`` of the measure, the mean (both runs read their pools alike). Of the accesses that
missed with the backup off, that share of the overflow should hit:
``on >= off + off misses x pages only node-2 holds / overflow pages`` (``predicted_gain_pp``).
Node-2's pool less the busy nodes' reclaimable pages (their metrics) is printed beside it as a
cross-check.
Root for namespaces.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NS = "backup-bench|p{}k"
BATCH = 16  # blocks per warm-up save
SAMPLE_S = 0.1  # how often the target's pulled bytes are read during the warm-up
# Seconds of --backup-max-bandwidth per plan (--backup-pull-max-bytes): the planner queues two
# a pass (MAX_QUEUED), twice what the bandwidth lets go; a bigger plan waits longer for its bytes.
PLAN_S = 1.0
KEPT_S = 0.5  # how often the busy nodes' reclaimable pages are read during the measure
WAIT_S = 60.0  # bound on every wait for the backup (role, reclaimable pages)
GO_S = 0.2  # both measures start this long after both runs are warm
BUSY = (0, 1)
IDLE = 2


def block(node: int, i: int) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(f"n{node}:{i}".encode())


def accesses(n: int, working_set: int, seed: int) -> list[tuple[int, int]]:
    """(busy node, block) per request: alternating nodes, uniform over each working set."""
    rng = random.Random(seed)
    return [(BUSY[i % len(BUSY)], rng.randrange(working_set)) for i in range(n)]


def metric_sum(text: str, name: str, labels: str = "") -> float:
    pat = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} ([0-9.e+-]+)$"
    return sum(float(v) for v in re.findall(pat, text, re.M))


def bandwidth(samples: list[tuple[float, float]]) -> tuple[float, int]:
    """(bytes/s between the first and the last change of a pulled-bytes counter, changes
    seen). The first change is the end of the first plan, which the bucket's burst let go at
    once: only what came after it is paced. 0.0 with fewer than three changes."""
    changes = [(t, b) for (t, b), (_, prev) in zip(samples[1:], samples, strict=False) if b != prev]
    if len(changes) < 3:
        return 0.0, len(changes)
    (t1, b1), (tn, bn) = changes[0], changes[-1]
    return (bn - b1) / (tn - t1), len(changes)


def together(barrier: Path, mode: str, timeout: float) -> float:
    """This run is warm: say so in ``barrier`` and wait (bounded) for the go, the moment
    (``time.monotonic``, one clock for every namespace) both runs' measures start from."""
    from tests.harness import wait_until

    (barrier / f"warm-{mode}").touch()
    go = barrier / "go"
    return float(wait_until(lambda: go.exists() and go.read_text() or None, timeout, "the go of both runs' measures"))


def _drive(cfg: dict[str, Any]) -> None:
    """In host 0's namespace: warm-up and measure (the module docstring); one JSON line."""
    import urllib.request

    import grpc
    import numpy as np

    from pegaflow._proto import node_pb2, node_pb2_grpc
    from pegaflow.client import PegaClient
    from tests.harness import wait_until

    page, pages, ws, on = cfg["page"], cfg["pages"], 2 * cfg["pages"], cfg["on"]
    ns = NS.format(page >> 10)

    def metrics(k: int) -> str:
        return str(urllib.request.urlopen(f"http://{cfg['https'][k]}/metrics", timeout=5).read().decode())

    def reclaimable_pages(k: int) -> float:
        return metric_sum(metrics(k), "pegaflow_node_resident_bytes_by_class", 'class="reclaimable"') / page

    stubs = {k: node_pb2_grpc.PegaNodeStub(grpc.insecure_channel(cfg["addrs"][k])) for k in (*BUSY, IDLE)}
    working = {k: [block(k, i) for i in range(ws)] for k in BUSY}

    def resident(k: int, of: int) -> np.ndarray:
        """Which of busy node ``of``'s working-set pages node ``k`` holds in its pool now
        (``CacheInspect``: reads the index, touches nothing)."""
        r = stubs[k].CacheInspect(node_pb2.CacheInspectRequest(namespace=ns, hashes=working[of]), timeout=5)
        return np.array(r.dram if r.namespace_known else [False] * ws, dtype=bool)

    def holding() -> list[list[int]]:
        """Per busy node: its working-set pages it holds, and those only node-2 holds."""
        rows = []
        for k in BUSY:
            own = resident(k, k)
            rows.append([int(own.sum()), int((resident(IDLE, k) & ~own).sum())])
        return rows

    clients = {k: PegaClient(cfg["addrs"][k], timeout=30) for k in BUSY}
    for c in clients.values():
        c.register({ns: page})
    if on:
        wait_until(lambda: metric_sum(metrics(IDLE), "pegaflow_node_backup_target") == 1, WAIT_S,
                   "node-2 to become a backup target")

    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(SAMPLE_S):
            samples.append((time.monotonic(), metric_sum(metrics(IDLE), "pegaflow_node_backup_pulled_bytes_total")))

    sampler = threading.Thread(target=sample, name="pulled-bytes-sampler", daemon=True)
    sampler.start()
    t0 = time.monotonic()
    for start in range(0, ws, BATCH):
        for k in BUSY:
            if on and start >= pages:  # the pool is full: evict only what node-2 holds
                wait_until(lambda k=k: reclaimable_pages(k) >= BATCH, WAIT_S,
                           f"node-{k} to hold {BATCH} backed-up pages", every=0.05)
            hs = [block(k, i) for i in range(start, min(start + BATCH, ws))]
            r = clients[k].reserve(ns, hs)
            if r.reservation_id:
                clients[k].commit(r.reservation_id)
    warm_s = time.monotonic() - t0
    stop.set()
    sampler.join(10)
    rate, plans = bandwidth(samples)

    start_t = together(Path(cfg["barrier"]), "on" if on else "off", WAIT_S * 10) + cfg["offset"]
    before = {k: metrics(k) for k in (*BUSY, IDLE)}
    kept = [[reclaimable_pages(k) for k in BUSY]]  # every KEPT_S of the measure, its start and end
    held = [holding()]  # alike
    done = threading.Event()

    def sample_kept() -> None:
        while not done.wait(KEPT_S):
            kept.append([reclaimable_pages(k) for k in BUSY])
            held.append(holding())

    kept_sampler = threading.Thread(target=sample_kept, name="reclaimable-sampler", daemon=True)
    kept_sampler.start()
    lat: list[float] = []
    hits = remote = 0
    for i, (k, b) in enumerate(accesses(cfg["accesses"], ws, cfg["seed"])):
        pause = start_t + i / cfg["rate"] - time.monotonic()  # pacing, not waiting for a condition
        if pause > 0:
            time.sleep(pause)
        c, h = clients[k], [block(k, b)]
        loading = False

        def ready(c=c, h=h, i=i):  # noqa: ANN001, ANN202
            nonlocal loading
            t = time.perf_counter()
            q = c.query([ns], h, req_id=f"r{i}")
            lat.append(time.perf_counter() - t)
            loading |= q.status != "READY"
            return q if q.status == "READY" else None

        q = wait_until(ready, 30, f"access {i} READY", every=0.005)
        hits += q.hit_blocks
        remote += q.hit_blocks if loading else 0
        if q.lease_id:
            c.release(q.lease_id)
        if not q.hit_blocks:
            r = c.reserve(ns, h)
            if r.reservation_id:
                c.commit(r.reservation_id)
    measure_s = time.monotonic() - start_t
    done.set()
    kept_sampler.join(10)
    after = {k: metrics(k) for k in (*BUSY, IDLE)}
    kept.append([reclaimable_pages(k) for k in BUSY])
    held.append(holding())

    def delta(k: int, name: str, labels: str = "") -> float:
        return metric_sum(after[k], name, labels) - metric_sum(before[k], name, labels)

    us = np.array(lat) * 1e6
    print(json.dumps({
        "hits": hits, "remote_hits": remote, "accesses": cfg["accesses"], "measure_s": measure_s, "warm_s": warm_s,
        "measure_start": start_t,
        "query_calls": len(lat), "query_p50_us": float(np.percentile(us, 50)),
        "query_p99_us": float(np.percentile(us, 99)), "query_us": [round(float(x), 1) for x in us],
        "bandwidth_bytes_per_s": rate, "plans_seen": plans,
        "warm_pulled_bytes": samples[-1][1] if samples else 0.0,
        "measure_pulled_bytes": delta(IDLE, "pegaflow_node_backup_pulled_bytes_total"),
        "reclaimable_pages": kept[-1],
        "reclaimable_pages_mean": [float(np.mean([row[j] for row in kept])) for j in range(len(BUSY))],
        "reclaimable_samples": len(kept),
        # Means over the same samples, per busy node: its working-set pages in its own pool, and
        # those in node-2's pool only (what the idle pool adds).
        "own_pages_mean": [float(np.mean([row[j][0] for row in held])) for j in range(len(BUSY))],
        "idle_only_pages_mean": [float(np.mean([row[j][1] for row in held])) for j in range(len(BUSY))],
        "idle_resident_pages": sum(metric_sum(after[IDLE], "pegaflow_node_resident_bytes_by_class", f'class="{c}"')
                                   for c in ("retained", "reclaimable")) / page,
        "demoted_backup": sum(metric_sum(after[k], "pegaflow_node_class_demotions_total", 'reason="backup_hint"')
                              for k in BUSY),
        "missing": metric_sum(after[IDLE], "pegaflow_node_backup_missing_blocks_total"),
        # Busy nodes' retained evictions during the measure: blocks lost from the cluster (no copy).
        "evicted_retained": sum(delta(k, "pegaflow_node_evicted_blocks_by_class_total", 'class="retained"')
                                for k in BUSY),
    }), flush=True)


def replay_prediction(a: argparse.Namespace, on: bool) -> dict[str, Any]:
    """The same warm-up and accesses on replay's cluster model (the module docstring), paced as
    the live backup: a step per ``BACKUP_TICK_S`` of requests, copying the bandwidth's pages
    per tick, demoted on the source after the mean of the stages between an offer and its
    notice (the planner's pass; the plan's wait for its bytes, one plan of the bandwidth's
    bucket, as the target takes a plan when its last one is pulled; the planner's settle; the
    notice's poll); the warm-up's waits for ``BATCH`` backed-up pages are backup steps until
    there are."""
    from pegaflow.meta.backup import PASS_S, SETTLE_S
    from pegaflow.node.backup import BACKUP_TICK_S
    from pegaflow.node.classes import NOTICE_POLL_S
    from pegaflow.replay.cluster import BackupSettings, NodeCluster

    ns, ws = NS.format(a.page_kib), 2 * a.pages
    lag = (PASS_S + PLAN_S + SETTLE_S + NOTICE_POLL_S) / 2
    pace = BackupSettings(percent=a.reclaimable_percent, every=max(1, round(a.rate * BACKUP_TICK_S)),
                          step_blocks=max(1, int(a.bandwidth_mb * BACKUP_TICK_S * 1024 // a.page_kib)),
                          delay=round(lag / BACKUP_TICK_S))
    c = NodeCluster(3, (a.pages, True), (0, True), {ns: 1}, idle=1, backup=pace if on else None)
    l1 = [c.pools[k].l1 for k in range(3)]
    for start in range(0, ws, BATCH):
        for k in BUSY:
            if on and start >= a.pages:
                for _ in range(ws):  # bounded: a step copies at least one block while any is retained
                    if l1[k].index.reclaimable_bytes >= BATCH:
                        break
                    c.backup_step()
            c.serve(k, ns, [], saved=[block(k, i) for i in range(start, min(start + BATCH, ws))])
    hits = remote = 0
    for k, b in accesses(a.accesses, ws, a.seed):
        own_l1, own_ssd, peer_l1, peer_ssd = c.serve(k, ns, [block(k, b)])
        hits += own_l1 + own_ssd + peer_l1 + peer_ssd
        remote += peer_l1 + peer_ssd
    return {"hits": hits, "remote_hits": remote, "hit_rate": hits / a.accesses,
            "backed_up": c.backup.copied if c.backup else 0,
            "reclaimable_pages": [l1[k].index.reclaimable_bytes for k in BUSY]}


@dataclass
class Run:
    """One run (backup off or on): its cluster and its driver, in host 0's namespace."""

    on: bool
    cluster: Any  # tests.harness.p2p.P2PCluster
    tmp: Path
    proc: subprocess.Popen | None = None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.cluster.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def start_run(a: argparse.Namespace, on: bool, barrier: Path) -> Run:
    """A fresh 3-node cluster, backup on or off, and its driver started (warm-up, then the
    measure once both runs are warm: :func:`together`)."""
    from tests.harness.p2p import HTTP_PORT, P2PCluster

    page = a.page_kib << 10
    tmp = Path(tempfile.mkdtemp(prefix="pegaflow-bench-backup-"))
    node_args = ("--log-level", "warning", "--pool-size", str(a.pages * page),
                 "--backup-reclaimable-percent", str(a.reclaimable_percent),
                 "--backup-pull-max-bytes", str(int(PLAN_S * a.bandwidth_mb) << 20),
                 "--backup-max-bandwidth", str(a.bandwidth_mb << 20))
    meta = ("--enable-decode-backup", "--backup-target-delay-secs", "1") if on else ()
    try:
        cluster = P2PCluster(tmp, 3, node_args=node_args, meta_args=meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    run = Run(on, cluster, tmp)
    if cluster.fallback_reason:
        print(f"network namespaces unavailable ({cluster.fallback_reason}): loopback addresses instead")
    cfg = {"addrs": [n.addr for n in cluster.nodes], "https": [f"{n.host.ip}:{HTTP_PORT}" for n in cluster.nodes],
           "page": page, "pages": a.pages, "on": on, "accesses": a.accesses, "rate": a.rate, "seed": a.seed,
           "barrier": str(barrier), "offset": 0.5 / a.rate if on else 0.0}
    try:
        out, err = (open(tmp / f"driver.{x}", "w") for x in ("out", "err"))
        with out, err:
            run.proc = subprocess.Popen(cluster.nodes[0].host.argv(
                [sys.executable, str(Path(__file__).resolve()), "_drive", json.dumps(cfg)]), stdout=out, stderr=err)
    except BaseException:
        run.close()
        raise
    return run


def run_both(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Backup off and on, each on a fresh cluster, at once: both warm up, then measure from
    the same moment, their requests interleaved (the on run's half a request later), so the
    busy nodes' Query latencies of both come from the same moments of this host."""
    from tests.harness import wait_until

    barrier = Path(tempfile.mkdtemp(prefix="pegaflow-bench-backup-go-"))
    runs: list[Run] = []
    try:
        for on in (False, True):
            runs.append(start_run(a, on, barrier))

        def warm() -> bool:
            for r in runs:
                assert r.proc is not None
                if r.proc.poll() is not None:
                    raise SystemExit(driver_failed(r))
            return all((barrier / f"warm-{m}").exists() for m in ("off", "on"))

        wait_until(warm, WAIT_S * 10, "both runs' warm-ups", every=0.05)
        go = barrier / "go.tmp"
        go.write_text(repr(time.monotonic() + GO_S))
        go.rename(barrier / "go")
        results = []
        for r in runs:
            assert r.proc is not None
            r.proc.wait(timeout=900)
            if r.proc.returncode != 0:
                raise SystemExit(driver_failed(r))
            got: dict[str, Any] = json.loads((r.tmp / "driver.out").read_text().strip().splitlines()[-1])
            got["hit_rate"] = got["hits"] / got["accesses"]
            results.append(got)
        return results[0], results[1]
    finally:
        for r in runs:
            r.close()
        shutil.rmtree(barrier, ignore_errors=True)


def driver_failed(r: Run) -> str:
    out, err = ((r.tmp / f"driver.{x}").read_text(errors="replace") for x in ("out", "err"))
    return f"driver failed (backup {'on' if r.on else 'off'}): {out[-2000:]}\n{err[-3000:]}"


def summarize(a: argparse.Namespace, off: dict[str, Any], on: dict[str, Any],
              model: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures and their ratios, every one from this run's measurements and ``model``
    (:func:`replay_prediction`'s runs, "off" and "on")."""
    from bench.common import p99_ratio_interval

    overflow = 2 * (2 * a.pages - a.pages)  # the busy nodes' working-set pages beyond their pools
    # Distinct pages node-2 adds: the busy nodes' working-set pages only node-2 holds, read from
    # the three pools (CacheInspect) every KEPT_S of the measure with the backup on, the mean.
    useful = sum(on["idle_only_pages_mean"])
    share = useful / overflow
    share_on = off["hit_rate"] + (1 - off["hit_rate"]) * share  # the share's bound
    # A cross-check from the metrics alone: node-2's pool less the busy nodes' reclaimable
    # (backed-up) pages, which node-2 holds too.
    estimate = max(0.0, min(a.pages - sum(on["reclaimable_pages_mean"]), overflow))
    predicted_on = model["on"]["hit_rate"]  # replay's
    ws_pages = 2 * 2 * a.pages  # both busy nodes' working sets
    limit = a.bandwidth_mb << 20
    rate = on["bandwidth_bytes_per_s"]
    return {
        "hit_rate_off": off["hit_rate"], "hit_rate_on": on["hit_rate"],
        "gain_pp": (on["hit_rate"] - off["hit_rate"]) * 100,
        "idle_share_of_overflow": share, "idle_useful_pages": useful, "predicted_gain_pp": (share_on - off["hit_rate"]) * 100,
        "gain_over_predicted": (on["hit_rate"] - off["hit_rate"]) / (share_on - off["hit_rate"])
        if share_on > off["hit_rate"] else None,
        "idle_useful_pages_from_metrics": estimate,
        # What uniform accesses would hit from what the pools held (own pool; own or node-2 only).
        "held_hit_rate_off": sum(off["own_pages_mean"]) / ws_pages,
        "held_hit_rate_on": (sum(on["own_pages_mean"]) + useful) / ws_pages,
        "predicted_hit_rate_on": predicted_on, "prediction": "replay (pegaflow.replay.cluster, the same accesses)",
        "replay_hit_rate_off": model["off"]["hit_rate"], "replay_hit_rate_on": predicted_on,
        "replay_remote_hits_on": model["on"]["remote_hits"], "replay_backed_up": model["on"]["backed_up"],
        "hit_rate_error_pp": abs(on["hit_rate"] - predicted_on) * 100,
        "hit_rate_off_error_pp": abs(off["hit_rate"] - model["off"]["hit_rate"]) * 100,
        "bandwidth_mb_per_s": rate / 2**20, "bandwidth_limit_mb_per_s": limit / 2**20,
        "bandwidth_ratio": rate / limit, "bandwidth_error_pct": abs(rate / limit - 1) * 100,
        "query_p99_us_on": on["query_p99_us"], "query_p99_us_off": off["query_p99_us"],
        "query_p99_on_over_off": on["query_p99_us"] / off["query_p99_us"],
        "query_p99_on_over_off_90pct": p99_ratio_interval(on["query_us"], off["query_us"]),
        "off": {k: v for k, v in off.items() if k != "query_us"}, "on": {k: v for k, v in on.items() if k != "query_us"},
        "config": {"pages": a.pages, "page_kib": a.page_kib, "reclaimable_percent": a.reclaimable_percent,
                   "bandwidth_mb": a.bandwidth_mb, "accesses": a.accesses, "rate": a.rate, "seed": a.seed},
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_drive":
        _drive(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=256, help="each node's pool, in pages")
    p.add_argument("--page-kib", type=int, default=512)
    p.add_argument("--reclaimable-percent", type=int, default=25, help="the nodes' --backup-reclaimable-percent")
    p.add_argument("--bandwidth-mb", type=int, default=10, help="the nodes' --backup-max-bandwidth, MiB/s")
    p.add_argument("--accesses", type=int, default=2048, help="measured requests per run")
    p.add_argument("--rate", type=float, default=40.0, help="measured requests per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--summary", type=Path, help="write the figures as JSON here")
    a = p.parse_args()
    if a.pages < BATCH or not 0 <= a.reclaimable_percent <= 100 or a.bandwidth_mb < 1 or a.rate <= 0:
        p.error("--pages must be at least 16, --reclaimable-percent in 0..100, --bandwidth-mb and --rate positive")
    off, on = run_both(a)
    s = summarize(a, off, on, {"off": replay_prediction(a, False), "on": replay_prediction(a, True)})
    mb = a.pages * a.page_kib / 1024
    print(f"3 nodes, pools of {a.pages} x {a.page_kib} KiB ({mb:.0f} MiB); busy node-0, node-1 with working sets of "
          f"{2 * a.pages} pages each; idle node-2; {a.accesses} accesses at {a.rate:g}/s")
    print(f"hit rate: backup off {s['hit_rate_off']:.2%}, on {s['hit_rate_on']:.2%} "
          f"({s['gain_pp']:+.2f} pp; {on['remote_hits']} pulled back from node-2); replay predicts off "
          f"{s['replay_hit_rate_off']:.2%}, on {s['predicted_hit_rate_on']:.2%} ({s['replay_remote_hits_on']} pulled "
          f"back; on measured - predicted {(s['hit_rate_on'] - s['predicted_hit_rate_on']) * 100:+.2f} pp); the idle "
          f"pool's share: +{s['predicted_gain_pp']:.2f} pp (node-2 holds {s['idle_share_of_overflow']:.0%} of the "
          "overflow)")
    print(f"backup bandwidth {s['bandwidth_mb_per_s']:.2f} MiB/s against the limit {s['bandwidth_limit_mb_per_s']:.0f}"
          f" ({s['bandwidth_ratio']:.3f}x, over {on['plans_seen']} plans in a {on['warm_s']:.1f} s warm-up)")
    lo, hi = s["query_p99_on_over_off_90pct"]
    print(f"busy nodes' Query p99: on {s['query_p99_us_on']:.0f} µs, off {s['query_p99_us_off']:.0f} µs "
          f"({s['query_p99_on_over_off']:.2f}x; {lo:.2f}x-{hi:.2f}x over resamples of this run's "
          f"{on['query_calls']} and {off['query_calls']} calls)")
    print(f"backup on, at the end: busy nodes' reclaimable pages {on['reclaimable_pages']}, node-2 resident "
          f"{on['idle_resident_pages']:.0f} pages, demoted (backup_hint) {on['demoted_backup']:.0f}, "
          f"missing at pull {on['missing']:.0f}, retained evicted {on['evicted_retained']:.0f}; pulled during the "
          f"measure {on['measure_pulled_bytes'] / 2**20:.1f} MiB")
    print(f"node-2 alone held {s['idle_useful_pages']:.1f} of the busy nodes' pages (the pools read every "
          f"{KEPT_S:g} s; node-2's pool less their reclaimable pages: {s['idle_useful_pages_from_metrics']:.1f}); "
          f"uniform accesses to what the pools held would hit {s['held_hit_rate_off']:.2%} off, "
          f"{s['held_hit_rate_on']:.2%} on")
    if a.summary:
        a.summary.write_text(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
