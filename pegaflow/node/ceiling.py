"""The node's hit-rate ceiling: every answered Query feeds a :class:`CeilingEstimator`.

What is counted (the contract the gauges and the cluster union rely on):

- One observation per **request**: the first READY answer to a Query with a given
  ``req_id`` adds that query's blocks (N) and its prefix hits. A LOADING answer adds
  nothing (the engine asks again and the READY answer counts, with the promoted blocks
  as hits); later Queries with the same ``req_id`` (the connector re-asks while a request
  waits to be scheduled) add nothing either, so retries do not inflate N or the hit rate.
  Queries without a ``req_id`` are each one request.
- A query naming several namespaces (the TP shards of one engine) asks the same hashes in
  each; it is observed once, under its first namespace: the ceiling of the shards is
  the same, and hashing every shard's keys would cost k times as much on the event loop.
- Keys are ``ceiling_key(namespace name, hash)``: the hash's low 64 bits salted with a
  digest of the namespace *name*. Unlike ``admission_key`` (salted with the node-local
  namespace id) this is the same on every host, so sketches of different nodes can be
  united into the cluster's ceiling.
- The clock is ``time.time``: bucket indices must agree across hosts for the union.

Runs on the node's event loop only (the estimator is not thread-safe); gauges are
refreshed from the loop by :meth:`NodeCeiling.refresh` and read by scrapers from any thread.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence

from pegaflow.node.metrics import NodeMetrics
from pegaflow.policy.ceiling import CeilingEstimator, WindowStats

# Request ids remembered to skip repeated Queries of one request. The connector re-asks
# within seconds, so this only needs to outlive the scheduler's queue of waiting requests.
SEEN_REQUESTS = 65536


def namespace_salt(name: str) -> int:
    """64-bit salt of a namespace name, identical on every host and in every process."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def ceiling_key(name: str, hash_: bytes) -> int:
    """Cluster-wide 64-bit key of block ``hash_`` of namespace ``name`` for HLL sketches."""
    return int.from_bytes(hash_[:8], "little") ^ namespace_salt(name)


class NodeCeiling:
    """A node's CeilingEstimator plus request de-duplication and its Prometheus gauges."""

    def __init__(self, windows: Sequence[float], metrics: NodeMetrics | None = None) -> None:
        self.estimator = CeilingEstimator(windows, clock=time.time)
        self.metrics = metrics
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._salts: dict[str, int] = {}
        self.observed_requests = 0

    def observe(self, namespace: str, hashes: Sequence[bytes], hit: int, req_id: str = "") -> bool:
        """Count one READY answer (``hit`` of ``hashes`` served); False if ``req_id`` was seen."""
        if req_id:
            if req_id in self._seen:
                self._seen.move_to_end(req_id)
                return False
            self._seen[req_id] = None
            if len(self._seen) > SEEN_REQUESTS:
                self._seen.popitem(last=False)
        salt = self._salts.get(namespace)
        if salt is None:
            salt = self._salts[namespace] = namespace_salt(namespace)
        frm = int.from_bytes
        self.estimator.observe([frm(h[:8], "little") ^ salt for h in hashes], hit)
        self.observed_requests += 1
        return True

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
