"""The HTTP side of every PegaFlow daemon: ``/metrics``, ``/health`` and the routes a daemon adds.

One way for all of them. The routes are Starlette routes (the stack the router's FastAPI app
and vLLM's own server use); :func:`metrics_route` and :func:`health_route` are the same
routes in each daemon, so ``pegaflow router`` mounts them on its app, and the node and the
metaserver serve them with :class:`HttpEndpoint`:

- The endpoint runs uvicorn on a thread of its own with its own event loop. The node's
  event loop serves engines; a scrape never waits in that loop's queue, and nothing here
  waits for it. A route that must act on a daemon's loop-owned state hands a coroutine to
  that loop (``asyncio.run_coroutine_threadsafe``); reading counters and gauges needs no
  hand-off (prometheus_client's values are thread-safe).
- The listening socket is bound by :meth:`HttpEndpoint.start` in the caller's thread, so a
  taken port is an ``OSError`` there (a one-line start-up error), and port 0 gives the
  bound port in :attr:`HttpEndpoint.port`.
- ``/health`` answers 200 with the daemon's JSON when its ``ok`` is true, else 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

import structlog
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from pegaflow.common.priority import background_thread
from pegaflow.core.hosts import join_host_port, split_host_port

log = structlog.get_logger("pegaflow.http")

STOP_TIMEOUT_S = 5  # uvicorn's graceful end (whole seconds): open scrapes finish, then the thread ends
SLICE_S = 0.0003  # a paced render (Renders(pause=...)) renders this long between two pauses


class _Families(Collector):
    """A registry-like view of metric families already collected (``generate_latest`` input)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


class Renders:
    """The registry's text, rendered at most once per ``interval`` seconds.

    A render runs Python for every sample while holding the GIL (~3.5 ms for a node's
    registry on this kind of host), and on the node the thread doing it competes with the
    event loop that serves engines: every scraper added cost the data path another render a
    second (``bench/dataplane.py --parts scrape``: Query p99 1.20x the quiet node's with one
    scraper at 1/s, 1.52x with four). So renders are rate-limited, without serving stale
    values: a scrape that comes less than ``interval`` after the last render *started* waits
    for the next one, and every scrape waiting meanwhile gets that same render. Each answer
    therefore reflects the registry at or after the moment its request arrived; the cost
    is a wait of at most ``interval``. Runs on the HTTP endpoint's one event loop.

    With ``pause`` (the node: ``DataPathIdle.pause``, pegaflow/node/idle.py), a render is
    paced: it collects and formats the registry family by family, and before it starts and
    whenever it has run :data:`SLICE_S` it awaits ``pause()``, which returns once the data
    path has been quiet for a moment (or after a bounded wait). The render's GIL time then
    falls in the data path's gaps instead of on its calls. Each family is collected whole
    (its samples are as consistent as unpaced); families are collected up to a few
    milliseconds apart, as they are by any scrape that does not lock the whole registry.

    With ``settle`` (the node: a hop through its event loop), each render first awaits it:
    the node counts a Query's blocks in a callback queued behind the answer it wrote
    (``pegaflow.node.service._after_answer``), and the hop runs every callback queued before
    the scrape, so a scrape sent after an answer arrived always counts that answer."""

    def __init__(self, registry: CollectorRegistry, interval: float,
                 pause: Callable[[], Awaitable[None]] | None = None,
                 settle: Callable[[], Awaitable[None]] | None = None) -> None:
        self.registry = registry
        self.interval = interval
        self.pause = pause
        self.settle = settle
        self._lock = asyncio.Lock()
        self._started = -math.inf  # when the last render started (monotonic)
        self._body = b""

    async def text(self) -> bytes:
        arrived = time.monotonic()
        async with self._lock:
            if self._started >= arrived:  # rendered while this scrape waited: share it
                return self._body
            wait = self._started + self.interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            started = time.monotonic()
            body = await self.render()  # a render that raises leaves the last one as it was
            self._started, self._body = started, body
            return body

    async def render(self) -> bytes:
        if self.settle is not None:
            await self.settle()
        if self.pause is None:
            return generate_latest(self.registry)
        parts: list[bytes] = []
        await self.pause()
        t = time.perf_counter()
        for family in self.registry.collect():  # lazy: one collector at a time
            parts.append(generate_latest(_Families((family,))))
            if time.perf_counter() - t >= SLICE_S:
                await self.pause()
                t = time.perf_counter()
        return b"".join(parts)


def metrics_route(registry: CollectorRegistry, render_interval: float = 0.0,
                  pause: Callable[[], Awaitable[None]] | None = None,
                  settle: Callable[[], Awaitable[None]] | None = None) -> Route:
    """``GET /metrics``: the registry in Prometheus text format, rendered at most once per
    ``render_interval`` seconds (:class:`Renders`; 0: on every request), paced by ``pause``,
    each render after ``settle``."""
    renders = Renders(registry, render_interval, pause, settle)

    async def metrics(_: Request) -> Response:
        if not render_interval:
            return Response(await renders.render(), media_type=CONTENT_TYPE_LATEST)
        return Response(await renders.text(), media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", metrics, methods=["GET"])


def health_route(health: Callable[[], Mapping[str, object]]) -> Route:
    """``GET /health``: ``health()`` as JSON, 200 when its ``ok`` is true, else 503."""

    async def answer(_: Request) -> Response:
        h = health()
        return JSONResponse(h, status_code=200 if h.get("ok") else 503)

    return Route("/health", answer, methods=["GET"])


class HttpEndpoint:
    """A daemon's HTTP listener on ``addr`` (``HOST:PORT``) with ``/metrics`` of ``registry``,
    ``/health`` when ``health`` is given, and ``routes``; see the module's contracts."""

    def __init__(self, addr: str, registry: CollectorRegistry, health: Callable[[], Mapping[str, object]] | None = None,
                 routes: Sequence[BaseRoute] = (), render_interval: float = 0.0,
                 pause: Callable[[], Awaitable[None]] | None = None,
                 settle: Callable[[], Awaitable[None]] | None = None) -> None:
        self.host, self.port = split_host_port(addr)
        all_routes: list[BaseRoute] = [metrics_route(registry, render_interval, pause, settle)]
        if health is not None:
            all_routes.append(health_route(health))
        all_routes.extend(routes)
        self.app = Starlette(routes=all_routes)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind (``OSError`` when the address cannot be had) and serve on a thread of its own."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family, reuse_port=False)
        self.port = sock.getsockname()[1]
        # uvicorn's own lines ("Started server process", ...) are not structured: only its
        # warnings and errors reach the daemon's log; http_listening says what matters.
        # ws="none": no endpoint is a websocket, and uvicorn's default ("auto") imports the
        # websockets library at every start (~15 ms of CPU here, in every daemon).
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                ws="none", timeout_graceful_shutdown=STOP_TIMEOUT_S)
        self._server = server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, args=(server, sock), name="pf-http", daemon=True)
        self._thread.start()
        log.info("http_listening", addr=join_host_port(self.host, self.port))

    @staticmethod
    def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
        background_thread()  # scrapes run below the daemon's own serving (pegaflow/common/priority.py)
        with contextlib.closing(sock):
            asyncio.run(server.serve(sockets=[sock]))

    def stop(self) -> None:
        """Stop listening and wait (bounded) for the thread to end."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S + 1)
            self._thread = None
