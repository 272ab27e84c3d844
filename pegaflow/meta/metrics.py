"""Prometheus metrics of the metaserver: one object per process, registered on a registry.

The same pattern as the node's (``NodeMetrics``, ``SsdMetrics``, ``PeerMetrics``,
``PublisherMetrics``): a class whose constructor takes the ``CollectorRegistry`` its series
go to, passed to the parts that count. ``pegaflow-meta`` builds one on the default registry
(what ``--http-addr`` serves); a part built without one counts into a private registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from pegaflow.common.metric_alias import Alias, OriginalNames, ValueAlias, rpc_labels
from pegaflow.meta.events.consumer import ConsumerMetrics

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
            "pegaflow_meta_nodes_reaped_total", "Nodes retired after their liveness expired", registry=reg
        )
        self.query_seconds = Histogram(
            "pegaflow_meta_query_duration_seconds",
            "QueryPrefix latency inside the metaserver",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
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
        self._nodes: Callable[[], Iterable[tuple[Any, ...]]] = lambda: ()
        OriginalNames(reg, self._original_aliases())

    def bind_nodes(self, nodes: Callable[[], Iterable[tuple[Any, ...]]]) -> None:
        self._nodes = nodes

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
            Alias("pegaflow_metaserver_sweep_removed_owners", "counter",
                  "Index entries of retired incarnations removed by the sweeper (pegaflow_meta_swept_entries_total).",
                  ("pegaflow_meta_swept_entries",)),
            Alias("pegaflow_metaserver_sweep_removed_nodes", "counter",
                  "Nodes retired after their liveness expired (pegaflow_meta_nodes_reaped_total).",
                  ("pegaflow_meta_nodes_reaped",)),
        ]
