"""Who holds a prompt's prefix: ``{node id: (leading blocks held, of those only on its SSD)}``
for one namespace.

* :class:`MetaHints` asks the metaserver (``QueryPrefix``): every live node of the cluster,
  with the tier of what it holds (``ssd_blocks``; 0 from a metaserver without tiers).
* :class:`NodeHints` (no metaserver) asks each engine's node itself, with a ``peek`` Query
  (DRAM only, changes nothing on the node: no lease, no access counted, no promotion). The
  router registers a session with the node for that (the node answers only its sessions'
  namespaces), so the node must be reachable from the router: one host. DRAM only: no
  SSD blocks.

Both are routing hints: a slow or failed answer makes the request route by load alone
(the caller bounds the wait), and a source that failed is not asked again for a while.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import structlog

from pegaflow._proto import meta_pb2, meta_pb2_grpc, node_pb2, node_pb2_grpc
from pegaflow.common.security import Security, aio_channel

log = structlog.get_logger("pegaflow.router")

RETRY_AFTER_S = 2.0  # a source that failed is skipped this long
MAX_HINT_BLOCKS = 4096  # longer prompts are hinted by their first 4096 blocks


class HintUnavailable(Exception):
    """The source could not answer (down, slow, or refused); route by load."""


class MetaHints:
    def __init__(self, addr: str, security: Security, timeout: float) -> None:
        self.addr = addr
        self.timeout = timeout
        self._channel = aio_channel(addr, security)
        self._stub = meta_pb2_grpc.MetaServiceStub(self._channel)
        self._skip_until = 0.0

    async def prefixes(self, namespaces: Sequence[str], hashes: Sequence[bytes], node_addrs: Sequence[str] = (),
                       page_bytes: int = 0) -> dict[str, tuple[int, int]]:
        """Every live node's prefix of shard 0 (the index names each shard's blocks alike)."""
        if time.monotonic() < self._skip_until:
            raise HintUnavailable(f"metaserver {self.addr} failed recently")
        try:
            res = await self._stub.QueryPrefix(
                meta_pb2.QueryPrefixRequest(namespace=namespaces[0], hashes=list(hashes[:MAX_HINT_BLOCKS])),
                timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            self._skip_until = time.monotonic() + RETRY_AFTER_S
            raise HintUnavailable(f"metaserver {self.addr}: {exc.code().name}") from None
        return {p.node: (int(p.prefix_len), min(int(p.ssd_blocks), int(p.prefix_len))) for p in res.nodes}

    async def close(self) -> None:
        await self._channel.close()


class _NodeSession:
    """A registered session on one node, kept open (its stream is the node's liveness signal)."""

    def __init__(self, addr: str, security: Security) -> None:
        self.addr = addr
        self.channel = aio_channel(addr, security)
        self.stub = node_pb2_grpc.PegaNodeStub(self.channel)
        self.session_id = 0
        self.node_id = ""
        self.namespaces: dict[str, int] = {}
        self.stream: grpc.aio.UnaryStreamCall[node_pb2.SessionRequest, node_pb2.SessionEvent] | None = None
        self.skip_until = 0.0
        self.lock = asyncio.Lock()

    async def ensure(self, namespaces: dict[str, int], timeout: float) -> None:
        if self.session_id and all(n in self.namespaces for n in namespaces):
            return
        async with self.lock:
            want = {**self.namespaces, **namespaces}
            if self.session_id and want == self.namespaces:
                return
            res = await self.stub.Register(node_pb2.RegisterRequest(
                instance_id="pegaflow-router",
                namespaces=[node_pb2.NamespaceSpec(name=n, page_bytes=p) for n, p in want.items()]),
                timeout=max(timeout, 1.0))
            if self.stream is not None:
                self.stream.cancel()
            self.stream = self.stub.Session(node_pb2.SessionRequest(session_id=res.session_id))
            self.session_id, self.node_id, self.namespaces = int(res.session_id), res.node_id, want

    def lost(self) -> None:
        self.session_id = 0
        self.skip_until = time.monotonic() + RETRY_AFTER_S
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None

    async def close(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        await self.channel.close()


class NodeHints:
    """Peek queries to each engine's node; ``node_addrs`` are the engines' nodes for the
    namespaces, ``page_bytes`` their page size (a session registers what it asks about)."""

    def __init__(self, security: Security, timeout: float) -> None:
        self.security = security
        self.timeout = timeout
        self._nodes: dict[str, _NodeSession] = {}

    def _session(self, addr: str) -> _NodeSession:
        s = self._nodes.get(addr)
        if s is None:
            s = self._nodes[addr] = _NodeSession(addr, self.security)
        return s

    async def _one(self, addr: str, namespaces: Sequence[str], hashes: Sequence[bytes],
                   page_bytes: int) -> tuple[str, tuple[int, int]] | None:
        s = self._session(addr)
        if time.monotonic() < s.skip_until:
            return None
        try:
            await s.ensure(dict.fromkeys(namespaces, page_bytes), self.timeout)
            res = await s.stub.Query(node_pb2.QueryRequest(
                session_id=s.session_id, namespaces=list(namespaces), hashes=list(hashes[:MAX_HINT_BLOCKS]),
                peek=True), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                s.lost()  # re-register next time (the node restarted, or forgot the session)
            log.debug("node_hint_failed", node=addr, code=exc.code().name)
            return None
        return s.node_id, (int(res.hit_blocks), 0)

    async def prefixes(self, namespaces: Sequence[str], hashes: Sequence[bytes], node_addrs: Sequence[str] = (),
                       page_bytes: int = 0) -> dict[str, tuple[int, int]]:
        """Each of ``node_addrs``' prefix present in every shard (the nodes that answered)."""
        answers = await asyncio.gather(*(self._one(a, namespaces, hashes, page_bytes)
                                         for a in dict.fromkeys(node_addrs)))
        got = [a for a in answers if a is not None]
        if not got and node_addrs:
            raise HintUnavailable("no node answered")
        return dict(got)

    async def close(self) -> None:
        for s in self._nodes.values():
            await s.close()
