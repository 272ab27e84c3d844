"""The metaserver on a real 6-process Redis Cluster (3 masters, 3 replicas) from infra/redis/.

Node streams spread over slots, each namespace's index lives in its own slot, and lookups
reach two shards (index + registry) in parallel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.meta.lookup import Lookup
from tests.harness.redis import RedisClusterProc
from tests.integration import redis_fixtures
from tests.integration.meta_harness import (
    SHORT_TTL,
    PublisherProc,
    client,
    index_view,
    run_rebuild,
    start_meta,
    wait_converged,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_cluster = redis_fixtures.redis_cluster


@pytest.fixture
def cluster(redis_cluster: RedisClusterProc) -> RedisClusterProc:
    redis_cluster.flush()
    return redis_cluster


def test_cluster_several_nodes_two_replicas_equal_truth_and_rebuild(
    cluster: RedisClusterProc, tmp_path: Path
) -> None:
    names = ["n1", "n2", "n3", "n4"]
    procs = {
        n: PublisherProc(
            cluster.url,
            True,
            n,
            tmp_path / f"{n}.json",
            tmp_path / f"{n}.log",
            "--seed",
            str(i),
            "--ops",
            "1200",
            "--rate",
            "800",
            "--namespaces",
            "3",
            "--hold",
        )  # fmt: skip
        for i, n in enumerate(names)
    }
    m1 = start_meta(cluster.url, True, "m1", tmp_path / "m1.log", lease_ttl=1.5)
    m2 = start_meta(cluster.url, True, "m2", tmp_path / "m2.log", lease_ttl=1.5)
    r = client(cluster.url, True)
    try:
        # The data really spreads: streams and namespaces land on more than one shard.
        shards = {r.get_node_from_key(stream_key(n)).name for n in names}
        assert len(shards) > 1
        wait_until(lambda: r.hlen(keys.NAMESPACES) == 3, 30, "three namespaces indexed")
        tags = [t.decode() for t in r.hkeys(keys.NAMESPACES)]
        assert len({r.get_node_from_key(keys.anchor_key(t)).name for t in tags}) > 1
        m1.kill()  # mid-stream; m2 takes its streams over and claims its pending entries
        for p in procs.values():
            p.wait_done(90)
        states = {n: p.state for n, p in procs.items()}
        wait_converged(r, states, timeout=60)
        state = json.loads(procs["n3"].state.read_text())
        ns, hs = next((ns, [bytes.fromhex(h) for h in v[:16]]) for ns, v in state.items() if v)
        assert m2.query(ns, hs)["n3"] == 16
        assert Lookup(r).query_prefix(ns, hs)[0].node == "n3"  # the longest prefix first
        live = index_view(r)
        run_rebuild(cluster.url, True)
        assert index_view(r) == live
    finally:
        for p in procs.values():
            p.kill()
        m1.stop()
        m2.stop()


def test_cluster_dead_node_invisible_and_swept(cluster: RedisClusterProc, tmp_path: Path) -> None:
    meta = start_meta(cluster.url, True, "m1", tmp_path / "m.log", sweep=1.0, extra=SHORT_TTL)
    r = client(cluster.url, True)
    procs = {
        n: PublisherProc(
            cluster.url,
            True,
            n,
            tmp_path / f"{n}.json",
            tmp_path / f"{n}.log",
            "--seed",
            str(i),
            "--ops",
            "200",
            "--ttl",
            "1.5",
            "--hold",
        )  # fmt: skip
        for i, n in enumerate(["n1", "n2"])
    }
    try:
        for p in procs.values():
            p.wait_done()
        wait_converged(r, {n: p.state for n, p in procs.items()})
        state = json.loads(procs["n1"].state.read_text())
        ns, hs = next((ns, [bytes.fromhex(h) for h in v[:4]]) for ns, v in state.items() if v)
        assert "n1" in meta.query(ns, hs)
        procs["n1"].kill()
        wait_until(lambda: "n1" not in meta.query(ns, hs), 5, "n1 to disappear", every=0.05)
        wait_until(lambda: "n1" not in registry.nodes(r), 20, "the sweeper to reap n1")
        wait_converged(r, {"n2": procs["n2"].state})
    finally:
        for p in procs.values():
            p.kill()
        meta.stop()
