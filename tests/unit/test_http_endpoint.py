"""The daemons' HTTP side (pegaflow/common/http.py): /metrics, /health, added routes, a
thread of its own, a taken port reported at start, a clean stop."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pegaflow.common.http import HttpEndpoint


def get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_serves_metrics_health_and_added_routes_on_a_thread_of_its_own() -> None:
    reg = CollectorRegistry()
    Counter("pf_test_things", "things", registry=reg).inc(3)
    state = {"ok": True, "n": 1}

    async def hello(_: Request) -> PlainTextResponse:
        return PlainTextResponse(threading.current_thread().name)

    ep = HttpEndpoint("127.0.0.1:0", reg, lambda: dict(state), routes=[Route("/hello", hello)])
    ep.start()
    try:
        assert ep.port > 0
        code, ctype, body = get(ep.port, "/metrics")
        assert code == 200 and ctype.startswith("text/plain") and "pf_test_things_total 3.0" in body
        code, _, body = get(ep.port, "/health")
        assert code == 200 and json.loads(body) == {"ok": True, "n": 1}
        state["ok"] = False
        assert get(ep.port, "/health")[0] == 503
        code, _, body = get(ep.port, "/hello")
        assert code == 200 and body == "pf-http"  # not the caller's thread
        assert get(ep.port, "/nothing")[0] == 404
    finally:
        ep.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", ep.port), timeout=1).close()
    assert not any(t.name == "pf-http" for t in threading.enumerate())


def test_a_taken_port_is_an_oserror_at_start() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        ep = HttpEndpoint(f"127.0.0.1:{taken.getsockname()[1]}", CollectorRegistry())
        with pytest.raises(OSError):
            ep.start()
