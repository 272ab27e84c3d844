"""The node's event publisher (pegaflow/node/publishing.py) against a real redis-server:
what it leaves in its stream and the registry when Redis loses data, when it stops, when
its buffer overflows and when another node takes its name."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from pegaflow.cluster import keys, registry
from pegaflow.meta.events.codec import FIELD, decode
from pegaflow.meta.events.schema import Op
from pegaflow.node.publishing import EventPublisher
from tests.harness.redis import RedisServer, start_server
from tests.integration.meta_harness import client
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def replayed(r: object, stream: str) -> set[bytes]:
    """What the stream says the node holds: its events replayed from the last RESET on."""
    held: set[bytes] = set()
    for _, fields in r.xrange(stream):  # type: ignore[attr-defined]
        ev = decode(fields[FIELD])
        if ev.op == Op.RESET:
            held = set()
            continue
        blocks = {ev.blob[i : i + 16] for i in range(0, len(ev.blob), 16)}
        if ev.op == Op.EVICT:
            held -= blocks
        else:
            held |= blocks
    return held


class Node:
    """A publisher over a block set that is its truth (the snapshot reads it)."""

    def __init__(self, srv: RedisServer, name: str = "n1", addr: str = "h:1", **kw: object) -> None:
        self.r = client(srv.url, False)
        self.truth: set[bytes] = set()
        self.pub = EventPublisher(self.r, name, addr, lambda: [("ns", sorted(self.truth))],
                                  flush_interval=0.001, **kw)  # type: ignore[arg-type]

    def insert(self, a: int, b: int) -> None:
        hs = [h(i) for i in range(a, b)]
        self.truth.update(hs)
        self.pub.on_insert("ns", hs)

    def evict(self, a: int, b: int) -> None:
        hs = [h(i) for i in range(a, b)]
        self.truth.difference_update(hs)
        self.pub.on_evict("ns", hs)


@pytest.mark.parametrize("publishes_after", [True, False], ids=["publishing", "idle"])
def test_a_redis_that_lost_the_end_of_a_stream_but_kept_the_registration_gets_a_re_sync(
    publishes_after: bool, tmp_path: Path
) -> None:
    srv = start_server(tmp_path / "redis")
    node = Node(srv, ttl_seconds=1.5)
    try:
        node.pub.start(wait=5)
        node.insert(0, 100)
        assert node.pub.wait_idle()
        node.r.save()  # what Redis will come back with
        node.insert(100, 200)
        node.evict(0, 50)
        assert node.pub.wait_idle()
        srv.stop()  # SHUTDOWN NOSAVE: the restart loads the older save, the registration in it
        srv.start()
        if publishes_after:
            node.insert(200, 210)
        wait_until(lambda: replayed(node.r, node.pub.stream) == node.truth, 10,
                   lambda: f"the stream to hold the node's blocks again (resyncs {node.pub.stats.resyncs})")
        assert node.pub.stats.resyncs == 2
    finally:
        node.pub.stop()
        srv.stop()


def test_updates_lost_while_redis_is_down_are_counted_as_dropped(tmp_path: Path) -> None:
    """The batch a failed flush took and what was buffered meanwhile are dropped: counted in
    stats and in pegaflow_node_events_dropped_blocks_total."""
    srv = start_server(tmp_path / "redis")
    metrics = CollectorRegistry()
    node = Node(srv, retry_seconds=1.0, registry=metrics)
    node.pub.flush_interval = 0.5
    try:
        node.pub.start(wait=5)
        srv.stop()
        node.insert(0, 1000)
        wait_until(lambda: node.pub._buf_blocks == 0, 5, "the flush to take the batch")  # then it retries
        node.insert(1000, 1500)  # buffered while the flush retries
        wait_until(lambda: node.pub.stats.errors >= 1, 10, "the flush to give up")
        assert node.pub.stats.dropped_blocks == 1500 and node.pub.stats.published_blocks == 0
        assert metrics.get_sample_value("pegaflow_node_events_dropped_blocks_total") == 1500
    finally:
        node.pub.stop()
        srv.stop()


def start_one_after_the_other(a: Node, b: Node) -> None:
    """Two nodes given one id: ``a`` registers and publishes first, then ``b`` takes the name."""
    a.insert(0, 10)
    a.pub.start(wait=5)
    b.insert(100, 110)
    b.pub.start(wait=5)


def test_two_nodes_given_one_node_id_do_not_knock_each_other_out(tmp_path: Path) -> None:
    """The node that registered last keeps the name; the other logs one error naming both
    addresses, sets its conflict gauge and publishes nothing until the first one is gone,
    then registers anew."""
    srv = start_server(tmp_path / "redis")
    metrics = CollectorRegistry()
    a = Node(srv, "dup", "10.0.0.1:50055", ttl_seconds=1.5, registry=metrics)
    b = Node(srv, "dup", "10.0.0.2:50055", ttl_seconds=1.5)
    conflict = "pegaflow_node_events_node_id_conflict"
    try:
        with capture_logs() as logs:
            start_one_after_the_other(a, b)
            stamps: set[bytes] = set()

            def heartbeats() -> bool:
                stamps.add(a.r.hget(keys.SEEN, "dup"))
                return len(stamps) >= 5

            wait_until(heartbeats, 10, "a few more heartbeats (a third of the TTL apart)", every=0.05)
            assert (a.pub.stats.resyncs, b.pub.stats.resyncs) == (1, 1)
            assert metrics.get_sample_value(conflict) == 1
            assert registry.nodes(a.r)["dup"].addr == "10.0.0.2:50055"
            assert registry.visible(a.r, ["dup"]) == {b.pub.nid: "dup"}
            assert replayed(a.r, a.pub.stream) == b.truth
        errors = [e for e in logs if e["log_level"] == "error"]
        assert len(errors) == 1, logs
        assert errors[0]["other_addr"] == "10.0.0.2:50055" and "--node-id" in errors[0]["fix"]
        b.pub.stop()  # the name is free: the first node registers again, its blocks published
        wait_until(lambda: registry.visible(a.r, ["dup"]) == {a.pub.nid: "dup"}, 10, "the first node back")
        wait_until(lambda: replayed(a.r, a.pub.stream) == a.truth, 10, "its snapshot")
        assert metrics.get_sample_value(conflict) == 0 and a.pub.stats.resyncs == 2
    finally:
        a.pub.stop()
        b.pub.stop()
        srv.stop()


def test_a_node_whose_name_another_took_reports_the_conflict_not_a_redis_loss(tmp_path: Path) -> None:
    """The other node's start trims the shared stream at its RESET, which takes this node's
    last entry: its next flush (long before its heartbeat) found the entry gone and reported
    Redis losing acknowledged writes, pointing the operator at Redis instead of the id."""
    srv = start_server(tmp_path / "redis")
    a = Node(srv, "dup", "10.0.0.1:50055", ttl_seconds=30)
    b = Node(srv, "dup", "10.0.0.2:50055", ttl_seconds=30)
    try:
        with capture_logs() as logs:
            start_one_after_the_other(a, b)
            a.insert(10, 20)  # flushed at once: its round trip finds its last entry trimmed
            wait_until(lambda: any(e["log_level"] == "error" for e in logs), 10, "the conflict reported")
        assert a.pub.stats.errors == 0, logs
        assert not [e for e in logs if e["log_level"] == "warning"], logs
        (error,) = [e for e in logs if e["log_level"] == "error"]
        assert error["other_addr"] == "10.0.0.2:50055"
    finally:
        a.pub.stop()
        b.pub.stop()
        srv.stop()
