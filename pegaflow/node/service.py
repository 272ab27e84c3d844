"""The node's engine-facing service (docs/architecture.md, "Engine ↔ node protocol"), over two transports.

One method implements each RPC's semantics (``query``, ``reserve``, ...). Both transports
call it: gRPC through the ``PegaNode`` servicer methods below, and the local fast path
(a Unix socket, :mod:`pegaflow.node.transports.unix_socket`) through :attr:`NodeService.local_methods`.
The :func:`rpc` wrapper is the one place that times a call (per transport); what a failure
answers and logs is ``pegaflow.common.rpc_errors`` (every service's), so both transports
answer alike.

Handlers are plain functions, not coroutines: every RPC but a Query that must ask the
metaserver completes without waiting for anything, so the local transport answers in the
event-loop callback that read the request, without a task per frame (measured on a 2-core
host: 10-15% less node CPU per Query+Release and Reserve+Commit pair than ``async def``
handlers behind asyncio streams, three interleaved runs of 6,000 pairs). A handler that
does have to wait returns an awaitable instead of the response (:data:`Answer`); the
transport awaits it.

Handlers run on the node's asyncio loop and are the only callers of :class:`BlockIndex`
and :class:`Sessions`, so no locks are needed. Every handler validates its request before
touching state: a bad request gets INVALID_ARGUMENT and changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar, TypeVarTuple

import grpc
import structlog
from google.protobuf.message import Message
from prometheus_client import Histogram

from pegaflow._proto import node_pb2, node_pb2_grpc
from pegaflow.common.errors import FailedPrecondition, InvalidArgument, PegaError
from pegaflow.common.local_wire import METHODS as LOCAL_METHODS
from pegaflow.common.rpc_errors import GRPC, RpcErrors, RpcStatus, status_of
from pegaflow.common.validate import check_copy_times, check_hashes
from pegaflow.core.block_index import Block, BlockIndex, Namespace
from pegaflow.core.recent import RecentKeys
from pegaflow.core.tiers import OUTCOMES, Tier
from pegaflow.node.accounting import SEEN_REQUESTS
from pegaflow.node.admin import NodeAdmin
from pegaflow.node.block_events import BlockEventFeed
from pegaflow.node.clearing import drop_namespaces
from pegaflow.node.idle import DataPathIdle
from pegaflow.node.metrics import NodeMetrics, value_of, values_by_label
from pegaflow.node.numa import engine_node
from pegaflow.node.sessions import Session, Sessions
from pegaflow.node.tiers.remote.metrics import PeerStats
from pegaflow.node.tiers.ssd.metrics import SsdStats
from pegaflow.policy.ceiling import WindowStats

if TYPE_CHECKING:
    from typing_extensions import TypeIs

_Session = Session  # in NodeService's body the name Session is the RPC method

log = structlog.get_logger("pegaflow.node")
errors = RpcErrors(log)  # a client can send any number of bad requests: rate-limited lines

MAX_NAME = 512  # bytes of a namespace or instance name
SESSION_PING_SECONDS = 5.0  # keep-alive events on the session stream
BLOCK_EVENTS_COALESCE_S = 0.01  # block events of a burst go out together, at most this much later

LOCAL = "local"

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
Ts = TypeVarTuple("Ts")  # a deferred call's arguments
Answer: TypeAlias = Resp | Awaitable[Resp]  # the response, or an awaitable of it (a handler that had to wait)
# A handler as the local socket calls it, looked up by its method's name: (request, transport) -> Answer.
# Its request is of the type paired with it in ``NodeService.local_methods``.
Handler = Callable[[Message, str], Answer[Message]]
DATA_PATH = frozenset({"Query", "Reserve", "Commit", "Release"})  # the engines' per-request calls


if TYPE_CHECKING:
    def _waits(answer: Answer[Resp]) -> TypeIs[Awaitable[Resp]]:
        """Whether a handler had to wait: its answer is the awaitable, else the response."""
else:  # the same check without a call more on every RPC
    _waits = inspect.isawaitable


def rpc(
    method: str,
) -> Callable[[Callable[[NodeService, Req], Answer[Resp]]], Callable[[NodeService, Req, str], Answer[Resp]]]:
    """Time a call by method, status and transport, and turn a failure into its status
    (``pegaflow.common.rpc_errors``). The wrapped ``fn(self, request)`` returns the response, or an
    awaitable of it when it has to wait; either way, failures become ``RpcStatus`` (raised
    at once, or by the awaitable)."""

    def wrap(fn: Callable[[NodeService, Req], Answer[Resp]]) -> Callable[[NodeService, Req, str], Answer[Resp]]:
        async def finish(self: NodeService, answer: Awaitable[Resp], transport: str, t0: float) -> Resp:
            status = "OK"
            try:
                return await answer
            except Exception as exc:
                st = errors.failed(exc, method, transport)
                status = st.code.name
                raise st from None
            finally:
                t1 = time.perf_counter()
                if data_path:
                    self.idle.last_call = t1
                self._observe(method, status, transport, t1 - t0)

        data_path = method in DATA_PATH

        @functools.wraps(fn)
        def handler(self: NodeService, request: Req, transport: str) -> Answer[Resp]:
            t0 = time.perf_counter()
            if data_path:  # background hand-offs wait for a pause after it (pegaflow/node/idle.py)
                self.idle.last_call = t0
            try:
                answer = fn(self, request)
            except Exception as exc:
                st = errors.failed(exc, method, transport)
                self._observe(method, st.code.name, transport, time.perf_counter() - t0)
                raise st from None
            if _waits(answer):
                return finish(self, answer, transport, t0)
            t1 = time.perf_counter()
            if data_path:
                self.idle.last_call = t1
            _after_answer(self._observe, method, "OK", transport, t1 - t0)
            return answer

        return handler

    return wrap


async def _over_grpc(handler: Callable[[Req, str], Answer[Resp]], request: Req,
                     context: grpc.aio.ServicerContext[Req, Resp]) -> Resp:
    try:
        answer = handler(request, GRPC)
        return (await answer) if _waits(answer) else answer
    except RpcStatus as st:
        await context.abort(st.code, st.message)


def _request_key(session_id: int, req_id: str) -> str:
    """A request's identity for the ceiling: engines number their requests independently
    (vLLM's offline engine counts from 0), so the session tells two engines' "0" apart."""
    return f"{session_id}/{req_id}" if req_id else ""


def _after_answer(fn: Callable[[*Ts], None], *args: *Ts) -> None:
    """Run ``fn(*args)`` once the answer being built is written: on the event loop, after
    the callback that serves the frame (the local socket writes its answers in that
    callback), so the engine waiting for the answer does not wait for the bookkeeping.
    In the same order as the answers; at once where no loop runs (tests calling handlers)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        fn(*args)
        return
    loop.call_soon(fn, *args)


class PromotingTier(Protocol):
    """The SSD tier as a Query sees it (``pegaflow.node.tiers.ssd.SsdTier``)."""

    def promote(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> int:
        """Start loading what follows the first ``hit`` blocks from SSD; the prefix length
        once loaded, 0 if nothing is there."""
        ...

    def leased(self, blocks: Sequence[Block]) -> None:
        """These blocks were leased: promoted ones need not be held for the engine any longer."""
        ...

    def clear(self, ns: Namespace) -> int:
        """Forget every SSD record of ``ns``; returns how many."""
        ...

    def stats(self) -> SsdStats:
        """The tier's numbers for the Stats RPC (what its metrics export)."""
        ...


class RemoteTier(Protocol):
    """Peer pulls as a Query sees them (``pegaflow.node.tiers.remote.puller.Puller``)."""

    async def query(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> bool:
        """Start pulling what follows the first ``hit`` blocks from peers; False if no peer has it."""
        ...

    def expected(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> int:
        """The prefix length once the pulls in flight land (the LOADING answer's ``expected_blocks``)."""
        ...

    def leased(self, blocks: Sequence[Block]) -> None:
        """These blocks were leased: pulled ones need not be held for the engine any longer."""
        ...


class QueryRecorder(Protocol):
    """The ``--query-trace`` writer (``pegaflow.node.query_trace.QueryTrace``)."""

    def record(self, namespace: str, hashes: Sequence[bytes], page_bytes: int, instance: str) -> None: ...


class Accounting(Protocol):
    """Per-request accounting (``pegaflow.node.accounting.RequestAccounting``)."""

    def loading(self, req_id: str, hit: int, tier: Tier) -> None: ...

    def observe(self, namespace: str, hashes: Sequence[bytes], hit: int, req_id: str = "") -> bool: ...

    def refresh(self) -> Sequence[WindowStats]:  # the windows now, gauges updated
        ...


class NodeService(node_pb2_grpc.PegaNodeServicer):
    """The engine-facing RPCs and the operator's cache RPCs (``admin``) on the node's loop.

    ``idle`` is the node's (pegaflow/node/idle.py): every data-path call stamps it, and the
    node's background hand-offs wait on it for a pause.
    """

    def __init__(
        self,
        index: BlockIndex,
        sessions: Sessions,
        metrics: NodeMetrics,
        pool_path: str,
        pool_bytes: int,
        node_id: str,
        epoch: int,
        max_batch: int = 16384,
        *,
        idle: DataPathIdle,
        admin: NodeAdmin,
        accounting: Accounting | None = None,
        ssd: PromotingTier | None = None,
        remote: RemoteTier | None = None,
        query_trace: QueryRecorder | None = None,
        pool_prefaulted: Callable[[], int] | None = None,
        block_events: BlockEventFeed | None = None,
        peer_stats: Callable[[], PeerStats] | None = None,
    ) -> None:
        self.index = index
        self.sessions = sessions
        self.metrics = metrics
        self.pool_path = pool_path
        self.pool_bytes = pool_bytes
        self.node_id = node_id
        self.epoch = epoch
        self.max_batch = max_batch
        self.stopping = asyncio.Event()
        self.idle = idle
        self.hit_blocks = 0
        self.miss_blocks = 0
        self._queried = RecentKeys(SEEN_REQUESTS)  # recent request keys, see query()
        self.accounting = accounting
        self.ssd = ssd  # --ssd-cache-path
        self.remote = remote  # pulls from peers: --metaserver-addr
        # Remote reads' figures (what their metrics export), pulls and serving: a node published
        # with --redis-url alone serves peers without pulling (no ``remote``).
        self.peer_stats = peer_stats
        self.query_trace = query_trace  # --query-trace
        self.pool_prefaulted = pool_prefaulted or (lambda: pool_bytes)  # bytes pre-faulted so far
        self.block_events = block_events  # evictions etc. for sessions that watch them
        self.local_socket = ""  # path of the local fast path announced at Register (set once it listens)
        self.admin = admin  # the operator's cache RPCs
        # Histogram children by (method, status, transport), looked up once: ``labels()``
        # costs a lock and a tuple on every RPC.
        self._latency: dict[tuple[str, str, str], Histogram] = {}
        # Wire method number -> (request type, handler) for pegaflow.node.transports.unix_socket.
        self.local_methods: dict[int, tuple[type[Message], Handler]] = {
            mid: (req_type, getattr(self, name.lower())) for mid, (name, req_type, _) in LOCAL_METHODS.items()
        }

    def _observe(self, method: str, status: str, transport: str, seconds: float) -> None:
        key = (method, status, transport)
        child = self._latency.get(key)
        if child is None:
            child = self._latency[key] = self.metrics.rpc_latency.labels(*key)
        child.observe(seconds)

    # ---- gRPC servicer: every unary method is the transport-neutral one above/below -------
    async def Register(
        self, request: node_pb2.RegisterRequest,
        context: grpc.aio.ServicerContext[node_pb2.RegisterRequest, node_pb2.RegisterResponse],
    ) -> node_pb2.RegisterResponse:
        return await _over_grpc(self.register, request, context)

    async def Query(
        self, request: node_pb2.QueryRequest,
        context: grpc.aio.ServicerContext[node_pb2.QueryRequest, node_pb2.QueryResponse],
    ) -> node_pb2.QueryResponse:
        return await _over_grpc(self.query, request, context)

    async def Reserve(
        self, request: node_pb2.ReserveRequest,
        context: grpc.aio.ServicerContext[node_pb2.ReserveRequest, node_pb2.ReserveResponse],
    ) -> node_pb2.ReserveResponse:
        return await _over_grpc(self.reserve, request, context)

    async def Commit(
        self, request: node_pb2.CommitRequest,
        context: grpc.aio.ServicerContext[node_pb2.CommitRequest, node_pb2.CommitResponse],
    ) -> node_pb2.CommitResponse:
        return await _over_grpc(self.commit, request, context)

    async def Release(
        self, request: node_pb2.ReleaseRequest,
        context: grpc.aio.ServicerContext[node_pb2.ReleaseRequest, node_pb2.ReleaseResponse],
    ) -> node_pb2.ReleaseResponse:
        return await _over_grpc(self.release, request, context)

    async def Reset(
        self, request: node_pb2.ResetRequest,
        context: grpc.aio.ServicerContext[node_pb2.ResetRequest, node_pb2.ResetResponse],
    ) -> node_pb2.ResetResponse:
        return await _over_grpc(self.reset, request, context)

    async def Health(
        self, request: node_pb2.HealthRequest,
        context: grpc.aio.ServicerContext[node_pb2.HealthRequest, node_pb2.HealthResponse],
    ) -> node_pb2.HealthResponse:
        return await _over_grpc(self.health, request, context)

    async def Stats(
        self, request: node_pb2.StatsRequest,
        context: grpc.aio.ServicerContext[node_pb2.StatsRequest, node_pb2.StatsResponse],
    ) -> node_pb2.StatsResponse:
        return await _over_grpc(self.stats, request, context)

    # The operator's `pegaflow cache` (pegaflow/node/admin.py).
    async def CacheInspect(
        self, request: node_pb2.CacheInspectRequest,
        context: grpc.aio.ServicerContext[node_pb2.CacheInspectRequest, node_pb2.CacheInspectResponse],
    ) -> node_pb2.CacheInspectResponse:
        return await _over_grpc(self.cache_inspect, request, context)

    async def CacheClear(
        self, request: node_pb2.CacheClearRequest,
        context: grpc.aio.ServicerContext[node_pb2.CacheClearRequest, node_pb2.CacheClearResponse],
    ) -> node_pb2.CacheClearResponse:
        return await _over_grpc(self.cache_clear, request, context)

    async def CachePin(
        self, request: node_pb2.CachePinRequest,
        context: grpc.aio.ServicerContext[node_pb2.CachePinRequest, node_pb2.CachePinResponse],
    ) -> node_pb2.CachePinResponse:
        return await _over_grpc(self.cache_pin, request, context)

    async def CacheUnpin(
        self, request: node_pb2.CacheUnpinRequest,
        context: grpc.aio.ServicerContext[node_pb2.CacheUnpinRequest, node_pb2.CacheUnpinResponse],
    ) -> node_pb2.CacheUnpinResponse:
        return await _over_grpc(self.cache_unpin, request, context)

    async def CachePins(
        self, request: node_pb2.CachePinsRequest,
        context: grpc.aio.ServicerContext[node_pb2.CachePinsRequest, node_pb2.CachePinsResponse],
    ) -> node_pb2.CachePinsResponse:
        return await _over_grpc(self.cache_pins, request, context)

    @rpc("CacheInspect")
    def cache_inspect(self, request: node_pb2.CacheInspectRequest) -> node_pb2.CacheInspectResponse:
        return self.admin.inspect(request)

    @rpc("CacheClear")
    def cache_clear(self, request: node_pb2.CacheClearRequest) -> node_pb2.CacheClearResponse:
        return self.admin.clear(request)

    @rpc("CachePin")
    def cache_pin(self, request: node_pb2.CachePinRequest) -> node_pb2.CachePinResponse:
        return self.admin.pin(request)

    @rpc("CacheUnpin")
    def cache_unpin(self, request: node_pb2.CacheUnpinRequest) -> node_pb2.CacheUnpinResponse:
        return self.admin.unpin(request)

    @rpc("CachePins")
    def cache_pins(self, request: node_pb2.CachePinsRequest) -> node_pb2.CachePinsResponse:
        return self.admin.list_pins(request)

    # ---- sessions ---------------------------------------------------------------------
    @rpc("Register")
    def register(self, request: node_pb2.RegisterRequest) -> node_pb2.RegisterResponse:
        if not request.namespaces:
            raise InvalidArgument("register needs at least one namespace")
        if len(request.instance_id.encode()) > MAX_NAME:
            raise InvalidArgument("instance_id too long")
        specs: list[tuple[str, int]] = []
        for ns in request.namespaces:
            if not ns.name or len(ns.name.encode()) > MAX_NAME:
                raise InvalidArgument(f"namespace name must be 1..{MAX_NAME} bytes")
            if not 0 < ns.page_bytes <= self.pool_bytes:
                raise InvalidArgument(
                    f"page_bytes {ns.page_bytes} of namespace {ns.name!r} must be in 1..{self.pool_bytes}"
                )
            specs.append((ns.name, ns.page_bytes))
        s = self.sessions.open(request.instance_id, specs)
        s.watch_blocks = request.watch_blocks
        s.numa_node = engine_node(self.sessions.index.alloc, request.pci_bus_id, request.cpu_affinity)
        if request.pci_bus_id:  # a worker (a GPU): where its namespaces' pages belong
            self.sessions.writer_node(s)
        log.info("session_registered", session=s.id, instance=request.instance_id, namespaces=[n for n, _ in specs],
                 numa_node=s.numa_node)
        return node_pb2.RegisterResponse(
            session_id=s.id, pool_path=self.pool_path, pool_bytes=self.pool_bytes, node_id=self.node_id,
            epoch=self.epoch, local_socket=self.local_socket,
        )

    async def Session(
        self, request: node_pb2.SessionRequest,
        context: grpc.aio.ServicerContext[node_pb2.SessionRequest, node_pb2.SessionEvent],
    ) -> AsyncIterator[node_pb2.SessionEvent]:
        try:
            s = self.sessions.get(request.session_id)
        except PegaError as exc:
            st = status_of(exc)
            await context.abort(st.code, st.message)
            return
        s.streams += 1
        s.streamed = True
        feed = self.block_events if s.watch_blocks else None
        watcher = feed.watch(s.id, s.namespaces.values()) if feed is not None else None
        try:
            # A session ended by the node (POST /instances/cleanup) ends its stream too.
            while not self.stopping.is_set() and s.id in self.sessions.sessions:
                if watcher is None:
                    yield node_pb2.SessionEvent(session_id=s.id, epoch=self.epoch)
                    try:
                        await asyncio.wait_for(self.stopping.wait(), SESSION_PING_SECONDS)
                    except TimeoutError:
                        pass
                    continue
                blocks, dropped = watcher.take()
                yield node_pb2.SessionEvent(session_id=s.id, epoch=self.epoch, blocks=blocks, dropped_hashes=dropped)
                try:
                    await asyncio.wait_for(watcher.ready.wait(), SESSION_PING_SECONDS)
                    await asyncio.sleep(BLOCK_EVENTS_COALESCE_S)  # one message per burst of evictions
                except TimeoutError:
                    pass
        finally:
            if watcher is not None and feed is not None:
                feed.unwatch(watcher)
            s.streams -= 1
            if s.streams == 0 and s.id in self.sessions.sessions:
                res, leases = self.sessions.close(s.id)
                self.metrics.sessions_closed.inc()
                log.info("session_closed", session=s.id, instance=s.instance_id,
                         reservations_freed=res, leases_released=leases)

    # ---- reads ------------------------------------------------------------------------
    @rpc("Query")
    def query(self, request: node_pb2.QueryRequest) -> Answer[node_pb2.QueryResponse]:
        s = self.sessions.get(request.session_id)
        if not request.namespaces:
            raise InvalidArgument("query needs at least one namespace")
        if len(request.namespaces) > len(s.namespaces) or len(set(request.namespaces)) < len(request.namespaces):
            raise InvalidArgument(f"query names {len(request.namespaces)} namespaces: each at most once, and only "
                                  f"the {len(s.namespaces)} this session registered")
        if len(request.req_id) > MAX_NAME:  # kept per request (counted once): bounded
            raise InvalidArgument(f"req_id longer than {MAX_NAME} characters")
        hashes = list(request.hashes)
        check_hashes(hashes, self.max_batch, "--max-batch")
        nss = [self.sessions.namespace(s, n) for n in request.namespaces]
        if request.peek:  # a router asking where to send a request: changes nothing here
            if request.lease:
                raise InvalidArgument("a peek query takes no lease")
            hit = min(len(self.index.prefix(ns, hashes, touch=False)) for ns in nss)
            self.metrics.queries.labels("peek").inc()
            return node_pb2.QueryResponse(status=node_pb2.READY, hit_blocks=hit)
        # A request is asked about again while its blocks load (LOADING polls) or when the
        # engine could not schedule it yet: its accesses count once, at its first Query.
        first = self._first_query(_request_key(s.id, request.req_id))
        per_ns = [self.index.prefix(ns, hashes, touch=first) for ns in nss]
        hit = min(len(p) for p in per_ns)
        if first:
            for ns in nss:
                self.index.record_access(ns, hashes[hit:])
        if self.ssd is not None and hit < len(hashes) and (expected := self.ssd.promote(nss, hashes, hit)):
            self.metrics.queries.labels("loading").inc()
            if self.accounting is not None:
                self.accounting.loading(_request_key(s.id, request.req_id), hit, Tier.SSD)
            return node_pb2.QueryResponse(status=node_pb2.LOADING, hit_blocks=hit,
                                          loading_from=node_pb2.LOADING_FROM_SSD, expected_blocks=expected)
        if self.remote is not None and hit < len(hashes):
            return self._query_peers(s, request, nss, hashes, hit)  # the one path that waits
        return self._answer(s, request, nss, hashes, per_ns, hit)

    async def _query_peers(self, s: _Session, request: node_pb2.QueryRequest, nss: list[Namespace],
                           hashes: list[bytes], hit: int) -> node_pb2.QueryResponse:
        """A local miss on a node with peers: ask the metaserver (awaited), then answer."""
        assert self.remote is not None
        if await self.remote.query(nss, hashes, hit):
            self.metrics.queries.labels("loading").inc()
            if self.accounting is not None:
                self.accounting.loading(_request_key(s.id, request.req_id), hit, Tier.REMOTE)
            return node_pb2.QueryResponse(status=node_pb2.LOADING, hit_blocks=hit,
                                          loading_from=node_pb2.LOADING_FROM_REMOTE,
                                          expected_blocks=self.remote.expected(nss, hashes, hit))
        # The metaserver lookup awaited: the session may have ended meanwhile (a lease on it
        # would pin its pages for good: nothing releases a gone session's leases), and
        # blocks may have come or gone.
        if self.sessions.sessions.get(s.id) is not s:
            raise FailedPrecondition(f"session {s.id} ended while its query waited for the metaserver")
        per_ns = [self.index.prefix(ns, hashes, touch=False) for ns in nss]
        return self._answer(s, request, nss, hashes, per_ns, min(len(p) for p in per_ns))

    def _answer(self, s: _Session, request: node_pb2.QueryRequest, nss: list[Namespace], hashes: list[bytes],
                per_ns: list[list[Block]], hit: int) -> node_pb2.QueryResponse:
        """READY with the first ``hit`` blocks of each namespace (leased if asked), counted."""
        pages = [node_pb2.NamespaceOffsets(namespace=ns.name, offsets=[b.offset for b in p[:hit]])
                 for ns, p in zip(nss, per_ns, strict=True)]
        lease_id = 0
        if request.lease and hit:
            blocks: list[Block] = [b for p in per_ns for b in p[:hit]]
            lease_id = self.sessions.lease(s, blocks).id
            if self.ssd is not None:
                self.ssd.leased(blocks)
            if self.remote is not None:
                self.remote.leased(blocks)
            self.metrics.load_bytes.inc(sum(b.size for b in blocks))
        self.hit_blocks += hit
        self.miss_blocks += len(hashes) - hit
        _after_answer(self._count_query, nss[0], hashes, hit, _request_key(s.id, request.req_id), s.instance_id)
        return node_pb2.QueryResponse(status=node_pb2.READY, hit_blocks=hit, lease_id=lease_id, pages=pages)

    def _count_query(self, ns: Namespace, hashes: list[bytes], hit: int, key: str, instance: str) -> None:
        """A READY answer's metrics, accounting (the hit-rate ceiling's sketches) and trace
        record: ~15-25% of a Query's work on the node, done once the answer is written."""
        self.metrics.hits.labels(Tier.L1).inc(hit)
        self.metrics.misses.inc(len(hashes) - hit)
        self.metrics.queries.labels("hit" if hit else "miss").inc()
        if self.accounting is not None:
            self.accounting.observe(ns.name, hashes, hit, key)
        if self.query_trace is not None:
            self.query_trace.record(ns.name, hashes, ns.page_bytes, instance)

    def _first_query(self, key: str) -> bool:
        """True unless request ``key`` was queried recently (requests without an id: always)."""
        return not key or not self._queried.seen(key)

    @rpc("Release")
    def release(self, request: node_pb2.ReleaseRequest) -> node_pb2.ReleaseResponse:
        s = self.sessions.get(request.session_id)
        copies = _copy_times(request.copies) if request.HasField("copies") else None
        self.sessions.release(s, request.lease_id)
        if copies is not None:
            self.metrics.observe_copies(*copies)
        return node_pb2.ReleaseResponse()

    # ---- writes -----------------------------------------------------------------------
    @rpc("Reserve")
    def reserve(self, request: node_pb2.ReserveRequest) -> node_pb2.ReserveResponse:
        s = self.sessions.get(request.session_id)
        hashes = list(request.hashes)
        check_hashes(hashes, self.max_batch, "--max-batch")
        ns = self.sessions.namespace(s, request.namespace)
        no_space_before = self.index.no_space
        res = self.sessions.reserve(s, ns, hashes)
        offsets = [b.offset if b is not None else -1 for b in res.blocks]
        skipped = offsets.count(-1)
        if skipped:
            full = self.index.no_space > no_space_before
            given = len(offsets) - skipped
            self._count_skips(ns, hashes, res.blocks, full, given)
        return node_pb2.ReserveResponse(reservation_id=res.id if res.id in s.reservations else 0, offsets=offsets)

    def _count_skips(self, ns: Namespace, hashes: list[bytes], blocks: list[Block | None], full: bool, given: int) -> None:
        held = sum(1 for h, b in zip(hashes, blocks, strict=True) if b is None and self.index.get(ns, h) is not None)
        other = len(hashes) - given - held
        if held:
            self.metrics.reserve_skipped.labels("already_stored").inc(held)
        if other:
            self.metrics.reserve_skipped.labels("no_space" if full else "in_flight").inc(other)

    @rpc("Commit")
    def commit(self, request: node_pb2.CommitRequest) -> node_pb2.CommitResponse:
        s = self.sessions.get(request.session_id)
        copies = _copy_times(request.copies) if request.HasField("copies") else None
        res = s.reservations.get(request.reservation_id)
        page = res.ns.page_bytes if res is not None else 0
        n = self.sessions.commit(s, request.reservation_id, list(request.indices), request.abort)
        self.metrics.save_bytes.inc(n * page)
        if copies is not None:
            self.metrics.observe_copies(*copies)
        return node_pb2.CommitResponse(committed=n)

    @rpc("Reset")
    def reset(self, request: node_pb2.ResetRequest) -> node_pb2.ResetResponse:
        s = self.sessions.get(request.session_id)
        if not request.namespaces:
            raise InvalidArgument("reset needs at least one namespace")
        nss = [self.sessions.namespace(s, n) for n in dict.fromkeys(request.namespaces)]
        dropped, busy, on_ssd = drop_namespaces(self.index, self.ssd, nss)
        self.metrics.resets.inc()
        self.metrics.removed.labels("reset").inc(dropped)
        log.info("namespaces_reset", session=s.id, instance=s.instance_id, namespaces=[ns.name for ns in nss],
                 dropped_blocks=dropped, busy_blocks=busy, ssd_blocks=on_ssd)
        return node_pb2.ResetResponse(dropped_blocks=dropped, busy_blocks=busy, ssd_blocks=on_ssd)

    # ---- introspection ----------------------------------------------------------------
    @rpc("Health")
    def health(self, request: node_pb2.HealthRequest) -> node_pb2.HealthResponse:
        return node_pb2.HealthResponse(ok=True, node_id=self.node_id, epoch=self.epoch, pool_bytes=self.pool_bytes,
                                       pool_prefaulted_bytes=self.pool_prefaulted())

    @rpc("Stats")
    def stats(self, request: node_pb2.StatsRequest) -> node_pb2.StatsResponse:
        idx = self.index
        by_ns = idx.blocks_by_namespace()
        m = self.metrics
        return node_pb2.StatsResponse(
            pool_bytes=self.pool_bytes,
            used_bytes=idx.alloc.used_bytes,
            resident_blocks=idx.resident_blocks,
            hits=self.hit_blocks,
            misses=self.miss_blocks,
            evictions=idx.evictions,
            active_leases=len(self.sessions.leases),
            active_reservations=len(self.sessions.reservations),
            sessions=len(self.sessions.sessions),
            blocks_by_namespace=by_ns,
            pool_prefaulted_bytes=self.pool_prefaulted(),
            node_id=self.node_id,
            epoch=self.epoch,
            uptime_seconds=max(0.0, time.time() - self.epoch / 1000),
            resident_bytes=idx.resident_bytes,
            windows=[node_pb2.CeilingWindow(window=w.label, requested_blocks=w.requests, hit_blocks=w.hits,
                                            distinct_blocks=w.distinct, hit_ratio=w.hit_rate,
                                            ceiling_ratio=w.ceiling)
                     for w in (self.accounting.refresh() if self.accounting is not None else ())],
            request_blocks=node_pb2.TierBlocks(**{k: _int(v) for k, v in values_by_label(m.request_blocks).items()
                                                  if k in OUTCOMES}),
            hit_blocks=node_pb2.TierBlocks(miss=_int(value_of(m.misses)),
                                           **{k: _int(v) for k, v in values_by_label(m.hits).items() if k in OUTCOMES}),
            ssd=node_pb2.SsdStats(**dataclasses.asdict(self.ssd.stats())) if self.ssd is not None else None,
            peers=node_pb2.PeerStats(**dataclasses.asdict(self.peer_stats())) if self.peer_stats is not None else None,
            engines=self._engine_stats(),
            namespaces=[node_pb2.NamespaceStats(name=ns.name, page_bytes=ns.page_bytes, blocks=by_ns.get(ns.name, 0),
                                                bytes=by_ns.get(ns.name, 0) * ns.page_bytes)
                        for ns in idx.namespaces()],
            save_bytes=_int(value_of(m.save_bytes)),
            load_bytes=_int(value_of(m.load_bytes)),
        )

    def _engine_stats(self) -> list[node_pb2.EngineStats]:
        engines: dict[str, node_pb2.EngineStats] = {}
        for s in self.sessions.sessions.values():
            e = engines.get(s.instance_id)
            if e is None:
                e = engines[s.instance_id] = node_pb2.EngineStats(instance_id=s.instance_id)
            e.sessions += 1
            e.leases += len(s.leases)
            e.reservations += len(s.reservations)
            e.namespaces.extend(n for n in s.namespaces if n not in e.namespaces)
        return list(engines.values())



def _copy_times(c: node_pb2.CopyTimes) -> tuple[list[float], list[float], int]:
    """An engine's report of its copies (``CopyTimes``), checked."""
    save, load = list(c.save_seconds), list(c.load_seconds)
    check_copy_times("save_seconds", save)
    check_copy_times("load_seconds", load)
    return save, load, c.load_failures


def _int(v: float) -> int:
    return max(0, int(v))
