"""Prometheus metrics of the metaserver: one object per process, registered on a registry.

The same pattern as the node's (``NodeMetrics``, ``SsdMetrics``, ``PeerMetrics``,
``PublisherMetrics``): a class whose constructor takes the ``CollectorRegistry`` its series
go to, passed to the parts that count. ``pegaflow-meta`` builds one on the default registry
(what ``--http-addr`` serves); a part built without one counts into a private registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pegaflow.meta.events.consumer import ConsumerMetrics


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
