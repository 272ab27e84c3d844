"""Prometheus metrics of the metaserver (one definition per metric, imported where counted)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS_APPLIED = Counter("pegaflow_meta_events_applied_total", "Node events applied to the index", ["op"])
BLOCKS_APPLIED = Counter("pegaflow_meta_blocks_applied_total", "Block updates applied to the index")
EVENTS_MALFORMED = Counter("pegaflow_meta_events_malformed_total", "Stream entries skipped as malformed")
EVENTS_SKIPPED = Counter("pegaflow_meta_events_stale_total", "Events of retired incarnations skipped")
ENTRIES_CLAIMED = Counter(
    "pegaflow_meta_entries_claimed_total", "Pending entries claimed from other consumers"
)
STREAMS_OWNED = Gauge("pegaflow_meta_streams_owned", "Node streams this replica consumes")
SWEPT = Counter("pegaflow_meta_swept_entries_total", "Index entries of retired incarnations removed")
REAPED = Counter("pegaflow_meta_nodes_reaped_total", "Nodes retired after their liveness expired")
QUERY_SECONDS = Histogram(
    "pegaflow_meta_query_duration_seconds",
    "QueryPrefix latency inside the metaserver",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
QUERY_ERRORS = Counter("pegaflow_meta_query_errors_total", "Lookups that failed", ["code"])
