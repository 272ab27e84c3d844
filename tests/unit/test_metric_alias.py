"""pegaflow.common.metric_alias: the original's names read from ours at scrape time, each
event counted once (relabelled, summed; histograms merged bucket by bucket)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pegaflow.common.metric_alias import Alias, OriginalNames, ValueAlias, rpc_labels, snake


def series(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(reg).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_histograms_of_two_transports_merge_into_the_originals_labels() -> None:
    reg = CollectorRegistry()
    h = Histogram("pegaflow_x_rpc_duration_seconds", "x", ["method", "status", "transport"],
                  buckets=(0.001, 0.01), registry=reg)
    h.labels("QueryPrefix", "OK", "grpc").observe(0.0005)
    h.labels("QueryPrefix", "OK", "local").observe(0.005)
    h.labels("QueryPrefix", "INVALID_ARGUMENT", "grpc").observe(0.5)
    OriginalNames(reg, [
        Alias("pegaflow_rpc_requests", "counter", "n", ("pegaflow_x_rpc_duration_seconds",), ("method", "status"),
              relabel=rpc_labels, from_count=True),
        Alias("pegaflow_rpc_duration_seconds", "histogram", "s", ("pegaflow_x_rpc_duration_seconds",),
              ("method", "status"), relabel=rpc_labels),
    ])
    s = series(reg)
    ok = (("method", "query_prefix"), ("status", "ok"))
    bad = (("method", "query_prefix"), ("status", "Client specified an invalid argument"))
    assert s[("pegaflow_rpc_requests_total", ok)] == 2
    assert s[("pegaflow_rpc_requests_total", bad)] == 1
    assert s[("pegaflow_rpc_duration_seconds_bucket", (("le", "0.001"), *ok))] == 1
    assert s[("pegaflow_rpc_duration_seconds_bucket", (("le", "0.01"), *ok))] == 2
    assert s[("pegaflow_rpc_duration_seconds_bucket", (("le", "+Inf"), *bad))] == 1
    assert s[("pegaflow_rpc_duration_seconds_sum", ok)] == 0.0055


def test_a_histogram_with_finer_buckets_is_exported_with_the_originals_only() -> None:
    reg = CollectorRegistry()
    h = Histogram("pegaflow_x_copy_seconds", "x", buckets=(0.001, 0.005, 0.01, 0.1), registry=reg)
    for v in (0.0005, 0.003, 0.007, 0.05, 2.0):
        h.observe(v)
    OriginalNames(reg, [Alias("pegaflow_copy_duration_seconds", "histogram", "s", ("pegaflow_x_copy_seconds",),
                              buckets=frozenset({0.01, 0.1}))])
    s = series(reg)
    got = {dict(k)["le"]: v for (name, k), v in s.items() if name == "pegaflow_copy_duration_seconds_bucket"}
    assert got == {"0.01": 3, "0.1": 4, "+Inf": 5}, "cumulative counts at the kept bounds are exact"
    assert s[("pegaflow_copy_duration_seconds_count", ())] == 5
    assert s[("pegaflow_copy_duration_seconds_sum", ())] == s[("pegaflow_x_copy_seconds_sum", ())]


def test_sources_are_summed_and_an_absent_source_exports_nothing() -> None:
    reg = CollectorRegistry()
    a = Counter("pegaflow_x_a_total", "a", registry=reg)
    b = Counter("pegaflow_x_b_total", "b", ["reason"], registry=reg)
    a.inc(2)
    b.labels("io").inc(3)
    b.labels("full").inc(5)
    OriginalNames(reg, [
        Alias("pegaflow_sum", "counter", "a + b{io}", ("pegaflow_x_a", "pegaflow_x_b"),
              relabel=lambda lb: None if lb.get("reason") == "full" else {}),
        Alias("pegaflow_none", "counter", "no source", ("pegaflow_x_missing",)),
        ValueAlias("pegaflow_value", "gauge", "v", lambda: [(("x",), 7.0)], ("k",)),
    ])
    s = series(reg)
    assert s[("pegaflow_sum_total", ())] == 5
    assert not [k for k in s if k[0].startswith("pegaflow_none")]
    assert s[("pegaflow_value", (("k", "x"),))] == 7


def test_a_registered_labelled_source_without_children_is_zero() -> None:
    reg = CollectorRegistry()
    Counter("pegaflow_x_skipped_total", "s", ["reason"], registry=reg)
    OriginalNames(reg, [Alias("pegaflow_failures", "counter", "f", ("pegaflow_x_skipped",),
                              relabel=lambda lb: {} if lb.get("reason") == "io" else None)])
    assert series(reg)[("pegaflow_failures_total", ())] == 0


def test_snake_case_methods() -> None:
    assert [snake(m) for m in ("Query", "QueryPrefix", "GetClusterConfig")] == [
        "query", "query_prefix", "get_cluster_config"]


def test_the_originals_ssd_inflight_and_prefetch_drops_read_our_per_direction_series() -> None:
    from pegaflow.node.metrics import NodeMetrics
    from pegaflow.node.tiers.ssd.metrics import SsdMetrics

    m = NodeMetrics()
    ssd = SsdMetrics(m.registry)
    ssd.dir_inflight.labels("write").set(2)
    ssd.dir_inflight.labels("prefetch").set(5)
    ssd.prefetch_dropped.inc(3)
    s = series(m.registry)
    assert s[("pegaflow_ssd_write_inflight", ())] == 2
    assert s[("pegaflow_ssd_prefetch_inflight", ())] == 5
    assert s[("pegaflow_ssd_prefetch_queue_full_total", ())] == 3


def test_the_originals_double_total_counters_are_served_under_both_names() -> None:
    """Its instruments pegaflow_rdma_fetch_total and pegaflow_transfer_lock_timeouts_total are
    served by its exporter (opentelemetry-prometheus 0.31) with _total added once more."""
    from pegaflow.node.metrics import NodeMetrics
    from pegaflow.node.tiers.remote.metrics import PeerMetrics

    m = NodeMetrics()
    p2p = PeerMetrics(m.registry)
    p2p.pulls.labels(status="ok").inc(3)
    p2p.pulls.labels(status="partial").inc(1)
    p2p.pulls.labels(status="error").inc(2)
    p2p.pins_expired.inc(5)
    s = series(m.registry)
    for name in ("pegaflow_rdma_fetch_total", "pegaflow_rdma_fetch_total_total"):
        assert s[(name, (("status", "ok"),))] == 4 and s[(name, (("status", "error"),))] == 2, name
    for name in ("pegaflow_transfer_lock_timeouts_total", "pegaflow_transfer_lock_timeouts_total_total"):
        assert s[(name, ())] == 5, name
    text = generate_latest(m.registry).decode()
    assert "# TYPE pegaflow_rdma_fetch_total_total counter" in text


def test_without_an_ssd_tier_the_originals_ssd_series_are_absent() -> None:
    from pegaflow.node.metrics import NodeMetrics

    s = series(NodeMetrics().registry)
    assert not [k for k in s if k[0].startswith(("pegaflow_ssd_write_inflight", "pegaflow_ssd_prefetch_"))]


def test_evictions_by_class_come_from_the_index_as_the_node_binds_them() -> None:
    from pegaflow.core.block_index import BlockIndex
    from pegaflow.node.metrics import NodeMetrics

    idx = BlockIndex(3 * 4096)
    ns = idx.namespace("a", 4096)
    m = NodeMetrics()
    m.bind(evictions_by_class=lambda: (idx.evictions, idx.evicted_reclaimable),
           evicted_bytes=lambda: idx.evicted_bytes)
    idx.insert(ns, [b"1" * 16])
    idx.insert(ns, [b"2" * 16], reclaimable=True)  # a pulled copy: first in line
    idx.insert(ns, [b"3" * 16, b"4" * 16, b"5" * 16])  # 3 fits; 4 evicts the copy, 5 the oldest retained
    got = series(m.registry)
    for name in ("pegaflow_cache_block_evictions_by_class_total", "pegaflow_node_evicted_blocks_by_class_total"):
        assert got[(name, (("class", "reclaimable"),))] == 1
        assert got[(name, (("class", "retained"),))] == 1
    assert got[("pegaflow_cache_eviction_reclaimed_bytes_total", ())] == 2 * 4096
