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
- Transport: Query, Reserve, Commit and Release go over the node's local Unix socket when
  Register announces one and this process can connect to it (every engine on the node's
  host), else over gRPC. No configuration; errors and results are the same either way.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar, cast

import grpc
import structlog
import torch
from google.protobuf.message import Message

from pegaflow._proto import node_pb2, node_pb2_grpc
from pegaflow.client.populate import map_lazily
from pegaflow.common.local_wire import (
    HELLO,
    MAX_FRAME,
    METHOD_IDS,
    NO_REPLY,
    POOL,
    POOL_REPLY,
    REPLY_HEADER,
    REQUEST_HEADER,
)
from pegaflow.common.logging import ensure_library_logging
from pegaflow.common.security import Security, sync_channel
from pegaflow.common.validate import MAX_COPY_TIMES
from pegaflow.core.hosts import NODE_ADDR
from pegaflow.core.tiers import Tier

ensure_library_logging()
log = structlog.get_logger("pegaflow.client")

GRPC_MAX_MESSAGE = 64 << 20
CLOSE_DRAIN_S = 2.0  # at most this long, close() waits for calls sent without waiting

Resp = TypeVar("Resp", bound=Message)  # an RPC's response message


class NodeUnavailable(Exception):
    """The node is down or unreachable (or restarted in the middle of an operation)."""


class ClientClosed(RuntimeError):
    """A call on a :class:`PegaClient` after its ``close()``: a bug in the caller."""


class NodeError(Exception):
    """The node rejected a request (INVALID_ARGUMENT and friends): a bug in the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class QueryStatus(enum.StrEnum):
    """READY: the hit is leased (``pages`` hold it); LOADING: the node is bringing more of the
    prefix in from SSD or a peer, ask again."""

    READY = "READY"
    LOADING = "LOADING"


_LOADING_FROM = {node_pb2.LOADING_FROM_SSD: Tier.SSD, node_pb2.LOADING_FROM_REMOTE: Tier.REMOTE}
_MEDIUM = {node_pb2.MEDIUM_DRAM: "dram", node_pb2.MEDIUM_SSD: "ssd"}


@dataclass(frozen=True)
class BlockEvents:
    """Blocks of one namespace that left (``stored=False``) or reached a medium of the node."""

    namespace: str
    medium: str  # "dram" or "ssd"
    stored: bool
    hashes: list[bytes]


@dataclass(frozen=True)
class QueryResult:
    status: QueryStatus
    hit_blocks: int
    lease_id: int
    offsets: dict[str, list[int]]
    epoch: int
    pool: torch.Tensor | None = field(default=None, repr=False, compare=False)
    loading_from: Tier | None = None  # LOADING: SSD or REMOTE (where the blocks after hit_blocks come from)
    expected_blocks: int = 0  # LOADING from SSD: the prefix length once loaded (0: unknown)


@dataclass(frozen=True)
class Reservation:
    reservation_id: int
    offsets: list[int]  # -1: do not write this block
    epoch: int
    pool: torch.Tensor | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class CopyTimes:
    """What an engine's page copies took, sent to the node on a Commit or Release it sends
    anyway (node.proto, ``CopyTimes``): seconds of each save and load batch (one rank's
    copies of one step) and how many load batches failed. ``merge`` joins reports (ranks,
    steps) and keeps the newest ``MAX_COPY_TIMES`` durations of each kind."""

    save_seconds: tuple[float, ...] = ()
    load_seconds: tuple[float, ...] = ()
    load_failures: int = 0

    def __bool__(self) -> bool:
        return bool(self.save_seconds or self.load_seconds or self.load_failures)

    def merge(self, other: CopyTimes) -> CopyTimes:
        if not other:
            return self
        if not self:
            return other
        return CopyTimes((self.save_seconds + other.save_seconds)[-MAX_COPY_TIMES:],
                         (self.load_seconds + other.load_seconds)[-MAX_COPY_TIMES:],
                         self.load_failures + other.load_failures)

    def to_proto(self) -> node_pb2.CopyTimes:
        return node_pb2.CopyTimes(save_seconds=self.save_seconds, load_seconds=self.load_seconds,
                                  load_failures=self.load_failures)


NO_COPIES = CopyTimes()


@dataclass(frozen=True)
class ResetResult:
    dropped_blocks: int  # no longer visible in the node's DRAM
    busy_blocks: int  # of those, pages still pinned or being written (freed when done)
    ssd_blocks: int  # SSD records forgotten


class _Mapping:
    """One mapping of one node epoch's pool; unmapped when the last tensor view dies.

    From the descriptor the node passed over its local socket (``fd``, taken over and
    closed here: the way in for an engine of another user, ``--access-group``), else from
    Register's ``pool_path`` (``/proc/<node pid>/fd/<fd>``: the node's user or root only)."""

    def __init__(self, path: str, size: int, fd: int | None = None) -> None:
        if fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            # Not MAP_POPULATE: that maps the whole pool now (seconds per 100 GiB); copies
            # populate what they touch instead (pegaflow.client.populate.map_lazily).
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        map_lazily(self.tensor)


class _LocalLink:
    """Connections to the node's local socket (framing: :mod:`pegaflow.common.local_wire`).

    One socket per calling thread (``threading.local``): threads have calls in flight at
    once without a demultiplexer, and a call is one ``sendall`` plus blocking reads of its
    own reply. A socket that failed or timed out is dropped (its stream may be out of step);
    the thread's next call connects again.
    """

    def __init__(self, path: str, timeout: float, token: str = "") -> None:
        self.path = path
        self.timeout = timeout
        self.token = token
        self._tls = threading.local()
        self._lock = threading.Lock()
        # Every thread's socket, so close() reaches them all; weak, so a finished thread's
        # socket is closed with its thread-local slot.
        self._socks: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._closed = False

    def _sock(self) -> socket.socket:
        s: socket.socket | None = getattr(self._tls, "sock", None)
        if s is not None:
            return s
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self.timeout)
            s.connect(self.path)
            if self.token:  # the opening frame (local_wire.HELLO)
                hello = self.token.encode()
                s.sendall(REQUEST_HEADER.pack(len(hello), HELLO, 0) + hello)
                length, status = REPLY_HEADER.unpack(_recv_exactly(s, REPLY_HEADER.size))
                body = _recv_exactly(s, length)
                if status != 0:
                    raise PermissionError(f"local socket refused the token: {body.decode(errors='replace')}")
        except BaseException:
            s.close()
            raise
        with self._lock:
            if self._closed:
                s.close()
                raise ConnectionAbortedError("local link closed (the client registered again)")
            self._socks.add(s)
        self._tls.sock = s
        return s

    def connect(self) -> None:
        """Connect this thread's socket now (raises ``OSError`` if the path is unusable)."""
        self._sock()

    def _drop(self) -> None:
        s = getattr(self._tls, "sock", None)
        if s is not None:
            self._tls.sock = None
            with self._lock:
                self._socks.discard(s)
            s.close()

    def call(self, method_id: int, payload: bytes, reply: bool = True) -> tuple[int, bytes]:
        """Send one frame; with ``reply`` return ``(status, body)``. ``OSError`` (including a
        timeout, or EOF from a node that went away) means the socket is gone. Any exception
        mid-call drops the socket (``KeyboardInterrupt`` in a blocked read too): its reply may
        still come, and the thread's next call would read it as its own."""
        s = self._sock()
        try:
            s.sendall(REQUEST_HEADER.pack(len(payload), method_id, 0 if reply else NO_REPLY) + payload)
            if not reply:
                return 0, b""
            length, status = REPLY_HEADER.unpack(_recv_exactly(s, REPLY_HEADER.size))
            return status, _recv_exactly(s, length)
        except BaseException:
            self._drop()
            raise

    def pool_fd(self, epoch: int, size: int) -> int | None:
        """The pool's descriptor from the node (``local_wire.POOL``), or ``None`` when it
        does not send one for this epoch and size (an older node, a full reply buffer)."""
        s = self._sock()
        try:
            s.sendall(REQUEST_HEADER.pack(0, POOL, 0))
            want = REPLY_HEADER.size + POOL_REPLY.size
            data, fds, _, _ = socket.recv_fds(s, want, 1, socket.MSG_CMSG_CLOEXEC)
        except BaseException:
            self._drop()
            raise
        try:
            if not data:
                self._drop()
                raise ConnectionResetError("the node closed the local socket")
            if len(data) < REPLY_HEADER.size:
                data += self._recv(s, REPLY_HEADER.size - len(data))
            length, status = REPLY_HEADER.unpack_from(data)
            body = data[REPLY_HEADER.size:]
            if len(body) < length:
                body += self._recv(s, length - len(body))
            if status != 0 or len(fds) != 1 or length != POOL_REPLY.size:
                log.info("local_pool_fd_unavailable", status=status, error=body.decode(errors="replace"))
                return None
            node_epoch, node_size = POOL_REPLY.unpack(body)
            if node_epoch != epoch or node_size != size:  # a node restarted since Register
                return None
            fd = fds.pop()
            return fd
        finally:
            for fd in fds:
                os.close(fd)

    def _recv(self, s: socket.socket, n: int) -> bytes:
        try:
            return _recv_exactly(s, n)
        except BaseException:
            self._drop()
            raise

    def close(self, drain: float = 0.0) -> None:
        """Close every thread's socket. ``drain > 0``: first let the node finish the frames
        already sent (no-reply Commits and Releases): shut down every socket's write side and
        wait, ``drain`` seconds in all, for the node to close its side of each — it serves a
        connection's frames in order and closes only after the last one."""
        with self._lock:
            self._closed = True
            socks, self._socks = list(self._socks), weakref.WeakSet()
        deadline = time.monotonic() + drain
        if drain > 0:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_WR)
        for s in socks:
            try:
                if drain > 0 and (left := deadline - time.monotonic()) > 0:
                    s.settimeout(left)
                    while s.recv(1 << 16):
                        pass  # replies nobody waits for any more
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
            except OSError:
                pass
            s.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the node closed the local socket")
        got += k
    return bytes(buf)


_STATUS_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _EventStream(Protocol):
    """The Session RPC's answer: the node's events, until either side cancels."""

    def __iter__(self) -> Iterator[node_pb2.SessionEvent]: ...
    def cancel(self) -> bool: ...

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class _Bound:
    """One registration, read under the lock in one piece by every call: its session, its
    transports and its pool mapping, so a result never mixes two epochs."""

    session_id: int
    epoch: int
    stub: node_pb2_grpc.PegaNodeStub
    local: _LocalLink | None
    pool: torch.Tensor | None
    channel: grpc.Channel | None = None  # ``stub``'s: held by each call made on it (``_holding``)


class PegaClient:
    """Calls go over the node's local socket when Register announces one and it connects
    (Query, Reserve, Commit, Release), else over gRPC; both raise the same errors. Several
    threads may call at once: the lock covers (re-)registration only, not the calls."""

    def __init__(self, addr: str = NODE_ADDR, instance_id: str | None = None, timeout: float = 5.0,
                 map_pool: bool = True, security: Security | None = None,
                 on_blocks: Callable[[list[BlockEvents], int], None] | None = None) -> None:
        """``map_pool=False`` for a process that only queries and never copies pages (vLLM's
        scheduler): it skips mapping and pre-faulting the pool; results then carry no pool.
        ``on_blocks(events, dropped_hashes)``: the node's block events for the registered
        namespaces (evictions, SSD writes; ``pegaflow.node.block_events``), called from the
        session thread; it must not block.
        ``security``: the token and TLS roots to use; default from the environment
        (``PEGAFLOW_AUTH_TOKEN[_FILE]``, ``PEGAFLOW_TLS_CA``; see ``pegaflow.common.security``).
        With no token configured, a node on loopback is called with its own token when this
        user can read it (``<local socket>.token``; docs/security.md)."""
        self.addr = addr
        self.security = security if security is not None else Security.load()
        self.map_pool = map_pool
        self.instance_id = instance_id or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Where this engine runs, sent at Register for the pool's NUMA placement: its GPU's PCI
        # address (set it before register(): CUDA's pci_bus_id) and the CPUs it may run on.
        self.pci_bus_id = ""
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        # A channel is closed only when no call is on it: grpcio crashes the process (SIGSEGV)
        # on a call made on a closed channel with interceptors, which a thread could do with a
        # registration taken just before another thread reconnected or closed the client.
        self._uses_lock = threading.Lock()
        self._uses: dict[grpc.Channel, int] = {}  # calls on each channel now
        self._retired: set[grpc.Channel] = set()  # replaced, closed when their last call ends
        self._shut: weakref.WeakSet[grpc.Channel] = weakref.WeakSet()  # closed: never called again
        self._connect()
        self._lock = threading.RLock()
        self._namespaces: dict[str, int] = {}
        self._session_id = 0
        self._bound: _Bound | None = None
        self._stream: _EventStream | None = None
        self._mapping: _Mapping | None = None
        self.epoch = 0
        self.node_id = ""
        self._closed = False
        self._pending: set[grpc.Future[Message]] = set()  # wait=False gRPC calls in flight
        self.on_blocks = on_blocks

    def _connect(self) -> None:
        """A fresh channel. Used again after the node was unreachable: a channel that saw
        its peer go away sits in gRPC's reconnect backoff (seconds), and a restarted node
        should be used as soon as it listens."""
        if self._channel is not None:
            self._retire(self._channel)
        self._channel = sync_channel(self.addr, self.security, options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
            ("grpc.enable_retries", 0),
            # gRPC shares subchannels between channels to one address by default, so a
            # new channel would inherit the old one's reconnect backoff.
            ("grpc.use_local_subchannel_pool", 1),
        ])
        self._stub = node_pb2_grpc.PegaNodeStub(self._channel)
        self._unreachable = False

    def _retire(self, channel: grpc.Channel) -> None:
        """Close ``channel`` now if no call is on it, else when its last call ends."""
        with self._uses_lock:
            if self._uses.get(channel):
                self._retired.add(channel)
                return
            self._shut.add(channel)
        channel.close()

    @contextlib.contextmanager
    def _holding(self, channel: grpc.Channel | None) -> Iterator[None]:
        """A call on ``channel``: it stays open until the call ends."""
        if channel is None:
            yield
            return
        self._hold(channel)
        try:
            yield
        finally:
            self._release(channel)

    def _hold(self, channel: grpc.Channel) -> None:
        with self._uses_lock:
            if channel in self._shut:  # replaced (the node was unreachable) or the client closed
                raise NodeUnavailable(f"node {self.addr}: the connection was replaced or closed; call again")
            self._uses[channel] = self._uses.get(channel, 0) + 1

    def _release(self, channel: grpc.Channel) -> None:
        with self._uses_lock:
            n = self._uses.pop(channel) - 1
            if n:
                self._uses[channel] = n
                return
            if channel not in self._retired:
                return
            self._retired.discard(channel)
            self._shut.add(channel)
        channel.close()

    def _check_open(self) -> None:
        """Raise :class:`ClientClosed` once :meth:`close` was called (under ``_lock``)."""
        if self._closed:
            raise ClientClosed(f"this PegaClient of node {self.addr} is closed")

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
            watch_blocks=self.on_blocks is not None,
            cpu_affinity=sorted(os.sched_getaffinity(0)),
            pci_bus_id=self.pci_bus_id,
        )
        resp = self._call("Register", req, node_pb2.RegisterResponse, None, retry_session=False)
        if self._bound is not None and self._bound.local is not None:
            self._bound.local.close()
        local = None
        pool_fd: int | None = None
        if resp.local_socket:
            local = _LocalLink(resp.local_socket, self.timeout, self.security.token_for(self.addr))
            try:
                local.connect()
                # The pool's descriptor, for this node's epoch and pool size: it maps the pool,
                # and proves the socket is this node's. The path is the node's choice on its
                # own host: a node on another host, run with the same --addr, names the path
                # of this host's node, whose answers to our session would all fail.
                pool_fd = local.pool_fd(resp.epoch, resp.pool_bytes)
            except OSError as exc:  # not on the node's host, or no access: gRPC does it all
                log.info("local_socket_unusable", path=resp.local_socket, error=str(exc))
                local.close()
                local = None
            else:
                if pool_fd is None:
                    log.info("local_socket_unusable", path=resp.local_socket,
                             error="another node's socket (its epoch or pool size differ), or no descriptor sent")
                    local.close()
                    local = None
        if self.map_pool and (self._mapping is None or resp.epoch != self.epoch):
            self._mapping, pool_fd = _Mapping(resp.pool_path, resp.pool_bytes, pool_fd), None
        if pool_fd is not None:  # not mapped with it (a client that does not map, or mapped already)
            os.close(pool_fd)
        self._session_id = resp.session_id
        self.epoch = resp.epoch
        self.node_id = resp.node_id
        self._bound = _Bound(resp.session_id, resp.epoch, self._stub, local, self._pool_or_none(), self._channel)
        if self._stream is not None:
            self._stream.cancel()
        self._stream = self._stub.Session(node_pb2.SessionRequest(session_id=resp.session_id))
        threading.Thread(target=self._drain, args=(self._stream,), daemon=True,
                         name="pegaflow-session").start()
        log.info("registered", node=self.node_id, epoch=self.epoch, session=self._session_id,
                 pool_bytes=resp.pool_bytes, transport="local" if local else "grpc")

    def _drain(self, stream: _EventStream) -> None:
        try:
            for ev in stream:
                if (ev.blocks or ev.dropped_hashes) and self.on_blocks is not None:
                    try:
                        self.on_blocks([BlockEvents(b.namespace, _MEDIUM.get(b.medium, ""), b.stored, list(b.hashes))
                                        for b in ev.blocks], ev.dropped_hashes)
                    except Exception:  # noqa: BLE001 - a consumer bug must not end the session
                        log.exception("on_blocks_failed")
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

    def pool_of(self, epoch: int) -> torch.Tensor | None:
        """The pool mapped for node epoch ``epoch``, or ``None`` (another epoch, not mapped):
        one read of the current registration, so a re-registration to a restarted node
        running meanwhile never pairs one epoch's offsets with the other's pool (``epoch``
        and ``pool`` read apart could)."""
        b = self._bound
        return b.pool if b is not None and b.epoch == epoch else None

    def _pool_or_none(self) -> torch.Tensor | None:
        return self._mapping.tensor if self._mapping is not None else None

    @property
    def session_id(self) -> int:
        return self._session_id

    @property
    def transport(self) -> str:
        """``local`` if the current registration uses the node's local socket, else ``grpc``."""
        b = self._bound
        return "local" if b is not None and b.local is not None else "grpc"

    def _ensure_session(self) -> _Bound:
        with self._lock:
            self._check_open()
            if self._unreachable:
                self._connect()
            if not self._session_id:
                if not self._namespaces:
                    raise RuntimeError("call register() first")
                self._register_locked()
            assert self._bound is not None
            return self._bound

    def _lost(self, b: _Bound | None, unreachable: bool) -> None:
        """Forget the session (and the channel if ``unreachable``) unless another thread
        has already registered again since ``b`` was taken."""
        with self._lock:
            if b is None or self._bound is b:
                self._session_id = 0
                if unreachable:
                    self._unreachable = True

    def _call(self, method: str, request: Message, reply: type[Resp], b: _Bound | None,
              retry_session: bool = True) -> Resp:
        """One unary call under registration ``b`` (``None``: Register, over gRPC), over ``b``'s
        local socket if it has one; ``reply`` is ``method``'s response message. Failures map
        alike for both transports."""
        if b is not None and b.local is not None:
            mid = METHOD_IDS[method]
            payload = request.SerializeToString()
            if len(payload) > MAX_FRAME:
                raise NodeError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request of {len(payload)} bytes > {MAX_FRAME}")
            try:
                status, body = b.local.call(mid, payload)
            except OSError as exc:  # node killed or restarted: like UNAVAILABLE
                self._lost(b, unreachable=True)
                raise NodeUnavailable(f"node {self.addr} (local socket {b.local.path}): {exc}") from None
            if status == 0:
                return reply.FromString(body)
            code = _STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN)
            details = body.decode(errors="replace")
        else:
            stub, channel = (b.stub, b.channel) if b is not None else (self._stub, self._channel)
            try:
                with self._holding(channel):
                    # The generated stub is untyped: its method answers ``reply``.
                    return cast(Resp, getattr(stub, method)(request, timeout=self.timeout))
            except grpc.RpcError as exc:
                code, details = exc.code(), str(exc.details())
        if code in _UNREACHABLE:
            self._lost(b, unreachable=True)
            raise NodeUnavailable(f"node {self.addr}: {details}")
        if code is grpc.StatusCode.FAILED_PRECONDITION and retry_session:
            self._lost(b, unreachable=False)
            raise _SessionLost(details)
        raise NodeError(code, details)

    def _with_session(
        self, make_request: Callable[[int], Message], method: str, reply: type[Resp], reregister_ok: bool = True
    ) -> tuple[Resp, _Bound]:
        """Run RPC ``method`` under the current session; register again once if the node
        restarted. Returns ``(response, registration used)``."""
        b = self._ensure_session()
        try:
            return self._call(method, make_request(b.session_id), reply, b), b
        except _SessionLost:
            if not reregister_ok:
                raise NodeUnavailable("node restarted; session lost") from None
        b = self._ensure_session()
        try:
            return self._call(method, make_request(b.session_id), reply, b), b
        except _SessionLost as exc:
            raise NodeUnavailable(f"session lost twice in a row: {exc}") from None

    # ---- RPCs -------------------------------------------------------------------------
    def query(self, namespaces: Sequence[str], hashes: Sequence[bytes], req_id: str = "",
              lease: bool = True, peek: bool = False) -> QueryResult:
        """The longest prefix of ``hashes`` stored in every one of ``namespaces``. ``peek``
        (routing hints): DRAM only, no lease, and nothing counted or fetched on the node."""
        resp, b = self._with_session(
            lambda sid: node_pb2.QueryRequest(session_id=sid, namespaces=list(namespaces), hashes=list(hashes),
                                              req_id=req_id, lease=lease and not peek, peek=peek),
            "Query", node_pb2.QueryResponse,
        )
        status = QueryStatus.LOADING if resp.status == node_pb2.LOADING else QueryStatus.READY
        return QueryResult(status, resp.hit_blocks, resp.lease_id,
                           {p.namespace: list(p.offsets) for p in resp.pages}, b.epoch, b.pool,
                           _LOADING_FROM.get(resp.loading_from), resp.expected_blocks)

    def reserve(self, namespace: str, hashes: Sequence[bytes]) -> Reservation:
        resp, b = self._with_session(
            lambda sid: node_pb2.ReserveRequest(session_id=sid, namespace=namespace, hashes=list(hashes)),
            "Reserve", node_pb2.ReserveResponse,
        )
        return Reservation(resp.reservation_id, list(resp.offsets), b.epoch, b.pool)

    def commit(self, reservation_id: int, indices: Sequence[int] | None = None, wait: bool = True,
               copies: CopyTimes = NO_COPIES) -> int:
        """Make the reserved pages visible. ``wait=False`` sends the commit without waiting
        for the answer (the save path does not need it; errors are logged) and returns -1.
        ``copies``: the engine's copy times to report with it (``CopyTimes``)."""
        sent = copies.to_proto() if copies else None
        req = lambda sid: node_pb2.CommitRequest(  # noqa: E731
            session_id=sid, reservation_id=reservation_id, indices=list(indices or ()), copies=sent)
        if not wait:
            self._send_async("Commit", req)
            return -1
        return self._with_session(req, "Commit", node_pb2.CommitResponse, reregister_ok=False)[0].committed

    def abort(self, reservation_id: int) -> None:
        self._with_session(
            lambda sid: node_pb2.CommitRequest(session_id=sid, reservation_id=reservation_id, abort=True),
            "Commit", node_pb2.CommitResponse, reregister_ok=False,
        )

    def release(self, lease_id: int, wait: bool = True, copies: CopyTimes = NO_COPIES) -> None:
        """Unpin a lease's pages. ``wait=False`` does not wait for the answer. ``copies``:
        the engine's copy times to report with it (``CopyTimes``)."""
        if not lease_id:
            return
        sent = copies.to_proto() if copies else None
        req = lambda sid: node_pb2.ReleaseRequest(session_id=sid, lease_id=lease_id, copies=sent)  # noqa: E731
        if not wait:
            self._send_async("Release", req)
            return
        self._with_session(req, "Release", node_pb2.ReleaseResponse, reregister_ok=False)

    def reset(self, namespaces: Sequence[str]) -> ResetResult:
        """Drop every stored block of ``namespaces`` (registered by this client) on the node."""
        resp, _ = self._with_session(
            lambda sid: node_pb2.ResetRequest(session_id=sid, namespaces=list(namespaces)), "Reset",
            node_pb2.ResetResponse)
        return ResetResult(resp.dropped_blocks, resp.busy_blocks, resp.ssd_blocks)

    def _send_async(self, method: str, make_request: Callable[[int], Message]) -> None:
        """Fire an RPC whose answer the caller does not need; failures are logged (by the
        node, for the local socket), and a lost session is noticed by the next synchronous call."""
        with self._lock:
            if self._closed or not self._session_id or self._bound is None:
                return  # session gone (or closed): the node drops what this would commit/release
            b = self._bound
        request = make_request(b.session_id)
        if b.local is not None:
            try:
                b.local.call(METHOD_IDS[method], request.SerializeToString(), reply=False)
            except OSError as exc:
                log.warning("async_rpc_failed", method=method, error=str(exc))
            return
        held = b.channel
        if held is not None:
            try:
                self._hold(held)  # released by done() below
            except NodeUnavailable:
                return  # replaced: the node restarted or went away meanwhile
        fut = getattr(b.stub, method).future(request, timeout=self.timeout)
        with self._lock:
            self._pending.add(fut)

        def done(f: grpc.Future[Message]) -> None:
            if held is not None:
                self._release(held)
            with self._lock:
                self._pending.discard(f)
            exc = f.exception()
            if exc is not None:
                log.warning("async_rpc_failed", method=method,
                            error=str(getattr(exc, "details", lambda: exc)()))

        fut.add_done_callback(done)

    def health(self) -> node_pb2.HealthResponse:
        with self._lock:
            self._check_open()
            if self._unreachable:
                self._connect()
            return self._call("Health", node_pb2.HealthRequest(), node_pb2.HealthResponse, None)

    def stats(self) -> node_pb2.StatsResponse:
        with self._lock:
            self._check_open()
            if self._unreachable:
                self._connect()
            return self._call("Stats", node_pb2.StatsRequest(), node_pb2.StatsResponse, None)

    def close(self) -> None:
        """Deliver what was sent without waiting (``wait=False`` Commits and Releases) —
        bounded by the client's timeout — then end the session. Ending the session first
        would let the node drop a reservation whose Commit is still on its way. The pool
        mapping is dropped too: unmapped at once unless a caller still holds a view of it
        (a result's ``.pool``, a slice of ``client.pool``), then when the last view dies."""
        drain = min(self.timeout, CLOSE_DRAIN_S)
        deadline = time.monotonic() + drain
        with self._lock:
            self._closed = True
            local = self._bound.local if self._bound is not None else None
            pending, self._pending = list(self._pending), set()
        if local is not None:  # outside the lock: the other threads' calls end meanwhile
            local.close(drain=drain)
        for fut in pending:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - logged by its done-callback, or the node is gone
                pass
        with self._lock:
            if self._stream is not None:
                self._stream.cancel()
            if self._channel is not None:
                self._retire(self._channel)
            # The pool mapping goes with the last view of it: at once when the caller holds
            # none. It cannot be unmapped under views callers still hold (results' ``.pool``,
            # tensors sliced from ``client.pool``: unmapping would make them fault), so those
            # keep it until they die.
            self._mapping = None
            if self._bound is not None:
                self._bound = replace(self._bound, pool=None)

    def __enter__(self) -> PegaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SessionLost(Exception):
    pass
