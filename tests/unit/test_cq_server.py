"""pegaflow/common/cq_server.py: the unary gRPC server that answers fast calls on grpc's polling
thread, against a real grpc client over a real socket."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pegaflow._proto import meta_pb2
from pegaflow.common import cq_server
from pegaflow.common.cq_server import CqServer
from pegaflow.common.grpc_guard import SyncGuard
from tests.waiting import wait_until

SERVICE = "test.Echo"
TOKEN = "s3cret"


def path(method: str) -> str:
    return f"/{SERVICE}/{method}"


class Echo:
    """Handlers that say which thread ran them."""

    def __init__(self) -> None:
        self.threads: dict[str, set[str]] = {}
        self.release = threading.Event()

    def _seen(self, method: str) -> None:
        self.threads.setdefault(method, set()).add(threading.current_thread().name)

    def fast(self, req: bytes, ctx: cq_server.Context) -> bytes:
        self._seen("Fast")
        return b"fast:" + req

    def slow(self, req: bytes, ctx: cq_server.Context) -> bytes:
        self._seen("Slow")
        return b"slow:" + req

    def refuse(self, req: bytes, ctx: cq_server.Context) -> bytes:
        ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request {req!r}")
        raise AssertionError("abort returns")  # pragma: no cover

    def broken(self, req: bytes, ctx: cq_server.Context) -> bytes:
        raise RuntimeError("a bug")

    def hang(self, req: bytes, ctx: cq_server.Context) -> bytes:
        self._seen("Hang")
        self.release.wait(30)
        return b"late"

    def config(self, req: meta_pb2.ClusterConfigRequest, ctx: cq_server.Context) -> meta_pb2.ClusterConfigResponse:
        return meta_pb2.ClusterConfigResponse(redis_url="redis://x:1")


def serve(echo: Echo, token: str = "", pool: futures.Executor | None = None) -> tuple[CqServer, grpc.Channel]:
    server, channel, _ = serve_port(echo, token, pool)
    return server, channel


def serve_port(echo: Echo, token: str = "", pool: futures.Executor | None = None
               ) -> tuple[CqServer, grpc.Channel, int]:
    ident = lambda b: b  # noqa: E731
    handlers = {name: grpc.unary_unary_rpc_method_handler(fn, ident, ident)
                for name, fn in (("Fast", echo.fast), ("Slow", echo.slow), ("Refuse", echo.refuse),
                                 ("Broken", echo.broken), ("Hang", echo.hang))}
    handlers["Config"] = grpc.unary_unary_rpc_method_handler(
        echo.config, meta_pb2.ClusterConfigRequest.FromString, meta_pb2.ClusterConfigResponse.SerializeToString)
    server = CqServer([path("Fast"), path("Refuse"), path("Config")], pool=pool, workers=2,
                      interceptors=[SyncGuard(token)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    return server, channel, port


@pytest.fixture
def echo() -> Echo:
    return Echo()


@pytest.fixture
def channel(echo: Echo) -> Iterator[grpc.Channel]:
    server, ch = serve(echo)
    yield ch
    echo.release.set()
    ch.close()
    assert server.stop(1.0).wait(10)


def call(ch: grpc.Channel, method: str, body: bytes, **kw: object) -> bytes:
    out: bytes = ch.unary_unary(path(method))(body, timeout=10, **kw)
    return out


def test_the_pinned_grpcio_has_what_the_server_uses() -> None:
    assert cq_server.supported()


def test_inline_methods_run_on_the_polling_thread_and_the_others_on_the_pool(
        channel: grpc.Channel, echo: Echo) -> None:
    assert call(channel, "Fast", b"a") == b"fast:a"
    assert call(channel, "Slow", b"b") == b"slow:b"
    assert echo.threads["Fast"] == {"pf-grpc-cq"}
    assert all(t.startswith("pf-grpc_") for t in echo.threads["Slow"]), echo.threads


def test_statuses_reach_the_client(channel: grpc.Channel) -> None:
    cases = [("Refuse", grpc.StatusCode.INVALID_ARGUMENT, "bad request b'x'"),
             ("Broken", grpc.StatusCode.UNKNOWN, "a bug"),
             ("Nope", grpc.StatusCode.UNIMPLEMENTED, f"unknown method: /{SERVICE}/Nope")]
    for method, code, details in cases:
        with pytest.raises(grpc.RpcError) as err:
            call(channel, method, b"x")
        assert err.value.code() == code, method
        assert details in err.value.details(), (method, err.value.details())
    assert call(channel, "Fast", b"after") == b"fast:after"  # still serving


def test_many_clients_at_once_all_get_their_own_answers(channel: grpc.Channel) -> None:
    def client(k: int) -> int:
        for i in range(100):
            method = "Fast" if (k + i) % 2 else "Slow"
            body = b"%d-%d" % (k, i)
            assert call(channel, method, body) == method.lower().encode() + b":" + body
        return k

    with futures.ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(client, range(8))) == list(range(8))


def test_the_token_gate_and_undecodable_requests(echo: Echo) -> None:
    server, ch = serve(echo, token=TOKEN)
    try:
        with pytest.raises(grpc.RpcError) as err:
            call(ch, "Fast", b"x")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = (("authorization", f"Bearer {TOKEN}"),)
        assert call(ch, "Fast", b"x", metadata=auth) == b"fast:x"
        got = meta_pb2.ClusterConfigResponse.FromString(
            call(ch, "Config", meta_pb2.ClusterConfigRequest().SerializeToString(), metadata=auth))
        assert got.redis_url == "redis://x:1"
        with pytest.raises(grpc.RpcError) as err:
            call(ch, "Config", b"\xff\xff\xff", metadata=auth)  # not a ClusterConfigRequest
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        ch.close()
        assert server.stop(1.0).wait(10)


def test_stop_cancels_what_outlives_the_grace_and_takes_no_new_call(echo: Echo) -> None:
    pool = futures.ThreadPoolExecutor(2)
    server, ch = serve(echo, pool=pool)
    hung = ch.unary_unary(path("Hang")).future(b"x", timeout=30)
    wait_until(lambda: "Hang" in echo.threads, 5, "the hanging call to be running")
    t0 = time.monotonic()
    done = server.stop(0.5)
    assert done.wait(10), "the server did not stop"
    assert 0.4 <= time.monotonic() - t0 < 5
    with pytest.raises(grpc.RpcError) as err:
        hung.result(timeout=10)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls")
    with pytest.raises(grpc.RpcError) as err:
        call(ch, "Fast", b"x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    echo.release.set()  # the handler ends after the stop: its answer has nowhere to go, and is dropped
    pool.shutdown(wait=True)
    assert echo.threads["Hang"]
    ch.close()


def test_a_stopped_server_leaves_its_port_free_though_a_client_is_still_connected(echo: Echo) -> None:
    """The clients close their connections, not the server: a port in TIME_WAIT on the server's
    side could not be bound again (without SO_REUSEADDR) for a minute."""
    server, ch, port = serve_port(echo)
    assert call(ch, "Fast", b"x") == b"fast:x"
    assert call(ch, "Slow", b"y") == b"slow:y"
    assert server.stop(1.0).wait(10)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises while anything holds the port
    ch.close()


def test_a_server_never_started_stops_at_once() -> None:
    server = CqServer([], workers=1)
    assert server.add_insecure_port("127.0.0.1:0") > 0
    assert server.stop(1.0).wait(5)
