"""Replacement classes by owner count, end to end: a real redis-server, a real pegaflow-meta
(--min-reclaimable-owner-count 3) and three real nodes (docs/architecture.md, "Replacement
classes"). Blocks all three hold become reclaimable on each; when a holder removes them or
dies, the others get them back as retained. Each node's /metrics shows it."""

from __future__ import annotations

import pytest
import xxhash

from pegaflow.client import PegaClient
from pegaflow.cluster import keys, notices, registry
from pegaflow.cluster.redis_conn import connect
from pegaflow.meta.events.schema import Op, Update
from pegaflow.meta.index import Index
from pegaflow.meta.owners import recount_once
from tests.harness.meta import MetaServer
from tests.harness.redis import RedisClusterProc, RedisServer
from tests.integration import redis_fixtures
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server
redis_cluster = redis_fixtures.redis_cluster

PAGE = 64 << 10
NS1, NS2 = "owners-one", "owners-two"
N1, N2 = 6, 4  # blocks of each namespace every node holds


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def reclaimable(node) -> float:  # noqa: ANN001
    return node.metric("pegaflow_node_resident_bytes_by_class", 'class="reclaimable"')


def test_blocks_three_nodes_hold_are_reclaimable_until_a_holder_goes(node_factory, redis_server: RedisServer,
                                                                     tmp_path) -> None:
    meta = MetaServer(redis_server.url, tmp_path / "meta.log",
                      extra=["--min-reclaimable-owner-count", "3", "--sweep-interval", "0"]).start()
    common = ["--redis-url", redis_server.url, "--liveness-ttl", "1.5"]
    nodes = [node_factory(pool_size="8mb", extra=[*common, "--node-id", f"owner-{x}"]) for x in "abc"]
    clients = [PegaClient(n.addr) for n in nodes]
    try:
        one, two = hashes("one", N1), hashes("two", N2)
        for k, c in enumerate(clients):
            c.register({NS1: PAGE, NS2: PAGE})
            for ns, hs in ((NS1, one), (NS2, two)):
                res = c.reserve(ns, [*hs, *hashes(f"own-{k}-{ns}", 3)])  # shared blocks and 3 of its own
                assert c.commit(res.reservation_id) == len(hs) + 3
        a, b, c_ = nodes

        # 1. Three holders each: every shared block is reclaimable on every node, nothing else.
        for n in nodes:
            wait_until(lambda n=n: reclaimable(n) == (N1 + N2) * PAGE, 30, f"{n.addr}: shared blocks reclaimable")
            assert n.metric("pegaflow_node_class_demotions_total", 'reason="reclaim_hint"') == N1 + N2
            assert n.metric("pegaflow_node_resident_bytes_by_class", 'class="retained"') == 2 * 3 * PAGE
        assert a.metric("pegaflow_cache_resident_bytes_by_class", 'class="reclaimable"') == (N1 + N2) * PAGE
        assert a.metric("pegaflow_cache_class_demotions_total", 'reason="reclaim_hint"') == N1 + N2

        # 2. b drops NS1 (an engine's Reset, published as removals): its blocks have two holders
        # left, which get them back as retained; NS2's stay reclaimable everywhere.
        clients[1].reset([NS1])
        for n in (a, c_):
            wait_until(lambda n=n: reclaimable(n) == N2 * PAGE, 30, f"{n.addr}: NS1 retained again")
        assert reclaimable(b) == N2 * PAGE

        # 3. c dies: after its liveness expires the metaserver stops counting it, and a and b,
        # the two holders of NS2 left, get NS2 back as retained (NS1: a is its last holder).
        c_.kill()
        for n in (a, b):
            wait_until(lambda n=n: reclaimable(n) == 0, 30, f"{n.addr}: NS2 retained again after a holder died")
        assert a.metric("pegaflow_node_resident_bytes_by_class", 'class="retained"') == (N1 + N2 + 6) * PAGE
        assert a.metric("pegaflow_node_class_demotions_total", 'reason="reclaim_hint"') == N1 + N2  # none since
    finally:
        for cl in clients:
            cl.close()
        meta.stop()


def test_notices_are_written_in_each_namespace_slot_of_a_redis_cluster(redis_cluster: RedisClusterProc) -> None:
    """On a 6-process Redis Cluster: the scripts write each namespace's notice lists in its
    own slot (HSETNX batches and merges alike), a node pops them across shards, and a
    recount of a node that died reaches the survivors."""
    redis_cluster.flush()
    r = connect(redis_cluster.url, cluster=True)
    r.set(keys.OWNER_COUNT, 2)
    names = [f"cluster-ns-{i}" for i in range(4)]  # spread over the shards
    tags = [keys.ns_tag(n) for n in names]
    assert len({r.keyslot(keys.anchor_key(t)) for t in tags}) == 4
    nids = {n: registry.register(r, n, f"{n}:1", 60_000, True)[0] for n in ("x", "y")}
    registry.add_namespace_tags(r, dict(zip(tags, names, strict=True)))
    idx = Index(r)
    hs = hashes("cluster", 8)
    for nid in nids.values():
        idx.apply_many([Update(Op.INSERT, ns, nid, b"".join(hs)) for ns in names])
    for nid in nids.values():
        got = notices.pop(r, nid, tags)
        assert sorted(got) == sorted(tags)
        for els in got.values():
            assert [notices.decode(e) for e in els] == [notices.Notice(True, hs)]
    recount_once(r, "t", None)
    r.delete(keys.live_key("y"))  # y's liveness expired
    recount_once(r, "t", None)  # stores y as uncounted
    assert recount_once(r, "t", None) == len(names) * len(hs)
    got = notices.pop(r, nids["x"], tags)  # one element per script call: per bucket range
    restored = {t: sorted(h for e in els for h in notices.decode(e).hashes) for t, els in got.items()}
    assert restored == {t: sorted(hs) for t in tags}
    assert not any(notices.decode(e).reclaimable for els in got.values() for e in els)
    assert notices.pop(r, nids["y"], tags) == {}
