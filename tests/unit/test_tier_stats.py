"""The Stats RPC reports what /metrics exports, and no number of it is silently zero.

The tiers' typed ``stats()`` (``SsdStats``, ``PeerStats``) read their metrics objects, and
the Stats RPC builds its ``ssd`` and ``peers`` answers from them field for field. Here a real
SSD tier writes and promotes, and a real pin table, PegaPeer service and TCP data port serve
a real puller (the metaserver faked); then every field of both and of the node's own block
counts is compared with the sample /metrics renders for it, and checked to be non-zero: a
field read from the wrong place, or a metric that a rename left behind, fails here."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from pegaflow._proto import node_pb2, peer_pb2
from pegaflow.core.tiers import OUTCOMES, Tier
from pegaflow.node.admin import NodeAdmin
from pegaflow.node.idle import DataPathIdle
from pegaflow.node.metrics import NodeMetrics
from pegaflow.node.service import NodeService
from pegaflow.node.sessions import Sessions
from pegaflow.node.tiers.remote.metrics import PeerStats
from pegaflow.node.tiers.remote.puller import Holder
from pegaflow.node.tiers.ssd import SsdStats, promote
from tests.unit.test_p2p import Side, hashes, pull, pulling_from
from tests.unit.test_ssd_gates import _Tier
from tests.unit.test_ssd_store import WAIT_S
from tests.waiting import wait_until_async

# Each field of the typed stats -> the sample /metrics renders it as.
SSD_SAMPLES = {
    "capacity_bytes": "pegaflow_node_ssd_capacity_bytes",
    "used_bytes": "pegaflow_node_ssd_used_bytes",
    "blocks": "pegaflow_node_ssd_blocks",
    "write_bytes": "pegaflow_node_ssd_write_bytes_total",
    "read_bytes": "pegaflow_node_ssd_read_bytes_total",
    "write_bytes_per_second": "pegaflow_node_ssd_write_bytes_per_second",
    "read_bytes_per_second": "pegaflow_node_ssd_read_bytes_per_second",
    "write_queue_blocks": "pegaflow_node_ssd_write_queue_blocks",
    "promoted_blocks": "pegaflow_node_ssd_promoted_blocks_total",
    "skipped_writes": "pegaflow_node_ssd_skipped_writes_total{reason=%r}",
}
PEER_SAMPLES = {  # a dict field: one sample per label value
    "pulls": "pegaflow_node_p2p_pulls_total{status=%r}",
    "pull_bytes": "pegaflow_node_p2p_pull_bytes_total",
    "served_bytes": "pegaflow_node_p2p_served_bytes_total",
    "active_pins": "pegaflow_node_p2p_active_pins",
    "backed_off_peers": "pegaflow_node_p2p_backed_off_peers",
    "lookups": "pegaflow_node_p2p_lookups_total{result=%r}",
}
NODE_SAMPLES = {  # StatsResponse field -> sample; TierBlocks: one per outcome (pegaflow.core.tiers)
    "request_blocks": "pegaflow_node_request_blocks_total{outcome='%s'}",
    "hit_blocks": "pegaflow_node_hit_blocks_total{tier='%s'}",
    "save_bytes": "pegaflow_node_save_bytes_total",
    "load_bytes": "pegaflow_node_load_bytes_total",
}


def scrape(metrics: NodeMetrics | Side) -> dict[str, float]:
    """``/metrics`` as text, parsed: ``name{labels}`` -> value."""
    text = generate_latest(metrics.registry).decode().replace('"', "'")
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln[:1] != "#"}


def by_label(scraped: dict[str, float], sample: str) -> dict[str, float]:
    """A one-label family's samples in ``scrape``'s output (``sample`` as in the maps above):
    {label value: value}, every label value it renders."""
    family = sample.split("{")[0] + "{"
    return {k.split("'")[1]: v for k, v in scraped.items() if k.startswith(family)}


def service(metrics: NodeMetrics, t: _Tier | None = None, side: Side | None = None, puller=None) -> NodeService:  # noqa: ANN001
    index = t.index if t is not None else side.index  # type: ignore[union-attr]
    sessions = Sessions(index)
    admin = NodeAdmin(index, sessions, metrics, "n", 0.5, 16384, ssd=t.tier if t is not None else None)
    return NodeService(index, sessions, metrics, "/pool", 4 << 20, "n", 0, idle=DataPathIdle(), admin=admin,
                       ssd=t.tier if t is not None else None, remote=puller,
                       peer_stats=puller.metrics.stats if puller is not None else None)


def stats_rpc(svc: NodeService) -> node_pb2.StatsResponse:
    return svc.stats(node_pb2.StatsRequest(), "grpc")


def test_the_maps_name_every_field() -> None:
    assert set(SSD_SAMPLES) == {f.name for f in dataclasses.fields(SsdStats)} == set(
        node_pb2.SsdStats.DESCRIPTOR.fields_by_name)
    assert set(PEER_SAMPLES) == {f.name for f in dataclasses.fields(PeerStats)} == set(
        node_pb2.PeerStats.DESCRIPTOR.fields_by_name)


def _ssd_agrees(t: _Tier, svc: NodeService, fields: set[str]) -> None:
    """SsdStats, the Stats RPC and /metrics agree on every field; ``fields`` are non-zero."""
    stats, rpc, scraped = t.tier.stats(), stats_rpc(svc).ssd, scrape(t.metrics)
    for name, sample in SSD_SAMPLES.items():
        value = getattr(stats, name)
        if isinstance(value, dict):  # one sample per label value (none before the first)
            assert value == dict(getattr(rpc, name)) == by_label(scraped, sample), name
        else:
            assert value == getattr(rpc, name) == scraped[sample], name
    for name in fields:
        assert getattr(stats, name) > 0, f"SsdStats.{name} is 0"


def test_ssd_stats_are_what_metrics_export_and_none_is_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(promote, "HOLD_SECONDS", 0.0)

    async def run() -> None:
        t = _Tier(tmp_path, "threads")
        svc = service(t.metrics, t)
        hs = [i.to_bytes(16, "little") for i in range(1, 9)]
        t.save(hs)  # queued for SSD, not written yet: read before the loop turns
        _ssd_agrees(t, svc, {"capacity_bytes", "write_queue_blocks"})
        await wait_until_async(t.tier.writer.idle, WAIT_S, "the write-behind to drain")
        # The throughput gauges cover the last second (the tier's stats task, once a second).
        await wait_until_async(lambda: t.tier.stats().write_bytes_per_second > 0, WAIT_S, "a write throughput")
        _ssd_agrees(t, svc, {"used_bytes", "blocks", "write_bytes", "write_bytes_per_second"})
        t.index.remove(t.index.resident())
        assert t.tier.promote([t.ns], hs, 0) == len(hs)
        await wait_until_async(lambda: all(t.index.get(t.ns, h) is not None for h in hs), WAIT_S,
                               "every block promoted")
        await wait_until_async(lambda: t.tier.stats().read_bytes_per_second > 0, WAIT_S, "a read throughput")
        _ssd_agrees(t, svc, {"read_bytes", "read_bytes_per_second", "promoted_blocks"})
        await t.close()

    asyncio.run(run())


def test_the_nodes_block_counts_in_stats_are_what_metrics_export(tmp_path: Path) -> None:
    async def run() -> None:
        t = _Tier(tmp_path, "threads")
        svc = service(t.metrics, t)
        m = t.metrics
        for i, tier in enumerate(Tier, 1):
            m.hits.labels(tier).inc(i)
        for i, outcome in enumerate(OUTCOMES, 1):
            m.request_blocks.labels(outcome).inc(10 * i)
        m.misses.inc(4)
        m.save_bytes.inc(100)
        m.load_bytes.inc(50)
        rpc, scraped = stats_rpc(svc), scrape(m)
        for outcome in OUTCOMES:
            assert getattr(rpc.request_blocks, outcome) == scraped[NODE_SAMPLES["request_blocks"] % outcome] > 0
        for tier in Tier:
            assert getattr(rpc.hit_blocks, tier) == scraped[NODE_SAMPLES["hit_blocks"] % tier] > 0
        assert rpc.hit_blocks.miss == scraped["pegaflow_node_miss_blocks_total"] == 4
        assert rpc.save_bytes == scraped[NODE_SAMPLES["save_bytes"]] == 100
        assert rpc.load_bytes == scraped[NODE_SAMPLES["load_bytes"]] == 50
        await t.close()

    asyncio.run(run())


def _peers_agree(stats: PeerStats, side: Side, fields: set[str]) -> None:
    scraped = scrape(side)
    for name, sample in PEER_SAMPLES.items():
        value = getattr(stats, name)
        if isinstance(value, dict):
            assert value and value == by_label(scraped, sample), name
        else:
            assert value == scraped[sample], name
    for name in fields:
        value = getattr(stats, name)
        assert (sum(value.values()) if isinstance(value, dict) else value) > 0, f"PeerStats.{name} is 0"


def test_peer_stats_are_what_metrics_export_and_none_is_zero() -> None:
    with pulling_from(Side("a")) as (a, b, meta, peers, puller):
        hs = hashes("stats", 8)
        a.store(hs)
        meta.holders = [Holder("a", a.address, 8)]
        pull(a, b, puller, hs[:4], 0)  # pulls{ok}, pull and served bytes, lookups{found}

        def bad(resp: peer_pb2.PinResponse) -> None:
            resp.page_bytes *= 2

        peers.tamper = bad
        pull(a, b, puller, hs, 4)  # a wrong answer: the peer is backed off

        async def pinned() -> None:  # a pin held for a puller, on the serving side
            a.table.loop = asyncio.get_running_loop()
            assert await a.table.pin_for_transfer(a.ns.name, hs[:2], ttl=30.0) is not None

        asyncio.run(pinned())
        stats = puller.metrics.stats()
        _peers_agree(stats, b, {"pulls", "pull_bytes", "backed_off_peers", "lookups"})
        assert stats.pulls["ok"] == 1 and stats.pulls["bad_answer"] == 1
        _peers_agree(a.metrics.stats(), a, {"served_bytes", "active_pins"})
        rpc = stats_rpc(service(NodeMetrics(), side=b, puller=puller)).peers
        assert rpc == node_pb2.PeerStats(**dataclasses.asdict(puller.metrics.stats()))
        assert rpc.pull_bytes == scrape(b)[PEER_SAMPLES["pull_bytes"]] > 0
