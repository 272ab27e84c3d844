"""Engine-side client of a PegaFlow node.

Contracts:
- ``register`` opens a session and maps the node's pool. A background thread holds the
  session's keep-alive stream; if this process dies, the node frees what it reserved or
  leased.
- Offsets are only meaningful in the pool mapping they came with: results carry that
  mapping (``.pool``) and the node's ``epoch``. After a node restart the client registers
  again on the next call and maps the new pool; old results keep their old mapping, so a
  copy can never mix one epoch's offsets with another epoch's memory.
- Every call raises :class:`NodeUnavailable` when the node cannot be reached; callers
  (the connector) treat that as a miss and recompute.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import grpc
import structlog
import torch

from pegaflow._proto import node_pb2, node_pb2_grpc
from pegaflow.common.logging import ensure_library_logging

ensure_library_logging()
log = structlog.get_logger("pegaflow.client")

GRPC_MAX_MESSAGE = 64 << 20


class NodeUnavailable(Exception):
    """The node is down or unreachable (or restarted in the middle of an operation)."""


class NodeError(Exception):
    """The node rejected a request (INVALID_ARGUMENT and friends): a bug in the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


@dataclass(frozen=True)
class QueryResult:
    status: Literal["READY", "LOADING"]
    hit_blocks: int
    lease_id: int
    offsets: dict[str, list[int]]
    epoch: int
    pool: torch.Tensor | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Reservation:
    reservation_id: int
    offsets: list[int]  # -1: do not write this block
    epoch: int
    pool: torch.Tensor | None = field(default=None, repr=False, compare=False)


class _Mapping:
    """One mapping of one node epoch's pool; unmapped when the last tensor view dies."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)


class PegaClient:
    def __init__(self, addr: str = "127.0.0.1:50055", instance_id: str | None = None, timeout: float = 5.0,
                 map_pool: bool = True) -> None:
        """``map_pool=False`` for a process that only queries and never copies pages (vLLM's
        scheduler): it skips mapping and pre-faulting the pool; results then carry no pool."""
        self.addr = addr
        self.map_pool = map_pool
        self.instance_id = instance_id or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._connect()
        self._lock = threading.RLock()
        self._namespaces: dict[str, int] = {}
        self._session_id = 0
        self._stream: grpc.Future | None = None
        self._mapping: _Mapping | None = None
        self.epoch = 0
        self.node_id = ""
        self._closed = False

    def _connect(self) -> None:
        """A fresh channel. Used again after the node was unreachable: a channel that saw
        its peer go away sits in gRPC's reconnect backoff (seconds), and a restarted node
        should be used as soon as it listens."""
        if self._channel is not None:
            self._channel.close()
        self._channel = grpc.insecure_channel(self.addr, options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
            ("grpc.enable_retries", 0),
            # gRPC shares subchannels between channels to one address by default, so a
            # new channel would inherit the old one's reconnect backoff.
            ("grpc.use_local_subchannel_pool", 1),
        ])
        self._stub = node_pb2_grpc.PegaNodeStub(self._channel)
        self._unreachable = False

    # ---- session ----------------------------------------------------------------------
    def register(self, namespaces: Mapping[str, int]) -> None:
        """Register ``namespace -> page_bytes`` and map the pool."""
        with self._lock:
            self._namespaces = dict(namespaces)
            self._register_locked()

    def _register_locked(self) -> None:
        req = node_pb2.RegisterRequest(
            instance_id=self.instance_id,
            namespaces=[node_pb2.NamespaceSpec(name=n, page_bytes=p) for n, p in self._namespaces.items()],
        )
        resp = self._call(self._stub.Register, req, retry_session=False)
        if self.map_pool and (self._mapping is None or resp.epoch != self.epoch):
            self._mapping = _Mapping(resp.pool_path, resp.pool_bytes)
        self._session_id = resp.session_id
        self.epoch = resp.epoch
        self.node_id = resp.node_id
        if self._stream is not None:
            self._stream.cancel()
        self._stream = self._stub.Session(node_pb2.SessionRequest(session_id=resp.session_id))
        threading.Thread(target=self._drain, args=(self._stream,), daemon=True,
                         name="pegaflow-session").start()
        log.info("registered", node=self.node_id, epoch=self.epoch, session=self._session_id,
                 pool_bytes=resp.pool_bytes)

    def _drain(self, stream: grpc.Future) -> None:
        try:
            for _ in stream:  # type: ignore[attr-defined]
                pass
        except grpc.RpcError:
            pass
        with self._lock:
            if self._stream is stream and not self._closed:
                # the node went away: reconnect and register again on next use
                self._session_id = 0
                self._unreachable = True

    @property
    def pool(self) -> torch.Tensor:
        if self._mapping is None:
            raise NodeUnavailable("not registered" if self.map_pool else "this client does not map the pool")
        return self._mapping.tensor

    def _pool_or_none(self) -> torch.Tensor | None:
        return self._mapping.tensor if self._mapping is not None else None

    @property
    def session_id(self) -> int:
        return self._session_id

    def _ensure_session(self) -> None:
        if self._unreachable:
            self._connect()
        if not self._session_id:
            if not self._namespaces:
                raise RuntimeError("call register() first")
            self._register_locked()

    def _call(self, method, request, retry_session: bool = True):  # type: ignore[no-untyped-def]
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                self._session_id = 0
                self._unreachable = True
                raise NodeUnavailable(f"node {self.addr}: {exc.details()}") from None  # type: ignore[attr-defined]
            if code is grpc.StatusCode.FAILED_PRECONDITION and retry_session:
                self._session_id = 0
                raise _SessionLost(exc.details()) from None  # type: ignore[attr-defined]
            raise NodeError(code, exc.details()) from None  # type: ignore[attr-defined]

    def _with_session(self, make_request, method: str, reregister_ok: bool = True):  # type: ignore[no-untyped-def]
        """Run RPC ``method`` under the current session; register again once if the node restarted."""
        with self._lock:
            self._ensure_session()
            try:
                return self._call(getattr(self._stub, method), make_request(self._session_id))
            except _SessionLost:
                if not reregister_ok:
                    raise NodeUnavailable("node restarted; session lost") from None
                self._register_locked()
                return self._call(getattr(self._stub, method), make_request(self._session_id))

    # ---- RPCs -------------------------------------------------------------------------
    def query(self, namespaces: Sequence[str], hashes: Sequence[bytes], req_id: str = "",
              lease: bool = True) -> QueryResult:
        resp = self._with_session(
            lambda sid: node_pb2.QueryRequest(session_id=sid, namespaces=list(namespaces), hashes=list(hashes),
                                              req_id=req_id, lease=lease),
            "Query",
        )
        status: Literal["READY", "LOADING"] = "LOADING" if resp.status == node_pb2.LOADING else "READY"
        return QueryResult(status, resp.hit_blocks, resp.lease_id,
                           {p.namespace: list(p.offsets) for p in resp.pages}, self.epoch, self._pool_or_none())

    def reserve(self, namespace: str, hashes: Sequence[bytes]) -> Reservation:
        resp = self._with_session(
            lambda sid: node_pb2.ReserveRequest(session_id=sid, namespace=namespace, hashes=list(hashes)),
            "Reserve",
        )
        return Reservation(resp.reservation_id, list(resp.offsets), self.epoch, self._pool_or_none())

    def commit(self, reservation_id: int, indices: Sequence[int] | None = None, wait: bool = True) -> int:
        """Make the reserved pages visible. ``wait=False`` sends the commit without waiting
        for the answer (the save path does not need it; errors are logged) and returns -1."""
        req = lambda sid: node_pb2.CommitRequest(  # noqa: E731
            session_id=sid, reservation_id=reservation_id, indices=list(indices or ()))
        if not wait:
            self._send_async("Commit", req)
            return -1
        return self._with_session(req, "Commit", reregister_ok=False).committed

    def abort(self, reservation_id: int) -> None:
        self._with_session(
            lambda sid: node_pb2.CommitRequest(session_id=sid, reservation_id=reservation_id, abort=True),
            "Commit", reregister_ok=False,
        )

    def release(self, lease_id: int, wait: bool = True) -> None:
        """Unpin a lease's pages. ``wait=False`` does not wait for the answer."""
        if not lease_id:
            return
        req = lambda sid: node_pb2.ReleaseRequest(session_id=sid, lease_id=lease_id)  # noqa: E731
        if not wait:
            self._send_async("Release", req)
            return
        self._with_session(req, "Release", reregister_ok=False)

    def _send_async(self, method: str, make_request) -> None:  # type: ignore[no-untyped-def]
        """Fire an RPC whose answer the caller does not need; failures are logged, and a
        lost session is noticed by the next synchronous call."""
        with self._lock:
            if not self._session_id:
                return  # session gone: the node already dropped what this would commit/release
            fut = getattr(self._stub, method).future(make_request(self._session_id), timeout=self.timeout)

        def done(f: grpc.Future) -> None:
            exc = f.exception()
            if exc is not None:
                log.warning("async_rpc_failed", method=method,
                            error=str(getattr(exc, "details", lambda: exc)()))

        fut.add_done_callback(done)

    def health(self) -> node_pb2.HealthResponse:
        with self._lock:
            if self._unreachable:
                self._connect()
            return self._call(self._stub.Health, node_pb2.HealthRequest())

    def stats(self) -> node_pb2.StatsResponse:
        with self._lock:
            if self._unreachable:
                self._connect()
            return self._call(self._stub.Stats, node_pb2.StatsRequest())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._stream is not None:
                self._stream.cancel()
            if self._channel is not None:
                self._channel.close()

    def __enter__(self) -> PegaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SessionLost(Exception):
    pass
