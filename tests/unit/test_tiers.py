"""One vocabulary of tiers (``pegaflow.core.tiers``): every place that must cover every tier
or outcome does, by the same names, and the names others fix (the original's metric labels,
vLLM's hit sources, the wire's enums) are mapped from each tier, none left out."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest

from pegaflow._proto import meta_pb2, node_pb2
from pegaflow.client.client import _LOADING_FROM
from pegaflow.connector.scheduler import VLLM_HIT_SOURCE
from pegaflow.core.tiers import LOCAL_TIERS, MISS, OUTCOMES, Tier
from pegaflow.meta.service import _WIRE_TIER
from pegaflow.node.metrics import _ORIGINAL_TIER, NodeMetrics
from pegaflow.node.tiers.remote.metrics import PeerMetrics
from pegaflow.ops.status import node_snapshot, totals
from pegaflow.ops.status_screen import LABEL, cluster_lines, tier_line
from pegaflow.policy.routing import TierCosts


def _samples(registry) -> set[str]:  # noqa: ANN001
    """``name{labels}`` of every sample /metrics renders (quotes as ')."""
    text = generate_latest(registry).decode().replace('"', "'")
    return {ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln[:1] != "#"}


def test_the_names_are_the_values_everyone_reads() -> None:
    assert [t.value for t in Tier] == ["l1", "ssd", "remote"]
    assert OUTCOMES == (Tier.L1, Tier.SSD, Tier.REMOTE, MISS) and MISS == "miss"
    assert set(LOCAL_TIERS) == set(Tier) - {Tier.REMOTE}
    assert str(Tier.REMOTE) == f"{Tier.REMOTE}" == "remote"  # a label value, a JSON key, a log field


def test_a_fresh_node_exports_every_tier_and_outcome_at_zero() -> None:
    m = NodeMetrics()
    got = _samples(m.registry)
    for tier in Tier:
        assert f"pegaflow_node_hit_blocks_total{{tier='{tier}'}}" in got
    for outcome in OUTCOMES:
        assert f"pegaflow_node_request_blocks_total{{outcome='{outcome}'}}" in got
    # The original's names for the same series: one label value per outcome, none invented.
    assert set(_ORIGINAL_TIER) == set(OUTCOMES)
    assert {s for s in got if s.startswith("pegaflow_cache_tier_block_requests_total{")} == {
        f"pegaflow_cache_tier_block_requests_total{{tier='{v}'}}" for v in ("ram", "rdma", "ssd", "miss")}
    peers = PeerMetrics(m.registry)
    assert peers is not None
    got = _samples(m.registry)
    for tier in LOCAL_TIERS:  # a pull is from a holder's own tier
        assert f"pegaflow_node_p2p_pulled_blocks_total{{holder_tier='{tier}'}}" in got


def test_stats_and_pegaflow_status_carry_every_outcome() -> None:
    counts = {o: i for i, o in enumerate(OUTCOMES, 1)}
    assert {f.name for f in node_pb2.TierBlocks.DESCRIPTOR.fields} == set(OUTCOMES)
    r = node_pb2.StatsResponse(node_id="n", request_blocks=node_pb2.TierBlocks(**counts),
                               hit_blocks=node_pb2.TierBlocks(**counts))
    snap = node_snapshot("h:1", r)
    assert snap["requests"] == snap["answers"] == counts
    t = totals([{"node": "a", "address": "h:1", "alive": True, "status": snap},
                {"node": "b", "address": "h:2", "alive": True, "status": snap}])
    assert t["requests"] == {o: 2 * n for o, n in counts.items()}
    assert set(LABEL) == set(OUTCOMES)
    line = tier_line("blocks", counts)
    for o, n in counts.items():
        assert f"{LABEL[o]} {n} " in line
    c = {"reachable": True, "metaserver": "m:1", "ceiling": None, "totals": t,
         "nodes": [{"node": "a", "address": "h:1", "alive": True, "status": snap}]}
    lines = cluster_lines(c, now=0.0)
    header = next(ln for ln in lines if ln.startswith("node "))
    assert header.split()[5:8] == [LABEL[k] for k in Tier] == ["L1", "SSD", "remote"]
    row = next(ln for ln in lines if ln.startswith("a "))
    assert row.split()[5:8] == [str(counts[k]) for k in Tier]


def test_the_wire_names_each_tier_it_carries() -> None:
    # A LOADING answer's rest comes from any tier but L1 (those blocks would be a hit).
    loading = {v for v in node_pb2.LoadingFrom.values() if v != node_pb2.LOADING_FROM_UNSPECIFIED}
    assert set(_LOADING_FROM) == loading
    assert set(_LOADING_FROM.values()) == set(Tier) - {Tier.L1}
    assert node_pb2.LOADING_FROM_REMOTE == 2  # the number is the wire (it was LOADING_FROM_PEER)
    # A holder's tier in the global index: one of its own.
    assert set(_WIRE_TIER) == set(LOCAL_TIERS)
    assert set(_WIRE_TIER.values()) == set(meta_pb2.Tier.values())


def test_vllm_hears_every_tier_in_its_own_words() -> None:
    assert set(VLLM_HIT_SOURCE) == set(Tier)
    assert len(set(VLLM_HIT_SOURCE.values())) == len(Tier)
    source = pytest.importorskip("vllm.v1.metrics.cache_hit_source").CacheHitSource
    assert VLLM_HIT_SOURCE == {Tier.L1: source.HOST, Tier.SSD: source.DISK, Tier.REMOTE: source.P2P}


def test_routing_weighs_each_tier_by_its_own_cost() -> None:
    assert [f.name for f in dataclasses.fields(TierCosts)] == [t.value for t in Tier]
    c = TierCosts(l1=0.1, ssd=0.2, remote=0.3)
    assert [c.of(t) for t in Tier] == [0.1, 0.2, 0.3]
    for tier in Tier:
        with pytest.raises(ValueError, match=str(tier)):
            TierCosts(**{tier.value: 1.5})
