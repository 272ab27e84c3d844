"""A real `pegaflow-node` with --redis-url publishes its block index; the metaserver's
index then equals what the node itself answers, through inserts and LRU evictions."""

from __future__ import annotations

import time

import pytest
import xxhash

from pegaflow.client import PegaClient
from pegaflow.cluster import keys, registry
from pegaflow.cluster.redis_conn import connect
from pegaflow.meta.events.consumer import Consumer
from pegaflow.meta.index import Index
from pegaflow.meta.lookup import Lookup
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server

PAGE = 64 << 10  # 64 KiB pages in a 4 MiB pool: 64 pages, so 100 blocks force evictions


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


@pytest.mark.serial  # gone within 3 s of a 1.5 s TTL
def test_node_daemon_publishes_inserts_and_evictions(node_factory, redis_server: RedisServer) -> None:
    node = node_factory(pool_size="4mb", extra=["--redis-url", redis_server.url, "--node-id", "host-a",
                                                 "--liveness-ttl", "1.5"])  # fmt: skip
    r = connect(redis_server.url)
    c = PegaClient(node.addr)
    c.register({"model-x": PAGE})
    hs = hashes("p", 100)
    for i in range(0, 100, 10):  # ten requests, chained prefixes of 10 blocks each
        res = c.reserve("model-x", hs[i : i + 10])
        c.commit(res.reservation_id)
    consumer = Consumer(r, Index(r), "t")
    lookup = Lookup(r)

    def node_holds(h: bytes) -> bool:
        q = c.query(["model-x"], [h])
        if q.lease_id:
            c.release(q.lease_id)
        return q.hit_blocks == 1

    def index_holds() -> list[bool]:
        consumer.wait_caught_up(5)
        return [bool(lookup.query_prefix("model-x", [h])) for h in hs]

    truth = [node_holds(h) for h in hs]
    assert 0 < sum(truth) < 100  # some were evicted
    wait_until(lambda: index_holds() == truth, 20, "index == the node's own answers")
    res = lookup.query_prefix("model-x", hs[90:])
    assert [(p.node, p.address, p.prefix_len) for p in res] == [("host-a", node.addr, 10)]
    node.kill()
    t0 = time.monotonic()
    wait_until(lambda: not lookup.query_prefix("model-x", hs[90:]), 5, "the dead node to vanish", every=0.05)
    assert time.monotonic() - t0 < 3.0
    c.close()


def test_a_reset_removes_blocks_from_the_index_without_counting_evictions(node_factory,
                                                                           redis_server: RedisServer) -> None:
    """A Reset's blocks leave the global index (published as removals) and are counted in
    pegaflow_node_removed_blocks_total{reason="reset"}, not as evictions, which count memory
    pressure only (the original's pegaflow_cache_block_evictions_total included)."""
    node = node_factory(pool_size="4mb", extra=["--redis-url", redis_server.url, "--node-id", "host-r"])
    r = connect(redis_server.url)
    c = PegaClient(node.addr)
    c.register({"model-r": PAGE})
    consumer = Consumer(r, Index(r), "t")
    lookup = Lookup(r)

    def held(hs: list[bytes]) -> int:
        consumer.wait_caught_up(5)
        return sum(bool(lookup.query_prefix("model-r", [h])) for h in hs)

    first = hashes("r", 40)  # 40 of the 64 pages: nothing evicted
    c.commit(c.reserve("model-r", first).reservation_id)
    wait_until(lambda: held(first) == 40, 20, "the index to hold the saved blocks")
    assert c.reset(["model-r"]).dropped_blocks == 40
    wait_until(lambda: held(first) == 0, 20, "the index to lose the reset's blocks")
    assert node.metric("pegaflow_node_removed_blocks_total", 'reason="reset"') == 40
    assert node.metric("pegaflow_node_evictions_total") == 0
    assert node.metric("pegaflow_cache_block_evictions_total") == 0

    more = hashes("s", 100)  # more than the pool: memory pressure evicts
    for i in range(0, 100, 10):
        c.commit(c.reserve("model-r", more[i:i + 10]).reservation_id)
    evicted = node.metric("pegaflow_node_evictions_total")
    assert evicted >= 100 - 64
    assert node.metric("pegaflow_cache_block_evictions_total") == evicted
    assert node.metric("pegaflow_node_removed_blocks_total") == 40  # unchanged by evictions
    c.close()


def test_a_node_that_stops_cleanly_is_hidden_at_once(node_factory, redis_server: RedisServer) -> None:
    """SIGTERM: the node's live key goes as it stops (the version bumped, so lookups' caches
    reload), not --liveness-ttl later, and lookups stop naming it."""
    node = node_factory(pool_size="4mb", extra=["--redis-url", redis_server.url, "--node-id", "host-s",
                                                 "--liveness-ttl", "60"])  # fmt: skip
    r = connect(redis_server.url)
    c = PegaClient(node.addr)
    c.register({"model-s": PAGE})
    hs = hashes("s", 10)
    c.commit(c.reserve("model-s", hs).reservation_id)
    consumer = Consumer(r, Index(r), "t")
    lookup = Lookup(r)

    def named() -> list[str]:
        consumer.wait_caught_up(5)
        return [p.node for p in lookup.query_prefix("model-s", hs)]

    wait_until(lambda: named() == ["host-s"], 20, "the index to name the node")
    version = registry.version(r)
    c.close()
    node.stop()
    assert not r.exists(keys.live_key("host-s"))
    assert registry.version(r) > version
    assert named() == []
    assert "host-s" in registry.nodes(r)  # still registered: reaped after --ttl-minutes as a dead node
