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
- The socket file has mode 0600 (like the pool) from the moment it appears: it is bound
  under a temporary name, chmod-ed, then renamed into place, which also replaces a stale
  socket left by a killed node. A path that a live process serves is a start-up error.
  The file is removed on clean shutdown, unless another node has replaced it meanwhile.
- A malformed frame (length over :data:`MAX_FRAME`, unknown method, undecodable payload)
  closes that connection with a log line; nothing else is affected.
- With a token (``--auth-token-file``), a connection's first frame must be HELLO with the
  token (constant-time compare); otherwise the node answers UNAUTHENTICATED and closes it.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import os
import socket
import stat
from collections.abc import Mapping

import structlog
from google.protobuf.message import DecodeError

from pegaflow.common.local_wire import HELLO, MAX_FRAME, NO_REPLY, REPLY_HEADER, REQUEST_HEADER
from pegaflow.common.logging import RateLimitedLog
from pegaflow.node.service import LOCAL, NodeService, RpcStatus

log = structlog.get_logger("pegaflow.node")
# A stranger with access to the socket can send any bytes: one line per reason and minute.
rejected = RateLimitedLog(log, "local_frame_rejected")

SOCKET_MODE = 0o600
SOCKET_NAME = "pegaflow-node-{host}-{port}.sock"
MAX_SUN_PATH = 107  # bytes of a Unix socket path (sun_path is 108 with the NUL)
MAX_HELLO = 4096  # bytes of a token
UNAUTHENTICATED = 16  # gRPC's code number
UNAUTHENTICATED_MSG = b"a valid token is required"


class LocalSocketError(Exception):
    """The local socket cannot be served (one line for the operator)."""


def default_socket_path(host: str, port: int, env: Mapping[str, str] | None = None) -> str:
    """``$XDG_RUNTIME_DIR`` (per user, private) or ``/tmp``, named after the gRPC address so
    several nodes on one host (tests, network namespaces sharing /tmp) never collide."""
    base = (os.environ if env is None else env).get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, SOCKET_NAME.format(host=host.strip("[]") or "any", port=port))


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

    def __init__(self, service: NodeService, path: str, token: str = "") -> None:
        self.token = token
        if len(os.fsencode(path)) > MAX_SUN_PATH:
            raise LocalSocketError(f"--local-socket {path} is longer than {MAX_SUN_PATH} bytes")
        self.service = service
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._inode = 0
        self._writers: set[asyncio.StreamWriter] = set()

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
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=1 << 20)
        log.info("local_socket_listening", path=self.path)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()
        self._server = None
        try:
            if os.stat(self.path).st_ino == self._inode:  # not replaced by a newer node
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        methods = self.service.local_methods
        authenticated = not self.token
        try:
            while True:
                try:
                    header = await reader.readexactly(REQUEST_HEADER.size)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        rejected.note("truncated header", reason="truncated header")
                    return
                length, method, flags = REQUEST_HEADER.unpack(header)
                if length > MAX_FRAME:
                    rejected.note("too long", reason="too long", length=length, max=MAX_FRAME)
                    return
                if method == HELLO:
                    if length > MAX_HELLO:
                        rejected.note("hello too long", reason="hello too long", length=length)
                        return
                    try:
                        presented = await reader.readexactly(length)
                    except asyncio.IncompleteReadError:
                        rejected.note("truncated hello", reason="truncated hello", length=length)
                        return
                    if self.token and not hmac.compare_digest(presented, self.token.encode()):
                        await _refuse(writer, "wrong token")
                        return
                    authenticated = True
                    writer.write(REPLY_HEADER.pack(0, 0))
                    await writer.drain()
                    continue
                if not authenticated:
                    await _refuse(writer, "no token presented")
                    return
                entry = methods.get(method)
                if entry is None:
                    rejected.note("unknown method", reason="unknown method", method=method)
                    return
                try:
                    payload = await reader.readexactly(length)
                except asyncio.IncompleteReadError:
                    rejected.note("truncated payload", reason="truncated payload", length=length)
                    return
                req_type, handler = entry
                try:
                    request = req_type.FromString(payload)
                except DecodeError as exc:
                    rejected.note("undecodable payload", reason="undecodable payload", method=method, error=str(exc))
                    return
                try:
                    body = (await handler(request, LOCAL)).SerializeToString()
                    status = 0
                except RpcStatus as st:
                    if flags & NO_REPLY:  # nobody reads the answer: the log is the only trace
                        log.warning("local_no_reply_call_failed", method=req_type.__name__,
                                    code=st.code.name, error=st.message)
                        continue
                    body, status = st.message.encode(), st.code.value[0]
                if not flags & NO_REPLY:
                    writer.write(REPLY_HEADER.pack(len(body), status) + body)
                    await writer.drain()  # immediate below the high-water mark
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass  # the engine went away; its session stream tells the node
        finally:
            self._writers.discard(writer)
            writer.close()


async def _refuse(writer: asyncio.StreamWriter, reason: str) -> None:
    """Answer UNAUTHENTICATED (the caller then closes the connection)."""
    rejected.note(reason, reason=reason)
    writer.write(REPLY_HEADER.pack(len(UNAUTHENTICATED_MSG), UNAUTHENTICATED) + UNAUTHENTICATED_MSG)
    await writer.drain()
