"""gRPC MetaService over :class:`pegaflow.meta.lookup.Lookup`.

Requests are validated before Redis is touched: a bad namespace, a hash that is not 16
bytes or too many hashes get INVALID_ARGUMENT; Redis failures get UNAVAILABLE. The
mapping to status codes is ``pegaflow.common.errors`` (the one place).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
import redis
import structlog

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.common.errors import InvalidArgument, PegaError, Unavailable, grpc_code
from pegaflow.common.grpc_guard import SyncGuard
from pegaflow.common.security import Security
from pegaflow.common.validate import check_hashes
from pegaflow.meta.events.schema import Tier
from pegaflow.meta.lookup import Lookup, NodePrefix
from pegaflow.meta.metrics import MetaMetrics

log = structlog.get_logger("pegaflow.meta.service")

GRPC_THREADS = 8

Resp = TypeVar("Resp")


def _rpc(method: str) -> Callable[[Callable[..., Resp]], Callable[..., Resp]]:
    def wrap(fn: Callable[..., Resp]) -> Callable[..., Resp]:
        @functools.wraps(fn)
        def handler(self: MetaServicer, request: Any, context: grpc.ServicerContext) -> Resp:
            t0 = time.perf_counter()
            status = "OK"
            try:
                try:
                    return fn(self, request, context)
                except (redis.RedisError, OSError) as exc:
                    raise Unavailable(f"redis: {exc}") from exc
            except PegaError as exc:
                code = grpc_code(exc)
                status = code.name
                self.metrics.query_errors.labels(code.name).inc()
                if code is grpc.StatusCode.INVALID_ARGUMENT:
                    log.info("invalid_request", method=method, error=str(exc))
                else:
                    log.warning("rpc_failed", method=method, error=str(exc))
                context.abort(code, str(exc))
                raise  # unreachable: abort raises
            except Exception:
                status = "UNKNOWN"
                raise
            finally:
                self.metrics.rpc_seconds.labels(method, status).observe(time.perf_counter() - t0)

        return handler

    return wrap


# () -> ([WindowStats], nodes merged, nodes skipped), or None when the sketches cannot be read
CeilingSource = Callable[[], "tuple[list[Any], int, int] | None"]


def check_request(namespace: str, hashes: Sequence[bytes], max_blocks: int) -> None:
    if not namespace:
        raise InvalidArgument("namespace is empty")
    check_hashes(hashes, max_blocks, "--query-max-blocks")


_WIRE_TIER = {Tier.L1: meta_pb2.TIER_L1, Tier.SSD: meta_pb2.TIER_SSD}


def _pb(p: NodePrefix) -> meta_pb2.NodePrefix:
    return meta_pb2.NodePrefix(node=p.node, address=p.address, prefix_len=p.prefix_len, tier=_WIRE_TIER[p.tier],
                               ssd_blocks=p.ssd_blocks)


class MetaServicer(meta_pb2_grpc.MetaServiceServicer):
    def __init__(self, lookup: Lookup, max_blocks: int, redis_url: str = "", redis_cluster: bool = False,
                 metrics: MetaMetrics | None = None) -> None:
        self.lookup = lookup
        self.metrics = metrics if metrics is not None else MetaMetrics()
        self.max_blocks = max_blocks
        self.cluster_config = meta_pb2.ClusterConfigResponse(redis_url=redis_url, redis_cluster=redis_cluster)
        # The cluster's ceiling per window (ClusterCeilingCollector.current), or None: not served.
        self.ceiling: CeilingSource | None = None

    def _query(self, request: meta_pb2.QueryPrefixRequest) -> list[NodePrefix]:
        check_request(request.namespace, request.hashes, self.max_blocks)
        t0 = time.perf_counter()
        res = self.lookup.query_prefix(request.namespace, list(request.hashes))
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
        cur = self.ceiling() if self.ceiling is not None else None
        if cur is None:
            return meta_pb2.ClusterCeilingResponse(available=False)
        stats, merged, skipped = cur
        return meta_pb2.ClusterCeilingResponse(
            available=True, nodes_merged=merged, nodes_skipped=skipped,
            windows=[meta_pb2.ClusterWindow(window=s.label, requested_blocks=s.requests, hit_blocks=s.hits,
                                            distinct_blocks=s.distinct, hit_ratio=s.hit_rate, ceiling_ratio=s.ceiling)
                     for s in stats],
        )


def serve(
    lookup: Lookup, addr: str, max_blocks: int, redis_url: str = "", redis_cluster: bool = False,
    security: Security | None = None, metrics: MetaMetrics | None = None, ceiling: CeilingSource | None = None,
) -> tuple[grpc.Server, int]:
    """Start the gRPC server; returns it and the bound port (``addr`` may use port 0).
    ``security``: the token every call must carry and the TLS certificate (none: open, plaintext)."""
    sec = security or Security()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=GRPC_THREADS), interceptors=[SyncGuard(sec.token)])
    servicer = MetaServicer(lookup, max_blocks, redis_url, redis_cluster, metrics)
    servicer.ceiling = ceiling
    servicer.metrics.bind_nodes(lookup.nodes)  # pegaflow_metaserver_nodes{state}, at scrape time
    meta_pb2_grpc.add_MetaServiceServicer_to_server(servicer, server)
    port = sec.add_port(server, addr)
    if port == 0:
        raise OSError(f"cannot bind {addr}")
    server.start()
    return server, port
