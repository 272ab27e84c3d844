"""Prometheus metrics of the node. Names: ``pegaflow_node_<what>[_<unit>][_total]``.

Gauges that mirror state (pool usage, resident blocks, leases) are computed at scrape
time from the live objects, so they can never drift from the truth.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.rpc_latency = Histogram(
            "pegaflow_node_rpc_duration_seconds",
            "Latency of node RPCs by method, gRPC status and transport (grpc, local).",
            ["method", "status", "transport"],
            buckets=RPC_BUCKETS,
            registry=r,
        )
        self.hits = Counter("pegaflow_node_hit_blocks_total", "Blocks found by Query, by tier.", ["tier"], registry=r)
        self.misses = Counter("pegaflow_node_miss_blocks_total", "Blocks asked by Query and not found.", registry=r)
        self.queries = Counter("pegaflow_node_queries_total", "Query RPCs by outcome.", ["outcome"], registry=r)
        self.evictions = Counter("pegaflow_node_evictions_total", "Blocks evicted from L1.", ["tier"], registry=r)
        self.save_bytes = Counter("pegaflow_node_save_bytes_total", "Bytes committed into L1 by engines.", registry=r)
        self.load_bytes = Counter("pegaflow_node_load_bytes_total", "Bytes leased to engines for loading.", registry=r)
        self.reserve_skipped = Counter(
            "pegaflow_node_reserve_skipped_blocks_total",
            "Blocks not given a page by Reserve, by reason.",
            ["reason"],
            registry=r,
        )
        self.namespaces_dropped = Counter(
            "pegaflow_node_namespaces_dropped_total",
            "Namespaces forgotten because they held no block (L1 or SSD) and no live session used them.",
            registry=r,
        )
        self.expired = Counter(
            "pegaflow_node_expired_total",
            "Reservations and leases held past their TTL by a live engine (reported, never taken from "
            "it), and sessions ended because they never opened their Session stream.",
            ["kind"], registry=r
        )
        self.sessions_closed = Counter("pegaflow_node_sessions_closed_total", "Sessions ended.", registry=r)
        self.resets = Counter("pegaflow_node_resets_total",
                              "Reset calls: an engine dropped its namespaces' blocks (reset_prefix_cache).",
                              registry=r)
        self.pool_capacity = Gauge("pegaflow_node_pool_capacity_bytes", "Size of the L1 pool.", registry=r)
        self.pool_prefaulted = Gauge("pegaflow_node_pool_prefaulted_bytes",
                                     "Bytes of the pool pre-faulted so far (only these are handed out; "
                                     "equal to the capacity once the background pre-fault is done).", registry=r)
        self.pool_used = Gauge("pegaflow_node_pool_used_bytes", "Bytes of the pool in use (resident + pending).", registry=r)
        self.resident_blocks = Gauge("pegaflow_node_resident_blocks", "Committed blocks in L1.", registry=r)
        self.resident_bytes = Gauge("pegaflow_node_resident_bytes", "Bytes of committed blocks in L1.", registry=r)
        self.leases = Gauge("pegaflow_node_active_leases", "Leases currently held.", registry=r)
        self.reservations = Gauge("pegaflow_node_active_reservations", "Uncommitted reservations.", registry=r)
        self.sessions = Gauge("pegaflow_node_sessions", "Registered engine sessions.", registry=r)
        # Hit-rate ceiling per window (pegaflow/node/accounting.py), refreshed by the node's loop.
        self.ceiling = Gauge(
            "pegaflow_node_ceiling_hit_ratio",
            "Hit-rate ceiling r* = (N - U) / N of the requests in the window.",
            ["window"],
            registry=r,
        )
        self.hit_ratio = Gauge(
            "pegaflow_node_measured_hit_ratio", "Measured hit rate (hits / N) in the window.", ["window"], registry=r
        )
        self.window_requested = Gauge(
            "pegaflow_node_window_requested_blocks", "N: blocks requested in the window.", ["window"], registry=r
        )
        self.window_hits = Gauge(
            "pegaflow_node_window_hit_blocks", "Blocks served from cache in the window.", ["window"], registry=r
        )
        self.window_distinct = Gauge(
            "pegaflow_node_window_distinct_blocks",
            "U: distinct blocks requested in the window (HyperLogLog estimate).",
            ["window"],
            registry=r,
        )
        self.request_blocks = Counter(
            "pegaflow_node_request_blocks_total",
            "Blocks of each request by where they were found (l1, ssd, remote, miss); once per request.",
            ["outcome"],
            registry=r,
        )
        for outcome in ("l1", "ssd", "remote", "miss"):
            self.request_blocks.labels(outcome)
        self.sketch_publications = Counter(
            "pegaflow_node_ceiling_sketch_publications_total",
            "Ceiling sketches written to Redis for the cluster view, by result (ok, error).",
            ["result"],
            registry=r,
        )
        self._admission_rejections: Callable[[], float] = lambda: 0
        r.register(_FnCounter(
            "pegaflow_node_admission_rejections",
            "New blocks not stored because TinyLFU preferred the LRU victim.",
            lambda: self._admission_rejections(),
        ))  # fmt: skip
        for tier in ("l1", "ssd", "remote"):  # export zeros, so dashboards see every tier
            self.hits.labels(tier)
        self.evictions.labels("l1")

    def bind(self, **sources: Callable[[], float]) -> None:
        """Compute state gauges (and ``admission_rejections``) at scrape time: ``bind(pool_used=lambda: ...)``."""
        for name, fn in sources.items():
            if name == "admission_rejections":
                self._admission_rejections = fn
            else:
                getattr(self, name).set_function(fn)


class _FnCounter(Collector):
    """A counter whose value is read from a live object at scrape time (a monotonic int)."""

    def __init__(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        self.name, self.doc, self.fn = name, doc, fn

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.doc)]

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.doc, value=float(self.fn()))]
