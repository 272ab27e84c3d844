"""Metaserver benchmark: update apply rate, lookup latency, memory per block, beside the original's.

    python bench/meta.py [--blocks 1048576] [--standalone-only | --cluster-only] [--no-original]

Starts its own redis-server / 6-process cluster (infra/redis/) on free ports, then per
backend:

1. baselines measured in the same run: ``redis-benchmark`` pipelined XADD (server
   ceiling), redis-py pipelined XADD and XREADGROUP+XACK of one small entry per message
   (what a one-event-per-block design would get), single GET round-trip latency;
2. node streams holding ``--blocks`` 128-block request prefixes' worth of inserts (8
   nodes, 2 namespaces, some prefixes held by two nodes) plus 10% insert+evict churn,
   written as real events (512 hashes per entry);
3. one consumer replica (``events.consumer.Consumer``) applies them: block updates / s;
4. Redis memory per indexed (block, node) pair (streams deleted first), and the growth of
   the metaserver's processes (RSS, consumer child included) over one serving an empty index;
5. QueryPrefix of 128-block prefixes: in-process ``Lookup`` (one Redis round trip), and
   QueryPrefix and RouteHint through a real ``pegaflow-meta`` gRPC server, once its
   in-memory view has read the streams (how many it answered from the view and how many
   from Redis is counted); p50 / p99; every answer checked; the time Redis spent per query.
   Interleaved with them, a
   GetClusterConfig (answered from memory) on the same server: its p99 is this host's gRPC
   floor at that moment (it varied 0.6-4 ms between runs here);
6. ingest: a fresh workload of as many blocks, published as our nodes publish (bench/sender.py:
   encoded beforehand, pipelined XADD, one connection per node, in a process of its own), timed
   from the first XADD until that server's in-memory view has applied every update
   (``pegaflow_meta_view_updates_total``, polled every 20 ms: late by up to that, never early):
   the (block, node) pairs a replica makes answerable per second. Its consumer applies the same
   events to the Redis index meanwhile (step 3's rate); that backlog is drained before step 7;
7. the same gRPC lookups while the nodes publish a second load (the same inserts again plus
   fresh churn) again and again, until as many lookups as in step 5 were answered: the view and
   the consumer ingest it as they serve. An XADD is answered before any replica read it, so the
   nodes are paced: at the rate the original ingested the same load (its nodes wait for each
   reply: as fast as it ingests), or ``LOAD_RATE`` without it.

On standalone Redis the Rust original's metaserver (``pegaflow-llm`` 0.25.1, fetched once
into a cache: bench/original_meta.py; skipped with the reason where it cannot be) is the
same-run peer: the same nodes register and send it the same events (InsertBlockHashes /
RemoveBlockHashes, at full rate from one connection per node, bench/sender.py): its ingest
rate (from the first call to the last reply: then it answers them) and its
RSS growth per block; its QueryPrefixBlocks and HeartbeatNode (its cheapest call)
interleaved round by round with ours in step 5, each answer checked against the expected
longest holder; and its lookups while its nodes send the second load again and again
(before ours, whose nodes then publish at the rate it reached). The
report shows ours ÷ original per row; bench/goals.py holds issue #55's goals on them. Beside
the idle lookup p99 ratios it gives how far each moves over bootstrap resamples of the rounds
(5th-95th percentile; a round's calls resampled together, so a slow moment of the host stays
on both sides): on a shared host a p99 from 2,000 calls rests on its 20 slowest, and the
ratio moved 0.83x-1.14x between three runs of 2,000 in a row on one host (0.64x-1.18x over
resamples within a run); ``python -m bench`` makes 6,000 (~2 minutes in all).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from bench.common import p99_ratio_interval  # noqa: E402
from bench.original_meta import (  # noqa: E402
    PACKAGE,
    VERSION,
    OriginalMetaServer,
    Session,
    Unavailable,
    ingest,
    longest_holder,
    plan,
    process_rss,
)
from bench.sender import Sender  # noqa: E402
from pegaflow._proto import meta_pb2, meta_pb2_grpc  # noqa: E402
from pegaflow.cluster import registry  # noqa: E402
from pegaflow.cluster.keys import stream_key  # noqa: E402
from pegaflow.cluster.redis_conn import Client, connect, is_cluster  # noqa: E402
from pegaflow.common.logging import configure_logging  # noqa: E402
from pegaflow.config.options import META, default_of, options_for  # noqa: E402
from pegaflow.meta.events.codec import FIELD, encode  # noqa: E402
from pegaflow.meta.events.consumer import Consumer  # noqa: E402
from pegaflow.meta.events.schema import Event, Op  # noqa: E402
from pegaflow.meta.events.streams import GROUP  # noqa: E402
from pegaflow.meta.index import Index  # noqa: E402
from pegaflow.meta.lookup import Lookup  # noqa: E402
from pegaflow.node.publishing import XADD_PIPELINE  # noqa: E402
from tests.harness.meta import MetaServer  # noqa: E402

NODES = 8
PREFIX = 128
NAMESPACES = ["bench-model-a|fp16|bs16|tp1", "bench-model-b|fp16|bs16|tp1"]
ENTRY = 512
WARMUP = 200  # gRPC rounds before the timed ones
# The view's bound at pegaflow-meta's default --view-max-lag-ms: within it, the view answers lookups.
VIEW_BOUND_S = float(next(default_of(o) for o in options_for(META) if o.name == "view-max-lag-ms")) / 1000  # type: ignore[arg-type]  # default_of: object
LOAD_RATE = 500_000.0  # updates / s our nodes publish under load where the original's rate is not measured
RSS_SETTLE_S = 15.0  # the longest settled_rss waits for a process tree's memory to settle


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
    """Register the nodes and open their streams as a node does: the group, then the epoch's
    RESET (seq 0; a metaserver's in-memory view holds a node's blocks once it has read it)."""
    nids = {}
    for node in range(NODES):
        name = node_name(node)
        nid, epoch = registry.register(r, name, node_address(node), 600_000, switch=True)
        nids[node] = (name, nid, epoch)
        r.xgroup_create(stream_key(name), GROUP, id="0", mkstream=True)
        r.xadd(stream_key(name), {FIELD: encode(Event(name, nid, epoch, 0, Op.RESET))})
    return nids


def node_events(held: dict[tuple[int, int], list[bytes]], churn: float, seed: int
                ) -> list[tuple[int, int, Op, list[bytes]]]:
    """The nodes' events (node, namespace index, op, hashes), each node's in its order: its
    holdings in entries of ``ENTRY`` hashes, and after a ``churn`` share of them a block batch
    inserted and evicted again. Both metaservers are given these."""
    rng = random.Random(seed)
    out = []
    for (node, ns), hashes in held.items():
        for j in range(0, len(hashes), ENTRY):
            out.append((node, ns, Op.INSERT, hashes[j : j + ENTRY]))
            if churn and rng.random() < churn:
                tmp = [rng.randbytes(16) for _ in range(ENTRY // 2)]
                out.append((node, ns, Op.INSERT, tmp))
                out.append((node, ns, Op.EVICT, tmp))
    return out


def encode_events(events: list[tuple[int, int, Op, list[bytes]]], nids: dict[int, tuple[str, int, int]],
                  seqs: dict[int, int]) -> list[list[tuple[bytes, int]]]:
    """Per node, its events encoded as its stream entries (``seqs`` carries the nodes' sequence
    numbers from one call to the next), each with the block updates in it."""
    entries: list[list[tuple[bytes, int]]] = [[] for _ in range(NODES)]
    for node, ns, op, hashes in events:
        name, nid, epoch = nids[node]
        seqs[node] += 1
        entries[node].append((encode(Event(name, nid, epoch, seqs[node], op, NAMESPACES[ns], b"".join(hashes))),
                              len(hashes)))
    return entries


def write_streams(r: Client, events: list[tuple[int, int, Op, list[bytes]]],
                  nids: dict[int, tuple[str, int, int]] | None = None, seqs: dict[int, int] | None = None) -> int:
    """Write the nodes' events to their streams (registering the nodes first unless ``nids``
    is given; ``seqs`` carries their sequence numbers from one call to the next); returns the
    block updates."""
    nids = nids if nids is not None else register_nodes(r)
    seqs = seqs if seqs is not None else dict.fromkeys(range(NODES), 0)
    entries = encode_events(events, nids, seqs)
    for node, node_entries in enumerate(entries):
        for j in range(0, len(node_entries), XADD_PIPELINE):
            p = r.pipeline(transaction=False)
            for data, _ in node_entries[j : j + XADD_PIPELINE]:
                p.xadd(stream_key(nids[node][0]), {FIELD: data})
            p.execute()
    return sum(n for e in entries for _, n in e)


def backlog(r: Client) -> int:
    """Entries of the node streams not yet delivered to or not yet acknowledged by a consumer."""
    n = 0
    for node in range(NODES):
        for g in r.xinfo_groups(stream_key(node_name(node))):
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


def index_bytes(r: Client, before: int, events: list[tuple[int, int, Op, list[bytes]]],
                nids: dict[int, tuple[str, int, int]]) -> tuple[int, int]:
    """Redis memory of the index (and registry) alone: the streams deleted, measured, then
    written again as they were (RESET and the same events; the consumer group created past
    them, so the index needs nothing more, while a metaserver's view reads them from the start)."""
    for node in range(NODES):
        r.delete(stream_key(node_name(node)))
    used = used_memory(r)
    for name, nid, epoch in nids.values():
        r.xadd(stream_key(name), {FIELD: encode(Event(name, nid, epoch, 0, Op.RESET))})
    write_streams(r, events, nids=nids, seqs=dict.fromkeys(range(NODES), 0))
    for name, _nid, _epoch in nids.values():
        r.xgroup_create(stream_key(name), GROUP, id="$")
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
    names = {i: node_name(i) for i in range(NODES)}
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


# --- lookups through gRPC: ours and the original's, interleaved -------------------------------

Probe = Callable[[int], float]  # a request's index -> seconds of one call, its answer checked


def node_name(node: int) -> str:
    return f"bench-node-{node}"


def node_address(node: int) -> str:
    """A node's advertised address (ours keeps it beside the name; the original names nodes by it)."""
    return f"10.0.0.{node}:50055"


def longest_expected(expect: dict[int, int]) -> tuple[int, int]:
    return max(expect.items(), key=lambda kv: kv[1])


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"bench: wrong answer: {what}")


def our_probes(stub: meta_pb2_grpc.MetaServiceStub, reqs, expect) -> dict[str, Probe]:
    """QueryPrefix (every holder checked), RouteHint (the longest holder checked) and
    GetClusterConfig (answered from memory: the floor of any call) on our metaserver."""
    cfg = meta_pb2.ClusterConfigRequest()

    def query(i: int) -> float:
        req = meta_pb2.QueryPrefixRequest(namespace=NAMESPACES[i % len(NAMESPACES)], hashes=reqs[i])
        t0 = time.perf_counter()
        res = stub.QueryPrefix(req, timeout=5)
        dt = time.perf_counter() - t0
        got = {n.node: n.prefix_len for n in res.nodes}
        want = {node_name(k): v for k, v in expect[i].items()}
        check(got == want, f"QueryPrefix of request {i}: {got}, expected {want}")
        return dt

    def route(i: int) -> float:
        req = meta_pb2.QueryPrefixRequest(namespace=NAMESPACES[i % len(NAMESPACES)], hashes=reqs[i])
        t0 = time.perf_counter()
        res = stub.RouteHint(req, timeout=5)
        dt = time.perf_counter() - t0
        node, n = longest_expected(expect[i])
        check(res.found and (res.best.node, res.best.prefix_len) == (node_name(node), n),
              f"RouteHint of request {i}: {res}, expected {node_name(node)} with {n}")
        return dt

    def floor(i: int) -> float:
        t0 = time.perf_counter()
        stub.GetClusterConfig(cfg, timeout=5)
        return time.perf_counter() - t0

    return {"query": query, "route": route, "floor": floor}


def original_probes(orig: OriginalMetaServer, first: Session, reqs, expect) -> dict[str, Probe]:
    """QueryPrefixBlocks (its longest holder checked) and HeartbeatNode (an in-memory map
    update: the cheapest call it answers) on the original's metaserver."""
    pb, stub = orig.pb, orig.stub
    beat = pb.HeartbeatNodeRequest(node=first.node, node_id=first.node_id)

    def query(i: int) -> float:
        req = pb.QueryPrefixBlocksRequest(namespace=NAMESPACES[i % len(NAMESPACES)], block_hashes=reqs[i])
        t0 = time.perf_counter()
        res = stub.QueryPrefixBlocks(req, timeout=5)
        dt = time.perf_counter() - t0
        node, n = longest_expected(expect[i])
        got = longest_holder(res)
        check(got == (node_address(node), n), f"QueryPrefixBlocks of request {i}: {got}, expected "
                                               f"{node_address(node)} with {n}")
        return dt

    def floor(i: int) -> float:
        t0 = time.perf_counter()
        stub.HeartbeatNode(beat, timeout=5)
        return time.perf_counter() - t0

    return {"query": query, "floor": floor}


def drive(probes: dict[str, Probe], n_reqs: int, rounds: int | None, until: Callable[[int], bool] | None = None,
          seed: int = 4) -> dict[str, list[float]]:
    """Rounds of one call of each probe, each call on a random request of its own and the
    round's order shuffled: ``rounds`` of them, or until ``until(rounds so far)`` (asked every
    50 rounds). Every call is cold alike: no probe always follows the same one (a rotation
    kept each probe's predecessor fixed: our RouteHint always came right after our QueryPrefix,
    on the same hashes, so it found the view's entries in cache where the original's lookup,
    after our GetClusterConfig, never did)."""
    rng = random.Random(seed)
    names = list(probes)
    lat: dict[str, list[float]] = {k: [] for k in names}
    k = 0
    while True:
        for name in rng.sample(names, len(names)):
            lat[name].append(probes[name](rng.randrange(n_reqs)))
        k += 1
        if rounds is not None and k >= rounds:
            return lat
        if until is not None and k % 50 == 0 and until(k):
            return lat


def p50_p99_us(xs: list[float]) -> tuple[float, float]:
    return pct(xs, 0.5) * 1e6, pct(xs, 0.99) * 1e6


def tree_rss(pid: int) -> int:
    """VmRSS of a process and its descendants (our metaserver's consumer is a child process)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += process_rss(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def settled_rss(pid: int) -> int:
    """``tree_rss`` once it holds within 1% for a second (the consumer child imports after the
    server answers), bounded: the last reading after ``RSS_SETTLE_S``."""
    last, t_end = tree_rss(pid), time.monotonic() + RSS_SETTLE_S
    while time.monotonic() < t_end:
        time.sleep(1.0)
        cur = tree_rss(pid)
        if abs(cur - last) <= 0.01 * last:
            return cur
        last = cur
    return last


def start_meta(url: str, cluster: bool, logs: Path) -> MetaServer:
    """Our metaserver with the flags the original peer gets too (bench/original_meta.py's
    SERVER_FLAGS): the bench's nodes register once and never heartbeat again, so none may go
    stale within a run (the default, 30 s, empties every answer at 1M blocks), and no sweep."""
    return MetaServer(url, logs / "meta.log", cluster=cluster, http=True,
                      extra=["--sweep-interval", "0", "--node-stale-secs", "3600", "--log-level", "warning"]).start()


def meta_samples(meta: MetaServer) -> dict[str, float]:
    """Our metaserver's /metrics samples without labels, and lookups by source (``lookups_view``...)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{meta.http_port}/metrics", timeout=5).read().decode()
    out = {}
    for m in re.finditer(r'^(pegaflow_meta_[a-z_]+)(?:\{source="([a-z]+)"\})? (\S+)$', text, re.M):
        out[m.group(1) + (f"_{m.group(2)}" if m.group(2) else "")] = float(m.group(3))
    return out


def wait_view(meta: MetaServer, timeout: float = 600.0) -> float:
    """Seconds until our metaserver's in-memory view holds the streams (its lag within the
    default bound, 100 ms); the lookups measured after that are answered from it."""
    t0 = time.monotonic()
    while meta_samples(meta).get("pegaflow_meta_view_lag_seconds", math.inf) > VIEW_BOUND_S:
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"bench: our metaserver's view did not catch up in {timeout:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def empty_index_rss(url: str, cluster: bool, logs: Path) -> int:
    """Our metaserver's memory over an empty index, after the same warm-up as the measured one:
    the base its growth per indexed block is taken from."""
    meta = start_meta(url, cluster, logs)
    try:
        rng = random.Random(9)
        for _ in range(WARMUP):
            req = meta_pb2.QueryPrefixRequest(namespace=NAMESPACES[0], hashes=[rng.randbytes(16) for _ in range(PREFIX)])
            meta.stub.QueryPrefix(req, timeout=5)
            meta.stub.RouteHint(req, timeout=5)
            meta.stub.GetClusterConfig(meta_pb2.ClusterConfigRequest(), timeout=5)
        assert meta.proc is not None
        return settled_rss(meta.proc.pid)
    finally:
        meta.stop()


def start_original(logs: Path) -> OriginalMetaServer | str:
    """The original's metaserver, started; or the one-line reason it cannot run here."""
    try:
        return OriginalMetaServer(logs / "original-meta.log").start()
    except Unavailable as e:
        return str(e)


def original_ingest(orig: OriginalMetaServer, sessions: list[Session], events, scratch: Path) -> Sender:
    """``events`` as the original's nodes send them, in a process of its own, ready to go."""
    calls = plan(orig.pb, sessions, ((node, NAMESPACES[ns], op is Op.INSERT, hashes)
                                     for node, ns, op, hashes in events))
    return ingest(orig.addr, calls, scratch)


class StreamEntries:
    """bench/sender.py's ``streams`` kind: each node's events, encoded beforehand, ``XADD``-ed
    to its stream on a connection of its own in pipelines of ``XADD_PIPELINE`` entries, as
    ``pegaflow/node/publishing.py`` sends them."""

    def __init__(self, data: dict) -> None:
        self.url, self.cluster, self.streams = data["url"], data["cluster"], data["streams"]
        self.items = [[(chunk, sum(n for _, n in chunk)) for chunk in
                       (entries[j : j + XADD_PIPELINE] for j in range(0, len(entries), XADD_PIPELINE))]
                      for entries in data["entries"]]

    def connect(self, k: int) -> Callable[[list[tuple[bytes, int]]], list]:
        r, key = connect(self.url, self.cluster, socket_timeout=60), self.streams[k]

        def send(chunk: list[tuple[bytes, int]]) -> list:
            p = r.pipeline(transaction=False)
            for data, _ in chunk:
                p.xadd(key, {FIELD: data})
            return p.execute()

        return send

    def check_first(self, replies: list[list[list]]) -> None:
        for items, got in zip(self.items, replies, strict=True):
            for (chunk, _), ids in zip(items, got, strict=True):
                self.check_later(chunk, ids)

    def check_later(self, chunk: list[tuple[bytes, int]], ids: list) -> None:
        if len(ids) != len(chunk) or not all(isinstance(i, bytes) for i in ids):
            raise RuntimeError(f"XADD of {len(chunk)} entries answered {ids[:2]}...")


def publish(url: str, cluster: bool, events: list[tuple[int, int, Op, list[bytes]]],
            nids: dict[int, tuple[str, int, int]], seqs: dict[int, int], scratch: Path, rate: float = 0.0
            ) -> tuple[Sender, int]:
    """``events`` as our nodes publish them, in a process of its own, ready to go (at most
    ``rate`` updates / s: XADD answers before any replica read the entry); and the block
    updates in them (``seqs`` carries the nodes' sequence numbers on)."""
    entries = encode_events(events, nids, seqs)
    payload = {"url": url, "cluster": cluster, "streams": [stream_key(nids[k][0]) for k in range(NODES)],
               "entries": entries}
    return Sender("streams", payload, scratch, rate), sum(n for e in entries for _, n in e)


def wait_view_updates(meta: MetaServer, target: float, restarts: float, timeout: float = 600.0,
                      every: float = 0.02) -> float:
    """``time.monotonic()`` of the first poll (every ``every`` s) that found our metaserver's view
    had applied ``target`` block updates in all and was within its bound (``VIEW_BOUND_S``: it answers
    lookups): late by up to ``every``, never early. A view that started over meanwhile (past
    ``restarts``) counted updates twice: no figure."""
    t0 = time.monotonic()
    while True:
        m = meta_samples(meta)
        if m.get("pegaflow_meta_view_restarts_total", 0) != restarts:
            raise SystemExit("bench: our metaserver's view started over during the ingest: no figure")
        if (m.get("pegaflow_meta_view_updates_total", 0) >= target
                and m.get("pegaflow_meta_view_lag_seconds", math.inf) <= VIEW_BOUND_S):
            return time.monotonic()
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"bench: our metaserver's view did not apply {target:,.0f} updates in {timeout:.0f} s")
        time.sleep(every)


def wait_backlog(r: Client, timeout: float = 900.0) -> None:
    """Until every node stream's entries were applied and acked by a consumer."""
    t0 = time.monotonic()
    while backlog(r):
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"bench: the consumer did not apply the streams' backlog in {timeout:.0f} s")
        time.sleep(0.1)


def run_backend(cluster: bool, blocks: int, queries: int, peer: bool) -> dict:
    from tests.harness.dirs import temp_dir_removed_at_exit
    from tests.harness.redis import start_cluster, start_server

    tmp = Path(temp_dir_removed_at_exit("pf-bench-meta-"))
    redis = start_cluster(tmp / "redis") if cluster else start_server(tmp / "redis")
    url = redis.url
    orig: OriginalMetaServer | None = None
    try:
        r = connect(url, cluster, socket_timeout=60)
        out: dict = {"backend": "cluster (3 masters + 3 replicas)" if cluster else "standalone"}
        out["redis_benchmark_xadd_per_s"] = redis_benchmark_xadd(r)
        out["raw_xadd_per_s"], out["raw_xreadgroup_ack_per_s"] = raw_stream_rates(r)
        out["get_p50_us"], out["get_p99_us"] = (x * 1e6 for x in get_latency(r))
        base_rss = empty_index_rss(url, cluster, tmp)
        reqs, held, expect = make_workload(blocks)
        before = used_memory(r)
        t0 = time.perf_counter()
        nids, seqs = register_nodes(r), dict.fromkeys(range(NODES), 0)
        events = node_events(held, churn=0.1, seed=2)
        updates = write_streams(r, events, nids=nids, seqs=seqs)
        out["publish_blocks_per_s"] = updates / (time.perf_counter() - t0)
        out["updates"] = updates
        out["apply_blocks_per_s"], out["apply_seconds"] = apply_all(r, updates)
        pairs = sum(len(v) for v in held.values())
        distinct = len(reqs) * PREFIX
        idx_bytes, _ = index_bytes(r, before, events, nids)
        out["indexed_blocks"] = distinct
        out["indexed_pairs"] = pairs
        out["bytes_per_block"] = idx_bytes / distinct
        out["bytes_per_pair"] = idx_bytes / pairs
        reset_stats(r)
        q50, q99, checked = query_latency(r, reqs, expect, queries)
        out["query_server_us"] = query_usec_per_call(r, checked)
        out["query_p50_us"], out["query_p99_us"], out["queries_checked"] = q50 * 1e6, q99 * 1e6, checked

        # The original's metaserver: the same nodes register and send the same events.
        sessions: list[Session] = []
        if peer:
            started = start_original(tmp)
            if isinstance(started, str):
                print(f"bench/meta.py: the original's metaserver ({PACKAGE} {VERSION}) is skipped: {started}",
                      flush=True)
                out["original"] = {"version": VERSION, "skipped": started}
            else:
                orig = started
                sessions = orig.register(node_address(k) for k in range(NODES))
                rss0 = orig.rss()
                ingest = original_ingest(orig, sessions, events, tmp)
                ingest.go(loop=False)
                res = ingest.result()
                o = out["original"] = {"version": VERSION, "updates": res["pairs"], "ingest_calls": res["calls"],
                                       "ingest_pairs_per_s": res["pairs"] / res["seconds"]}
                o["bytes_per_block"] = (orig.rss() - rss0) / distinct

        # Lookups through gRPC, ours and the original's interleaved (a round: one call of each kind,
        # in a shuffled order, each on a random request; drive()): the same moments of this host for both.
        meta = start_meta(url, cluster, tmp)
        try:
            out["view_ready_s"] = wait_view(meta)  # its view read from the streams, as a replica starts
            ours = our_probes(meta.stub, reqs, expect)
            probes = {f"ours_{k}": v for k, v in ours.items()}
            if orig is not None:
                probes |= {f"orig_{k}": v for k, v in original_probes(orig, sessions[0], reqs, expect).items()}
            drive(probes, len(reqs), WARMUP)
            seen = meta_samples(meta)
            lat = drive(probes, len(reqs), queries)
            now = meta_samples(meta)
            out["lookups_from_view"], out["lookups_from_redis"] = (
                now.get(f"pegaflow_meta_lookups_total_{k}", 0) - seen.get(f"pegaflow_meta_lookups_total_{k}", 0)
                for k in ("view", "redis"))
            out["grpc_lookups_checked"] = queries
            out["grpc_query_p50_us"], out["grpc_query_p99_us"] = p50_p99_us(lat["ours_query"])
            out["grpc_route_p50_us"], out["grpc_route_p99_us"] = p50_p99_us(lat["ours_route"])
            out["grpc_floor_p50_us"], out["grpc_floor_p99_us"] = p50_p99_us(lat["ours_floor"])
            if orig is not None:
                o = out["original"]
                o["query_p50_us"], o["query_p99_us"] = p50_p99_us(lat["orig_query"])
                o["floor_p50_us"], o["floor_p99_us"] = p50_p99_us(lat["orig_floor"])
                # Paired: the calls of a round were made one after the other, so a slow moment of
                # the host lands on both sides of a resample.
                o["route_p99_ratio_90pct"], o["query_p99_ratio_90pct"] = (
                    p99_ratio_interval(lat[f"ours_{k}"], lat["orig_query"], paired=True) for k in ("route", "query"))
                o["lookups_checked"] = queries
            assert meta.proc is not None
            out["meta_process_bytes_per_block"] = (settled_rss(meta.proc.pid) - base_rss) / distinct
            out["memory_bytes_per_block"] = out["bytes_per_block"] + out["meta_process_bytes_per_block"]

            # Ingest: a fresh workload of as many blocks, published as our nodes publish it
            # (bench/sender.py, one connection per node), timed from the first XADD until the
            # view answers it all: what a lookup on this replica sees. Its consumer applies the
            # same events to the Redis index meanwhile, as it serves; that backlog is drained
            # before the next step.
            _, held2, _ = make_workload(blocks, seed=11)
            sender, updates2 = publish(url, cluster, node_events(held2, churn=0.1, seed=3), nids, seqs, tmp)
            m = meta_samples(meta)
            sender.go(loop=False)
            t_view = wait_view_updates(meta, m.get("pegaflow_meta_view_updates_total", 0) + updates2,
                                       m.get("pegaflow_meta_view_restarts_total", 0))
            res = sender.result()
            out["ingest_updates"] = updates2
            out["ingest_pairs_per_s"] = updates2 / (t_view - res["t0"])
            out["ingest_publish_pairs_per_s"] = res["pairs"] / res["seconds"]
            wait_backlog(r)

            # Under load: the same events again (inserts of blocks already held: the answers
            # stay what they were) plus fresh churn, sent again and again while the lookups
            # run, until there were as many as in the idle rounds. The original first: its
            # nodes wait for each reply, so its load is as fast as it ingests.
            again = node_events(held, churn=0.1, seed=5)
            if orig is not None:
                ingest = original_ingest(orig, sessions, again, tmp)
                probes = original_probes(orig, sessions[0], reqs, expect)
                ingest.go(loop=True)
                lat = drive(probes, len(reqs), None,
                            until=lambda k: (k >= queries and ingest.first_pass.is_set()) or not ingest.running())
                ingest.stop()
                res = ingest.result()
                o = out["original"]
                o["loaded_updates"], o["loaded_ingest_pairs_per_s"] = res["pairs"], res["pairs"] / res["seconds"]
                o["loaded_passes"] = res["passes"]
                o["loaded_queries"] = len(lat["query"])
                o["loaded_query_p50_us"], o["loaded_query_p99_us"] = p50_p99_us(lat["query"])
                o["loaded_floor_p99_us"] = p50_p99_us(lat["floor"])[1]

            # Ours: an XADD is answered before any replica read the entry, so our nodes publish
            # at the rate the original ingested that load (LOAD_RATE without it); the view and
            # the consumer ingest it as they serve.
            load_rate = out.get("original", {}).get("loaded_ingest_pairs_per_s", LOAD_RATE)
            sender, updates = publish(url, cluster, again, nids, seqs, tmp, rate=load_rate)
            seen = meta_samples(meta)
            sender.go(loop=True)
            t0 = time.monotonic()
            lat = drive(ours, len(reqs), None,
                        until=lambda k: (k >= queries and sender.first_pass.is_set()) or not sender.running())
            sender.stop()
            dt = time.monotonic() - t0
            res = sender.result()
            now = meta_samples(meta)
            out["loaded_lookups_from_view"], out["loaded_lookups_from_redis"] = (
                now.get(f"pegaflow_meta_lookups_total_{k}", 0) - seen.get(f"pegaflow_meta_lookups_total_{k}", 0)
                for k in ("view", "redis"))
            out["loaded_updates"], out["loaded_passes"] = res["pairs"], res["passes"]
            out["loaded_offered_pairs_per_s"] = load_rate
            out["loaded_ingest_pairs_per_s"] = (now.get("pegaflow_meta_view_updates_total", 0)
                                                - seen.get("pegaflow_meta_view_updates_total", 0)) / dt
            out["loaded_publish_pairs_per_s"] = res["pairs"] / res["seconds"]
            out["loaded_queries"] = len(lat["query"])
            out["loaded_grpc_query_p50_us"], out["loaded_grpc_query_p99_us"] = p50_p99_us(lat["query"])
            out["loaded_grpc_route_p50_us"], out["loaded_grpc_route_p99_us"] = p50_p99_us(lat["route"])
            out["loaded_grpc_floor_p99_us"] = p50_p99_us(lat["floor"])[1]
        finally:
            meta.stop()
        return out
    finally:
        if orig is not None:
            orig.stop()
        redis.stop()


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "—"


def report_original(res: dict) -> list[str]:
    """Ours beside the original's metaserver, measured in the same run: ours ÷ original."""
    o = res.get("original")
    if o is None:
        return []
    head = f"#### beside the original's metaserver (`{PACKAGE}` {o['version']}), same run"
    if "skipped" in o:
        return [head, "", f"Skipped: {o['skipped']}", ""]
    lines = [head, "", "| metric | ours | original | ours ÷ original |", "|---|---|---|---|"]

    def row(metric: str, ours: tuple[float, ...], theirs: tuple[float, ...], unit: str, fmt: str = ".0f") -> None:
        a = " / ".join(f"{x:,{fmt}}" for x in ours)
        b = " / ".join(f"{x:,{fmt}}" for x in theirs)
        lines.append(f"| {metric} | {a} {unit} | {b} {unit} | "
                     f"{' / '.join(ratio(x, y) for x, y in zip(ours, theirs, strict=True))} |")

    row("lookup 128 blocks p50 / p99: RouteHint vs QueryPrefixBlocks",
        (res["grpc_route_p50_us"], res["grpc_route_p99_us"]), (o["query_p50_us"], o["query_p99_us"]), "µs")
    row("lookup 128 blocks p50 / p99: QueryPrefix vs QueryPrefixBlocks",
        (res["grpc_query_p50_us"], res["grpc_query_p99_us"]), (o["query_p50_us"], o["query_p99_us"]), "µs")
    row("cheapest call answered from memory p50 / p99: GetClusterConfig vs HeartbeatNode",
        (res["grpc_floor_p50_us"], res["grpc_floor_p99_us"]), (o["floor_p50_us"], o["floor_p99_us"]), "µs")
    row(f"ingest, (block, node) pairs / s: XADD from {NODES} node connections until a replica's view answers "
        f"them vs Insert/RemoveBlockHashes from {NODES} node connections",
        (res["ingest_pairs_per_s"],), (o["ingest_pairs_per_s"],), "/s")
    row("the same into the Redis index: one consumer replica applying the streams (fallback path, owner counts)",
        (res["apply_blocks_per_s"],), (o["ingest_pairs_per_s"],), "/s")
    row("memory per indexed block: Redis + metaserver processes vs process RSS growth",
        (res["memory_bytes_per_block"],), (o["bytes_per_block"],), "B", ".1f")
    row("lookup p50 / p99 while ingesting at full rate: RouteHint vs QueryPrefixBlocks",
        (res["loaded_grpc_route_p50_us"], res["loaded_grpc_route_p99_us"]),
        (o["loaded_query_p50_us"], o["loaded_query_p99_us"]), "µs")
    row("lookup p50 / p99 while ingesting at full rate: QueryPrefix vs QueryPrefixBlocks",
        (res["loaded_grpc_query_p50_us"], res["loaded_grpc_query_p99_us"]),
        (o["loaded_query_p50_us"], o["loaded_query_p99_us"]), "µs")
    row("ingest rate meanwhile, (block, node) pairs / s: into ours' view vs the original's", (res["loaded_ingest_pairs_per_s"],),
        (o["loaded_ingest_pairs_per_s"],), "/s")
    spread = " and ".join(f"{name} {lo:.2f}x-{hi:.2f}x" for name, (lo, hi) in (
        ("RouteHint", o["route_p99_ratio_90pct"]), ("QueryPrefix", o["query_p99_ratio_90pct"])))
    lines += ["", f"{res['grpc_lookups_checked']:,} lookups of each kind interleaved, every answer checked "
              f"(the idle p99 ÷ the original's over resamples of their rounds, 5th-95th percentile: {spread}); "
              f"under load {res['loaded_queries']:,} (ours, its nodes' events published {res['loaded_passes']} times "
              f"or more) and {o['loaded_queries']:,} (original, its nodes' events sent {o['loaded_passes']} times or "
              "more); "
              f"{res['indexed_blocks']:,} blocks, {res['indexed_pairs']:,} (block, node) pairs on {NODES} nodes. "
              f"Ours' memory: {res['bytes_per_block']:.1f} B of Redis and "
              f"{res['meta_process_bytes_per_block']:.1f} B of the metaserver's processes per block.", ""]
    return lines


def report(res: dict) -> str:
    return "\n".join(
        [
            f"### {res['backend']}",
            "",
            "| metric | value | ratio vs same-run baseline |",
            "|---|---|---|",
            f"| block updates made answerable / s (published at full rate until a replica's view holds them) | "
            f"{res['ingest_pairs_per_s']:,.0f} ({res['ingest_updates']:,} updates; published alone at "
            f"{res['ingest_publish_pairs_per_s']:,.0f}/s) | {res['ingest_pairs_per_s'] / res['ingest_publish_pairs_per_s']:.2f}x "
            "the publishing alone |",
            f"| block updates applied to the Redis index / s (1 replica) | {res['apply_blocks_per_s']:,.0f} "
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
            f"| RouteHint 128 blocks, via gRPC p50 / p99 | {res['grpc_route_p50_us']:.0f} / "
            f"{res['grpc_route_p99_us']:.0f} µs | {res['grpc_route_p99_us'] / res['grpc_floor_p99_us']:.2f}x the same |",
            f"| gRPC lookups answered from the metaserver's in-memory view, idle / under load | "
            f"{res['lookups_from_view']:,.0f} of {res['lookups_from_view'] + res['lookups_from_redis']:,.0f} / "
            f"{res['loaded_lookups_from_view']:,.0f} of "
            f"{res['loaded_lookups_from_view'] + res['loaded_lookups_from_redis']:,.0f} (the rest from Redis; "
            f"the view read from the streams {res['view_ready_s']:.1f} s after the server started) | |",
            f"| QueryPrefix 128 blocks via gRPC while nodes publish at full rate, p50 / p99 | "
            f"{res['loaded_grpc_query_p50_us']:.0f} / {res['loaded_grpc_query_p99_us']:.0f} µs "
            f"({res['loaded_queries']} queries; {res['loaded_ingest_pairs_per_s']:,.0f} updates/s into the view "
            f"meanwhile, {res['loaded_updates']:,} published at {res['loaded_publish_pairs_per_s']:,.0f}/s, offered "
            f"{res['loaded_offered_pairs_per_s']:,.0f}/s) | {res['loaded_grpc_query_p99_us'] / res['loaded_grpc_floor_p99_us']:.2f}x "
            f"the interleaved in-memory call's p99 ({res['loaded_grpc_floor_p99_us']:.0f} µs) |",
            f"| Redis bytes per indexed block | {res['bytes_per_block']:.1f} B "
            f"({res['indexed_blocks']:,} blocks, {res['indexed_pairs']:,} (block, node) pairs; "
            f"{res['bytes_per_pair']:.1f} B/pair) | |",
            f"| metaserver process memory per indexed block (RSS growth over an empty index) | "
            f"{res['meta_process_bytes_per_block']:.1f} B | |",
            f"| baselines | redis-benchmark XADD -P 64: {res['redis_benchmark_xadd_per_s']:,.0f}/s; "
            f"redis-py XADD: {res['raw_xadd_per_s']:,.0f}/s; XREADGROUP+XACK: {res['raw_xreadgroup_ack_per_s']:,.0f}/s; "
            f"GET p50/p99 {res['get_p50_us']:.0f}/{res['get_p99_us']:.0f} µs | |",
            "",
            *report_original(res),
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1 << 20, help="distinct blocks indexed (default 1048576)")
    ap.add_argument("--queries", type=int, default=3000, help="gRPC lookups of each kind (and in-process ones)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--standalone-only", action="store_true")
    g.add_argument("--cluster-only", action="store_true")
    ap.add_argument("--no-original", action="store_true",
                    help=f"leave out the original's metaserver ({PACKAGE} {VERSION}; standalone Redis only)")
    ap.add_argument("--json", help="also write raw results here")
    ap.add_argument("--summary", type=Path, help="write the first backend's figures as JSON (python -m bench)")
    a = ap.parse_args()
    configure_logging("warning")
    results = []
    if not a.cluster_only:
        results.append(run_backend(False, a.blocks, a.queries, peer=not a.no_original))
    if not a.standalone_only:
        results.append(run_backend(True, a.blocks, a.queries, peer=False))
    for res in results:
        print(report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    if a.summary:
        a.summary.write_text(json.dumps(results[0]))


if __name__ == "__main__":
    main()
