"""Bytes that are not the message, sent to every RPC of a real node and metaserver: each
answers INVALID_ARGUMENT, the daemon logs one structured line per method (not a traceback
per request), and it goes on serving."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from pegaflow._proto import meta_pb2, node_pb2, peer_pb2
from pegaflow.common.security import Security, sync_channel
from tests.harness.node import FAST_RECONNECT
from tests.harness.ports import free_port
from tests.integration.redis_fixtures import redis_server  # noqa: F401
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

GARBAGE = [b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x12\x05abc"]
REPEAT = 40


def methods(desc) -> list[str]:  # type: ignore[no-untyped-def]
    return [f"/{desc.full_name}/{m.name}" for m in desc.methods if not m.client_streaming]


def send_garbage(addr: str, paths: list[str]) -> dict[str, set[grpc.StatusCode]]:
    seen: dict[str, set[grpc.StatusCode]] = {}
    with sync_channel(addr, Security()) as ch:  # a node's own token, when it has one
        for path in paths:
            unary = ch.unary_unary(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            stream = ch.unary_stream(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            for _ in range(REPEAT):
                for g in GARBAGE:
                    try:
                        if path.endswith("/Session"):
                            list(stream(g, timeout=5))
                        else:
                            unary(g, timeout=5)
                        code = grpc.StatusCode.OK
                    except grpc.RpcError as exc:
                        code = exc.code()  # type: ignore[attr-defined]
                    seen.setdefault(path, set()).add(code)
    return seen


def test_node_answers_undecodable_requests_with_invalid_argument(node_factory):  # type: ignore[no-untyped-def]
    node = node_factory(extra=["--redis-url", "redis://127.0.0.1:1/0"])  # PegaPeer is served too
    paths = methods(node_pb2.DESCRIPTOR.services_by_name["PegaNode"])
    paths += methods(peer_pb2.DESCRIPTOR.services_by_name["PegaPeer"])
    seen = send_garbage(node.addr, paths)
    # A request that happens to decode (a valid message's bytes) may get another answer; the
    # first garbage value never decodes for any message.
    assert all(grpc.StatusCode.INVALID_ARGUMENT in codes for codes in seen.values()), seen
    assert not any(c in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) for cs in seen.values() for c in cs), seen
    log = node.log()
    assert "Traceback" not in log
    refused = [line for line in log.splitlines() if "grpc_request_refused" in line]
    assert 0 < len(refused) <= len(paths), f"{len(refused)} log lines for {len(paths)} methods"
    assert node.metric("pegaflow_node_pool_capacity_bytes") > 0  # still serving


def test_metaserver_answers_undecodable_requests_with_invalid_argument(tmp_path, redis_server):  # type: ignore[no-untyped-def]  # noqa: F811
    port = free_port()
    log_path = tmp_path / "meta.log"
    meta = subprocess.Popen([sys.executable, "-m", "pegaflow.meta.cli", "--addr", f"127.0.0.1:{port}",
                             "--redis-url", redis_server.url, "--http-addr", "off", "--log-format", "json"],
                            env=os.environ.copy(), stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)
    try:
        addr = f"127.0.0.1:{port}"

        def up() -> bool:
            assert meta.poll() is None, log_path.read_text()
            with grpc.insecure_channel(addr, options=FAST_RECONNECT) as ch:
                try:
                    grpc.channel_ready_future(ch).result(timeout=1)
                    return True
                except grpc.FutureTimeoutError:
                    return False

        wait_until(up, 30, "the metaserver")
        paths = methods(meta_pb2.DESCRIPTOR.services_by_name["MetaService"])
        seen = send_garbage(addr, paths)
        assert all(grpc.StatusCode.INVALID_ARGUMENT in codes for codes in seen.values()), seen
        assert not any(c in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) for cs in seen.values() for c in cs)
        text = log_path.read_text()
        assert "Traceback" not in text
        assert 0 < text.count("grpc_request_refused") <= len(paths)
    finally:
        meta.terminate()
        meta.wait(15)


def test_requests_past_the_nodes_bounds_are_refused_and_change_nothing(node_factory):  # type: ignore[no-untyped-def]
    from pegaflow._proto import node_pb2_grpc

    node = node_factory(extra=["--max-namespaces", "4"])
    with sync_channel(node.addr, Security()) as ch:
        stub = node_pb2_grpc.PegaNodeStub(ch)

        def register(*names: str) -> node_pb2.RegisterResponse:
            return stub.Register(node_pb2.RegisterRequest(
                instance_id="b", namespaces=[node_pb2.NamespaceSpec(name=n, page_bytes=4096) for n in names]),
                timeout=5)

        sid = register("a", "b").session_id
        for q, why in (
            (node_pb2.QueryRequest(session_id=sid, namespaces=["a"] * 1000, hashes=[b"\0" * 16]), "namespaces"),
            (node_pb2.QueryRequest(session_id=sid, namespaces=["a", "a"], hashes=[b"\0" * 16]), "namespaces"),
            (node_pb2.QueryRequest(session_id=sid, namespaces=["a"], hashes=[b"\0" * 16], req_id="r" * (1 << 20)),
             "req_id"),
            (node_pb2.QueryRequest(session_id=sid, namespaces=["a"], hashes=[b"\0" * 16], peek=True, lease=True),
             "peek"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Query(q, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            register("c", "d", "e")  # 2 + 3 > 4: refused whole
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-namespaces" in err.value.details()
        stats = stub.Stats(node_pb2.StatsRequest(), timeout=5)
        assert set(stats.blocks_by_namespace) <= {"a", "b"}
        register("c", "d")  # exactly at the bound


def test_empty_namespaces_no_session_uses_are_forgotten(node_factory):  # type: ignore[no-untyped-def]
    from pegaflow.client import PegaClient

    node = node_factory(extra=["--max-namespaces", "3"])
    with PegaClient(node.addr) as c:  # holds a block: its namespace stays
        c.register({"kept": 4096})
        r = c.reserve("kept", [b"\1" * 16])
        c.commit(r.reservation_id)
    with PegaClient(node.addr) as c:
        c.register({"a": 4096, "b": 4096})
        with PegaClient(node.addr) as other, pytest.raises(Exception, match="max-namespaces"):
            other.register({"c": 4096})
    # Once their session is gone, the two empty ones are dropped and room is back.
    wait_until(lambda: node.metric("pegaflow_node_namespaces_dropped_total") >= 2, 20, "empty namespaces dropped")
    with PegaClient(node.addr) as c:
        c.register({"c": 4096, "d": 4096})
        assert set(c.stats().blocks_by_namespace) == {"kept", "c", "d"}
        assert c.query(["c"], [b"\1" * 16]).hit_blocks == 0
    with PegaClient(node.addr) as c:
        c.register({"kept": 4096})
        q = c.query(["kept"], [b"\1" * 16])
        assert q.hit_blocks == 1
        c.release(q.lease_id)
