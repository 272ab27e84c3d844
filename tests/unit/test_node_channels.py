"""The node's channels to the metaserver (``MetaLookup``) and to peers (``GrpcPeers``), real
grpc.aio channels to in-process servers: the lookup connects when the node starts, before any
lookup, and both find a server that was down at start soon after it serves."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import grpc

from pegaflow._proto import meta_pb2, meta_pb2_grpc, peer_pb2, peer_pb2_grpc
from pegaflow.common.security import Security
from pegaflow.node.tiers.remote.puller import META_TIMEOUT, GrpcPeers, Holder, MetaLookup
from tests.waiting import wait_until_async

NS = "model|fp16|bs16"


class _Meta(meta_pb2_grpc.MetaServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def QueryPrefix(self, request, context):  # noqa: N802
        self.calls += 1
        return meta_pb2.QueryPrefixResponse(nodes=[meta_pb2.NodePrefix(
            node="node-b", address="10.0.0.2:50055", prefix_len=len(request.hashes))])


class _Peer(peer_pb2_grpc.PegaPeerServicer):
    async def Unpin(self, request, context):  # noqa: N802
        return peer_pb2.UnpinResponse(released=True)


def _server(meta: _Meta, port: int = 0, peer: _Peer | None = None) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    meta_pb2_grpc.add_MetaServiceServicer_to_server(meta, server)
    if peer is not None:
        peer_pb2_grpc.add_PegaPeerServicer_to_server(peer, server)
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


def test_a_metaserver_and_a_peer_down_at_start_are_found_soon_after_they_serve():
    """Nothing listens when the node starts: the lookup's connection fails, and the outage's
    lookups and peer calls fail (the puller then skips the metaserver or the peer for its
    backoff). Once they serve, a call finds each within its channel's capped wait between
    attempts to connect, not grpc's growing one."""
    reconnect_max = 0.2

    async def run() -> tuple[dict[str, int], dict[str, float]]:
        held = [socket.socket() for _ in range(2)]  # the ports, bound and not listening: refused
        for h in held:
            h.bind(("127.0.0.1", 0))
        meta_port, peer_port = (h.getsockname()[1] for h in held)
        servers: list[grpc.aio.Server] = []
        lookup = MetaLookup(f"127.0.0.1:{meta_port}", Security(), reconnect_max=reconnect_max)
        peers = GrpcPeers(Security(), reconnect_max=reconnect_max)
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "metaserver": lambda: lookup(NS, [b"h" * 16]),
            "peer": lambda: peers.unpin(f"127.0.0.1:{peer_port}", 1),
        }
        try:
            await start(lookup, grpc.ChannelConnectivity.TRANSIENT_FAILURE, "fail to connect")
            failed = dict.fromkeys(calls, 0)
            end = time.monotonic() + OUTAGE_S
            while time.monotonic() < end:  # the outage: every call fails
                for what, call in calls.items():
                    try:
                        await call()
                    except grpc.aio.AioRpcError:
                        failed[what] += 1
                await asyncio.sleep(META_TIMEOUT / 5)
            for h in held:
                h.close()
            for port, peer in ((meta_port, None), (peer_port, _Peer())):
                server, _ = _server(_Meta(), port, peer)
                servers.append(server)
                await server.start()
            t0 = time.monotonic()
            found: dict[str, float] = {}
            while len(found) < len(calls):  # bounded: each try waits at most 2 s
                for what, call in calls.items():
                    if what in found:
                        continue
                    try:
                        await call()
                        found[what] = time.monotonic() - t0
                    except grpc.aio.AioRpcError:
                        assert time.monotonic() < t0 + 10, f"the {what} was never found once it served"
                await asyncio.sleep(META_TIMEOUT / 5)
            return failed, found
        finally:
            for h in held:
                h.close()
            await lookup.close()
            await peers.close()
            for server in servers:
                await server.stop(None)

    failed, found = asyncio.run(run())
    assert all(failed.values()), failed
    assert all(t < reconnect_max + 1.0 for t in found.values()), f"found after {found} s"
