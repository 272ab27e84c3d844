"""The cluster-wide hit-rate ceiling: nodes publish their sketches, the metaserver unites them.

Node side: every ``--ceiling-publish-interval`` the node serializes its
:class:`~pegaflow.policy.ceiling.CeilingEstimator` (on its event loop) and
:func:`publish_sketch` stores the bytes under ``pf:sk:{<node>}`` with a TTL of
``SKETCH_TTL_INTERVALS`` intervals, so a dead node's sketch disappears by itself. The key
shares the slot of the node's event stream; in a Redis Cluster, sketches of different
nodes spread over the shards like the streams do.

Metaserver side: :class:`ClusterCeilingCollector` is a Prometheus collector. On a scrape
it reads the latest sketch of every registered node and builds a **fresh** union
(``CeilingEstimator.union_of`` semantics: never merged into a running estimator, because a
snapshot merged twice would count its N twice), then exports per window the union's r*,
its measured hit rate, N, hits and U as ``pegaflow_meta_cluster_*`` gauges. The result is
cached for ``min_interval`` seconds so several scrapers (or replicas' scrapes) do not
multiply the Redis reads. Every replica computes the same numbers from the same keys.

Sketches whose windows differ from the metaserver's ``--ceiling-windows``, whose HLL
bucket bits (``lg_k``) differ from its ``--metric-hll-bucket-bits``, or that do not parse
are left out, logged once per node and reason (``ceiling_sketch_skipped``), and counted in
``pegaflow_meta_cluster_sketches_skipped``: the union of different windows has no
meaning, and HLLs of different register counts cannot be merged register by register (the
original refuses such a merge too). The union never takes the first node's settings as
the reference: a misconfigured node is what gets left out, not the rest of the cluster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import redis
import structlog
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pegaflow.cluster import keys, registry
from pegaflow.cluster.redis_conn import Client, error_text
from pegaflow.policy.ceiling import CeilingEstimator, WindowStats

# The original's --metric-hll-bucket-bits default: 2^16 registers per sketch.
DEFAULT_BUCKET_BITS = 16

log = structlog.get_logger("pegaflow.cluster.sketches")

SKETCH_TTL_INTERVALS = 3  # a sketch outlives two missed publications, then expires
MIN_SCRAPE_INTERVAL = 5.0  # seconds a union is reused by later scrapes (a union of 50 full sketches takes ~2 s)


def publish_sketch(r: Client, node: str, blob: bytes, interval: float) -> None:
    """Store ``node``'s serialized estimator, expiring after ``SKETCH_TTL_INTERVALS`` intervals."""
    r.set(keys.sketch_key(node), blob, px=max(1000, int(interval * SKETCH_TTL_INTERVALS * 1000)))


def latest_sketches(r: Client, nodes: Iterable[str] | None = None) -> dict[str, bytes]:
    """The current sketch of each node (default: every registered node) that has one."""
    names = sorted(registry.nodes(r) if nodes is None else nodes)
    if not names:
        return {}
    p = r.pipeline(transaction=False)
    for n in names:
        p.get(keys.sketch_key(n))
    return {n: bytes(v) for n, v in zip(names, p.execute(), strict=True) if v is not None}


def cluster_union(
    blobs: dict[str, bytes], windows: Sequence[float], lg_k: int = DEFAULT_BUCKET_BITS
) -> tuple[CeilingEstimator | None, list[str], dict[str, str]]:
    """A fresh union of the sketches whose windows equal ``windows`` and whose HLL bucket
    bits equal ``lg_k``.

    Returns ``(estimator or None when none fit, nodes merged, {node skipped: why})``.
    """
    est: CeilingEstimator | None = None
    merged: list[str] = []
    skipped: dict[str, str] = {}
    want = tuple(sorted(windows))
    for node, blob in sorted(blobs.items()):
        try:
            if est is None:
                cand = CeilingEstimator.deserialize(blob, clock=time.time)
                if cand.lg_k != lg_k:
                    raise ValueError(
                        f"HLL bucket bits {cand.lg_k} != this metaserver's --metric-hll-bucket-bits {lg_k}"
                    )
                if cand.windows != want:
                    raise ValueError(f"windows {cand.windows} != this metaserver's --ceiling-windows {want}")
                est = cand
            else:
                est.merge(blob)  # raises on other windows, buckets or lg_k than the first's (= ours)
            merged.append(node)
        except ValueError as exc:
            skipped[node] = str(exc)
    return est, merged, skipped


class ClusterCeilingCollector(Collector):
    """Prometheus collector of the cluster's ceiling, computed from Redis at scrape time."""

    def __init__(
        self,
        r: Client,
        windows: Sequence[float],
        min_interval: float = MIN_SCRAPE_INTERVAL,
        lg_k: int = DEFAULT_BUCKET_BITS,
    ) -> None:
        self.r = r
        self.windows = tuple(sorted(windows))
        self.lg_k = lg_k
        self._warned: dict[str, str] = {}  # node -> the reason last logged for skipping it
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._at = -1e18
        self._cached: tuple[list[WindowStats], int, int] = ([], 0, 0)

    def compute(self) -> tuple[list[WindowStats], int, int]:
        """(stats per window, nodes merged, nodes skipped), fresh from Redis."""
        est, merged, skipped = cluster_union(latest_sketches(self.r), self.windows, self.lg_k)
        for node, why in skipped.items():
            if self._warned.get(node) != why:  # once per node and reason, not on every scrape
                log.warning("ceiling_sketch_skipped", node=node, error=why)
        self._warned = dict(skipped)
        stats = est.snapshot() if est is not None else []
        return stats, len(merged), len(skipped)

    def _current(self) -> tuple[list[WindowStats], int, int] | None:
        with self._lock:
            if time.monotonic() - self._at >= self.min_interval:
                try:
                    self._cached = self.compute()
                except redis.RedisError as exc:
                    log.warning("cannot read ceiling sketches", error=error_text(exc))
                    return None
                self._at = time.monotonic()
            return self._cached

    def current(self) -> tuple[list[WindowStats], int, int] | None:
        """(stats per window, nodes merged, nodes skipped) as the last scrape saw them (at most
        ``min_interval`` old); None when Redis cannot be read. For the metaserver's RPC."""
        return self._current()

    def describe(self) -> list[GaugeMetricFamily]:
        return self._families([], 0, 0)

    def collect(self) -> list[GaugeMetricFamily]:
        cur = self._current()
        return self._families(*cur) if cur is not None else []

    @staticmethod
    def _families(stats: list[WindowStats], merged: int, skipped: int) -> list[GaugeMetricFamily]:
        w = ["window"]
        fams = {
            "ceiling": GaugeMetricFamily(
                "pegaflow_meta_cluster_ceiling_hit_ratio",
                "Cluster hit-rate ceiling r* = (N - U) / N over the union of the nodes' sketches.", labels=w
            ),
            "hit_rate": GaugeMetricFamily(
                "pegaflow_meta_cluster_measured_hit_ratio", "Cluster measured hit rate (hits / N).", labels=w
            ),
            "requests": GaugeMetricFamily(
                "pegaflow_meta_cluster_requested_blocks", "N: blocks requested in the window, all nodes.", labels=w
            ),
            "hits": GaugeMetricFamily(
                "pegaflow_meta_cluster_hit_blocks", "Blocks served from cache in the window, all nodes.", labels=w
            ),
            "distinct": GaugeMetricFamily(
                "pegaflow_meta_cluster_distinct_blocks",
                "U: distinct blocks requested in the window across all nodes (HLL union estimate).", labels=w
            ),
        }  # fmt: skip
        for s in stats:
            for attr, fam in fams.items():
                fam.add_metric([s.label], float(getattr(s, attr)))
        nodes = GaugeMetricFamily(
            "pegaflow_meta_cluster_sketch_nodes", "Nodes whose ceiling sketch is in the cluster union.", value=merged
        )
        bad = GaugeMetricFamily(
            "pegaflow_meta_cluster_sketches_skipped",
            "Node sketches left out of the union (other windows or HLL bucket bits, or unreadable).",
            value=skipped,
        )
        return [*fams.values(), nodes, bad]
