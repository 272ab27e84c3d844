"""The leases a Query hands out, on a NodeService in-process.

A Query that misses locally on a node with peers waits for the metaserver's answer (the
one data-path call that waits). Whatever happens to its session meanwhile, no page may stay
pinned for a session that is gone: nothing would ever release it. And a session's leases
are bounded: a lease takes no page, so the pool does not bound them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest

from pegaflow._proto import node_pb2
from pegaflow.common.rpc_errors import RpcStatus
from pegaflow.core.block_index import Block, BlockIndex, Namespace
from pegaflow.node.admin import NodeAdmin
from pegaflow.node.idle import DataPathIdle
from pegaflow.node.metrics import NodeMetrics
from pegaflow.node.service import NodeService
from pegaflow.node.sessions import Sessions

PAGE = 4096


class WaitingRemote:
    """The peer tier with a metaserver that answers "nobody else holds it" when told to."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def query(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> bool:
        self.asked.set()
        await self.answer.wait()
        return False

    def expected(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> int:
        return 0

    def leased(self, blocks: Sequence[Block]) -> None:
        pass


@pytest.mark.parametrize("session_ends", [False, True], ids=["session-alive", "session-ended-meanwhile"])
def test_a_query_that_waited_on_the_metaserver_leases_only_for_a_live_session(session_ends: bool) -> None:
    async def run() -> None:
        index = BlockIndex(64 * PAGE)
        sessions = Sessions(index)
        metrics = NodeMetrics()
        remote = WaitingRemote()
        admin = NodeAdmin(index, sessions, metrics, "n", 0.5, 16384)
        svc = NodeService(index, sessions, metrics, "/pool", 64 * PAGE, "n", 0, idle=DataPathIdle(), admin=admin,
                          remote=remote)
        sid = svc.register(node_pb2.RegisterRequest(
            instance_id="engine", namespaces=[node_pb2.NamespaceSpec(name="ns", page_bytes=PAGE)]), "local").session_id
        ns = index.get_namespace("ns")
        assert ns is not None
        hs = [i.to_bytes(16, "little") for i in range(4)]
        held = index.commit([b for b in index.reserve(ns, hs[:2]) if b is not None])
        answer = svc.query(node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hs, lease=True), "local")
        assert asyncio.iscoroutine(answer), "a local miss on a node with peers waits for the metaserver"
        task = asyncio.ensure_future(answer)
        await asyncio.wait_for(remote.asked.wait(), 5)
        if session_ends:
            sessions.close(sid)  # the engine exited, or POST /instances/cleanup
        remote.answer.set()
        if session_ends:
            with pytest.raises(RpcStatus, match="session") as failed:
                await task
            assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert not sessions.leases and all(b.pins == 0 for b in held), "pins of a session that is gone"
        else:
            resp = await task
            assert resp.hit_blocks == 2 and resp.lease_id in sessions.leases
            assert all(b.pins == 1 for b in held)

    asyncio.run(run())


def test_a_session_that_never_releases_its_leases_is_refused_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease takes no page, so the pool does not bound their number: the node does."""
    from pegaflow.node import sessions as sessions_mod

    monkeypatch.setattr(sessions_mod, "MAX_LEASES", 3)
    index = BlockIndex(64 * PAGE)
    sessions = Sessions(index)
    metrics = NodeMetrics()
    svc = NodeService(index, sessions, metrics, "/pool", 64 * PAGE, "n", 0, idle=DataPathIdle(),
                      admin=NodeAdmin(index, sessions, metrics, "n", 0.5, 16384))
    sid = svc.register(node_pb2.RegisterRequest(
        instance_id="engine", namespaces=[node_pb2.NamespaceSpec(name="ns", page_bytes=PAGE)]), "local").session_id
    ns = index.get_namespace("ns")
    assert ns is not None
    hs = [i.to_bytes(16, "little") for i in range(2)]
    held = index.commit([b for b in index.reserve(ns, hs) if b is not None])
    ask = node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hs, lease=True)
    leases = [svc.query(ask, "local").lease_id for _ in range(3)]  # type: ignore[union-attr]
    with pytest.raises(RpcStatus) as refused:
        svc.query(ask, "local")
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(b.pins == 3 for b in held), "the refused query pinned nothing"
    svc.release(node_pb2.ReleaseRequest(session_id=sid, lease_id=leases[0]), "local")
    assert svc.query(ask, "local").lease_id  # type: ignore[union-attr]
