"""Replay's cluster model (pegaflow/replay/cluster.py): one node is exactly replay's one
pool; peers serve from their L1 or, promoting first, from their SSD; L1 holders are
preferred among equals; the order of tiers a request walks."""

from __future__ import annotations

from pathlib import Path

from pegaflow.config.capacity import Capacity
from pegaflow.core.trace import read_trace
from pegaflow.replay.cluster import NodeCluster, main, replay_cluster
from pegaflow.replay.model import SSD_WRITES, Scenario
from pegaflow.replay.run import replay

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_slice.jsonl"
NS = "m"


def hs(tag: str, n: int) -> list[bytes]:
    return [f"{tag}:{i}".encode().ljust(16, b".")[:16] for i in range(n)]


def test_one_node_is_replays_one_pool() -> None:
    trace = read_trace(TRACE.open())
    l1, ssd = Capacity.parse("900blocks"), Capacity.parse("3000blocks")
    for writes in SSD_WRITES:
        ours = replay_cluster(trace, 1, l1, ssd, ssd_writes=writes)
        theirs = replay(trace, Scenario(l1=l1, ssd=ssd, ssd_writes=writes))
        assert ours.request_hits == theirs.request_hits
    assert ours.request_hits == theirs.request_hits
    assert ours.ssd == theirs.ssd_hit_blocks and ours.peer_l1 == ours.peer_ssd == 0


def test_peers_serve_from_l1_then_from_ssd_without_promoting() -> None:
    c = NodeCluster(3, (8, True), (64, True), {NS: 1})
    x = hs("x", 6)
    assert c.serve(0, NS, x) == (0, 0, 0, 0)  # computed on node 0
    assert c.serve(1, NS, x) == (0, 0, 6, 0)  # pulled from node 0's L1
    # push x out of node 0's and node 1's L1 (8 blocks each): onto their SSDs
    c.serve(0, NS, hs("f0", 8))
    c.serve(1, NS, hs("f1", 8))
    n0 = c.pools[0]
    assert not any(n0.l1.index.contains(n0.l1.ns[NS], h) for h in x)
    assert c.serve(2, NS, x) == (0, 0, 0, 6)  # only on peers' SSDs
    # the serving peer read x from its SSD into the transfer (pins.py): still on its SSD only
    for p in c.pools[:2]:
        assert not any(p.l1.index.contains(p.l1.ns[NS], h) for h in x)
        assert all(p.ssd.index.contains(p.ssd.ns[NS], h) for h in x)


def test_a_request_walks_own_l1_own_ssd_then_peers() -> None:
    c = NodeCluster(2, (8, True), (64, True), {NS: 1})
    a = hs("a", 8)
    c.serve(0, NS, a[:4])  # node 0: a[0:4]
    c.serve(0, NS, hs("f", 8))  # ... then on its SSD only
    assert c.serve(1, NS, a) == (0, 0, 0, 4)  # node 1: a[0:4] from node 0's SSD, computes a[4:8]
    assert not any(c.pools[0].l1.index.contains(c.pools[0].l1.ns[NS], h) for h in a[:4])  # served, not promoted
    assert c.serve(0, NS, a) == (0, 4, 4, 0)  # own SSD for a[0:4], then node 1's L1 for a[4:8]
    assert c.serve(0, NS, a) == (8, 0, 0, 0)  # all in its own L1 now


def test_a_peer_is_found_only_through_the_requests_leading_blocks() -> None:
    c = NodeCluster(2, (8, True), (64, True), {NS: 1})
    a = hs("a", 8)
    c.serve(1, NS, a[4:])  # node 1 holds a[4:8] but not a[0]: QueryPrefix does not list it
    assert c.serve(0, NS, a) == (0, 0, 0, 0)


def test_l1_holder_preferred_among_equal_coverage() -> None:
    c = NodeCluster(3, (4, True), (64, True), {NS: 1})
    y = hs("y", 4)
    c.serve(0, NS, y)
    c.serve(0, NS, hs("g", 4))  # y now only on node 0's SSD
    c.serve(1, NS, y)  # pulled from node 0's SSD: node 1 holds y in L1
    assert c.serve(2, NS, y) == (0, 0, 4, 0)  # from node 1's L1, not node 0's SSD


def test_peer_pulls_raise_the_cluster_hit_rate_and_the_cli_prints_both(capsys) -> None:
    trace = read_trace(TRACE.open())
    l1, ssd = Capacity.parse("300blocks"), Capacity.parse("1000blocks")
    alone = replay_cluster(trace, 3, l1, ssd, peers=False)
    pulled = replay_cluster(trace, 3, l1, ssd)
    assert pulled.hit_rate > alone.hit_rate and pulled.peer_ssd > 0
    assert main([str(TRACE), "--nodes", "3", "--l1", "300blocks", "--ssd", "1000blocks"]) == 0
    out = capsys.readouterr().out
    assert "no peer pulls" in out and f"{pulled.hit_rate:.2%}" in out


def test_pulled_copies_are_evicted_before_a_nodes_own_blocks() -> None:
    # The puller reserves pulled pages as reclaimable: the node's index evicts them first.
    c = NodeCluster(2, (8, True), (64, True), {NS: 1})
    x, y, z = hs("x", 4), hs("y", 4), hs("z", 2)
    c.serve(0, NS, x)
    c.serve(1, NS, y)  # node 1's own blocks, the older ones
    assert c.serve(1, NS, x) == (0, 0, 4, 0)  # pulled copies: node 1's L1 is full
    c.serve(1, NS, z)  # two victims
    n1 = c.pools[1]
    held = [h for h in x + y if n1.l1.index.contains(n1.l1.ns[NS], h)]
    assert held == x[2:] + y, "the least recent pulled copies go, not the older own blocks"
