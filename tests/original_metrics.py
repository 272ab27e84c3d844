"""The Rust original's metric names (novitalabs/pegaflow: docs/metrics.md, pegaflow-core/src/metrics.rs,
pegaflow-server/src/metric.rs, pegaflow-metaserver/src/metric.rs), kept in one place for the tests.

``EXPORTED``: what PegaFlow serves under the original's name, with the original's labels, as
its Prometheus exporter (opentelemetry-prometheus) names them: counters end in ``_total``,
unit ``s`` adds ``_seconds``. ``NOT_EXPORTED``: the original's names without a meaning here;
docs/metrics.md ("The original's names") says why for each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OriginalMetric:
    name: str  # as exported (a histogram's family name; series add _bucket/_count/_sum)
    kind: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    process: str  # node or meta
    needs: str = ""  # the part of the node it comes from, when not always there: ssd, p2p, publisher


def _n(name: str, kind: str, labels: tuple[str, ...] = (), needs: str = "") -> OriginalMetric:
    return OriginalMetric(name, kind, labels, "node", needs)


def _m(name: str, kind: str, labels: tuple[str, ...] = ()) -> OriginalMetric:
    return OriginalMetric(name, kind, labels, "meta")


EXPORTED: tuple[OriginalMetric, ...] = (
    _n("pegaflow_pool_used_bytes", "gauge"),
    _n("pegaflow_pool_capacity_bytes", "gauge"),
    _n("pegaflow_pool_largest_free_bytes", "gauge"),
    _n("pegaflow_pool_alloc_failures_total", "counter"),
    _n("pegaflow_inflight_bytes", "gauge"),
    _n("pegaflow_cache_block_hits_total", "counter"),
    _n("pegaflow_cache_block_misses_total", "counter"),
    _n("pegaflow_cache_tier_block_requests_total", "counter", ("tier",)),
    _n("pegaflow_cache_block_insertions_total", "counter"),
    _n("pegaflow_cache_block_admission_rejections_total", "counter"),
    _n("pegaflow_cache_block_evictions_total", "counter"),
    _n("pegaflow_cache_block_evictions_by_class_total", "counter", ("class",)),
    _n("pegaflow_cache_resident_bytes_by_class", "gauge", ("class",)),
    _n("pegaflow_cache_class_demotions_total", "counter", ("reason",)),
    _n("pegaflow_cache_block_evictions_still_referenced_total", "counter"),
    _n("pegaflow_cache_eviction_reclaimed_bytes_total", "counter"),
    _n("pegaflow_cache_residence_duration_seconds", "histogram", ("reason",)),
    _n("pegaflow_cache_resident_blocks", "gauge"),
    _n("pegaflow_cache_resident_bytes", "gauge"),
    _n("pegaflow_hll_cardinality", "gauge", ("window",)),
    _n("pegaflow_hll_total_requests", "gauge", ("window",)),
    _n("pegaflow_hll_estimated_hit_rate", "gauge", ("window",)),
    _n("pegaflow_pinned_for_load_entries", "gauge"),
    _n("pegaflow_pinned_for_load_refs", "gauge"),
    _n("pegaflow_pinned_for_load_unique_blocks", "gauge"),
    _n("pegaflow_pinned_for_load_unique_bytes", "gauge"),
    _n("pegaflow_save_bytes_total", "counter"),
    _n("pegaflow_load_bytes_total", "counter"),
    _n("pegaflow_save_duration_seconds", "histogram"),
    _n("pegaflow_load_duration_seconds", "histogram"),
    _n("pegaflow_load_failures_total", "counter"),
    _n("pegaflow_ssd_write_bytes_total", "counter", needs="ssd"),
    _n("pegaflow_ssd_write_failures_total", "counter", needs="ssd"),
    _n("pegaflow_ssd_write_queue_pending", "gauge", needs="ssd"),
    _n("pegaflow_ssd_write_queue_full_total", "counter", needs="ssd"),
    _n("pegaflow_ssd_prefetch_bytes_total", "counter", needs="ssd"),
    _n("pegaflow_ssd_prefetch_success_total", "counter", needs="ssd"),
    _n("pegaflow_ssd_prefetch_failures_total", "counter", needs="ssd"),
    _n("pegaflow_ssd_prefetch_duration_seconds", "histogram", needs="ssd"),
    _n("pegaflow_ssd_prefetch_backpressure_blocks_total", "counter", needs="ssd"),
    _n("pegaflow_ssd_write_inflight", "gauge", needs="ssd"),
    _n("pegaflow_ssd_prefetch_inflight", "gauge", needs="ssd"),
    _n("pegaflow_ssd_prefetch_queue_full_total", "counter", needs="ssd"),
    # unit bytes/s: 0.25.1's exporter's names, and the older ones its dashboard queries
    _n("pegaflow_ssd_write_throughput_per_second", "histogram", needs="ssd"),
    _n("pegaflow_ssd_prefetch_throughput_per_second", "histogram", needs="ssd"),
    _n("pegaflow_ssd_write_throughput_bytes_per_second_per_second", "histogram", needs="ssd"),
    _n("pegaflow_ssd_prefetch_throughput_bytes_per_second_per_second", "histogram", needs="ssd"),
    _n("pegaflow_metaserver_registration_blocks_total", "counter", needs="publisher"),
    _n("pegaflow_metaserver_removal_blocks_total", "counter", needs="publisher"),
    _n("pegaflow_metaserver_registration_queue_full_total", "counter", needs="publisher"),
    _n("pegaflow_metaserver_registration_failures_total", "counter", needs="publisher"),
    _n("pegaflow_transfer_lock_active", "gauge", needs="p2p"),
    _n("pegaflow_transfer_lock_timeouts_total", "counter", needs="p2p"),
    _n("pegaflow_rdma_fetch_total", "counter", ("status",), needs="p2p"),
    # its instruments named ..._total, as its exporter really serves them (a second _total)
    _n("pegaflow_transfer_lock_timeouts_total_total", "counter", needs="p2p"),
    _n("pegaflow_rdma_fetch_total_total", "counter", ("status",), needs="p2p"),
    _n("pegaflow_rdma_fetch_duration_seconds", "histogram", needs="p2p"),
    _n("pegaflow_rdma_fetch_bytes_total", "counter", needs="p2p"),
    _n("pegaflow_rdma_qps", "gauge", needs="p2p"),
    _n("pegaflow_rpc_requests_total", "counter", ("method", "status")),
    _n("pegaflow_rpc_duration_seconds", "histogram", ("method", "status")),
    _m("pegaflow_metaserver_rpc_requests_total", "counter", ("method", "status")),
    _m("pegaflow_metaserver_rpc_duration_seconds", "histogram", ("method", "status")),
    _m("pegaflow_metaserver_nodes", "gauge", ("state",)),
    _m("pegaflow_metaserver_sweep_removed_owners_total", "counter"),
    _m("pegaflow_metaserver_sweep_removed_nodes_total", "counter"),
    _m("pegaflow_metaserver_store_entries", "gauge"),
    _m("pegaflow_metaserver_block_owners", "gauge"),
    _m("pegaflow_metaserver_block_redundancy", "gauge", ("owners",)),
    _m("pegaflow_metaserver_block_redundancy_avg", "gauge"),
    # The decode backup (0.25): the node's while it publishes, the metaserver's with --enable-decode-backup.
    _n("pegaflow_backup_role", "gauge", needs="publisher"),
    _n("pegaflow_backup_candidates_reported_total", "counter", needs="publisher"),
    _n("pegaflow_backup_pull_missing_blocks_total", "counter", needs="publisher"),
    _m("pegaflow_metaserver_backup_nodes", "gauge", ("role",)),
    _m("pegaflow_metaserver_backup_candidates", "gauge"),
    _m("pegaflow_metaserver_backup_candidates_filtered_total", "counter", ("reason",)),
    _m("pegaflow_metaserver_backup_dispatched_blocks_total", "counter", ("source", "target")),
    _m("pegaflow_metaserver_backup_dispatched_bytes_total", "counter", ("source", "target")),
    _m("pegaflow_metaserver_backup_pair", "gauge", ("source", "target")),
)

NOT_EXPORTED: tuple[str, ...] = (
    "pegaflow_ssd_write_duration_seconds",
    "pegaflow_inflight_gc_cleaned_total",
    "pegaflow_prefetch_stale_gc_total",
    "pegaflow_metaserver_removal_failures_total",
    "pegaflow_metaserver_removal_queue_full_total",
    "pegaflow_metaserver_heartbeat_failures_total",
    "pegaflow_metaserver_session_resets_total",
    "pegaflow_metaserver_unregister_failures_total",
    "pegaflow_metaserver_sweep_removed_keys_total",
    # 0.24/0.25
    "pegaflow_transfer_served_blocks_total",
    "pegaflow_rdma_fetch_plan_segments",
    "pegaflow_rdma_fetch_plan_completed_segments",
    "pegaflow_metaserver_backup_recall_planned_blocks_total",
)

ORIGINAL_NAMES: frozenset[str] = frozenset(m.name for m in EXPORTED) | frozenset(NOT_EXPORTED)
