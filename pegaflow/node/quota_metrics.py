"""Prometheus view of ``--namespace-quota``: each quota's bytes against its bounds.

Read at scrape time from the block index (``BlockIndex.quota_usage``, a list of ints the
event loop updates; reading it from the HTTP thread sees a consistent enough snapshot for
a gauge), so the eviction path does no metric work.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from pegaflow.core.block_index import BlockIndex
from pegaflow.policy.quota import Quotas


class QuotaCollector(Collector):
    """``pegaflow_node_namespace_quota_bytes{quota, kind=held|min|max}`` and
    ``pegaflow_node_namespace_quota_evictions_total`` (blocks a quota at its maximum evicted
    from itself)."""

    def __init__(self, index: BlockIndex, quotas: Quotas) -> None:
        self.index = index
        self.names = quotas.names()

    def describe(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        return list(self._families([]))

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return self._families(self.index.quota_usage())

    def _families(self, usage: list[tuple[int, int, int]]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        g = GaugeMetricFamily("pegaflow_node_namespace_quota_bytes",
                              "Bytes of the pool a --namespace-quota's namespaces hold (kind=held, pending and "
                              "resident), and its guaranteed (min) and maximum (max) bytes.", labels=["quota", "kind"])
        for name, (held, lo, hi) in zip(self.names, usage, strict=False):
            g.add_metric([name, "held"], held)
            g.add_metric([name, "min"], lo)
            g.add_metric([name, "max"], hi)
        yield g
        yield CounterMetricFamily("pegaflow_node_namespace_quota_evictions_total",
                                  "Blocks a namespace quota at its maximum evicted from itself to insert.",
                                  value=self.index.quota_evictions)


def register(registry: CollectorRegistry, index: BlockIndex, quotas: Quotas) -> None:
    """Export the quotas' figures (nothing when no quota is configured)."""
    if quotas:
        registry.register(QuotaCollector(index, quotas))
