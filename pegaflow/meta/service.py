"""gRPC MetaService over :class:`pegaflow.meta.lookup.Lookup`.

Requests are validated before Redis is touched: a bad namespace, a hash that is not 16
bytes or too many hashes get INVALID_ARGUMENT; Redis failures get UNAVAILABLE. Errors
become status codes and log lines in ``pegaflow.common.rpc_errors`` (one policy for every
service); the server that serves this servicer is built by ``pegaflow.meta.daemon``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
import redis
import structlog
from prometheus_client import Histogram

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.cluster.seeds import seed_urls
from pegaflow.common.errors import InvalidArgument, Unavailable
from pegaflow.common.rpc_errors import RpcErrors
from pegaflow.common.validate import check_hashes
from pegaflow.core.tiers import Tier
from pegaflow.meta.lookup import Lookup, NodePrefix
from pegaflow.meta.metrics import MetaMetrics
from pegaflow.policy.ceiling import WindowStats

log = structlog.get_logger("pegaflow.meta.service")
errors = RpcErrors(log)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Method = Callable[["MetaServicer", Req, grpc.ServicerContext], Resp]


def _rpc(method: str) -> Callable[[Method[Req, Resp]], Method[Req, Resp]]:
    """Time the call by method and status; a Redis failure answers UNAVAILABLE, any failure
    the status of ``pegaflow.common.rpc_errors`` (counted in ``query_errors`` by code)."""

    def wrap(fn: Method[Req, Resp]) -> Method[Req, Resp]:
        @functools.wraps(fn)
        def handler(self: MetaServicer, request: Req, context: grpc.ServicerContext) -> Resp:
            t0 = time.perf_counter()
            status = "OK"
            try:
                try:
                    return fn(self, request, context)
                except (redis.RedisError, OSError) as exc:
                    raise Unavailable(f"redis: {exc}") from exc
            except Exception as exc:
                st = errors.failed(exc, method)
                status = st.code.name
                self.metrics.query_errors.labels(status).inc()
                context.abort(st.code, st.message)
                raise  # unreachable: abort raises
            finally:
                # Each (method, status)'s timer resolved once: labels() is a lock and a dict per call.
                timer = self._timers.get((method, status))
                if timer is None:
                    timer = self._timers[(method, status)] = self.metrics.rpc_seconds.labels(method, status)
                timer.observe(time.perf_counter() - t0)

        return handler

    return wrap


# () -> (stats per window, nodes merged, nodes skipped), or None when the sketches cannot
# be read (ClusterCeilingCollector.current).
CeilingSource = Callable[[], "tuple[list[WindowStats], int, int] | None"]


def check_request(namespace: str, hashes: Sequence[bytes], max_blocks: int) -> None:
    if not namespace:
        raise InvalidArgument("namespace is empty")
    check_hashes(hashes, max_blocks, "--query-max-blocks")


# A holder's tier (one of core.tiers.LOCAL_TIERS) on the wire: meta.proto's Tier.
_WIRE_TIER = {Tier.L1: meta_pb2.TIER_L1, Tier.SSD: meta_pb2.TIER_SSD}


def _pb(p: NodePrefix) -> meta_pb2.NodePrefix:
    return meta_pb2.NodePrefix(node=p.node, address=p.address, prefix_len=p.prefix_len, tier=_WIRE_TIER[p.tier],
                               ssd_blocks=p.ssd_blocks)


class MetaServicer(meta_pb2_grpc.MetaServiceServicer):
    """The lookups, over ``lookup``; ``max_blocks`` bounds a request's hashes
    (``--query-max-blocks``); GetClusterConfig names the Redis the nodes should publish to
    (``redis_url``, ``redis_cluster``); ClusterCeiling serves ``ceiling``. Handlers run on
    the gRPC server's threads and share nothing but ``lookup`` and ``metrics``."""

    def __init__(self, lookup: Lookup, max_blocks: int, metrics: MetaMetrics, ceiling: CeilingSource,
                 redis_url: str | Sequence[str] = (), redis_cluster: bool = False) -> None:
        self.lookup = lookup
        self.metrics = metrics
        self.max_blocks = max_blocks
        # Several seeds travel comma-separated in the one field (pegaflow/node/discovery.py splits them).
        self.cluster_config = meta_pb2.ClusterConfigResponse(redis_url=",".join(seed_urls(redis_url)),
                                                             redis_cluster=redis_cluster)
        self.ceiling = ceiling
        self._timers: dict[tuple[str, str], Histogram] = {}  # (method, status) -> its rpc_seconds child

    def _query(self, request: meta_pb2.QueryPrefixRequest) -> list[NodePrefix]:
        # One list: each read of a protobuf repeated field makes new bytes objects (128 of them
        # for a checked, then walked, request: ~5 us of a lookup's ~30 us of Python).
        hashes = list(request.hashes)
        check_request(request.namespace, hashes, self.max_blocks)
        t0 = time.perf_counter()
        res = self.lookup.query_prefix(request.namespace, hashes)
        self.metrics.query_seconds.observe(time.perf_counter() - t0)
        return res

    @_rpc("QueryPrefix")
    def QueryPrefix(self, request: meta_pb2.QueryPrefixRequest, context: grpc.ServicerContext) -> meta_pb2.QueryPrefixResponse:  # noqa: N802
        return meta_pb2.QueryPrefixResponse(nodes=[_pb(p) for p in self._query(request)])

    @_rpc("RouteHint")
    def RouteHint(self, request: meta_pb2.QueryPrefixRequest, context: grpc.ServicerContext) -> meta_pb2.RouteHintResponse:  # noqa: N802
        res = self._query(request)
        if not res:
            return meta_pb2.RouteHintResponse(found=False)
        return meta_pb2.RouteHintResponse(found=True, best=_pb(res[0]))

    @_rpc("ListNodes")
    def ListNodes(self, request: meta_pb2.ListNodesRequest, context: grpc.ServicerContext) -> meta_pb2.ListNodesResponse:  # noqa: N802
        return meta_pb2.ListNodesResponse(
            nodes=[
                meta_pb2.NodeEntry(node=n, address=a, epoch=e, alive=al)
                for n, a, e, al in self.lookup.nodes()
            ]
        )

    @_rpc("GetClusterConfig")
    def GetClusterConfig(self, request: meta_pb2.ClusterConfigRequest, context: grpc.ServicerContext) -> meta_pb2.ClusterConfigResponse:  # noqa: N802
        return self.cluster_config

    @_rpc("ClusterCeiling")
    def ClusterCeiling(self, request: meta_pb2.ClusterCeilingRequest, context: grpc.ServicerContext) -> meta_pb2.ClusterCeilingResponse:  # noqa: N802
        cur = self.ceiling()
        if cur is None:
            return meta_pb2.ClusterCeilingResponse(available=False)
        stats, merged, skipped = cur
        return meta_pb2.ClusterCeilingResponse(
            available=True, nodes_merged=merged, nodes_skipped=skipped,
            windows=[meta_pb2.ClusterWindow(window=s.label, requested_blocks=s.requests, hit_blocks=s.hits,
                                            distinct_blocks=s.distinct, hit_ratio=s.hit_rate, ceiling_ratio=s.ceiling)
                     for s in stats],
        )

