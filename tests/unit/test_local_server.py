"""The node's local socket server in-process, against a raw client and a stand-in service.

It stops even while an engine has stopped reading its replies: such a connection holds
unsent replies, closing it waits for them to drain, and the server's ``wait_closed`` waits
for every connection (Python >= 3.12.1), so the node's stop would hang on one stalled
engine. A pool descriptor it cannot send is closed, whatever failed."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from pathlib import Path

import pytest

import pegaflow.node.transports.unix_socket as unix_socket
from pegaflow._proto import node_pb2
from pegaflow.common.local_wire import METHODS, POOL, REPLY_HEADER, REQUEST_HEADER
from pegaflow.node.transports.unix_socket import UNAVAILABLE, LocalServer
from tests.waiting import wait_until_async

QUERY = next(mid for mid, (name, _, _) in METHODS.items() if name == "Query")


class BigAnswers:
    """A service whose every Query answer is ~1 MiB."""

    def __init__(self) -> None:
        big = node_pb2.QueryResponse(pages=[node_pb2.NamespaceOffsets(namespace="n", offsets=list(range(1 << 17)))])
        self.local_methods = {QUERY: (node_pb2.QueryRequest, lambda request, transport: big)}


def test_the_local_socket_stops_while_an_engine_does_not_read(tmp_path: Path) -> None:
    async def run() -> None:
        server = LocalServer(BigAnswers(), str(tmp_path / "n.sock"))  # type: ignore[arg-type]
        await server.start()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, server.path)
        frame = REQUEST_HEADER.pack(0, QUERY, 0)
        for _ in range(64):  # 64 MiB of answers asked for; none is read
            await asyncio.get_running_loop().sock_sendall(client, frame)
        await wait_until_async(lambda: any(c.write_paused for c in server._connections), 10.0,
                               "the server to hold replies it cannot send")
        await asyncio.wait_for(server.close(), 5.0)
        await asyncio.sleep(0)  # connection_lost runs on the loop
        assert not server._connections, "a stalled engine's connection outlived the server"
        client.close()

    asyncio.run(run())


class APool:
    """A service with a pool (a plain file here) and no methods."""

    def __init__(self, path: Path) -> None:
        path.write_bytes(b"\0" * 4096)
        self.pool_path, self.pool_bytes, self.epoch = str(path), 4096, 7
        self.local_methods: dict[int, object] = {}


def test_a_pool_descriptor_that_cannot_be_sent_is_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_more_fds(fd: int) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    async def run() -> None:
        server = LocalServer(APool(tmp_path / "pool"), str(tmp_path / "n.sock"))  # type: ignore[arg-type]
        await server.start()
        loop = asyncio.get_running_loop()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.setblocking(False)
        await loop.sock_connect(client, server.path)
        await wait_until_async(lambda: server._connections, 10.0, "the server to accept the connection")
        before = len(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(unix_socket.os, "dup", no_more_fds)
        await loop.sock_sendall(client, REQUEST_HEADER.pack(0, POOL, 0))
        head = await loop.sock_recv(client, REPLY_HEADER.size)
        monkeypatch.undo()
        length, status = REPLY_HEADER.unpack(head)
        assert status == UNAVAILABLE and length > 0
        assert len(os.listdir("/proc/self/fd")) == before, "the pool's descriptor leaked"
        client.close()
        await server.close()

    asyncio.run(run())


class _Transport:
    """A transport whose buffer fills at the second reply: the connection pauses writing."""

    def __init__(self) -> None:
        self.conn: unix_socket._Connection | None = None
        self.replies = 0
        self.closed = False

    def write(self, data: bytes) -> None:
        self.replies += 1
        assert self.conn is not None
        if self.replies == 2:
            self.conn.pause_writing()

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> None:
        return None


def test_frames_sent_before_the_engine_shut_its_side_are_all_served(tmp_path: Path) -> None:
    """A Query that waits (for the metaserver), then two more frames, then the engine shuts
    its sending side: while the replies back up, the two frames must still be answered."""

    async def run() -> None:
        answered = asyncio.get_running_loop().create_future()

        async def waits() -> node_pb2.QueryResponse:
            await answered
            return node_pb2.QueryResponse()

        first = [True]

        def query(request: object, transport: str) -> object:
            if first[0]:
                first[0] = False
                return waits()
            return node_pb2.QueryResponse()

        service = type("S", (), {"local_methods": {QUERY: (node_pb2.QueryRequest, query)}})()
        server = LocalServer(service, str(tmp_path / "n.sock"))  # type: ignore[arg-type]
        conn = unix_socket._Connection(server)
        t = _Transport()
        t.conn = conn
        conn.connection_made(t)  # type: ignore[arg-type]
        conn.data_received(REQUEST_HEADER.pack(0, QUERY, 0) * 3)
        assert conn.eof_received() is True  # kept open: a frame is being answered
        answered.set_result(None)
        await wait_until_async(lambda: conn.waiting is None, 5.0, "the waiting query to be answered")
        while conn.write_paused and not t.closed:  # the engine reads: each reply drains the buffer
            conn.resume_writing()
        assert t.replies == 3, "frames the engine sent were dropped at its end of input"
        assert t.closed

    asyncio.run(run())
