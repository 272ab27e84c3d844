"""A node's lifecycle in the index (``--ttl-minutes``: minutes without node activity before
lifecycle cleanup, not block age), against a real redis-server and its clock.

A node whose live key expired is hidden but kept, entries and all, until it has sent nothing
(no heartbeat, no event in its stream) for ``--ttl-minutes``; a heartbeat before that brings
it back with the same incarnation and every entry; after that the sweeper reaps it.
"""

from __future__ import annotations

import random

import pytest

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import Client, connect
from pegaflow.meta import sweeper
from pegaflow.meta.events.schema import Op
from pegaflow.meta.index import Index
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server

NS = "lifecycle-ns"
IDLE_MS = 60_000  # the --ttl-minutes these tests sweep with (1 minute)


def held(r: Client, n: int = 12) -> tuple[int, list[bytes]]:
    """Node ``a`` registered (live), holding ``n`` blocks in the index."""
    nid, _ = registry.register(r, "a", "h:1", 60_000, switch=True)
    hs = [random.Random(i).randbytes(16) for i in range(n)]
    Index(r).apply(Op.INSERT, NS, nid, hs)
    registry.add_namespace_tags(r, {keys.ns_tag(NS): NS})
    return nid, hs


def redis_now_ms(r: Client) -> int:
    return registry.redis_ms(r.time())


def silent_for(r: Client, node: str, ms: int) -> None:
    """``node``'s live key expired and its last heartbeat stamp is ``ms`` old."""
    r.delete(keys.live_key(node))
    r.hset(keys.SEEN, node, redis_now_ms(r) - ms)


def test_a_silent_node_is_hidden_and_kept_and_a_heartbeat_brings_it_back_with_its_entries(
    redis_server: RedisServer,
) -> None:
    r = connect(redis_server.url)
    nid, hs = held(r)
    silent_for(r, "a", IDLE_MS // 2)
    assert registry.visible(r, ["a"]) == {}
    assert sweeper.sweep_once(r, idle_ms=IDLE_MS) == (0, 0)  # silent, but not for --ttl-minutes
    assert "a" in registry.nodes(r) and Index(r).holders(NS, hs) == [{nid}] * len(hs)
    assert registry.heartbeat(r, "a", nid, 60_000)  # the same incarnation recovers
    assert registry.visible(r, ["a"]) == {nid: "a"} and Index(r).holders(NS, hs) == [{nid}] * len(hs)
    assert nid not in registry.retired(r)


def test_a_node_silent_for_ttl_minutes_is_reaped_with_its_entries_and_stream(redis_server: RedisServer) -> None:
    r = connect(redis_server.url)
    nid, hs = held(r)
    r.xadd(stream_key("a"), {"e": b"x"}, id=f"{redis_now_ms(r) - 2 * IDLE_MS}-0")  # its last event, long ago
    silent_for(r, "a", IDLE_MS + 1000)
    assert sweeper.sweep_once(r, idle_ms=IDLE_MS) == (1, len(hs))
    assert "a" not in registry.nodes(r) and nid in registry.retired(r)
    assert Index(r).holders(NS, hs) == [set()] * len(hs)
    assert not r.exists(stream_key("a"))
    assert not registry.heartbeat(r, "a", nid, 60_000)  # reaped: the node must register anew


def test_a_recent_event_counts_as_activity_without_heartbeats(redis_server: RedisServer) -> None:
    r = connect(redis_server.url)
    nid, hs = held(r)
    silent_for(r, "a", 2 * IDLE_MS)  # no heartbeat for two ttls...
    r.xadd(stream_key("a"), {"e": b"x"})  # ...but an event just now
    assert sweeper.silent_nodes(r, IDLE_MS) == {}
    assert sweeper.sweep_once(r, idle_ms=IDLE_MS) == (0, 0)
    assert "a" in registry.nodes(r) and Index(r).holders(NS, hs) == [{nid}] * len(hs)


def test_a_live_node_is_never_reaped_however_old_its_stamp(redis_server: RedisServer) -> None:
    # The live key is the node's own claim (--liveness-ttl): while it exists nothing is removed.
    r = connect(redis_server.url)
    nid, hs = held(r)
    r.hset(keys.SEEN, "a", redis_now_ms(r) - 10 * IDLE_MS)
    assert sweeper.sweep_once(r, idle_ms=IDLE_MS) == (0, 0)
    assert Index(r).holders(NS, hs) == [{nid}] * len(hs)


def test_a_node_that_comes_back_while_it_is_reaped_keeps_its_new_stream(redis_server: RedisServer) -> None:
    """The stream and the registry are in different slots: between the sweeper's last look at
    the registry and its DEL, the node may register again and publish its new RESET. That DEL
    took the new entries with it (the snapshot never reached the index)."""
    r = connect(redis_server.url)
    held(r)
    r.xadd(stream_key("a"), {"e": b"old"}, id=f"{redis_now_ms(r) - 2 * IDLE_MS}-0")
    silent_for(r, "a", IDLE_MS + 1000)

    class ComesBack:
        """The node registers again and publishes right after the sweeper found it gone."""

        def __init__(self, real: Client) -> None:
            self.real = real

        def hexists(self, name: str, key: str) -> bool:
            there = bool(self.real.hexists(name, key))
            if not there and name == keys.NODES:
                registry.register(self.real, "a", "h:1", 60_000, switch=True)
                self.real.xadd(stream_key("a"), {"e": b"reset"})
            return there

        def __getattr__(self, attr: str) -> object:
            return getattr(self.real, attr)

    assert sweeper.sweep_once(ComesBack(r), idle_ms=IDLE_MS)[0] == 1  # type: ignore[arg-type, index]
    assert [f[b"e"] for _, f in r.xrange(stream_key("a"))] == [b"old", b"reset"], "the new RESET was deleted"
