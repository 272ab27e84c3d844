"""The node's local socket stops even while an engine has stopped reading its replies.

Such a connection holds unsent replies; closing it waits for them to drain, and the
server's ``wait_closed`` waits for every connection (Python >= 3.12.1): the node's stop
would hang on one stalled engine. Here the replies are large and the client never reads."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from pegaflow._proto import node_pb2
from pegaflow.common.local_wire import METHODS, REQUEST_HEADER
from pegaflow.node.transports.unix_socket import LocalServer
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
