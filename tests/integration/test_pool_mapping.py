"""How a client maps the node's pool, and when it lets go of it, against real nodes.

Over the local socket the node passes its memfd (``local_wire.POOL``, SCM_RIGHTS); a client
that reaches it over gRPC only opens Register's ``/proc/<node pid>/fd/<fd>`` (same user).
Either way pages saved through the mapping load back byte for byte. ``close()`` drops the
mapping at once (no garbage collection) unless a caller still holds a view of it.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

import pegaflow.client.client as client_mod
from pegaflow.client import NodeUnavailable, PegaClient

pytestmark = pytest.mark.integration

PAGE = 8192
N = 4


def hashes(tag: str) -> list[bytes]:
    import xxhash

    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(N)]


def pool_mappings() -> int:
    """This process's mappings of a node's pool (any node's)."""
    return sum(1 for ln in Path("/proc/self/maps").read_text().splitlines() if "memfd:pegaflow-pool" in ln)


@pytest.mark.parametrize("socket_on", [True, False], ids=["local-socket-fd", "grpc-proc-path"])
def test_pages_round_trip_through_the_mapping(node_factory, monkeypatch, socket_on):  # type: ignore[no-untyped-def]
    node = node_factory(extra=[] if socket_on else ["--local-socket", "off"])
    opened: list[str] = []
    real_open = os.open

    def spy(path, *a, **kw):  # type: ignore[no-untyped-def]
        opened.append(str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(client_mod.os, "open", spy)
    with PegaClient(node.addr) as c:
        c.register({"ns": PAGE})
        assert c.transport == ("local" if socket_on else "grpc")
        proc_opens = [p for p in opened if p.startswith("/proc/") and "/fd/" in p]
        # Over the socket the descriptor came with the reply: the /proc path is not opened.
        assert len(proc_opens) == (0 if socket_on else 1), opened
        r = c.reserve("ns", hashes("p"))
        for i, off in enumerate(r.offsets):
            r.pool[off:off + PAGE] = 90 + i
        assert c.commit(r.reservation_id) == N
        q = c.query(["ns"], hashes("p"))
        got = [bytes(q.pool[off:off + PAGE].numpy()) for off in q.offsets["ns"]]
        c.release(q.lease_id)
        assert got == [bytes([90 + i]) * PAGE for i in range(N)]


def test_close_unmaps_the_pool_at_once_unless_a_view_is_held(node_factory):  # type: ignore[no-untyped-def]
    node = node_factory()
    gc.collect()
    gc.disable()  # what close() releases must go without the collector
    try:
        before = pool_mappings()
        c = PegaClient(node.addr)
        c.register({"ns": PAGE})
        assert pool_mappings() == before + 1
        c.close()
        assert pool_mappings() == before
        with pytest.raises(NodeUnavailable):
            _ = c.pool

        c = PegaClient(node.addr)
        c.register({"ns": PAGE})
        r = c.reserve("ns", hashes("v"))
        view = r.pool[r.offsets[0]:r.offsets[0] + PAGE]
        view[:] = 5
        c.close()
        del r
        # A view a caller still holds keeps the mapping (unmapping under it would fault).
        assert pool_mappings() == before + 1 and int(view.sum()) == 5 * PAGE
        del view
        assert pool_mappings() == before
    finally:
        gc.enable()


@pytest.mark.parametrize("map_pool", [True, False], ids=["worker", "scheduler"])
def test_a_node_whose_socket_path_names_another_nodes_socket_is_used_over_grpc(node_factory, monkeypatch,  # type: ignore[no-untyped-def]
                                                                              map_pool):
    """A node on another host, run with the same --addr and the cluster's token, announces the
    socket path that this host's node listens on: the client must not send that node's
    session to this one (every call failed: unknown session, register again, in a loop)."""
    token = {"PEGAFLOW_AUTH_TOKEN": "one-token-for-the-cluster"}
    here, there = node_factory(env=token), node_factory(env=token)
    monkeypatch.setenv("PEGAFLOW_AUTH_TOKEN", token["PEGAFLOW_AUTH_TOKEN"])
    real = PegaClient._call

    def announced_elsewhere(self, method, request, reply, b, **kw):  # type: ignore[no-untyped-def]
        resp = real(self, method, request, reply, b, **kw)
        if method == "Register":
            resp.local_socket = here.local_socket  # the same path, on "this" host
        return resp

    monkeypatch.setattr(PegaClient, "_call", announced_elsewhere)
    with PegaClient(there.addr, map_pool=map_pool) as c:
        c.register({"ns": PAGE})
        assert c.transport == "grpc"
        q = c.query(["ns"], hashes("far"))
        assert q.hit_blocks == 0
