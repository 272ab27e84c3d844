"""The Rust original's metric names (tests/original_metrics.py) on a live node's and a live
metaserver's /metrics, with the original's types and labels, beside ours, and with values
that mean what they should after real traffic (an L1 hit, an SSD promotion, a miss,
metaserver lookups good and bad): each equals the series of ours it is derived from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pegaflow.client import PegaClient
from pegaflow.common.metric_alias import TONIC_STATUS
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures
from tests.integration.metrics_stack import (
    NS,
    PAGE,
    SAVED,
    WAIT_S,
    drive,
    node_args,
    scrape,
    start_metaserver,
    value,
)
from tests.original_metrics import EXPORTED, NOT_EXPORTED, ORIGINAL_NAMES, OriginalMetric
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def check_declared(types: dict[str, str], samples: dict, wanted: list[OriginalMetric]) -> None:
    """Every name is exported with the original's type, and its series carry exactly its labels."""
    missing = [m.name for m in wanted if m.name not in types]
    assert not missing, f"the original's metrics missing from /metrics: {missing}"
    wrong = {m.name: (m.kind, types[m.name]) for m in wanted if types[m.name] != m.kind}
    assert not wrong, f"type differs from the original's (want, got): {wrong}"
    for m in wanted:
        series = m.name if m.kind != "histogram" else m.name + "_count"
        for labels, _ in samples.get(series, []):
            assert set(labels) == set(m.labels), f"{series}{labels}: the original's labels are {m.labels}"


def test_every_original_name_is_in_the_docs_mapping_table() -> None:
    text = DOC.read_text()
    section = text[text.index("## The original's names"):text.index("## OTLP export")]
    rows = {n for line in section.splitlines() if line.startswith("| `pegaflow_")
            for n in re.findall(r"`(pegaflow_[a-z_]+)`", line.split("|")[1])}
    assert not sorted(ORIGINAL_NAMES - rows), f"not in docs/metrics.md's table: {sorted(ORIGINAL_NAMES - rows)}"
    assert not set(NOT_EXPORTED) & {m.name for m in EXPORTED}


def test_a_live_node_and_metaserver_serve_the_originals_names(node_factory, redis_server: RedisServer,
                                                              tmp_path: Path) -> None:
    meta = start_metaserver(tmp_path, redis_server.url, ("--index-census-interval", "0.2", "--enable-decode-backup"))
    try:
        # Two SSD reads in flight at most: the SSD request's four blocks are promoted two by two.
        node = node_factory(pool_size="1mb",
                            extra=node_args(tmp_path, redis_server.url) + ["--max-prefetch-blocks", "2"])
        # A fresh pool is one free extent (sampled every second).
        wait_until(lambda: node.metric("pegaflow_pool_largest_free_bytes") == 1 << 20, WAIT_S,
                   "the largest free extent to be the whole pool")
        t = drive(node, meta)

        # The node's loop refreshes the window gauges every 5 s; the publisher flushes on its own.
        # A scrape collects family by family (pegaflow.common.http.Renders), so a refresh may
        # fall between our gauge and its alias: wait until both show every request in every
        # window; later refreshes then set the same values.
        requested = t.l1_hits + t.ssd_blocks + t.missed

        def settled():  # type: ignore[no-untyped-def]
            types, s = scrape(node.http_port)
            ok = (all(value(s, name, window=w) >= requested for w in ("15m", "1h", "1d")
                      for name in ("pegaflow_hll_total_requests", "pegaflow_node_window_requested_blocks"))
                  and value(s, "pegaflow_metaserver_registration_blocks_total") >= SAVED)
            return (types, s) if ok else None

        types, s = wait_until(settled, WAIT_S, "the window gauges and the publisher to catch up")
        check_declared(types, s, [m for m in EXPORTED if m.process == "node"])

        def same(orig: str, ours: str, **labels: str) -> float:
            a, b = value(s, orig), value(s, ours, **labels)
            assert a == b, f"{orig} = {a}, but {ours}{labels or ''} = {b}"
            return a

        # Pool and residency: the same scrape, the same numbers.
        assert same("pegaflow_pool_capacity_bytes", "pegaflow_node_pool_capacity_bytes") == 1 << 20
        used = same("pegaflow_pool_used_bytes", "pegaflow_node_pool_used_bytes")
        assert 0 <= same("pegaflow_pool_largest_free_bytes", "pegaflow_node_pool_largest_free_bytes") <= (1 << 20) - used
        same("pegaflow_cache_resident_bytes", "pegaflow_node_resident_bytes")
        assert same("pegaflow_cache_resident_blocks", "pegaflow_node_resident_blocks") > 0
        assert value(s, "pegaflow_inflight_bytes") == 0  # every reservation was committed
        # Hits, misses, tiers: after one L1 hit, one SSD promotion and one miss.
        assert same("pegaflow_cache_block_hits_total", "pegaflow_node_hit_blocks_total", tier="l1") >= t.l1_hits
        assert same("pegaflow_cache_block_misses_total", "pegaflow_node_miss_blocks_total") >= t.missed
        tiers = {lb["tier"]: v for lb, v in s["pegaflow_cache_tier_block_requests_total"]}
        assert tiers == {"ram": t.l1_hits, "ssd": t.ssd_blocks, "rdma": 0, "miss": t.missed}, tiers
        assert sum(tiers.values()) == value(s, "pegaflow_node_request_blocks_total")
        inserted = same("pegaflow_cache_block_insertions_total", "pegaflow_node_inserted_blocks_total")
        assert inserted == SAVED + t.ssd_blocks  # the saves, then the promoted copies
        evictions = same("pegaflow_cache_block_evictions_total", "pegaflow_node_evictions_total", tier="l1")
        assert evictions > 0
        # No pulled copies on this node: every eviction took a retained block.
        by_class = {lb["class"]: v for lb, v in s["pegaflow_cache_block_evictions_by_class_total"]}
        assert by_class == {"reclaimable": 0, "retained": evictions}, by_class
        assert by_class["retained"] == value(s, "pegaflow_node_evicted_blocks_by_class_total", **{"class": "retained"})
        # Each eviction ended one residence under pressure; nothing was removed on request.
        assert value(s, "pegaflow_cache_residence_duration_seconds_count", reason="pressure") == value(
            s, "pegaflow_node_block_residence_seconds_count", reason="pressure") == evictions
        assert value(s, "pegaflow_cache_residence_duration_seconds_count", reason="cleanup") == 0
        # Every page is PAGE bytes, freed when its block is evicted.
        assert same("pegaflow_cache_eviction_reclaimed_bytes_total", "pegaflow_node_evicted_bytes_total") == \
            evictions * PAGE
        assert same("pegaflow_save_bytes_total", "pegaflow_node_save_bytes_total") == SAVED * PAGE
        assert same("pegaflow_load_bytes_total", "pegaflow_node_load_bytes_total") >= (t.l1_hits + t.ssd_blocks) * PAGE
        same("pegaflow_pool_alloc_failures_total", "pegaflow_node_reserve_skipped_blocks_total", reason="no_space")
        same("pegaflow_cache_block_admission_rejections_total", "pegaflow_node_admission_rejections_total")
        # The ceiling per window: the same gauges under the original's names.
        for w in ("15m", "1h", "1d"):
            assert value(s, "pegaflow_hll_total_requests", window=w) == value(
                s, "pegaflow_node_window_requested_blocks", window=w)
            assert value(s, "pegaflow_hll_cardinality", window=w) == value(
                s, "pegaflow_node_window_distinct_blocks", window=w)
            rate = value(s, "pegaflow_hll_estimated_hit_rate", window=w)
            assert rate == value(s, "pegaflow_node_ceiling_hit_ratio", window=w) and 0 <= rate <= 1
        # SSD: written, then promoted once.
        assert same("pegaflow_ssd_write_bytes_total", "pegaflow_node_ssd_write_bytes_total") >= SAVED * PAGE
        assert same("pegaflow_ssd_prefetch_success_total", "pegaflow_node_ssd_promoted_blocks_total") >= t.ssd_blocks
        assert same("pegaflow_ssd_prefetch_bytes_total", "pegaflow_node_ssd_read_bytes_total") >= t.ssd_blocks * PAGE
        assert value(s, "pegaflow_ssd_prefetch_failures_total") == 0
        assert value(s, "pegaflow_ssd_prefetch_duration_seconds_count") == value(
            s, "pegaflow_node_ssd_promotion_seconds_count") >= 1
        for kind, direction in (("write", "write"), ("read", "prefetch")):  # one observation per SSD I/O
            ours = f"pegaflow_node_ssd_{kind}_io_throughput_bytes_per_second_count"
            for name in (f"pegaflow_ssd_{direction}_throughput_per_second_count",
                         f"pegaflow_ssd_{direction}_throughput_bytes_per_second_per_second_count"):
                assert value(s, name) == value(s, ours) >= 1, name
        # No Reset or clear: nothing left DRAM while still held.
        assert same("pegaflow_cache_block_evictions_still_referenced_total", "pegaflow_node_removed_held_blocks_total") == 0
        same("pegaflow_ssd_write_queue_pending", "pegaflow_node_ssd_write_queue_blocks")
        same("pegaflow_ssd_write_inflight", "pegaflow_node_ssd_direction_inflight_ios", direction="write")
        same("pegaflow_ssd_prefetch_inflight", "pegaflow_node_ssd_direction_inflight_ios", direction="prefetch")
        same("pegaflow_ssd_prefetch_queue_full_total", "pegaflow_node_ssd_prefetch_dropped_blocks_total")
        # The first Query of the SSD request promoted two blocks and left two for the next one.
        assert same("pegaflow_ssd_prefetch_backpressure_blocks_total",
                    "pegaflow_node_ssd_prefetch_deferred_blocks_total") >= t.ssd_blocks - 2
        # The global index: the saves were published (an evicted block already on SSD is published
        # as a tier change, an insert, not as a removal).
        assert value(s, "pegaflow_metaserver_registration_blocks_total") == value(
            s, "pegaflow_node_events_published_blocks_total", op="insert") + value(
            s, "pegaflow_node_events_published_blocks_total", op="snapshot")
        same("pegaflow_metaserver_removal_blocks_total", "pegaflow_node_events_published_blocks_total", op="evict")
        # A TCP node (no --nics) opens no RDMA queue pair; RDMA ones: tests/unit/test_rdma_qps.py.
        assert len(s["pegaflow_node_p2p_rdma_queue_pairs"]) == 2  # pull, serve
        assert value(s, "pegaflow_rdma_qps") == value(s, "pegaflow_node_p2p_rdma_queue_pairs") == 0
        # RPCs: every Query we sent, under the original's method/status labels.
        assert value(s, "pegaflow_rpc_requests_total", method="query", status="ok") >= t.queries
        assert value(s, "pegaflow_rpc_requests_total") == value(s, "pegaflow_node_rpc_duration_seconds_count")
        assert value(s, "pegaflow_rpc_duration_seconds_count", method="query") == value(
            s, "pegaflow_node_rpc_duration_seconds_count", method="Query")
        assert {lb["method"] for lb, _ in s["pegaflow_rpc_requests_total"]} >= {"register", "reserve", "commit",
                                                                                 "query", "release"}
        # Load-path pins are the leases'; none is held after the traffic.
        pins = ("pegaflow_pinned_for_load_entries", "pegaflow_pinned_for_load_refs",
                "pegaflow_pinned_for_load_unique_blocks", "pegaflow_pinned_for_load_unique_bytes")
        ours = ("pegaflow_node_lease_pin_entries", "pegaflow_node_lease_pin_refs",
                "pegaflow_node_lease_pinned_blocks", "pegaflow_node_lease_pinned_bytes")
        assert [same(a, b) for a, b in zip(pins, ours, strict=True)] == [0, 0, 0, 0]
        c = PegaClient(node.addr)
        try:  # one session leases the same resident blocks twice
            c.register({NS: PAGE})
            leases = [c.query([NS], t.saved[:4], req_id=f"pin-{i}") for i in range(2)]
            n = leases[0].hit_blocks
            assert n > 0 and all(q.status == "READY" and q.hit_blocks == n for q in leases), leases
            _, s = scrape(node.http_port)
            assert [same(a, b) for a, b in zip(pins, ours, strict=True)] == [n, 2 * n, n, n * PAGE]
            for q in leases:
                c.release(q.lease_id)
            _, s = scrape(node.http_port)
            assert [value(s, a) for a in pins] == [0, 0, 0, 0]
        finally:
            c.close()

        # The metaserver.
        types, s = wait_until(lambda: (r := scrape(meta.http_port)) and
                              value(r[1], "pegaflow_metaserver_nodes", state="active") == 1 and r,
                              WAIT_S, "the metaserver to see the node")
        check_declared(types, s, [m for m in EXPORTED if m.process == "meta"])
        assert value(s, "pegaflow_metaserver_rpc_requests_total", method="query_prefix", status="ok") == t.meta_ok
        bad = TONIC_STATUS["INVALID_ARGUMENT"]
        assert value(s, "pegaflow_metaserver_rpc_requests_total", method="query_prefix", status=bad) == t.meta_bad
        assert value(s, "pegaflow_metaserver_rpc_duration_seconds_count", method="query_prefix") == t.meta_ok + t.meta_bad
        assert value(s, "pegaflow_meta_rpc_duration_seconds_count", method="QueryPrefix",
                     status="INVALID_ARGUMENT") == t.meta_bad
        assert value(s, "pegaflow_metaserver_nodes", state="stale") == 0
        assert value(s, "pegaflow_metaserver_sweep_removed_nodes_total") == value(s, "pegaflow_meta_nodes_reaped_total")
        # The index counted in the background: every saved block (all on SSD, none removed), one
        # live holder each.
        _, s = wait_until(lambda: (r := scrape(meta.http_port)) and
                          value(r[1], "pegaflow_metaserver_store_entries") == SAVED and r,
                          WAIT_S, "the census to count the saved blocks")
        for orig, ours in (("pegaflow_metaserver_store_entries", "pegaflow_meta_index_blocks"),
                           ("pegaflow_metaserver_block_owners", "pegaflow_meta_index_owners"),
                           ("pegaflow_metaserver_block_redundancy_avg", "pegaflow_meta_index_redundancy_avg")):
            assert value(s, orig) == value(s, ours), (orig, ours)
        assert value(s, "pegaflow_metaserver_block_owners") == SAVED
        assert value(s, "pegaflow_metaserver_block_redundancy_avg") == 1.0
        red = {lb["owners"]: v for lb, v in s["pegaflow_metaserver_block_redundancy"]}
        assert red == {"1": SAVED, "2": 0, "3": 0, ">=4": 0}, red
        assert red == {lb["owners"]: v for lb, v in s["pegaflow_meta_index_redundancy_blocks"]}
    finally:
        meta.stop()
