"""The node's request accounting: the hit-rate ceiling and the per-tier outcome of each block.

Every answered Query feeds a :class:`CeilingEstimator`, and each request's blocks are
counted once by where they came from (``pegaflow_node_request_blocks_total{outcome}``).

What is counted (the contract the gauges and the cluster union rely on):

- One observation per **request**: the first READY answer to a Query with a given
  ``req_id`` (of that engine session) adds that query's blocks (N) and its prefix hits.
  A LOADING answer adds nothing (the engine asks again and the READY answer counts, with
  the promoted blocks as hits); later Queries with the same ``req_id`` (the connector
  re-asks while a request waits to be scheduled) add nothing either, so retries do not
  inflate N or the hit rate. Queries without a ``req_id`` are each one request.
- A query naming several namespaces (the TP shards of one engine) asks the same hashes in
  each; it is observed once, under its first namespace: the ceiling of the shards is
  the same, and hashing every shard's keys would cost k times as much on the event loop.
- Keys are the block index's ``block_key`` (the same keys TinyLFU sees): the hash's low
  64 bits salted with a digest of the namespace *name*, the same on every host, so
  sketches of different nodes can be united into the cluster's ceiling.
- The clock is ``time.time``: bucket indices must agree across hosts for the union.
- Outcomes (``pegaflow.core.tiers``): at the counted READY answer, blocks of the prefix that
  were already in L1 at the request's first answer are ``l1``; blocks that a LOADING answer of
  the same ``req_id`` said were coming from SSD or a peer node (:meth:`RequestAccounting.loading`)
  are ``ssd`` or ``remote``; the rest are ``miss``. So the four outcomes partition each request's
  blocks. Without a ``req_id`` a LOADING answer cannot be linked to the later READY one,
  whose prefix then counts as ``l1``.

Runs on the node's event loop only (the estimator is not thread-safe); gauges are
refreshed from the loop by :meth:`RequestAccounting.refresh` and read by scrapers from any thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from pegaflow.core.identity import block_keys, namespace_salt
from pegaflow.core.recent import RecentKeys
from pegaflow.core.tiers import MISS, Tier
from pegaflow.node.metrics import NodeMetrics
from pegaflow.policy.ceiling import DEFAULT_BUCKETS, MAX_BYTES, CeilingEstimator, WindowStats, sketch_bytes

# Request ids remembered to skip repeated Queries of one request (here and in the service's
# first-Query check). The connector re-asks within seconds, so this only needs to outlive
# the scheduler's queue of waiting requests.
SEEN_REQUESTS = 65536


class RequestAccounting:
    """A node's CeilingEstimator plus request de-duplication and its Prometheus gauges."""

    def __init__(
        self, windows: Sequence[float], metrics: NodeMetrics | None = None, lg_k: int | None = None
    ) -> None:
        # lg_k: the HLL bucket bits (--metric-hll-bucket-bits). Given, it is used whatever the
        # sketches then weigh (the operator chose the accuracy; 3 windows at 18 bits: ~4 MiB);
        # None: the largest that fits the estimator's 1 MiB budget.
        budget = MAX_BYTES if lg_k is None else max(MAX_BYTES, len(windows) * DEFAULT_BUCKETS * sketch_bytes(lg_k))
        self.estimator = CeilingEstimator(windows, lg_k=lg_k, clock=time.time, max_bytes=budget)
        self.metrics = metrics
        self._seen = RecentKeys(SEEN_REQUESTS)  # requests whose READY answer was counted
        # req_id -> [(prefix length at a LOADING answer, tier loading the blocks after it)]
        self._loading: OrderedDict[str, list[tuple[int, Tier]]] = OrderedDict()
        self._salts: dict[str, int] = {}
        self.observed_requests = 0

    def loading(self, req_id: str, hit: int, tier: Tier) -> None:
        """A LOADING answer: the blocks after the first ``hit`` are on their way from ``tier``."""
        if not req_id or req_id in self._seen:
            return
        stages = self._loading.get(req_id)
        if stages is None:
            stages = self._loading[req_id] = []
            if len(self._loading) > SEEN_REQUESTS:
                self._loading.popitem(last=False)
        if not stages or hit > stages[-1][0]:
            stages.append((hit, tier))

    def observe(self, namespace: str, hashes: Sequence[bytes], hit: int, req_id: str = "") -> bool:
        """Count one READY answer (``hit`` of ``hashes`` served); False if ``req_id`` was seen."""
        stages: list[tuple[int, Tier]] = []
        if req_id:
            if self._seen.seen(req_id):
                return False
            stages = self._loading.pop(req_id, [])
        if self.metrics is not None:
            self._count_outcomes(len(hashes), hit, stages)
        salt = self._salts.get(namespace)
        if salt is None:
            salt = self._salts[namespace] = namespace_salt(namespace)
        self.estimator.observe(block_keys(salt, hashes), hit)
        self.observed_requests += 1
        return True

    def _count_outcomes(self, n: int, hit: int, stages: list[tuple[int, Tier]]) -> None:
        assert self.metrics is not None
        out = self.metrics.request_blocks
        bounds = [min(start, hit) for start, _ in stages] + [hit]
        out.labels(Tier.L1).inc(bounds[0])
        for i, (_, tier) in enumerate(stages):
            out.labels(tier).inc(bounds[i + 1] - bounds[i])
        out.labels(MISS).inc(n - hit)

    def refresh(self) -> list[WindowStats]:
        """Recompute every window and set the gauges (call from the event loop)."""
        snap = self.estimator.snapshot()
        m = self.metrics
        if m is not None:
            for s in snap:
                m.ceiling.labels(s.label).set(s.ceiling)
                m.hit_ratio.labels(s.label).set(s.hit_rate)
                m.window_requested.labels(s.label).set(s.requests)
                m.window_hits.labels(s.label).set(s.hits)
                m.window_distinct.labels(s.label).set(s.distinct)
        return snap

    def serialize(self) -> bytes:
        """The estimator's wire form, for the metaserver's cluster union (event loop only)."""
        return self.estimator.serialize()
