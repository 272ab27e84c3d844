"""The node's metaserver lookup (``MetaLookup``) over a real grpc.aio channel to an in-process
MetaService: it connects when the node starts, before any lookup, and finds a metaserver that
was down at start once it serves."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.common.security import Security
from pegaflow.node.tiers.remote.puller import META_TIMEOUT, Holder, MetaLookup
from tests.waiting import wait_until_async

NS = "model|fp16|bs16"


class _Meta(meta_pb2_grpc.MetaServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def QueryPrefix(self, request, context):  # noqa: N802
        self.calls += 1
        return meta_pb2.QueryPrefixResponse(nodes=[meta_pb2.NodePrefix(
            node="node-b", address="10.0.0.2:50055", prefix_len=len(request.hashes))])


def _server(meta: _Meta, port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    meta_pb2_grpc.add_MetaServiceServicer_to_server(meta, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    return server, f"127.0.0.1:{port}"


async def start(lookup: MetaLookup, state: grpc.ChannelConnectivity, what: str) -> None:
    """Start ``lookup`` and wait (bounded) until its channel is in ``state``, with no call made."""
    lookup.start()
    ch = lookup.channel
    assert ch is not None
    await wait_until_async(lambda: ch.get_state() == state, 10,
                           lambda: f"the started channel to {what} (state {ch.get_state()})")


def test_a_started_lookup_is_connected_before_its_first_call():
    async def run() -> tuple[int, list[Holder], int]:
        meta = _Meta()
        server, addr = _server(meta)
        await server.start()
        lookup = MetaLookup(addr, Security())
        try:
            await start(lookup, grpc.ChannelConnectivity.READY, "connect on its own")
            before = meta.calls  # connected, and nothing asked yet
            return before, await lookup(NS, [b"h" * 16] * 3), meta.calls
        finally:
            await lookup.close()
            await server.stop(None)

    before, holders, calls = asyncio.run(run())
    assert before == 0
    assert holders == [Holder("node-b", "10.0.0.2:50055", 3, 0)]
    assert calls == 1


# A metaserver down this long: grpc's default waits between attempts to connect (1, 1.6,
# 2.56, 4.1 s ..., each +-20%) put its next attempt 2-4 s after the outage ends.
OUTAGE_S = 6.0


def test_a_metaserver_down_at_start_is_found_soon_after_it_serves():
    """Nothing listens when the lookup starts: its connection fails, and the lookups of an
    outage fail (the puller then skips the metaserver for its backoff). Once the metaserver
    serves, a lookup finds it within the channel's capped wait between attempts, not
    grpc's growing one."""
    reconnect_max = 0.2

    async def run() -> tuple[int, float]:
        meta = _Meta()
        held = socket.socket()  # the port, bound and not listening: connections are refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        server: grpc.aio.Server | None = None
        lookup = MetaLookup(f"127.0.0.1:{port}", Security(), reconnect_max=reconnect_max)
        try:
            await start(lookup, grpc.ChannelConnectivity.TRANSIENT_FAILURE, "fail to connect")
            failed = 0
            end = time.monotonic() + OUTAGE_S
            while time.monotonic() < end:  # the outage: Queries' lookups keep failing
                try:
                    await lookup(NS, [b"h" * 16])
                except grpc.aio.AioRpcError:
                    failed += 1
                await asyncio.sleep(META_TIMEOUT / 5)
            held.close()
            server, _ = _server(meta, port)
            await server.start()
            t0 = time.monotonic()
            deadline = t0 + 10
            while True:  # bounded: each try waits at most META_TIMEOUT
                try:
                    await lookup(NS, [b"h" * 16])
                    break
                except grpc.aio.AioRpcError:
                    assert time.monotonic() < deadline, "the metaserver was never found once it served"
                    await asyncio.sleep(META_TIMEOUT / 5)
            return failed, time.monotonic() - t0
        finally:
            held.close()
            await lookup.close()
            if server is not None:
                await server.stop(None)

    failed, found_after = asyncio.run(run())
    assert failed > 0
    assert found_after < reconnect_max + 1.0, f"found {found_after:.2f} s after it served"
