"""The metaserver's --node-stale-secs (the original's stale filtering), against a real
redis-server: a node whose last heartbeat is older is hidden from lookups and from
ListNodes' alive nodes while its live key still exists, and is visible again at its next
heartbeat; without the bound only the live key counts."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest
import xxhash
from structlog.testing import capture_logs

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.client import PegaClient
from pegaflow.cluster import keys, registry
from pegaflow.cluster.redis_conn import connect
from pegaflow.meta.lookup import Lookup
from tests.harness.meta import MetaServer
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server


def alive(lookup: Lookup) -> dict[str, bool]:
    return {n: a for n, _addr, _epoch, a in lookup.nodes()}


def test_a_node_without_heartbeat_for_stale_ms_is_hidden_until_it_beats_again(redis_server: RedisServer) -> None:
    r = connect(redis_server.url)
    r.flushall()
    nid_a, _ = registry.register(r, "a", "10.0.0.1:1", 60_000, True)
    nid_b, _ = registry.register(r, "b", "10.0.0.2:1", 60_000, True)
    with capture_logs() as logs:
        stale = Lookup(r, stale_ms=1000)
        assert alive(stale) == {"a": True, "b": True}
        stale.query_prefix("ns", [b"\0" * 16])  # loads the registry cache: warns of the slow heartbeats
    plain = Lookup(r)
    slow = [e["node"] for e in logs if e["event"] == "node_heartbeats_slower_than_stale"]
    assert sorted(slow) == ["a", "b"]  # every 20 s against 1 s

    def a_hidden() -> bool:
        assert registry.heartbeat(r, "b", nid_b, 60_000)  # b keeps beating
        return alive(stale) == {"a": False, "b": True}

    wait_until(a_hidden, 10, "a to go stale", every=0.2)
    assert r.exists(keys.live_key("a"))  # not expired: only the metaserver's bound hides it
    assert registry.visible(r, ["a", "b"], 1000) == {nid_b: "b"}
    assert registry.visible(r, ["a", "b"]) == {nid_a: "a", nid_b: "b"}
    assert alive(plain) == {"a": True, "b": True}
    # Staleness never reaps: the live key decides that.
    assert registry.reap(r, ["a", "b"]) == []
    assert registry.heartbeat(r, "a", nid_a, 60_000)
    assert alive(stale) == {"a": True, "b": True}
    # A reaped node's stamp goes with it.
    r.delete(keys.live_key("a"))
    assert registry.reap(r, ["a", "b"]) == ["a"]
    assert r.hget(keys.SEEN, "a") is None and r.hget(keys.SEEN, "b") is not None
    r.close()


def test_metaserver_hides_a_stopped_node_after_node_stale_secs(node_factory, redis_server: RedisServer,
                                                               tmp_path: Path) -> None:
    # The node beats every 10 s (a third of --liveness-ttl 30); the metaserver's bound is 12 s:
    # a running node never goes stale, a stopped one does 12 s after its last beat, 18 s
    # before its live key would expire.
    r = connect(redis_server.url)
    r.flushall()
    node = node_factory(extra=["--redis-url", redis_server.url, "--node-id", "host-s", "--liveness-ttl", "30"])
    meta = MetaServer(redis_server.url, tmp_path / "meta.log", extra=["--node-stale-secs", "12", "--sweep-interval", "1"])
    meta.start()
    channel = grpc.insecure_channel(meta.addr)
    stub = meta_pb2_grpc.MetaServiceStub(channel)
    try:
        hs = [xxhash.xxh3_128_digest(f"s:{i}".encode()) for i in range(8)]
        c = PegaClient(node.addr)
        c.register({"m": 16 << 10})
        res = c.reserve("m", hs)
        assert c.commit(res.reservation_id) == 8

        def holders() -> dict[str, int]:
            try:
                ans = stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace="m", hashes=hs), timeout=5)
            except grpc.RpcError:
                return {}
            return {n.node: n.prefix_len for n in ans.nodes}

        def listed_alive() -> bool:
            ans = stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=5)
            return any(n.node == "host-s" and n.alive for n in ans.nodes)

        wait_until(lambda: holders() == {"host-s": 8}, 30, "the metaserver to answer with the node")
        assert listed_alive()
        node.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: holders() == {}, 25, "the stopped node to go stale", every=0.25)
            assert r.exists(keys.live_key("host-s")), "hidden by its own TTL, not by --node-stale-secs"
            assert not listed_alive()
            assert "host-s" in registry.nodes(r)  # not reaped: the sweeper runs but the key lives
        finally:
            node.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: holders() == {"host-s": 8}, 25, "the node visible again after its next heartbeat")
        assert listed_alive()
        c.close()
    finally:
        channel.close()
        meta.stop()
        r.close()


def test_node_stale_secs_0_turns_the_bound_off(redis_server: RedisServer, tmp_path: Path) -> None:
    """0 is off, as for the metaserver's other intervals: only the live key hides a node (it
    hid every node from lookups and ListNodes whose heartbeat was older than 0 ms)."""
    r = connect(redis_server.url)
    r.flushall()
    registry.register(r, "a", "10.0.0.1:1", 60_000, True)
    meta = MetaServer(redis_server.url, tmp_path / "meta.log", extra=["--node-stale-secs", "0", "--sweep-interval", "0"])
    meta.start()
    channel = grpc.insecure_channel(meta.addr)
    try:
        ans = meta_pb2_grpc.MetaServiceStub(channel).ListNodes(meta_pb2.ListNodesRequest(), timeout=5)
        assert [(n.node, n.alive) for n in ans.nodes] == [("a", True)]
    finally:
        channel.close()
        meta.stop()
        r.close()
