"""Two real `pegaflow-node` processes publish their ceiling sketches to a real redis-server;
a real `pegaflow-meta` exports the union: its r* equals the ceiling of the combined request
stream within HLL error, its hit rate is exactly the combined one, and each node's own
gauges show its own stream."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
import xxhash

from pegaflow.client import PegaClient
from pegaflow.cluster import keys, registry
from pegaflow.cluster.redis_conn import connect
from pegaflow.cluster.sketches import ClusterCeilingCollector, publish_sketch
from pegaflow.policy.ceiling import CeilingEstimator
from tests.harness.meta import MetaServer
from tests.harness.redis import RedisClusterProc, RedisServer
from tests.integration import redis_fixtures
from tests.oracles.ceiling import exact_ceiling
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server
redis_cluster = redis_fixtures.redis_cluster

PAGE = 16 << 10
NS = "model-x"
CHUNK = 100  # hashes per Query


def hashes(n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"blk:{i}".encode()) for i in range(n)]


def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines() if ln and ln[0] != "#"}


def run_requests(c: PegaClient, tag: str, hs: list[bytes], repeat: int) -> int:
    """Query ``hs`` in chunks, ``repeat`` times, one req_id per query (each asked twice:
    the repeat must not count). Returns the hit blocks of the first answers."""
    hits = 0
    for r in range(repeat):
        for i in range(0, len(hs), CHUNK):
            rid = f"{tag}-{r}-{i}"
            q = c.query([NS], hs[i : i + CHUNK], req_id=rid, lease=False)
            c.query([NS], hs[i : i + CHUNK], req_id=rid, lease=False)  # the engine re-asking
            hits += q.hit_blocks
    return hits


def test_metaserver_union_ceiling_equals_the_combined_stream(node_factory, redis_server: RedisServer,
                                                             tmp_path: Path) -> None:
    common = ["--redis-url", redis_server.url, "--ceiling-publish-interval", "0.3", "--liveness-ttl", "5"]
    a = node_factory(pool_size="64mb", extra=[*common, "--node-id", "host-a"])
    b = node_factory(pool_size="64mb", extra=[*common, "--node-id", "host-b"])
    meta = MetaServer(redis_server.url, tmp_path / "meta.log", http=True, extra=["--sweep-interval", "0"]).start()
    meta_http = meta.http_port
    try:
        hs = hashes(3000)
        ca, cb = PegaClient(a.addr), PegaClient(b.addr)
        ca.register({NS: PAGE})
        cb.register({NS: PAGE})
        res = ca.reserve(NS, hs[:500])  # host-a holds the first 500 blocks
        assert ca.commit(res.reservation_id) == 500
        # host-a: blocks 0..1999, twice; host-b: blocks 1000..2999 once (1000 shared with a).
        hits_a = run_requests(ca, "a", hs[:2000], repeat=2)
        hits_b = run_requests(cb, "b", hs[1000:], repeat=1)
        assert (hits_a, hits_b) == (1000, 0)
        key = [int.from_bytes(h[:8], "little") for h in hs]
        truth = exact_ceiling(key[:2000] * 2 + key[1000:])
        assert truth == 0.5

        def meta_sees_both() -> bool:
            try:
                m = scrape(meta_http)
            except OSError:
                return False
            return (m.get("pegaflow_meta_cluster_sketch_nodes") == 2
                    and m.get('pegaflow_meta_cluster_requested_blocks{window="15m"}') == 6000)

        wait_until(meta_sees_both, 30, "the metaserver to unite both nodes' sketches", every=0.3)
        m = scrape(meta_http)
        for w in ("15m", "1h", "1d"):
            assert abs(m[f'pegaflow_meta_cluster_ceiling_hit_ratio{{window="{w}"}}'] - truth) < 0.01, w
            assert m[f'pegaflow_meta_cluster_measured_hit_ratio{{window="{w}"}}'] == 1000 / 6000
            assert m[f'pegaflow_meta_cluster_hit_blocks{{window="{w}"}}'] == 1000
            assert abs(m[f'pegaflow_meta_cluster_distinct_blocks{{window="{w}"}}'] - 3000) < 30
        # Not the mean of the nodes' ceilings (0.5 and 0.0): shared blocks count once.
        def node_ceiling(n: object) -> dict[str, float]:
            return scrape(n.http_port)  # type: ignore[attr-defined]

        wait_until(lambda: node_ceiling(a).get('pegaflow_node_window_requested_blocks{window="15m"}') == 4000,
                   15, "host-a's gauges")  # fmt: skip
        wait_until(lambda: node_ceiling(b).get('pegaflow_node_window_requested_blocks{window="15m"}') == 2000,
                   15, "host-b's gauges")  # fmt: skip
        ma, mb = node_ceiling(a), node_ceiling(b)
        assert abs(ma['pegaflow_node_ceiling_hit_ratio{window="15m"}'] - 0.5) < 0.01
        assert ma['pegaflow_node_measured_hit_ratio{window="15m"}'] == 0.25
        assert mb['pegaflow_node_ceiling_hit_ratio{window="15m"}'] < 0.01
        assert ma['pegaflow_node_ceiling_sketch_publications_total{result="ok"}'] >= 1
        ca.close()
        cb.close()
    finally:
        meta.stop()


def test_sketches_of_many_nodes_spread_over_a_redis_cluster_and_unite(redis_cluster: RedisClusterProc) -> None:
    """Each node's sketch lives in its own slot (beside its stream); the collector reads them
    all in one pipeline across the shards and unites them."""
    redis_cluster.flush()
    r = connect(redis_cluster.url, True)
    now = time.time()
    streams: dict[str, list[int]] = {}
    for i in range(6):
        node = f"node-{i}"
        registry.register(r, node, f"10.0.0.{i}:50055", 60_000, True)
        est = CeilingEstimator((900.0,), clock=time.time)
        ks = list(range(i * 500, i * 500 + 1000))  # neighbours share 500 blocks
        est.observe(ks, hits=i, now=now)
        streams[node] = ks
        publish_sketch(r, node, est.serialize(), 10.0)
    slots = {r.keyslot(keys.sketch_key(n)) for n in streams}
    assert len(slots) == 6
    assert len({redis_cluster.client().get_node_from_key(keys.sketch_key(n)).name for n in streams}) > 1
    stats, merged, skipped = ClusterCeilingCollector(r, (900.0,)).compute()
    assert (merged, skipped) == (6, 0)
    combined = [k for ks in streams.values() for k in ks]
    s = stats[0]
    assert (s.requests, s.hits) == (6000, 15)
    assert abs(s.ceiling - exact_ceiling(combined)) < 0.01
    r.close()
