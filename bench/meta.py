"""Metaserver benchmark: update apply rate, QueryPrefix latency, Redis bytes per block.

    python bench/meta.py [--blocks 1048576] [--standalone-only | --cluster-only]

Starts its own redis-server / 6-process cluster (infra/redis/) on free ports, then per
backend:

1. baselines measured in the same run: ``redis-benchmark`` pipelined XADD (server
   ceiling), redis-py pipelined XADD and XREADGROUP+XACK of one small entry per message
   (what a one-event-per-block design would get), single GET round-trip latency;
2. node streams holding ``--blocks`` 128-block request prefixes' worth of inserts (8
   nodes, 2 namespaces, some prefixes held by two nodes) plus 10% insert+evict churn,
   written as real events (512 hashes per entry);
3. one consumer replica (``events.consumer.Consumer``) applies them: block updates / s;
4. Redis memory per indexed (block, node) pair (streams deleted first);
5. QueryPrefix of 128-block prefixes: in-process ``Lookup`` (one Redis round trip) and
   through a real ``pegaflow-meta`` gRPC server; p50 / p99; answers checked; the time
   Redis spent per query. Each gRPC
   QueryPrefix is followed by a GetClusterConfig (answered from memory) on the same server:
   its p99 is this host's gRPC floor at that moment (it varied 0.6-4 ms between runs here);
6. the same gRPC queries while that server's consumer applies a second backlog of events
   (the same inserts again plus fresh churn) at full rate, counted while the backlog lasts.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from pegaflow._proto import meta_pb2  # noqa: E402
from pegaflow.cluster import registry  # noqa: E402
from pegaflow.cluster.keys import stream_key  # noqa: E402
from pegaflow.cluster.redis_conn import Client, connect, is_cluster  # noqa: E402
from pegaflow.common.logging import configure_logging  # noqa: E402
from pegaflow.meta.events.codec import FIELD, encode  # noqa: E402
from pegaflow.meta.events.consumer import Consumer  # noqa: E402
from pegaflow.meta.events.schema import Event, Op  # noqa: E402
from pegaflow.meta.events.streams import GROUP  # noqa: E402
from pegaflow.meta.index import Index  # noqa: E402
from pegaflow.meta.lookup import Lookup  # noqa: E402

NODES = 8
PREFIX = 128
NAMESPACES = ["bench-model-a|fp16|bs16|tp1", "bench-model-b|fp16|bs16|tp1"]
ENTRY = 512


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# --- baselines -------------------------------------------------------------------------------


def redis_benchmark_xadd(r: Client) -> float:
    """Server ceiling: redis-benchmark pipelined XADD against the shard owning the stream."""
    port = (
        r.get_node_from_key("bench:{rb}").port
        if is_cluster(r)
        else r.connection_pool.connection_kwargs["port"]
    )
    args = ["redis-benchmark", "-p", str(port), "-n", "200000", "-P", "64", "-q"]
    out = subprocess.run(
        [*args, "XADD", "bench:{rb}", "*", "f", "v"], capture_output=True, text=True, timeout=120
    )
    m = re.findall(r"([\d.]+) requests per second", out.stdout)
    return float(m[-1]) if m else float("nan")


def raw_stream_rates(r: Client, n: int = 100_000) -> tuple[float, float]:
    """redis-py pipelined XADD, then XREADGROUP+XACK, of one 16-byte entry per message."""
    key = "bench:{raw}"
    r.delete(key)
    t0 = time.perf_counter()
    for _ in range(0, n, 1000):
        p = r.pipeline(transaction=False)
        for _j in range(1000):
            p.xadd(key, {"e": b"x" * 16})
        p.execute()
    xadd = n / (time.perf_counter() - t0)
    r.xgroup_create(key, "g", id="0")
    t0 = time.perf_counter()
    got = 0
    while got < n:
        res = r.xreadgroup("g", "c", {key: ">"}, count=1000)
        if not res:
            break
        ids = [i for i, _ in res[0][1]]
        r.xack(key, "g", *ids)
        got += len(ids)
    read = got / (time.perf_counter() - t0)
    r.delete(key)
    return xadd, read


def get_latency(r: Client, n: int = 3000) -> tuple[float, float]:
    r.set("bench:{pf}:k", "v")
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        r.get("bench:{pf}:k")
        lat.append(time.perf_counter() - t0)
    return pct(lat, 0.5), pct(lat, 0.99)


# --- workload ----------------------------------------------------------------------------------


def make_workload(blocks: int, seed: int = 1):
    """Requests of 128 blocks; holdings per node; and the expected prefix per (request, node)."""
    rng = random.Random(seed)
    n_req = blocks // PREFIX
    raw = rng.randbytes(16 * n_req * PREFIX)
    reqs = [
        [raw[(i * PREFIX + j) * 16 : (i * PREFIX + j + 1) * 16] for j in range(PREFIX)] for i in range(n_req)
    ]
    held: dict[tuple[int, int], list[bytes]] = {}  # (node, ns index) -> hashes
    expect: list[dict[int, int]] = []
    for i, req in enumerate(reqs):
        ns = i % len(NAMESPACES)
        owner = i % NODES
        e = {owner: PREFIX}
        held.setdefault((owner, ns), []).extend(req)
        if rng.random() < 0.3:  # a second node holds a shorter prefix
            other = (owner + 1 + rng.randrange(NODES - 1)) % NODES
            k = rng.randint(1, PREFIX - 1)
            held.setdefault((other, ns), []).extend(req[:k])
            e[other] = k
        expect.append(e)
    return reqs, held, expect


def register_nodes(r: Client) -> dict[int, tuple[str, int, int]]:
    nids = {}
    for node in range(NODES):
        name = f"bench-node-{node}"
        nid, epoch = registry.register(r, name, f"10.0.0.{node}:50055", 600_000, switch=True)
        nids[node] = (name, nid, epoch)
        r.xgroup_create(stream_key(name), GROUP, id="0", mkstream=True)
    return nids


def write_streams(r: Client, held: dict[tuple[int, int], list[bytes]], churn: float, seed: int = 2,
                  nids: dict[int, tuple[str, int, int]] | None = None, seqs: dict[int, int] | None = None) -> int:
    """Write the nodes' events (registering them first unless ``nids`` is given; ``seqs``
    carries their sequence numbers from one call to the next); returns the block updates."""
    rng = random.Random(seed)
    nids = nids if nids is not None else register_nodes(r)
    seqs = seqs if seqs is not None else dict.fromkeys(range(NODES), 0)
    updates = 0
    for (node, ns), hashes in held.items():
        name, nid, epoch = nids[node]
        entries = []

        def ev(
            op: Op, chunk: list[bytes], node: int = node, ns: int = ns, name: str = name, nid: int = nid,
            epoch: int = epoch,
        ) -> bytes:
            seqs[node] += 1
            return encode(Event(name, nid, epoch, seqs[node], op, NAMESPACES[ns], b"".join(chunk)))

        for j in range(0, len(hashes), ENTRY):
            entries.append(ev(Op.INSERT, hashes[j : j + ENTRY]))
            updates += len(hashes[j : j + ENTRY])
            if churn and rng.random() < churn:  # a block inserted and evicted again
                tmp = [rng.randbytes(16) for _ in range(ENTRY // 2)]
                entries.append(ev(Op.INSERT, tmp))
                entries.append(ev(Op.EVICT, tmp))
                updates += 2 * len(tmp)
        for j in range(0, len(entries), 64):
            p = r.pipeline(transaction=False)
            for data in entries[j : j + 64]:
                p.xadd(stream_key(name), {FIELD: data})
            p.execute()
    return updates


def backlog(r: Client) -> int:
    """Entries of the node streams not yet delivered to or not yet acknowledged by a consumer."""
    n = 0
    for node in range(NODES):
        for g in r.xinfo_groups(stream_key(f"bench-node-{node}")):
            n += int(g.get("lag") or 0) + int(g.get("pending") or 0)
    return n


def apply_all(r: Client, updates: int) -> tuple[float, float]:
    c = Consumer(r, Index(r), "bench-consumer", lease_ms=600_000)
    t0 = time.perf_counter()
    while c.stats.blocks < updates:
        c.step()
        if c.stats.stale or c.stats.malformed:  # the events are not the registered incarnation's
            raise SystemExit(f"bench: {c.stats.stale} stale and {c.stats.malformed} malformed events")
    dt = time.perf_counter() - t0
    c.release_all()
    return updates / dt, dt


def index_bytes(r: Client, before: int) -> tuple[int, int]:
    for node in range(NODES):
        r.delete(stream_key(f"bench-node-{node}"))
    used = used_memory(r)
    return used - before, used


def used_memory(r: Client) -> int:
    if is_cluster(r):
        return sum(v["used_memory"] for v in r.info("memory", target_nodes=r.PRIMARIES).values())
    return int(r.info("memory")["used_memory"])


def reset_stats(r: Client) -> None:
    if is_cluster(r):
        r.config_resetstat(target_nodes=r.PRIMARIES)
    else:
        r.config_resetstat()


def query_usec_per_call(r: Client, queries: int) -> float:
    """Mean time Redis spent on one query's commands (its HGET batch, or the script where
    the lookup runs it): server side, no network, no client."""
    infos = (
        r.info("commandstats", target_nodes=r.PRIMARIES).values()
        if is_cluster(r)
        else [r.info("commandstats")]
    )
    usec = 0
    for info in infos:
        for cmd in ("cmdstat_hget", "cmdstat_evalsha"):
            st = info.get(cmd)
            if st:
                usec += st["usec"]
    return usec / max(1, queries)


def query_latency(r: Client, reqs, expect, n: int) -> tuple[float, float, int]:
    lk = Lookup(r)
    names = {i: f"bench-node-{i}" for i in range(NODES)}
    rng = random.Random(3)
    lat = []
    checked = 0
    for _ in range(n):
        i = rng.randrange(len(reqs))
        t0 = time.perf_counter()
        res = lk.query_prefix(NAMESPACES[i % len(NAMESPACES)], reqs[i])
        lat.append(time.perf_counter() - t0)
        got = {p.node: p.prefix_len for p in res}
        want = {names[k]: v for k, v in expect[i].items()}
        assert got == want, (got, want)
        checked += 1
    return pct(lat, 0.5), pct(lat, 0.99), checked


def grpc_latency(url: str, cluster: bool, logs: Path, reqs, n: int, load=None) -> dict:
    """QueryPrefix through a real ``pegaflow-meta`` (p50 / p99, µs), each call followed by a
    GetClusterConfig on the same server (an answer from memory: the gRPC round trip this
    host gives at that moment, the floor of a QueryPrefix). With ``load`` (writes a backlog of
    events, returns its block updates): again while that server's consumer applies it at
    full rate, counted only while the backlog lasts; its apply rate is reported too."""
    from tests.harness.meta import MetaServer

    meta = MetaServer(url, logs / "meta.log", cluster=cluster,
                      extra=["--sweep-interval", "0", "--log-level", "warning"]).start()
    out: dict = {}
    try:
        stub = meta.stub
        rng = random.Random(4)

        def one() -> tuple[float, float]:
            i = rng.randrange(len(reqs))
            req = meta_pb2.QueryPrefixRequest(namespace=NAMESPACES[i % len(NAMESPACES)], hashes=reqs[i])
            t0 = time.perf_counter()
            stub.QueryPrefix(req, timeout=5)
            t1 = time.perf_counter()
            stub.GetClusterConfig(meta_pb2.ClusterConfigRequest(), timeout=5)
            return t1 - t0, time.perf_counter() - t1

        for _ in range(200):  # warm-up
            one()
        lat, floor = zip(*(one() for _ in range(n)), strict=True)
        out["grpc_query_p50_us"], out["grpc_query_p99_us"] = pct(lat, 0.5) * 1e6, pct(lat, 0.99) * 1e6
        out["grpc_floor_p50_us"], out["grpc_floor_p99_us"] = pct(floor, 0.5) * 1e6, pct(floor, 0.99) * 1e6
        if load is not None:
            r = connect(url, cluster, socket_timeout=60)
            updates = load()
            t0 = time.perf_counter()
            lat2, floor2 = [], []
            while True:
                for _ in range(50):
                    a, b = one()
                    lat2.append(a)
                    floor2.append(b)
                if backlog(r) == 0:
                    break
            dt = time.perf_counter() - t0
            out["loaded_updates"], out["loaded_apply_blocks_per_s"] = updates, updates / dt
            out["loaded_queries"] = len(lat2)
            out["loaded_grpc_query_p50_us"], out["loaded_grpc_query_p99_us"] = pct(lat2, 0.5) * 1e6, pct(lat2, 0.99) * 1e6
            out["loaded_grpc_floor_p99_us"] = pct(floor2, 0.99) * 1e6
        return out
    finally:
        meta.stop()


def run_backend(cluster: bool, blocks: int, queries: int) -> dict:
    from tests.harness.dirs import temp_dir_removed_at_exit
    from tests.harness.redis import start_cluster, start_server

    tmp = Path(temp_dir_removed_at_exit("pf-bench-meta-"))
    redis = start_cluster(tmp / "redis") if cluster else start_server(tmp / "redis")
    url = redis.url
    try:
        r = connect(url, cluster, socket_timeout=60)
        out: dict = {"backend": "cluster (3 masters + 3 replicas)" if cluster else "standalone"}
        out["redis_benchmark_xadd_per_s"] = redis_benchmark_xadd(r)
        out["raw_xadd_per_s"], out["raw_xreadgroup_ack_per_s"] = raw_stream_rates(r)
        out["get_p50_us"], out["get_p99_us"] = (x * 1e6 for x in get_latency(r))
        reqs, held, expect = make_workload(blocks)
        before = used_memory(r)
        t0 = time.perf_counter()
        nids, seqs = register_nodes(r), dict.fromkeys(range(NODES), 0)
        updates = write_streams(r, held, churn=0.1, nids=nids, seqs=seqs)
        out["publish_blocks_per_s"] = updates / (time.perf_counter() - t0)
        out["updates"] = updates
        out["apply_blocks_per_s"], out["apply_seconds"] = apply_all(r, updates)
        pairs = sum(len(v) for v in held.values())
        distinct = len(reqs) * PREFIX
        idx_bytes, _ = index_bytes(r, before)
        out["indexed_blocks"] = distinct
        out["indexed_pairs"] = pairs
        out["bytes_per_block"] = idx_bytes / distinct
        out["bytes_per_pair"] = idx_bytes / pairs
        reset_stats(r)
        q50, q99, checked = query_latency(r, reqs, expect, queries)
        out["query_server_us"] = query_usec_per_call(r, checked)
        out["query_p50_us"], out["query_p99_us"], out["queries_checked"] = q50 * 1e6, q99 * 1e6, checked
        # The same events again (inserts of blocks already held: the index does not change,
        # so the answers stay what they were) plus fresh churn, applied while queried.
        out.update(grpc_latency(url, cluster, tmp, reqs, queries,
                                load=lambda: write_streams(r, held, churn=0.1, seed=5, nids=nids, seqs=seqs)))
        return out
    finally:
        redis.stop()


def report(res: dict) -> str:
    return "\n".join(
        [
            f"### {res['backend']}",
            "",
            "| metric | value | ratio vs same-run baseline |",
            "|---|---|---|",
            f"| block updates applied / s (1 replica) | {res['apply_blocks_per_s']:,.0f} "
            f"({res['updates']:,} updates in {res['apply_seconds']:.1f} s) | "
            f"{res['apply_blocks_per_s'] / res['raw_xreadgroup_ack_per_s']:.2f}x redis-py XREADGROUP+XACK msgs/s; "
            f"{res['apply_blocks_per_s'] / res['redis_benchmark_xadd_per_s']:.2f}x redis-benchmark XADD/s |",
            f"| block updates published / s (codec + pipelined XADD) | {res['publish_blocks_per_s']:,.0f} | "
            f"{res['publish_blocks_per_s'] / res['raw_xadd_per_s']:.2f}x redis-py XADD msgs/s |",
            f"| QueryPrefix 128 blocks, in-process p50 / p99 | {res['query_p50_us']:.0f} / {res['query_p99_us']:.0f} µs "
            f"({res['queries_checked']} answers checked) | "
            f"{res['query_p50_us'] / res['get_p50_us']:.1f}x / {res['query_p99_us'] / res['get_p99_us']:.1f}x a GET |",
            f"| QueryPrefix 128 blocks, Redis time per query (mean) | {res['query_server_us']:.0f} µs | |",
            f"| QueryPrefix 128 blocks, via gRPC p50 / p99 | {res['grpc_query_p50_us']:.0f} / "
            f"{res['grpc_query_p99_us']:.0f} µs | {res['grpc_query_p99_us'] / res['grpc_floor_p99_us']:.2f}x the p99 "
            f"of a gRPC call answered from memory, interleaved ({res['grpc_floor_p50_us']:.0f} / "
            f"{res['grpc_floor_p99_us']:.0f} µs) |",
            f"| QueryPrefix 128 blocks via gRPC while the server applies updates, p50 / p99 | "
            f"{res['loaded_grpc_query_p50_us']:.0f} / {res['loaded_grpc_query_p99_us']:.0f} µs "
            f"({res['loaded_queries']} queries; {res['loaded_apply_blocks_per_s']:,.0f} updates/s applied meanwhile, "
            f"{res['loaded_updates']:,} in all) | {res['loaded_grpc_query_p99_us'] / res['loaded_grpc_floor_p99_us']:.2f}x "
            f"the interleaved in-memory call's p99 ({res['loaded_grpc_floor_p99_us']:.0f} µs) |",
            f"| Redis bytes per indexed block | {res['bytes_per_block']:.1f} B "
            f"({res['indexed_blocks']:,} blocks, {res['indexed_pairs']:,} (block, node) pairs; "
            f"{res['bytes_per_pair']:.1f} B/pair) | |",
            f"| baselines | redis-benchmark XADD -P 64: {res['redis_benchmark_xadd_per_s']:,.0f}/s; "
            f"redis-py XADD: {res['raw_xadd_per_s']:,.0f}/s; XREADGROUP+XACK: {res['raw_xreadgroup_ack_per_s']:,.0f}/s; "
            f"GET p50/p99 {res['get_p50_us']:.0f}/{res['get_p99_us']:.0f} µs | |",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1 << 20, help="distinct blocks indexed (default 1048576)")
    ap.add_argument("--queries", type=int, default=3000)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--standalone-only", action="store_true")
    g.add_argument("--cluster-only", action="store_true")
    ap.add_argument("--json", help="also write raw results here")
    ap.add_argument("--summary", type=Path, help="write the first backend's figures as JSON (python -m bench)")
    a = ap.parse_args()
    configure_logging("warning")
    results = []
    if not a.cluster_only:
        results.append(run_backend(False, a.blocks, a.queries))
    if not a.standalone_only:
        results.append(run_backend(True, a.blocks, a.queries))
    for res in results:
        print(report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    if a.summary:
        a.summary.write_text(json.dumps(results[0]))
    _ = statistics


if __name__ == "__main__":
    main()
