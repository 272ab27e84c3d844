"""How cheap can a Python gRPC server answer a unary call here? (research for issue #55)

    python bench/grpc_floor.py [--calls 1500] [--rounds 3] [--blocks 1048576] [--only a,b] [--no-original]
    python bench/grpc_floor.py table [--blocks 1048576,8388608]     # in-memory index: ns/hash, B/block
    python bench/grpc_floor.py ingest [--pairs 2097152]             # XREAD + decode + apply: pairs/s

``grpc`` (the default) measures, with the bench's own client (a sync ``grpc`` channel and
``meta_pb2_grpc.MetaServiceStub``), two calls against each server variant in ``VARIANTS``,
each variant a process of its own:

- ``floor``: ``GetClusterConfig`` answered from memory;
- ``route``: ``RouteHint`` of 128 hashes of a 2-namespace index of ``--blocks`` blocks held by
  8 nodes, answered from an in-memory table inside the server (``DictIndex`` or
  ``NumpyIndex``, every answer checked) in variants that have one, else answered
  ``found=False`` without looking (the cost of the message alone).

Variants: the sync ``grpc.server`` with a ``ThreadPoolExecutor`` of 1, 2, 4 or 8 workers, one
thread on grpc core's completion queue answering where each call lands (``cq-*``: what
``pegaflow/common/cq_server.py`` does for the metaserver's lookups),
``grpc.aio`` on asyncio or uvloop, protobuf servicers or generic handlers that answer
pre-serialized bytes, the real ``MetaServicer`` behind ``SyncGuard`` (``ours-daemon``: as
pegaflow-meta serves with its view, 2 threads, EventEngine off, heap frozen; ``ours-today``: 8
threads, as it served before the view; both minus Redis), server options, ``GRPC_POLL_STRATEGY``, grpc core's EventEngine listener and
endpoints switched off (``GRPC_EXPERIMENTS``, ``NO_EE``), a server pinned to one CPU, the
collector frozen or off. The Rust original's metaserver (bench/original_meta.py) is the reference:
``HeartbeatNode`` (its cheapest call) as its floor, ``QueryPrefixBlocks`` of the same
128-hash requests over the same blocks as its route.

Cold calls (what a lookup service sees, and what bench/meta.py measures): ``--rounds``
rounds of ``--calls`` steps, each step one call of every (variant, method) pair in a new
random order, so nearly every call reaches a server that was idle while the others were
called. Warm calls: then, per round, ``--calls // 2`` back-to-back floor calls per server,
servers shuffled. The table gives p50 / p99 over all rounds, the spread of the per-round
p50s (the noise of a shared host), and the server's CPU per call: the sum over its threads
of ``/proc/PID/task/*/schedstat`` across the run (cold: less its idle rate measured
before), divided by the calls it answered.

``table`` builds the two in-memory index layouts in this process and times the prefix
walk of 128 hashes (ns per hash) and the memory per block (RSS growth). ``ingest`` fills 8
node streams in a fresh redis-server with real events (``pegaflow/meta/events/codec.py``,
512 hashes per entry), then reads them with plain ``XREAD`` (no group) and applies them to
each layout, single-threaded: (block, node) pairs / s for read+decode alone and with apply.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pegaflow._proto import meta_pb2, meta_pb2_grpc  # noqa: E402

NODES = 8
PREFIX = 128
NAMESPACES = ["bench-model-a|fp16|bs16|tp1", "bench-model-b|fp16|bs16|tp1"]
SERVICE = "pegaflow.meta.v1.MetaService"
WARMUP = 100  # interleaved calls per (variant, method) before the timed rounds
READY_TIMEOUT_S = 120.0  # a variant with a table builds it before it answers

# --- the workload: blocks, holders, requests ---------------------------------------------------


def workload(blocks: int, seed: int = 1) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per namespace: the block hashes (n, 16) uint8, chains of ``PREFIX`` blocks, and each
    block's holders as a bitmask of the ``NODES`` nodes: every chain is held whole by one node,
    and its first half by a second one (so an answer has a longest holder and a runner-up)."""
    rng = np.random.default_rng(seed)
    per_ns = blocks // len(NAMESPACES) // PREFIX * PREFIX
    hashes, masks = [], []
    for _ in NAMESPACES:
        h = rng.integers(1, 2**63, size=(per_ns, 2), dtype=np.uint64)
        chains = per_ns // PREFIX
        a = rng.integers(0, NODES, size=chains)
        b = (a + rng.integers(1, NODES, size=chains)) % NODES
        m = np.repeat((np.uint64(1) << a.astype(np.uint64)), PREFIX).reshape(chains, PREFIX)
        m[:, : PREFIX // 2] |= (np.uint64(1) << b.astype(np.uint64))[:, None]
        hashes.append(h.view(np.uint8).reshape(per_ns, 16))
        masks.append(m.reshape(-1))
    return hashes, masks


def requests(hashes: list[np.ndarray], n: int, seed: int = 2) -> list[tuple[int, list[bytes]]]:
    """``n`` lookups: (namespace index, the 128 hashes of one random chain)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ns = i % len(NAMESPACES)
        c = rng.randrange(len(hashes[ns]) // PREFIX)
        blob = hashes[ns][c * PREFIX : (c + 1) * PREFIX].tobytes()
        out.append((ns, [blob[j : j + 16] for j in range(0, len(blob), 16)]))
    return out


def expected(masks: list[np.ndarray], hashes: list[np.ndarray], req: tuple[int, list[bytes]]) -> int:
    """The node holding the whole chain (the longest holder) of a request."""
    ns, hs = req
    h = hashes[ns]
    # the chain index from the first hash: chains are contiguous, so search by value
    first = np.frombuffer(hs[0], dtype=np.uint64)
    row = int(np.flatnonzero((h.view(np.uint64)[:, 0] == first[0]) & (h.view(np.uint64)[:, 1] == first[1]))[0])
    last = int(masks[ns][row + PREFIX - 1])
    return last.bit_length() - 1


# --- in-memory index layouts --------------------------------------------------------------------


def prefix_of(masks: Sequence[int], at: Sequence[int], n: int) -> dict[int, int]:
    """node bit -> prefix length, from the running AND of a request's holder masks given at
    the positions ``at`` where it changes (``at[0] == 0``) over ``n`` blocks."""
    out: dict[int, int] = {}
    prev = masks[0]
    for m, i in zip(masks[1:], at[1:], strict=True):
        gone = prev & ~m
        while gone:
            low = gone & -gone
            out[low.bit_length() - 1] = i
            gone ^= low
        prev = m
    while prev > 0:
        low = prev & -prev
        out[low.bit_length() - 1] = n
        prev ^= low
    return out


class DictIndex:
    """A dict per namespace: 16-byte hash -> holder bitmask (a Python int; bit k = the k-th
    live incarnation). The walk stops at the first block no one holds."""

    def __init__(self) -> None:
        self.ns: dict[int, dict[bytes, int]] = {}

    def add(self, ns: int, blob: bytes, bit: int) -> None:
        d = self.ns.setdefault(ns, {})
        get = d.get
        for j in range(0, len(blob), 16):
            h = blob[j : j + 16]
            d[h] = get(h, 0) | bit

    def add_masks(self, ns: int, hashes: np.ndarray, masks: np.ndarray) -> None:
        blob = hashes.tobytes()
        d = self.ns.setdefault(ns, {})
        for j, m in enumerate(masks.tolist()):
            d[blob[16 * j : 16 * j + 16]] = m

    def prefix(self, ns: int, hashes: Sequence[bytes]) -> dict[int, int]:
        get = self.ns[ns].get
        out: dict[int, int] = {}
        cur = -1
        for i, h in enumerate(hashes):
            nxt = cur & get(h, 0)
            if nxt != cur:
                gone = cur & ~nxt if i else 0
                while gone:
                    low = gone & -gone
                    out[low.bit_length() - 1] = i
                    gone ^= low
                cur = nxt
                if not cur:
                    return out
        while cur > 0:
            low = cur & -cur
            out[low.bit_length() - 1] = len(hashes)
            cur ^= low
        return out


class NumpyIndex:
    """Open addressing in numpy arrays per namespace: two uint64 key halves and a uint64
    holder mask per slot (24 B), linear probing on the hash's low bits (the hashes are
    already uniform), load ≤ ``LOAD``; an all-zero key marks an empty slot. Lookups and
    batch inserts are vectorized over the request / the event's blob."""

    LOAD = 0.7
    WINDOW = 8  # slots gathered per probe step
    _win = np.arange(WINDOW, dtype=np.uint64)

    def __init__(self, capacity_blocks: int) -> None:
        cap = 1 << max(10, int(np.ceil(np.log2(capacity_blocks / self.LOAD))))
        self.cap = cap
        self.mask = np.uint64(cap - 1)
        self.tabs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _tab(self, ns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t = self.tabs.get(ns)
        if t is None:
            t = (np.zeros(self.cap, np.uint64), np.zeros(self.cap, np.uint64), np.zeros(self.cap, np.uint64))
            self.tabs[ns] = t
        return t

    def _insert(self, ns: int, q: np.ndarray, vals: np.ndarray, orv: bool) -> None:
        k0, k1, v = self._tab(ns)
        q0, q1 = q[:, 0], q[:, 1]
        idx = np.arange(len(q))
        slot = q0 & self.mask
        while idx.size:
            a0, a1 = k0[slot], k1[slot]
            hit = (a0 == q0[idx]) & (a1 == q1[idx])
            if hit.any():
                s = slot[hit]
                if orv:
                    np.bitwise_or.at(v, s, vals[idx[hit]])
                else:
                    v[s] = vals[idx[hit]]
            empty = (a0 == 0) & (a1 == 0)
            claim = np.flatnonzero(empty)
            if claim.size:
                _, first = np.unique(slot[claim], return_index=True)
                win = claim[first]
                s = slot[win]
                k0[s], k1[s], v[s] = q0[idx[win]], q1[idx[win]], vals[idx[win]]
                empty[win] = False
                hit[win] = True
            # losers of a claim retry the same slot (now taken: same key, or they probe on)
            move = ~hit & ~empty
            slot = np.where(move, (slot + np.uint64(1)) & self.mask, slot)
            keep = ~hit
            idx, slot = idx[keep], slot[keep]

    def add(self, ns: int, blob: bytes, bit: int) -> None:
        q = np.frombuffer(blob, dtype=np.uint64).reshape(-1, 2)
        self._insert(ns, q, np.full(len(q), bit, np.uint64), orv=True)

    def add_masks(self, ns: int, hashes: np.ndarray, masks: np.ndarray) -> None:
        for j in range(0, len(hashes), 1 << 16):
            self._insert(ns, hashes[j : j + (1 << 16)].view(np.uint64).reshape(-1, 2),
                         masks[j : j + (1 << 16)], orv=False)

    def masks(self, ns: int, blob: bytes) -> np.ndarray:
        """Each hash's holder mask (0: absent). One gather of ``WINDOW`` slots per hash
        settles nearly every probe sequence at load 0.7; the rare longer one is walked on."""
        k0, k1, v = self.tabs[ns]
        q = np.frombuffer(blob, dtype=np.uint64).reshape(-1, 2)
        base = q[:, 0] & self.mask
        out = np.zeros(len(q), np.uint64)
        idx = np.arange(len(q))
        while idx.size:
            slots = (base[:, None] + self._win) & self.mask
            a0 = k0[slots]
            hit = (a0 == q[idx, 0, None]) & (k1[slots] == q[idx, 1, None])
            empty = (a0 == 0) & (k1[slots] == 0)
            found = hit.any(axis=1)
            first_hit = hit.argmax(axis=1)
            out[idx[found]] = v[slots[found, first_hit[found]]]
            done = found | empty.any(axis=1)
            idx, base = idx[~done], base[~done] + np.uint64(self.WINDOW)
        return out

    def prefix(self, ns: int, hashes: Sequence[bytes]) -> dict[int, int]:
        acc = np.bitwise_and.accumulate(self.masks(ns, b"".join(hashes)))
        change = np.flatnonzero(acc[1:] != acc[:-1]) + 1  # few: where some holder's prefix ends
        return prefix_of([int(acc[0]), *(int(acc[i]) for i in change)],
                         [0, *change.tolist()], len(hashes))


def build_index(kind: str, blocks: int) -> tuple[DictIndex | NumpyIndex, list[np.ndarray], list[np.ndarray]]:
    hashes, masks = workload(blocks)
    idx: DictIndex | NumpyIndex = DictIndex() if kind == "dict" else NumpyIndex(len(hashes[0]))
    for ns, (h, m) in enumerate(zip(hashes, masks, strict=True)):
        idx.add_masks(ns, h, m)
    return idx, hashes, masks


# --- server variants ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One server configuration (what ``serve`` builds in its own process)."""

    mode: str = "sync"  # sync: grpc.server + ThreadPoolExecutor; aio: grpc.aio.server; cq: one thread on
    # grpc core's completion queue (grpc._cython.cygrpc, private): each call answered where its request lands
    workers: int = 8  # sync (handlers cannot run inline on grpc's polling thread: a unary
    # handler waits there for its request body, which that thread delivers)
    loop: str = "asyncio"  # aio: asyncio or uvloop
    handler: str = "pb"  # pb: a protobuf servicer; raw: generic handler, bytes in/out; ours: MetaServicer+SyncGuard
    options: tuple[tuple[str, int | str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    pin: int | None = None  # CPU the server process is bound to
    gc: str = "on"  # on, freeze (gc.freeze() after start), off (gc.disable())
    table: str = ""  # "", dict, numpy: RouteHint answered from an in-memory index of --blocks


# grpc core's EventEngine experiments off: the iomgr poller, where the thread that waits
# on the completion queue polls the sockets itself (fewer thread hops per call)
NO_EE = "-event_engine_listener,-event_engine_for_all_other_endpoints,-event_engine_callback_cq,-event_engine_client"

VARIANTS: dict[str, Variant] = {
    "ours-today": Variant(handler="ours", workers=8),  # the daemon before the view
    # pegaflow-meta's gRPC as it serves with its view (daemon.py): 2 threads, EventEngine off, heap frozen
    "ours-daemon": Variant(handler="ours", workers=2, gc="freeze", env=(("GRPC_EXPERIMENTS", NO_EE),)),
    "sync-w8": Variant(workers=8),
    "sync-w4": Variant(workers=4),
    "sync-w2": Variant(workers=2),
    "sync-w1": Variant(workers=1),
    "sync-w1-raw": Variant(workers=1, handler="raw"),
    "sync-w1-poll": Variant(workers=1, env=(("GRPC_POLL_STRATEGY", "poll"),)),
    "sync-w1-pin": Variant(workers=1, pin=1),
    "aio": Variant(mode="aio"),
    "aio-uvloop": Variant(mode="aio", loop="uvloop"),
    "aio-raw": Variant(mode="aio", handler="raw"),
    "aio-raw-uvloop": Variant(mode="aio", handler="raw", loop="uvloop"),
    "aio-latency-opts": Variant(mode="aio", options=(("grpc.so_reuseport", 0), ("grpc.optimization_target", "latency"))),
    "aio-poll": Variant(mode="aio", env=(("GRPC_POLL_STRATEGY", "poll"),)),
    "aio-forksupport": Variant(mode="aio", env=(("GRPC_ENABLE_FORK_SUPPORT", "1"),)),
    "aio-pin": Variant(mode="aio", pin=1),
    "aio-gcfreeze": Variant(mode="aio", gc="freeze"),
    "aio-gcoff": Variant(mode="aio", gc="off"),
    "sync-w1-noee": Variant(workers=1, env=(("GRPC_EXPERIMENTS", NO_EE),)),
    "sync-w1-noee-poll": Variant(workers=1, env=(("GRPC_EXPERIMENTS", NO_EE), ("GRPC_POLL_STRATEGY", "poll"))),
    "aio-noee": Variant(mode="aio", env=(("GRPC_EXPERIMENTS", NO_EE),)),
    "aio-dict": Variant(mode="aio", table="dict", gc="freeze"),
    "aio-numpy": Variant(mode="aio", table="numpy", gc="freeze"),
    "sync-w1-dict": Variant(workers=1, table="dict", gc="freeze"),
    "sync-w1-noee-dict": Variant(workers=1, table="dict", gc="freeze", env=(("GRPC_EXPERIMENTS", NO_EE),)),
    "sync-w1-noee-raw": Variant(workers=1, handler="raw", env=(("GRPC_EXPERIMENTS", NO_EE),)),
    "cq-noee-raw": Variant(mode="cq", handler="raw", gc="freeze", env=(("GRPC_EXPERIMENTS", NO_EE),)),
    # pegaflow-meta as it serves today: its servicer behind SyncGuard on pegaflow/common/cq_server.py
    "ours-cqserver": Variant(mode="cqserver", handler="ours", workers=2, gc="freeze", env=(("GRPC_EXPERIMENTS", NO_EE),)),
    "cq-raw": Variant(mode="cq", handler="raw", gc="freeze"),
}


def _options(v: Variant) -> list[tuple[str, Any]]:
    return list(v.options)


class _Answers:
    """What every variant answers: pre-built messages, their bytes, and the route lookup."""

    def __init__(self, v: Variant, blocks: int) -> None:
        self.config = meta_pb2.ClusterConfigResponse(redis_url="redis://127.0.0.1:6379/0")
        self.config_raw = self.config.SerializeToString()
        self.notfound = meta_pb2.RouteHintResponse(found=False)
        self.notfound_raw = self.notfound.SerializeToString()
        self.index: DictIndex | NumpyIndex | None = None
        self.ns_of = {n: i for i, n in enumerate(NAMESPACES)}
        if v.table:
            self.index, _, _ = build_index(v.table, blocks)

    def route(self, req: meta_pb2.QueryPrefixRequest) -> meta_pb2.RouteHintResponse:
        if self.index is None:
            return self.notfound
        lens = self.index.prefix(self.ns_of[req.namespace], req.hashes)
        if not lens:
            return self.notfound
        node, n = max(lens.items(), key=lambda kv: (kv[1], -kv[0]))
        return meta_pb2.RouteHintResponse(found=True, best=meta_pb2.NodePrefix(
            node=f"node-{node}", address=f"10.0.0.{node}:50055", prefix_len=n, tier=meta_pb2.TIER_L1))


def _raw_handler(ans: _Answers) -> grpc.GenericRpcHandler:
    ident = lambda b: b  # noqa: E731

    def config(req: bytes, ctx: Any) -> bytes:
        return ans.config_raw

    def route(req: bytes, ctx: Any) -> bytes:
        return ans.notfound_raw

    return grpc.method_handlers_generic_handler(SERVICE, {
        "GetClusterConfig": grpc.unary_unary_rpc_method_handler(config, ident, ident),
        "RouteHint": grpc.unary_unary_rpc_method_handler(route, ident, ident),
    })


def _raw_handler_aio(ans: _Answers) -> grpc.GenericRpcHandler:
    ident = lambda b: b  # noqa: E731

    async def config(req: bytes, ctx: Any) -> bytes:
        return ans.config_raw

    async def route(req: bytes, ctx: Any) -> bytes:
        return ans.notfound_raw

    return grpc.method_handlers_generic_handler(SERVICE, {
        "GetClusterConfig": grpc.unary_unary_rpc_method_handler(config, ident, ident),
        "RouteHint": grpc.unary_unary_rpc_method_handler(route, ident, ident),
    })


def _ours(ans: _Answers) -> tuple[Any, list[Any]]:
    """Today's MetaServicer (its _rpc wrapper and metrics) behind SyncGuard; its lookup is
    never reached by GetClusterConfig, and RouteHint is answered by ``ans`` through it."""
    from prometheus_client import CollectorRegistry

    from pegaflow.common.grpc_guard import SyncGuard
    from pegaflow.meta.metrics import MetaMetrics
    from pegaflow.meta.service import MetaServicer

    class FakeLookup:
        def query_prefix(self, namespace: str, hashes: list[bytes]) -> list[Any]:
            return []

    servicer = MetaServicer(FakeLookup(), 1024, MetaMetrics(CollectorRegistry()), lambda: None,  # type: ignore[arg-type]
                            "redis://127.0.0.1:6379/0")
    return servicer, [SyncGuard("")]


class _PbServicer(meta_pb2_grpc.MetaServiceServicer):
    def __init__(self, ans: _Answers) -> None:
        self.ans = ans

    def GetClusterConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self.ans.config

    def RouteHint(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self.ans.route(request)


class _PbServicerAio(meta_pb2_grpc.MetaServiceServicer):
    def __init__(self, ans: _Answers) -> None:
        self.ans = ans

    async def GetClusterConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self.ans.config

    async def RouteHint(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self.ans.route(request)


def serve(name: str, blocks: int) -> None:
    """The child: build variant ``name``, bind a free port, print it, serve until stdin closes."""
    v = VARIANTS[name]
    if v.pin is not None:
        os.sched_setaffinity(0, {v.pin})
    ans = _Answers(v, blocks)
    if v.mode == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=v.workers), options=_options(v),
                             interceptors=_ours(ans)[1] if v.handler == "ours" else None)
        if v.handler == "raw":
            server.add_generic_rpc_handlers((_raw_handler(ans),))
        elif v.handler == "ours":
            meta_pb2_grpc.add_MetaServiceServicer_to_server(_ours(ans)[0], server)
        else:
            meta_pb2_grpc.add_MetaServiceServicer_to_server(_PbServicer(ans), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        _after_start(v, port)
        sys.stdin.read()
        server.stop(0)
        return

    if v.mode == "cq":
        _serve_cq(v, ans)
        return
    if v.mode == "cqserver":
        from pegaflow.common.cq_server import CqServer

        servicer, guard = _ours(ans)
        cq = CqServer([f"/{SERVICE}/{m}" for m in ("GetClusterConfig", "RouteHint", "QueryPrefix")],
                      workers=v.workers, interceptors=guard, options=_options(v))
        meta_pb2_grpc.add_MetaServiceServicer_to_server(servicer, cq)  # type: ignore[arg-type]
        port = cq.add_insecure_port("127.0.0.1:0")
        cq.start()
        _after_start(v, port)
        sys.stdin.read()
        cq.stop(0).wait(5)
        return

    async def main() -> None:
        server = grpc.aio.server(options=_options(v))
        if v.handler == "raw":
            server.add_generic_rpc_handlers((_raw_handler_aio(ans),))
        else:
            meta_pb2_grpc.add_MetaServiceServicer_to_server(_PbServicerAio(ans), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        _after_start(v, port)
        done = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await done
        await server.stop(0)

    if v.loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def _serve_cq(v: Variant, ans: _Answers) -> None:
    """Research (issue #55): no thread pool. One thread polls grpc core's completion queue; a new
    call asks for its request body there and then, and the body's completion answers it on the
    same thread (pre-serialized bytes), so no call waits for another thread to wake. Private
    API, no auth, no deadlines, no errors: a floor, not a server."""
    from grpc._cython import cygrpc

    cq = cygrpc.CompletionQueue()
    server = cygrpc.Server(tuple(_options(v)), False)
    server.register_completion_queue(cq)
    port = server.add_http2_port(b"127.0.0.1:0")
    server.start()
    answers = {f"/{SERVICE}/GetClusterConfig".encode(): ans.config_raw, f"/{SERVICE}/RouteHint".encode(): ans.notfound_raw}
    new = object()
    server.request_call(cq, cq, new)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    _after_start(v, port)
    while True:
        ev = cq.poll()
        if ev.tag is new:
            server.request_call(cq, cq, new)
            method = ev.call_details.method
            method = method if isinstance(method, bytes) else method.encode()
            ev.call.start_server_batch((cygrpc.ReceiveMessageOperation(0),), ("body", ev.call, method))
        elif isinstance(ev.tag, tuple) and ev.tag[0] == "body":
            _, call, method = ev.tag
            call.start_server_batch((cygrpc.SendInitialMetadataOperation(None, 0),
                                     cygrpc.SendMessageOperation(answers[method], 0),
                                     cygrpc.SendStatusFromServerOperation(None, cygrpc.StatusCode.ok, b"", 0),
                                     cygrpc.ReceiveCloseOnServerOperation(0)), ("done", call))


def _after_start(v: Variant, port: int) -> None:
    if v.gc == "freeze":
        gc.collect()
        gc.freeze()
    elif v.gc == "off":
        gc.disable()
    print(port, flush=True)


# --- the client side ---------------------------------------------------------------------------


def cpu_ns(pid: int) -> int:
    """On-CPU time of every thread of ``pid`` so far (ns)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


Probe = Callable[[int], float]


@dataclass
class Target:
    name: str
    pid: int
    probes: dict[str, Probe]
    close: Callable[[], None]
    lat: dict[str, list[list[float]]] = field(default_factory=dict)
    calls: int = 0


def start_variant(name: str, blocks: int, reqs: list[tuple[int, list[bytes]]], want: list[int]) -> Target:
    v = VARIANTS[name]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **dict(v.env)}
    proc = subprocess.Popen([sys.executable, __file__, "serve", name, "--blocks", str(blocks)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        raise RuntimeError(f"variant {name} did not start (exit {proc.wait()})")
    channel = grpc.insecure_channel(f"127.0.0.1:{line}")
    grpc.channel_ready_future(channel).result(timeout=READY_TIMEOUT_S)
    stub = meta_pb2_grpc.MetaServiceStub(channel)
    cfg = meta_pb2.ClusterConfigRequest()
    pbreqs = [meta_pb2.QueryPrefixRequest(namespace=NAMESPACES[ns], hashes=hs) for ns, hs in reqs]

    def floor(i: int) -> float:
        t0 = time.perf_counter()
        stub.GetClusterConfig(cfg, timeout=5)
        return time.perf_counter() - t0

    def route(i: int) -> float:
        t0 = time.perf_counter()
        res = stub.RouteHint(pbreqs[i], timeout=5)
        dt = time.perf_counter() - t0
        if v.table and (not res.found or res.best.node != f"node-{want[i]}" or res.best.prefix_len != PREFIX):
            raise SystemExit(f"{name}: wrong answer to request {i}: {res}, expected node-{want[i]} with {PREFIX}")
        return dt

    def close() -> None:
        channel.close()
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)

    return Target(name, proc.pid, {"floor": floor, "route": route}, close)


def start_original(blocks: int, reqs: list[tuple[int, list[bytes]]], want: list[int],
                   hashes: list[np.ndarray], masks: list[np.ndarray], logs: Path) -> Target:
    """The original's metaserver holding the same blocks: node k registered as address
    ``10.0.0.k:50055``, its blocks inserted 16,384 per call (as its nodes batch)."""
    from bench.original_meta import MAX_HASHES_PER_RPC, OriginalMetaServer, longest_holder

    orig = OriginalMetaServer(logs / "original-metaserver.log").start()
    pb = orig.pb
    sessions = orig.register(f"10.0.0.{k}:50055" for k in range(NODES))
    for ns, (h, m) in enumerate(zip(hashes, masks, strict=True)):
        for k, s in enumerate(sessions):
            held = h[(m >> np.uint64(k)) & np.uint64(1) == 1].tobytes()
            for j in range(0, len(held), 16 * MAX_HASHES_PER_RPC):
                chunk = held[j : j + 16 * MAX_HASHES_PER_RPC]
                res = orig.stub.InsertBlockHashes(pb.InsertBlockHashesRequest(
                    namespace=NAMESPACES[ns], node=s.node, node_id=s.node_id,
                    block_hashes=[chunk[x : x + 16] for x in range(0, len(chunk), 16)]), timeout=60)
                assert res.status.ok, res
    stub = orig.stub
    beat = pb.HeartbeatNodeRequest(node=sessions[0].node, node_id=sessions[0].node_id)
    pbreqs = [pb.QueryPrefixBlocksRequest(namespace=NAMESPACES[ns], block_hashes=hs) for ns, hs in reqs]

    def floor(i: int) -> float:
        t0 = time.perf_counter()
        stub.HeartbeatNode(beat, timeout=5)
        return time.perf_counter() - t0

    def route(i: int) -> float:
        t0 = time.perf_counter()
        res = stub.QueryPrefixBlocks(pbreqs[i], timeout=5)
        dt = time.perf_counter() - t0
        if longest_holder(res) != (f"10.0.0.{want[i]}:50055", PREFIX):
            raise SystemExit(f"original: wrong answer to request {i}: {longest_holder(res)}")
        return dt

    assert orig.proc is not None
    return Target("original (Rust)", orig.proc.pid, {"floor": floor, "route": route}, orig.stop)


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_grpc(args: argparse.Namespace) -> None:
    names = args.only.split(",") if args.only else list(VARIANTS)
    hashes, masks = workload(args.blocks)
    reqs = requests(hashes, 512)
    want = [expected(masks, hashes, r) for r in reqs]
    logs = Path(tempfile.mkdtemp(prefix="grpc-floor-"))
    targets: list[Target] = []
    try:
        if not args.no_original:
            try:
                targets.append(start_original(args.blocks, reqs, want, hashes, masks, logs))
            except Exception as exc:  # the peer is optional here: say why and go on
                print(f"original: skipped ({exc})")
        for n in names:
            try:
                targets.append(start_variant(n, args.blocks, reqs, want))
            except RuntimeError as exc:  # e.g. the tree's own code does not import right now
                print(f"skipped: {exc}")
        idle_s = 2.0
        c0 = {t.name: cpu_ns(t.pid) for t in targets}
        time.sleep(idle_s)
        idle = {t.name: (cpu_ns(t.pid) - c0[t.name]) / idle_s for t in targets}  # ns per s
        rng = random.Random(3)
        order = [(t, m) for t in targets for m in ("floor", "route")]
        for _ in range(WARMUP):
            for t, m in order:
                t.probes[m](rng.randrange(len(reqs)))
        cpu0 = {t.name: cpu_ns(t.pid) for t in targets}
        w0 = time.perf_counter()
        for r in range(args.rounds):
            for t in targets:
                for m in ("floor", "route"):
                    t.lat.setdefault(m, []).append([])
            for _ in range(args.calls):
                i = rng.randrange(len(reqs))
                for t, m in rng.sample(order, len(order)):  # the previous call went to another server
                    t.lat[m][r].append(t.probes[m](i))
                    t.calls += 1
        wall = time.perf_counter() - w0
        cpu = {t.name: (cpu_ns(t.pid) - cpu0[t.name] - idle[t.name] * wall) / t.calls for t in targets}
        warm: dict[str, list[list[float]]] = {t.name: [] for t in targets}
        warm_cpu = dict.fromkeys(warm, 0.0)
        for _ in range(args.rounds):
            for t in rng.sample(targets, len(targets)):
                for _ in range(20):
                    t.probes["floor"](0)
                c = cpu_ns(t.pid)
                warm[t.name].append([t.probes["floor"](k % len(reqs)) for k in range(args.calls // 2)])
                warm_cpu[t.name] += cpu_ns(t.pid) - c
    finally:
        for t in targets:
            t.close()
    print(f"\n{len(targets)} servers, {args.blocks} blocks; load average {os.getloadavg()[0]:.2f}")
    print(f"cold: {args.rounds} rounds x {args.calls} calls per (server, method), all (server, method) pairs in a "
          f"new random order each step (wall {wall:.0f} s); warm: {args.rounds} rounds x {args.calls // 2} "
          "back-to-back floor calls per server, servers shuffled per round")
    print("| server | cold floor p50 / p99 µs | per-round p50s | cold route p50 / p99 µs | per-round p50s | "
          "server CPU per cold call µs | warm floor p50 / p99 µs | per-round p50s | CPU per warm call µs |")
    print("|---|---|---|---|---|---|---|---|---|")

    def cell(rounds: list[list[float]]) -> list[str]:
        allx = [x for rnd in rounds for x in rnd]
        p50s = [pct(rnd, 0.5) * 1e6 for rnd in rounds]
        return [f"{pct(allx, 0.5) * 1e6:.0f} / {pct(allx, 0.99) * 1e6:.0f}", f"{min(p50s):.0f}-{max(p50s):.0f}"]

    for t in targets:
        n_warm = sum(len(x) for x in warm[t.name])
        cells = [*cell(t.lat["floor"]), *cell(t.lat["route"]), f"{cpu[t.name] / 1e3:.0f}", *cell(warm[t.name]),
                 f"{warm_cpu[t.name] / n_warm / 1e3:.0f}"]
        print(f"| {t.name} | {' | '.join(cells)} |")


# --- table: the in-memory index alone ------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_table(args: argparse.Namespace) -> None:
    print("| layout | blocks | build s | B/block (RSS growth) | prefix walk of 128 hashes µs p50 / p99 | ns/hash |")
    print("|---|---|---|---|---|---|")
    for blocks in (int(b) for b in args.blocks.split(",")):
        hashes, masks = workload(blocks)
        reqs = requests(hashes, 2000)
        want = [expected(masks, hashes, r) for r in reqs[:50]]
        for kind in ("dict", "numpy"):
            gc.collect()
            r0 = rss()
            t0 = time.perf_counter()
            idx: DictIndex | NumpyIndex = DictIndex() if kind == "dict" else NumpyIndex(len(hashes[0]))
            for ns, (h, m) in enumerate(zip(hashes, masks, strict=True)):
                idx.add_masks(ns, h, m)
            build = time.perf_counter() - t0
            per_block = (rss() - r0) / sum(len(h) for h in hashes)
            for r, w in zip(reqs[:50], want, strict=True):
                lens = idx.prefix(*r)
                assert max(lens.items(), key=lambda kv: (kv[1], -kv[0])) == (w, PREFIX), (kind, lens, w)
            lat = []
            for ns, hs in reqs:
                t1 = time.perf_counter_ns()
                idx.prefix(ns, hs)
                lat.append(time.perf_counter_ns() - t1)
            p50 = pct(lat, 0.5)
            print(f"| {kind} | {blocks} | {build:.1f} | {per_block:.0f} | {p50 / 1e3:.1f} / {pct(lat, 0.99) / 1e3:.1f} "
                  f"| {p50 / PREFIX:.0f} |")
            del idx
            gc.collect()


# --- ingest: XREAD of the node streams into a view -------------------------------------------------


def run_ingest(args: argparse.Namespace) -> None:
    import redis

    from pegaflow.meta.events.codec import FIELD, decode, encode
    from pegaflow.meta.events.schema import Event, Op
    from tests.harness.ports import free_port
    from tests.harness.redis import RedisServer

    srv = RedisServer(Path(tempfile.mkdtemp(prefix="grpc-floor-redis-")), free_port())
    srv.start()
    try:
        r = redis.Redis(port=srv.port)
        rng = np.random.default_rng(5)
        per_node = args.pairs // NODES // 512 * 512
        streams = [f"pf:ev:{{node-{k}}}" for k in range(NODES)]
        t0 = time.perf_counter()
        for k, s in enumerate(streams):
            blob = rng.integers(1, 2**63, size=(per_node, 2), dtype=np.uint64).tobytes()
            p = r.pipeline(transaction=False)
            for seq, j in enumerate(range(0, len(blob), 512 * 16)):
                ev = Event(f"node-{k}", 100 + k, 1, seq, Op.INSERT, NAMESPACES[seq % 2], blob[j : j + 512 * 16])
                p.xadd(s, {FIELD: encode(ev)})
            p.execute()
        print(f"filled {len(streams)} streams with {per_node * NODES} pairs in {time.perf_counter() - t0:.1f} s")
        total = per_node * NODES
        bits = {100 + k: 1 << k for k in range(NODES)}
        ns_of = {n: i for i, n in enumerate(NAMESPACES)}

        def read_all(apply: Callable[[int, bytes, int], None] | None, count: int) -> float:
            last: dict[Any, Any] = dict.fromkeys(streams, "0-0")
            n = 0
            t = time.perf_counter()
            while True:
                got: Any = r.xread(last, count=count)  # redis-py's reply type is a union of everything
                if not got:
                    break
                for s, entries in got:
                    for _eid, fields in entries:
                        ev = decode(fields[FIELD])
                        if apply is not None:
                            apply(ns_of[ev.namespace], ev.blob, bits[ev.nid])
                        n += ev.count
                    last[s.decode()] = entries[-1][0]
            dt = time.perf_counter() - t
            assert n == total, (n, total)
            return total / dt

        print("| reader | XREAD COUNT per stream | pairs/s (3 runs) |")
        print("|---|---|---|")
        for count in (16, 128):
            rates = [read_all(None, count) for _ in range(3)]
            print(f"| XREAD + decode only | {count} | {' / '.join(f'{x / 1e6:.2f}M' for x in rates)} |")
        for kind in ("dict", "numpy"):
            rates = []
            for _ in range(3):
                view: DictIndex | NumpyIndex = DictIndex() if kind == "dict" else NumpyIndex(total)
                rates.append(read_all(view.add, 128))
                del view
                gc.collect()
            print(f"| XREAD + decode + apply to {kind} | 128 | {' / '.join(f'{x / 1e6:.2f}M' for x in rates)} |")
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("serve")
    s.add_argument("variant")
    s.add_argument("--blocks", type=int, default=1 << 20)
    t = sub.add_parser("table")
    t.add_argument("--blocks", default="1048576,8388608")
    i = sub.add_parser("ingest")
    i.add_argument("--pairs", type=int, default=1 << 21)
    for q in (p,):
        q.add_argument("--calls", type=int, default=1500)
        q.add_argument("--rounds", type=int, default=3)
        q.add_argument("--blocks", type=int, default=1 << 20)
        q.add_argument("--only", default="", help="comma-separated variant names (default: all)")
        q.add_argument("--no-original", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "serve":
        serve(args.variant, args.blocks)
    elif args.cmd == "table":
        run_table(args)
    elif args.cmd == "ingest":
        run_ingest(args)
    else:
        run_grpc(args)


if __name__ == "__main__":
    main()
