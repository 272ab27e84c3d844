"""Prometheus metrics of the metaserver: one object per process, registered on a registry.

The same pattern as the node's (``NodeMetrics``, ``SsdMetrics``, ``PeerMetrics``,
``PublisherMetrics``): a class whose constructor takes the ``CollectorRegistry`` its series
go to, passed to the parts that count. ``pegaflow-meta`` builds one on the default registry
(what ``--http-addr`` serves); a part built without one counts into a private registry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pegaflow.common.metric_alias import Alias, OriginalNames, ValueAlias, rpc_labels
from pegaflow.meta.events.consumer import ConsumerMetrics
from pegaflow.meta.index import Census, Pause

if TYPE_CHECKING:
    from pegaflow.meta.view_feed import ViewFeed

OWNERS = (("1",), ("2",), ("3",), (">=4",))  # the original's owners label values

# The original's RPC buckets (pegaflow-metaserver/src/metric.rs), 0.5 ms to 2 s.
RPC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class MetaMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.consumer = ConsumerMetrics(reg)  # the stream consumer's series (events/consumer.py)
        self.swept = Counter(
            "pegaflow_meta_swept_entries_total", "Index entries of retired incarnations removed", registry=reg
        )
        self.reaped = Counter(
            "pegaflow_meta_nodes_reaped_total", "Nodes reaped after --ttl-minutes without activity", registry=reg
        )
        self.query_seconds = Histogram(
            "pegaflow_meta_query_duration_seconds",
            "QueryPrefix and RouteHint lookup latency inside the metaserver (view or Redis)",
            # From the in-memory view a lookup takes tens of us, from Redis hundreds.
            buckets=(0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=reg,
        )
        self.lookups = Counter(
            "pegaflow_meta_lookups_total",
            "QueryPrefix and RouteHint lookups by where they were answered from: view, redis",
            ["source"],
            registry=reg,
        )
        self.query_errors = Counter("pegaflow_meta_query_errors_total", "Lookups that failed", ["code"], registry=reg)
        self.rpc_seconds = Histogram(
            "pegaflow_meta_rpc_duration_seconds",
            "Latency of every metaserver RPC by method and gRPC status name",
            ["method", "status"],
            buckets=RPC_BUCKETS,
            registry=reg,
        )
        # Registered nodes (node, address, epoch, alive), read at scrape time: Lookup.nodes.
        self._nodes: Callable[[], Iterable[tuple[str, str, int, bool]]] = lambda: ()
        # The last background count of the index (run_census, --index-census-interval); None: none yet.
        self.census: Census | None = None
        self.census_at = 0.0  # time.time() of it
        reg.register(_CensusGauges(self))
        self.view: ViewFeed | None = None  # bind_view; None: --view-max-lag-ms 0, no view series
        reg.register(_ViewSeries(self))
        OriginalNames(reg, self._original_aliases())

    def bind_nodes(self, nodes: Callable[[], Iterable[tuple[str, str, int, bool]]]) -> None:
        self._nodes = nodes

    def bind_view(self, view: ViewFeed) -> None:
        """The in-memory view whose series (``pegaflow_meta_view_*``) a scrape reads."""
        self.view = view

    def _census(self, pick: Callable[[Census], Iterable[tuple[tuple[str, ...], float]]]
                ) -> list[tuple[tuple[str, ...], float]]:
        c = self.census
        return [] if c is None else list(pick(c))

    def _node_states(self) -> list[tuple[tuple[str, ...], float]]:
        try:
            alive = [bool(n[3]) for n in self._nodes()]
        except Exception:  # noqa: BLE001 - Redis down: no sample rather than a failed scrape
            return []
        return [(("active",), float(sum(alive))), (("stale",), float(len(alive) - sum(alive)))]

    def _original_aliases(self) -> list[Alias | ValueAlias]:
        """The Rust original's metaserver metrics (pegaflow-metaserver/src/metric.rs) that mean
        something here; docs/metrics.md, "The original's names", has the table."""
        return [
            Alias("pegaflow_metaserver_rpc_requests", "counter",
                  "Metaserver RPCs by method and status (the count of pegaflow_meta_rpc_duration_seconds).",
                  ("pegaflow_meta_rpc_duration_seconds",), ("method", "status"), relabel=rpc_labels,
                  from_count=True),
            Alias("pegaflow_metaserver_rpc_duration_seconds", "histogram",
                  "Metaserver RPC latency by method and status (pegaflow_meta_rpc_duration_seconds).",
                  ("pegaflow_meta_rpc_duration_seconds",), ("method", "status"), relabel=rpc_labels),
            ValueAlias("pegaflow_metaserver_nodes", "gauge",
                       "Registered nodes by liveness: active, stale (liveness expired, not yet retired).",
                       self._node_states, ("state",)),
            ValueAlias("pegaflow_metaserver_store_entries", "gauge",
                       "Block keys in the index, at the last background count (pegaflow_meta_index_blocks).",
                       lambda: self._census(lambda c: [((), c.entries)])),
            ValueAlias("pegaflow_metaserver_block_owners", "gauge",
                       "Holder entries over all block keys, at the last count (pegaflow_meta_index_owners).",
                       lambda: self._census(lambda c: [((), c.owners)])),
            ValueAlias("pegaflow_metaserver_block_redundancy", "gauge",
                       "Block keys by live holders: 1, 2, 3, >=4 (pegaflow_meta_index_redundancy_blocks).",
                       lambda: self._census(lambda c: zip(OWNERS, c.redundancy, strict=True)), ("owners",)),
            ValueAlias("pegaflow_metaserver_block_redundancy_avg", "gauge",
                       "Live holders per block key with at least one (pegaflow_meta_index_redundancy_avg).",
                       lambda: self._census(lambda c: [((), c.redundancy_avg)])),
            Alias("pegaflow_metaserver_sweep_removed_owners", "counter",
                  "Index entries of retired incarnations removed by the sweeper (pegaflow_meta_swept_entries_total).",
                  ("pegaflow_meta_swept_entries",)),
            Alias("pegaflow_metaserver_sweep_removed_nodes", "counter",
                  "Nodes reaped after --ttl-minutes without activity (pegaflow_meta_nodes_reaped_total).",
                  ("pegaflow_meta_nodes_reaped",)),
        ]


class _CensusGauges(Collector):
    """``pegaflow_meta_index_*``: the last census (no sample before the first one)."""

    NAMES = (
        ("pegaflow_meta_index_blocks", "Block keys in the index (every namespace), at the last background count.", ()),
        ("pegaflow_meta_index_owners", "Holder entries over all block keys (retired incarnations not yet swept "
                                       "included), at the last count.", ()),
        ("pegaflow_meta_index_redundancy_blocks", "Block keys by how many live (visible) nodes hold them: 1, 2, 3, "
                                                  ">=4, at the last count.", ("owners",)),
        ("pegaflow_meta_index_redundancy_avg", "Live holders per block key held by at least one live node, at the "
                                               "last count.", ()),
        ("pegaflow_meta_index_census_timestamp_seconds", "Unix time the last count finished.", ()),
    )

    def __init__(self, metrics: MetaMetrics) -> None:
        self.metrics = metrics
        self.at = 0.0

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(n, d, labels=lb) for n, d, lb in self.NAMES]

    def collect(self) -> list[GaugeMetricFamily]:
        fams = self.describe()
        c = self.metrics.census
        if c is None:
            return fams
        fams[0].add_metric([], c.entries)
        fams[1].add_metric([], c.owners)
        for key, v in zip(OWNERS, c.redundancy, strict=True):
            fams[2].add_metric(list(key), v)
        fams[3].add_metric([], c.redundancy_avg)
        fams[4].add_metric([], self.metrics.census_at)
        return fams


class _ViewSeries(Collector):
    """``pegaflow_meta_view_*``: the replica's in-memory view (``view_feed.py``), read at scrape
    time (no sample without one)."""

    def __init__(self, metrics: MetaMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        return [
            GaugeMetricFamily("pegaflow_meta_view_lag_seconds",
                              "Seconds since the in-memory view last held every node event written (+Inf: not "
                              "since it started over); lookups read it while this is within --view-max-lag-ms"),
            GaugeMetricFamily("pegaflow_meta_view_blocks", "Blocks (namespace, hash) the in-memory view holds"),
            GaugeMetricFamily("pegaflow_meta_view_bytes", "Bytes the in-memory view's tables take"),
            GaugeMetricFamily("pegaflow_meta_view_incarnations",
                              "Node incarnations the in-memory view holds blocks of (at most 64), those being "
                              "cleared included"),
            CounterMetricFamily("pegaflow_meta_view_restarts",
                                "Times the in-memory view started over from the streams (Redis errors, "
                                "incarnations it could not complete, more incarnations than it holds)"),
            CounterMetricFamily("pegaflow_meta_view_updates",
                                "Block updates (hashes of INSERT, SNAPSHOT and EVICT events) the in-memory view "
                                "applied from the node streams: its rate is what this replica makes answerable"),
        ]

    def collect(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        v = self.metrics.view
        fams = self.describe()
        if v is None:
            return fams
        for fam, value in zip(fams, (v.lag_s(), len(v.view), v.view.nbytes, v.incarnations(), v.restarts, v.updates),
                              strict=True):
            fam.add_metric([], value)
        return fams


# The census's share of its thread's time: after each round trip it waits (1 / share - 1) times
# as long. Unpaced, a count of 1M blocks held Redis and this process's interpreter lock for
# seconds; on a 2-core host that start-up count took the CPU lookups needed (bench/meta.py, one
# run each on host L: idle lookup p99 0.87x / 1.09x the original's with it, 0.81x / 0.91x with
# the census off).
CENSUS_SHARE = 0.2


class _Stopped(Exception):
    """The daemon stops: the count in progress is abandoned."""


def run_census(metrics: MetaMetrics, count: Callable[[Pause], Census], stop: threading.Event, interval: float,
               share: float = CENSUS_SHARE) -> None:
    """Count the index now, then every ``interval`` seconds until ``stop`` (a threading.Event)
    is set; a scrape serves the last count. A failed count (Redis away) keeps the previous.
    ``count`` calls its pause after every step; the pause waits so that counting takes at most
    ``share`` of the time (and ends the count when ``stop`` is set)."""
    import time

    import structlog

    log = structlog.get_logger("pegaflow.meta.census")
    idle = 1 / share - 1

    def pause(busy_s: float) -> None:
        if stop.wait(busy_s * idle):
            raise _Stopped

    while True:
        t0 = time.monotonic()
        try:
            metrics.census = count(pause)
            metrics.census_at = time.time()
            log.debug("index_census", seconds=round(time.monotonic() - t0, 3), blocks=metrics.census.entries)
        except _Stopped:
            return
        except Exception as exc:  # noqa: BLE001 - keep the last count, try again next time
            log.warning("index_census_failed", error=str(exc))
        if stop.wait(interval):
            return
