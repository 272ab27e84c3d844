"""The operator's side of a node: the original's HTTP endpoints and ``pegaflow cache``'s RPCs.

HTTP (the original's ``pegaflow-server/src/http_server.rs``, same paths, answers and codes):

- ``GET /instances``: ``{"instances": [ids]}`` (the original's answer) plus ``"details"``:
  per instance, its namespaces, its sessions and what they hold (leases, reservations) and
  the blocks its namespaces hold in the pool.
- ``POST /instances/cleanup[?id=ID]``: end every session of instance ``ID`` (all instances
  without ``id``), as if their engines had disconnected: reservations discarded, leases
  released, the ``Session`` streams end. ``{"removed_instances": [...], "removed_tensors": 0}``;
  an unknown ``id`` answers 404 ``instance ID not found``. (``removed_tensors`` counts CUDA
  IPC tensors the original's server holds for engines; this node holds none.)
- ``POST /cache/memory/cleanup``: evict every resident block of the pool that nothing holds
  (leases, transfers, SSD writes, operator pins), keeping the SSD tier's copies:
  ``{"evicted_blocks", "evicted_bytes", "reclaimed_bytes", "still_referenced_blocks"}``.
  Unlike the original, a held block stays indexed (it is counted in
  ``still_referenced_blocks``): its page is in use, and a pin means "keep it".

With a token (``--auth-token-file``/``PEGAFLOW_AUTH_TOKEN``) these need ``Authorization:
Bearer <token>`` (401 otherwise); ``/metrics`` and ``/health`` stay open.

gRPC (``pegaflow cache``): ``CacheInspect`` (where each block of a prefix is: pool, SSD,
pinned), ``CacheClear`` (a namespace, an engine instance's namespaces, everything: as an
engine's ``Reset``), ``CachePin``/``CacheUnpin``/``CachePins``. A pin keeps a prefix
resident: its blocks are pinned in the index (out of the eviction order, like a lease) as
soon as they are resident, now or later, until unpinned; all pins together may ask for at
most ``--max-pinned-share`` of the pool. A clear (or an engine's Reset) drops pinned blocks
too; the pin stays and holds them again when they are stored again.

Threads: everything here runs on the node's event loop. The HTTP routes run on the HTTP
endpoint's own thread and hand their work to that loop (``run_coroutine_threadsafe``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Protocol, TypedDict, TypeVar

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from pegaflow._proto import node_pb2
from pegaflow.common.errors import InvalidArgument, ResourceExhausted
from pegaflow.common.grpc_guard import token_matches
from pegaflow.common.validate import check_hashes
from pegaflow.core.block_index import Block, BlockIndex, IndexEvent, Namespace
from pegaflow.node.clearing import ClearableTier, drop_namespaces
from pegaflow.node.metrics import NodeMetrics
from pegaflow.node.sessions import Sessions
from pegaflow.node.tiers.ssd.store import SsdIndex

log = structlog.get_logger("pegaflow.node.admin")

T = TypeVar("T")


class _InstanceDetails(TypedDict):
    """One engine instance in ``GET /instances`` (the original's shape)."""

    namespaces: list[str]
    sessions: list[dict[str, object]]
    leased_blocks: int
    reserved_blocks: int
    namespace_blocks: dict[str, int]
HTTP_TIMEOUT_S = 30.0  # an HTTP call waits at most this long for the node's loop
MAX_PIN_NAME = 128


class SsdLookup(ClearableTier, Protocol):
    """What inspect and clear need of the SSD tier (``pegaflow.node.tiers.ssd.SsdTier``)."""

    store: SsdIndex  # inspect: ``get((ns_id, hash))``


@dataclass(eq=False)
class Pin:
    id: str
    namespace: str
    hashes: list[bytes]
    page_bytes: int
    held: dict[bytes, Block] = field(default_factory=dict)  # blocks this pin holds pinned now

    @property
    def bytes(self) -> int:
        return len(self.hashes) * self.page_bytes

    def info(self) -> node_pb2.PinInfo:
        return node_pb2.PinInfo(id=self.id, namespace=self.namespace, blocks=len(self.hashes),
                                resident=len(self.held), bytes=self.bytes)


class NodeAdmin:
    def __init__(self, index: BlockIndex, sessions: Sessions, metrics: NodeMetrics, node_id: str,
                 max_pinned_share: float, max_batch: int, ssd: SsdLookup | None = None) -> None:
        self.index = index
        self.sessions = sessions
        self.metrics = metrics
        self.node_id = node_id
        self.max_pinned_share = max_pinned_share
        self.max_batch = max_batch
        self.ssd = ssd
        self.pins: dict[str, Pin] = {}
        self.pinned_bytes = 0  # what all pins ask for (an int: the metrics' scrape thread reads it)
        self._by_ns: dict[str, list[Pin]] = {}  # namespace name -> its pins
        self._want: dict[str, set[bytes]] = {}  # namespace name -> every hash its pins name
        self._ids = itertools.count(1)
        self._scheduled: set[str] = set()  # namespaces with a catch-up pending on the loop
        self.loop: asyncio.AbstractEventLoop | None = None  # the node's, set by start()
        index.add_listener(self._on_index_event)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    # ---- pins -------------------------------------------------------------------------
    @property
    def max_pinned_bytes(self) -> int:
        return int(self.index.alloc.capacity * self.max_pinned_share)

    def _on_index_event(self, op: IndexEvent, ns: Namespace, hashes: list[bytes]) -> None:
        # Called inside the index's own calls: only note the namespace, act once they return.
        # The set test runs in C: a namespace's other blocks cost one probe each.
        want = self._want.get(ns.name)
        if want is None or want.isdisjoint(hashes):
            return
        if ns.name not in self._scheduled and self.loop is not None:
            self._scheduled.add(ns.name)
            self.loop.call_soon(self._catch_up, ns.name)

    def _catch_up(self, name: str) -> None:
        """Hold what this namespace's pins want and is resident; let go of blocks a clear or
        Reset dropped (their pages are freed at this unpin)."""
        self._scheduled.discard(name)
        for pin in self._by_ns.get(name, ()):
            self._sync(pin)

    def _sync(self, pin: Pin) -> None:
        ns = self.index.get_namespace(pin.namespace)
        stale = [b for h, b in pin.held.items() if ns is None or self.index.get(ns, h) is not b]
        if stale:
            self.index.unpin(stale)
            for b in stale:
                del pin.held[b.hash]
        if ns is None or ns.page_bytes != pin.page_bytes:
            return
        new = []
        for h in pin.hashes:
            if h not in pin.held:
                got = self.index.get(ns, h)
                if got is not None:
                    pin.held[h] = got
                    new.append(got)
        if new:
            self.index.pin(new)

    def _let_go(self, name: str) -> None:
        for pin in self._by_ns.get(name, ()):
            if pin.held:
                self.index.unpin(list(pin.held.values()))
                pin.held.clear()

    def pin(self, request: node_pb2.CachePinRequest) -> node_pb2.CachePinResponse:
        hashes = list(request.hashes)
        if not hashes:
            raise InvalidArgument("pin needs at least one block hash")
        check_hashes(hashes, self.max_batch, "--max-batch")
        if len(set(hashes)) != len(hashes):
            raise InvalidArgument("pin names a block hash twice")
        name = request.name
        if len(name.encode()) > MAX_PIN_NAME or any(c.isspace() for c in name):
            raise InvalidArgument(f"pin name must be at most {MAX_PIN_NAME} bytes, without spaces")
        if name in self.pins:
            raise InvalidArgument(f"a pin named {name!r} exists (unpin it first)")
        ns = self.index.get_namespace(request.namespace)
        if ns is None:
            raise InvalidArgument(f"namespace {request.namespace!r} is unknown on this node (no engine registered it)")
        pin = Pin(name or self._new_id(), ns.name, hashes, ns.page_bytes)
        if self.pinned_bytes + pin.bytes > self.max_pinned_bytes:
            raise ResourceExhausted(
                f"pinning {pin.bytes} bytes would pass --max-pinned-share {self.max_pinned_share:g} of the pool "
                f"({self.pinned_bytes} of {self.max_pinned_bytes} bytes pinned)")
        self.pins[pin.id] = pin
        self.pinned_bytes += pin.bytes
        self._by_ns.setdefault(ns.name, []).append(pin)
        self._want.setdefault(ns.name, set()).update(hashes)
        self._sync(pin)
        log.info("cache_pinned", pin=pin.id, namespace=ns.name, blocks=len(hashes), resident=len(pin.held))
        return node_pb2.CachePinResponse(pin=pin.info(), pinned_bytes=self.pinned_bytes,
                                         max_pinned_bytes=self.max_pinned_bytes)

    def _new_id(self) -> str:
        while True:
            i = f"pin-{next(self._ids)}"
            if i not in self.pins:
                return i

    def unpin(self, request: node_pb2.CacheUnpinRequest) -> node_pb2.CacheUnpinResponse:
        pin = self.pins.pop(request.id, None)
        if pin is None:
            raise InvalidArgument(f"no pin {request.id!r} on this node")
        self.pinned_bytes -= pin.bytes
        self._by_ns[pin.namespace].remove(pin)
        if self._by_ns[pin.namespace]:
            self._want[pin.namespace] = {h for p in self._by_ns[pin.namespace] for h in p.hashes}
        else:
            del self._by_ns[pin.namespace], self._want[pin.namespace]
        info = pin.info()
        if pin.held:
            self.index.unpin(list(pin.held.values()))
            pin.held.clear()
        log.info("cache_unpinned", pin=pin.id, namespace=pin.namespace, blocks=len(pin.hashes))
        return node_pb2.CacheUnpinResponse(pin=info)

    def list_pins(self, request: node_pb2.CachePinsRequest) -> node_pb2.CachePinsResponse:
        for name in list(self._by_ns):
            self._catch_up(name)
        return node_pb2.CachePinsResponse(pins=[p.info() for p in self.pins.values()],
                                          pinned_bytes=self.pinned_bytes, max_pinned_bytes=self.max_pinned_bytes)

    # ---- inspect and clear ------------------------------------------------------------
    def inspect(self, request: node_pb2.CacheInspectRequest) -> node_pb2.CacheInspectResponse:
        hashes = list(request.hashes)
        if not request.namespace:
            raise InvalidArgument("inspect needs a namespace")
        check_hashes(hashes, self.max_batch, "--max-batch")
        ns = self.index.get_namespace(request.namespace)
        if ns is None:
            n = len(hashes)
            return node_pb2.CacheInspectResponse(node_id=self.node_id, namespace_known=False, dram=[False] * n,
                                                 ssd=[False] * n, pinned=[False] * n)
        blocks = [self.index.get(ns, h) for h in hashes]
        held = {h for p in self._by_ns.get(ns.name, ()) for h, b in p.held.items() if b is self.index.get(ns, h)}
        store = self.ssd.store if self.ssd is not None else None
        dram = [b is not None for b in blocks]
        prefix = dram.index(False) if False in dram else len(dram)
        return node_pb2.CacheInspectResponse(
            node_id=self.node_id, namespace_known=True, dram=dram,
            ssd=[store is not None and store.get((ns.id, h)) is not None for h in hashes],
            pinned=[h in held for h in hashes], dram_prefix=prefix)

    def clear(self, request: node_pb2.CacheClearRequest) -> node_pb2.CacheClearResponse:
        given = sum(map(bool, (request.namespace, request.instance_id, request.all)))
        if given != 1:
            raise InvalidArgument("clear takes exactly one of: a namespace, an instance id, all")
        if request.all:
            nss = self.index.namespaces()
        elif request.namespace:
            ns = self.index.get_namespace(request.namespace)
            if ns is None:
                raise InvalidArgument(f"namespace {request.namespace!r} is unknown on this node")
            nss = [ns]
        else:
            names = {n for s in self.sessions.sessions.values() if s.instance_id == request.instance_id
                     for n in s.namespaces}
            if not names:
                raise InvalidArgument(f"no registered engine instance {request.instance_id!r} on this node")
            nss = [ns for n in sorted(names) if (ns := self.index.get_namespace(n)) is not None]
        # Pinned by an operator: freed now, held again when stored again.
        dropped, busy, on_ssd = drop_namespaces(self.index, self.ssd, nss,
                                                before=lambda ns: self._let_go(ns.name))
        self.metrics.resets.inc()
        self.metrics.removed.labels("clear").inc(dropped)
        log.warning("cache_cleared", namespaces=[ns.name for ns in nss], dropped_blocks=dropped, busy_blocks=busy,
                    ssd_blocks=on_ssd, by="operator")
        return node_pb2.CacheClearResponse(namespaces=[ns.name for ns in nss], dropped_blocks=dropped,
                                           busy_blocks=busy, ssd_blocks=on_ssd)

    # ---- the original's HTTP endpoints (run on the loop) ------------------------------
    def instances(self) -> dict[str, object]:
        blocks = self.index.blocks_by_namespace()
        details: dict[str, _InstanceDetails] = {}
        for s in self.sessions.sessions.values():
            d = details.setdefault(s.instance_id, {"namespaces": [], "sessions": [], "leased_blocks": 0,
                                                   "reserved_blocks": 0, "namespace_blocks": {}})
            leased = sum(len(lease.blocks) for lease in s.leases.values())
            reserved = sum(sum(b is not None for b in r.blocks) for r in s.reservations.values())
            d["sessions"].append({"namespaces": sorted(s.namespaces), "streams": s.streams,
                                  "leases": len(s.leases), "leased_blocks": leased,
                                  "reservations": len(s.reservations), "reserved_blocks": reserved,
                                  "watch_blocks": s.watch_blocks})
            d["leased_blocks"] += leased
            d["reserved_blocks"] += reserved
            for n in s.namespaces:
                if n not in d["namespaces"]:
                    d["namespaces"].append(n)
                    d["namespace_blocks"][n] = blocks.get(n, 0)
        return {"instances": sorted(details), "details": {k: details[k] for k in sorted(details)}}

    def cleanup_instances(self, instance_id: str | None) -> tuple[int, dict[str, object] | str]:
        chosen = [s for s in self.sessions.sessions.values() if instance_id is None or s.instance_id == instance_id]
        if instance_id is not None and not chosen:
            return 404, f"instance {instance_id} not found"
        removed = sorted({s.instance_id for s in chosen})
        freed_r = freed_l = 0
        for s in chosen:
            r, n = self.sessions.close(s.id)
            freed_r += r
            freed_l += n
        if chosen:
            self.metrics.sessions_closed.inc(len(chosen))
            log.warning("instances_cleaned_up", instances=removed, sessions=len(chosen),
                        reservations_freed=freed_r, leases_released=freed_l)
        else:
            log.info("instances_cleanup_nothing_to_remove")
        return 200, {"removed_instances": removed, "removed_tensors": 0}

    def cleanup_memory(self) -> dict[str, int]:
        used_before = self.index.alloc.used_bytes
        free = [b for b in self.index.resident() if b.pins == 0]
        gone = self.index.remove(free)
        self.metrics.removed.labels("cleanup").inc(len(gone))
        evicted_bytes = sum(b.size for b in gone)
        still = self.index.resident_blocks
        reclaimed = max(0, used_before - self.index.alloc.used_bytes)
        log.info("memory_cache_cleaned", evicted_blocks=len(gone), evicted_bytes=evicted_bytes,
                 reclaimed_bytes=reclaimed, still_referenced_blocks=still)
        return {"evicted_blocks": len(gone), "evicted_bytes": evicted_bytes, "reclaimed_bytes": reclaimed,
                "still_referenced_blocks": still}

    # ---- HTTP -------------------------------------------------------------------------
    def routes(self, token: Callable[[], str], where: Callable[[], str] = lambda: "") -> list[Route]:
        """The original's routes for :class:`pegaflow.common.http.HttpEndpoint`; ``token()``
        is the node's token ('' = open), read per request; ``where()``: the file that holds
        it when the node made its own ('' otherwise), named in the 401's answer."""

        def authorized(request: Request) -> Response | None:
            t = token()
            if not t or token_matches(t, request.headers.get("authorization")):
                return None
            path = where()
            if path:  # the original's scripts, run by the node's user, need only this header
                error = (f"missing or wrong token: this node made its own, in {path} (readable by its user); "
                         f"send it as Authorization: Bearer <token>, e.g. curl -H \"Authorization: Bearer "
                         f"$(cat {path})\" (docs/security.md; --no-auth to open the node)")
            else:
                error = ("missing or wrong token: send the node's --auth-token-file / PEGAFLOW_AUTH_TOKEN token as "
                         "Authorization: Bearer <token>")
            return JSONResponse({"error": error}, status_code=401, headers={"WWW-Authenticate": "Bearer"})

        async def on_loop(fn: Callable[[], T]) -> T:
            if self.loop is None:
                raise RuntimeError("the node is not started")

            async def call() -> T:
                return fn()

            coro: Coroutine[object, object, T] = call()
            return await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop)),
                                          HTTP_TIMEOUT_S)

        async def list_instances(request: Request) -> Response:
            return authorized(request) or JSONResponse(await on_loop(self.instances))

        async def cleanup(request: Request) -> Response:
            if (denied := authorized(request)) is not None:
                return denied
            instance_id = request.query_params.get("id")
            status, body = await on_loop(lambda: self.cleanup_instances(instance_id))
            if isinstance(body, str):
                return PlainTextResponse(body, status_code=status)
            return JSONResponse(body, status_code=status)

        async def cleanup_memory(request: Request) -> Response:
            return authorized(request) or JSONResponse(await on_loop(self.cleanup_memory))

        return [Route("/instances", list_instances, methods=["GET"]),
                Route("/instances/cleanup", cleanup, methods=["POST"]),
                Route("/cache/memory/cleanup", cleanup_memory, methods=["POST"])]
