"""The node's local fast path: the data-path RPCs over a Unix socket, beside gRPC.

Why: a synchronous Python gRPC unary call costs ~0.6-0.9 ms on a small host, as much as
copying a 64-block request of 256 KiB pages; a request/reply over a Unix socket with the
same protobuf payloads costs tens of microseconds. Every engine is on the node's host by
construction (it maps the pool), so engines use this path for Query, Reserve, Commit and
Release; Register, the session stream, Health and Stats stay on gRPC.

Contracts:
- The handlers are :class:`NodeService`'s own (``service.local_methods``), run on the
  node's loop like gRPC's: same validation, same status codes, same metrics (labelled
  ``transport="local"``). Frames of one connection are served one at a time, in order.
- A connection is an ``asyncio.Protocol``: a frame is answered inside the callback that
  received it, when its handler does not wait (all but a Query that asks the metaserver);
  one that waits stops that connection's reading until its answer is sent. Replies past
  the transport's high-water mark (a client that sends without reading) stop the reading
  too, until the buffer drains.
- The socket file has mode 0600 (like the pool; 0660 for ``--access-group``) from the moment it appears: it is bound
  under a temporary name, chmod-ed, then renamed into place, which also replaces a stale
  socket left by a killed node. A path that a live process serves is a start-up error.
  The file is removed on clean shutdown, unless another node has replaced it meanwhile.
- A malformed frame (length over :data:`MAX_FRAME`, unknown method, undecodable payload)
  closes that connection with a log line; nothing else is affected.
- With a token (``--auth-token-file``), a connection's first frame must be HELLO with the
  token (constant-time compare); otherwise the node answers UNAUTHENTICATED and closes it.
- POOL (``local_wire.POOL``, after that check) answers with a read-write descriptor of the
  pool's memfd (``SCM_RIGHTS``): how an engine of another user, let in by
  ``--access-group``, maps the pool it cannot open through ``/proc/<node pid>/fd/<fd>``.
  The descriptor is opened anew for each request and closed once sent; a connection whose
  reply buffer is not empty (the descriptor must ride on the reply's own bytes) is
  answered UNAVAILABLE, and the engine falls back to the ``/proc`` path.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import inspect
import os
import socket
import stat
from collections.abc import Awaitable
from typing import cast

import structlog
from google.protobuf.message import DecodeError, Message

from pegaflow.common.local_wire import (
    HELLO,
    MAX_FRAME,
    NO_REPLY,
    POOL,
    POOL_REPLY,
    REPLY_HEADER,
    REQUEST_HEADER,
)
from pegaflow.common.logging import RateLimitedLog
from pegaflow.common.rpc_errors import RpcStatus
from pegaflow.common.security import SOCKET_NAME, default_socket_path  # noqa: F401 - the naming rule's home
from pegaflow.node.service import LOCAL, NodeService

log = structlog.get_logger("pegaflow.node")
# A stranger with access to the socket can send any bytes: one line per reason and minute.
rejected = RateLimitedLog(log, "local_frame_rejected")

SOCKET_MODE = 0o600
GROUP_SOCKET_MODE = 0o660  # --access-group
MAX_SUN_PATH = 107  # bytes of a Unix socket path (sun_path is 108 with the NUL)
MAX_HELLO = 4096  # bytes of a token
UNAUTHENTICATED = 16  # gRPC's code number
UNAUTHENTICATED_MSG = b"a valid token is required"
UNAVAILABLE = 14  # gRPC's code number


class LocalSocketError(Exception):
    """The local socket cannot be served (one line for the operator)."""


def _claim(path: str) -> None:
    """Fail if ``path`` is served by a live process or is not a socket; a stale socket stays
    and is replaced atomically by the rename in :meth:`LocalServer.start`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise LocalSocketError(f"--local-socket {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return  # nobody listens: a killed node's leftover
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
            return
        raise LocalSocketError(f"--local-socket {path}: {exc.strerror}") from None
    finally:
        probe.close()
    raise LocalSocketError(f"--local-socket {path} is served by another process (another node on this port?)")


class LocalServer:
    """Serves ``service.local_methods`` on a Unix socket, on the running loop."""

    def __init__(self, service: NodeService, path: str, token: str = "", group: int | None = None) -> None:
        self.token = token
        self.group = group  # --access-group: the socket is 0660 for this group
        if len(os.fsencode(path)) > MAX_SUN_PATH:
            raise LocalSocketError(f"--local-socket {path} is longer than {MAX_SUN_PATH} bytes")
        self.service = service
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._inode = 0
        self._connections: set[_Connection] = set()

    async def start(self) -> None:
        _claim(self.path)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            sock.bind(tmp)
            os.chmod(tmp, SOCKET_MODE)
            if self.group is not None:
                os.chown(tmp, -1, self.group)
                os.chmod(tmp, GROUP_SOCKET_MODE)
            sock.listen(128)
            os.rename(tmp, self.path)
        except OSError as exc:
            sock.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise LocalSocketError(f"cannot listen on --local-socket {self.path}: {exc.strerror}") from None
        self._inode = os.stat(self.path).st_ino
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), sock=sock)
        log.info("local_socket_listening", path=self.path)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for c in list(self._connections):
            # abort, not close: a connection whose engine stopped reading keeps unsent replies,
            # and close() waits for them to drain; wait_closed() waits for every connection
            # (Python >= 3.12.1), so the node's stop would hang on one stalled engine.
            if c.transport is not None:
                c.transport.abort()
        await self._server.wait_closed()
        self._server = None
        try:
            if os.stat(self.path).st_ino == self._inode:  # not replaced by a newer node
                os.unlink(self.path)
        except FileNotFoundError:
            pass



class _Connection(asyncio.Protocol):
    """One engine connection: frames parsed from a buffer and answered in order."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        self.methods = server.service.local_methods
        self.authenticated = not server.token
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.waiting: asyncio.Future[None] | None = None  # an answer being awaited: later frames wait
        self.write_paused = False  # the reply buffer is past its high-water mark
        self.eof = False  # the engine shut its sending side: close once what it sent is served

    # ---- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream server's
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        # The engine went away; its session stream tells the node.
        self.server._connections.discard(self)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._serve()

    def eof_received(self) -> bool:
        self.eof = True
        if self.waiting is not None or self.write_paused:
            return True  # keep the connection until the frames already received are served
        self._end_of_input()
        return False

    def _end_of_input(self) -> None:
        if self.buf:
            rejected.note("truncated frame", reason="truncated frame", length=len(self.buf))
        self.close()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.transport is not None and self.waiting is None:
            self.transport.resume_reading()
            self._serve()
            if self.eof and self.waiting is None and not self.write_paused:
                self._end_of_input()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # ---- frames -------------------------------------------------------------------------
    def _serve(self) -> None:
        """Answer every complete frame in the buffer, unless a reply must be waited for."""
        buf, pos = self.buf, 0
        try:
            while self.waiting is None and not self.write_paused and self.transport is not None:
                if len(buf) - pos < REQUEST_HEADER.size:
                    return
                length, method, flags = REQUEST_HEADER.unpack_from(buf, pos)
                if length > MAX_FRAME:
                    return self._reject("too long", length=length, max=MAX_FRAME)
                if method == HELLO and length > MAX_HELLO:
                    return self._reject("hello too long", length=length)
                if method != HELLO:
                    if not self.authenticated:
                        return self._refuse("no token presented")
                    if method != POOL and method not in self.methods:
                        return self._reject("unknown method", method=method)
                start = pos + REQUEST_HEADER.size
                if len(buf) < start + length:
                    return
                payload = bytes(buf[start:start + length])
                pos = start + length
                if method == HELLO:
                    if self.server.token and not hmac.compare_digest(payload, self.server.token.encode()):
                        return self._refuse("wrong token")
                    self.authenticated = True
                    self.transport.write(REPLY_HEADER.pack(0, 0))
                    continue
                if method == POOL:
                    self._send_pool(flags)
                    continue
                req_type, handler = self.methods[method]
                try:
                    request = req_type.FromString(payload)
                except DecodeError as exc:
                    return self._reject("undecodable payload", method=method, error=str(exc))
                try:
                    answer = handler(request, LOCAL)
                except RpcStatus as st:
                    self._failed(st, flags, req_type)
                    continue
                if inspect.isawaitable(answer):
                    self.transport.pause_reading()
                    self.waiting = asyncio.ensure_future(self._finish(answer, flags, req_type))
                    return
                self._reply(answer, flags)
        finally:
            del buf[:pos]  # once per read: frames sent back to back are not shifted one by one

    async def _finish(self, answer: Awaitable[Message], flags: int, req_type: type) -> None:
        try:
            self._reply(await answer, flags)
        except RpcStatus as st:
            self._failed(st, flags, req_type)
        finally:
            self.waiting = None
        if self.transport is not None and not self.write_paused:
            self.transport.resume_reading()
            self._serve()
            # Replies may have filled the buffer again (pause_writing): the frames left are
            # served at resume_writing, which ends the input then.
            if self.eof and self.waiting is None and not self.write_paused:
                self._end_of_input()

    def _send_pool(self, flags: int) -> None:
        """Reply to POOL with the pool's descriptor (see the module's contracts)."""
        if flags & NO_REPLY or self.transport is None:
            return
        service = self.server.service
        body = POOL_REPLY.pack(service.epoch, service.pool_bytes)
        error = ""
        if self.transport.get_write_buffer_size():
            error = "reply buffer not empty"
        else:
            try:
                # The node's own path to its memfd: a new read-write open file description.
                fd = os.open(service.pool_path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                error = f"cannot open the pool: {exc.strerror}"
            else:
                sock: socket.socket | None = None
                try:
                    # A dup of the transport's (non-blocking) socket: asyncio's own object does
                    # not offer sendmsg. The send is of a few bytes into an empty buffer.
                    sock = socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
                    frame = REPLY_HEADER.pack(len(body), 0) + body
                    sent = socket.send_fds(sock, [frame], [fd])
                    if sent < len(frame):  # the descriptor went with the first bytes
                        self.transport.write(frame[sent:])
                    return
                except OSError as exc:  # the dup too (EMFILE): the pool's descriptor is closed all the same
                    error = f"cannot send the pool: {exc.strerror or exc}"
                finally:
                    if sock is not None:
                        sock.close()
                    os.close(fd)
        log.warning("local_pool_fd_not_sent", error=error)
        msg = error.encode()
        self.transport.write(REPLY_HEADER.pack(len(msg), UNAVAILABLE) + msg)

    def _reply(self, response: Message, flags: int) -> None:
        if flags & NO_REPLY or self.transport is None:
            return
        body = response.SerializeToString()
        self.transport.write(REPLY_HEADER.pack(len(body), 0) + body)

    def _failed(self, st: RpcStatus, flags: int, req_type: type) -> None:
        if flags & NO_REPLY:  # nobody reads the answer: the log is the only trace
            log.warning("local_no_reply_call_failed", method=req_type.__name__, code=st.code.name, error=st.message)
            return
        if self.transport is not None:
            body = st.message.encode()
            self.transport.write(REPLY_HEADER.pack(len(body), st.code.value[0]) + body)

    def _reject(self, reason: str, **fields: object) -> None:
        """A malformed frame: one rate-limited log line, and the connection is closed."""
        rejected.note(reason, reason=reason, **fields)
        self.close()

    def _refuse(self, reason: str) -> None:
        """Answer UNAUTHENTICATED and close."""
        rejected.note(reason, reason=reason)
        if self.transport is not None:
            self.transport.write(REPLY_HEADER.pack(len(UNAUTHENTICATED_MSG), UNAUTHENTICATED) + UNAUTHENTICATED_MSG)
        self.close()
