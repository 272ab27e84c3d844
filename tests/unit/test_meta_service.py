"""The metaserver's servicer answers a failure with the status of pegaflow/common/rpc_errors.py:
a bad request INVALID_ARGUMENT before the index is read, a Redis failure UNAVAILABLE, a bug
INTERNAL; each counted by code and timed by method and status."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest
import redis
from prometheus_client import CollectorRegistry

from pegaflow._proto import meta_pb2
from pegaflow.meta.lookup import NodePrefix
from pegaflow.meta.metrics import MetaMetrics
from pegaflow.meta.service import MetaServicer

NS = "m|fp16|bs16|tp1"


class Aborted(Exception):
    pass


class Context:
    """The threaded server's context as a handler sees it: abort raises."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(details)


class FakeLookup:
    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.queries = 0

    def query_prefix(self, namespace: str, hashes: Sequence[bytes]) -> list[NodePrefix]:
        self.queries += 1
        if self.fail is not None:
            raise self.fail
        return [NodePrefix("n1", "10.0.0.1:50055", len(hashes))]

    def nodes(self) -> list[tuple[str, str, int, bool]]:
        return [("n1", "10.0.0.1:50055", 1, True)]


def servicer(lookup: FakeLookup) -> tuple[MetaServicer, MetaMetrics]:
    metrics = MetaMetrics(CollectorRegistry())
    return MetaServicer(lookup, 4, metrics, lambda: None, "redis://r:6379", False), metrics  # type: ignore[arg-type]


def answer(s: MetaServicer, req: meta_pb2.QueryPrefixRequest) -> tuple[grpc.StatusCode, str]:
    ctx = Context()
    with pytest.raises(Aborted):
        s.QueryPrefix(req, ctx)  # type: ignore[arg-type]
    assert ctx.aborted is not None
    return ctx.aborted


def count(metrics: MetaMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (meta_pb2.QueryPrefixRequest(namespace="", hashes=[b"\1" * 16]), "namespace is empty"),
        (meta_pb2.QueryPrefixRequest(namespace=NS, hashes=[b"short"]), "5 bytes"),
        (meta_pb2.QueryPrefixRequest(namespace=NS, hashes=[b"\1" * 16] * 5), "--query-max-blocks"),
    ],
    ids=["no-namespace", "short-hash", "too-many"],
)
def test_a_bad_request_answers_invalid_argument_before_the_index_is_read(req, needle) -> None:  # type: ignore[no-untyped-def]
    lookup = FakeLookup()
    s, metrics = servicer(lookup)
    code, message = answer(s, req)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and needle in message, message
    assert lookup.queries == 0
    assert count(metrics, "pegaflow_meta_query_errors_total", code="INVALID_ARGUMENT") == 1
    assert count(metrics, "pegaflow_meta_rpc_duration_seconds_count", method="QueryPrefix",
                 status="INVALID_ARGUMENT") == 1


@pytest.mark.parametrize(
    ("fail", "code", "message"),
    [
        (redis.ConnectionError("Connection refused"), grpc.StatusCode.UNAVAILABLE, "redis: Connection refused"),
        (OSError("No route to host"), grpc.StatusCode.UNAVAILABLE, "redis: No route to host"),
        (KeyError("n9"), grpc.StatusCode.INTERNAL, "internal error: KeyError('n9')"),
    ],
    ids=["redis", "socket", "bug"],
)
def test_a_failed_lookup_answers_its_status(fail: Exception, code: grpc.StatusCode, message: str) -> None:
    s, metrics = servicer(FakeLookup(fail))
    assert answer(s, meta_pb2.QueryPrefixRequest(namespace=NS, hashes=[b"\1" * 16])) == (code, message)
    assert count(metrics, "pegaflow_meta_query_errors_total", code=code.name) == 1
    assert count(metrics, "pegaflow_meta_rpc_duration_seconds_count", method="QueryPrefix", status=code.name) == 1


def test_good_calls_answer_and_are_timed_ok() -> None:
    s, metrics = servicer(FakeLookup())
    ctx = Context()
    got = s.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace=NS, hashes=[b"\1" * 16] * 2), ctx)  # type: ignore[arg-type]
    assert [(n.node, n.prefix_len, n.tier) for n in got.nodes] == [("n1", 2, meta_pb2.TIER_L1)]
    assert s.GetClusterConfig(meta_pb2.ClusterConfigRequest(), ctx).redis_url == "redis://r:6379"  # type: ignore[arg-type]
    assert not s.ClusterCeiling(meta_pb2.ClusterCeilingRequest(), ctx).available  # type: ignore[arg-type]
    assert ctx.aborted is None
    assert count(metrics, "pegaflow_meta_rpc_duration_seconds_count", method="QueryPrefix", status="OK") == 1
