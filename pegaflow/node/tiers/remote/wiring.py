"""Wires remote reads into a node: pin table + PegaPeer service + data plane + puller.

P2P is on when the node joins a cluster: it is published, so peers may pull from it
(``--redis-url``, or the metaserver's Redis when only ``--metaserver-addr`` is given), and
it pulls what it misses (``--metaserver-addr``). Serving needs nothing else; pulling needs
the metaserver. ``--nics`` switches both sides from the TCP data plane to RDMA READ.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog

from pegaflow._proto import peer_pb2, peer_pb2_grpc
from pegaflow.common.security import Security, sync_channel
from pegaflow.config.tiers import PeerConfig
from pegaflow.core.block_index import BlockIndex
from pegaflow.core.hosts import WILDCARD, advertised, join_host_port, routability_warning, split_host_port
from pegaflow.node.pool import SharedPool
from pegaflow.node.tiers.remote import Transport
from pegaflow.node.tiers.remote.checksums import PageChecksums
from pegaflow.node.tiers.remote.metrics import PeerMetrics
from pegaflow.node.tiers.remote.pins import PeerService, PinTable
from pegaflow.node.tiers.remote.puller import GrpcPeers, MetaLookup, Puller
from pegaflow.node.tiers.remote.tcp import TcpDataServer, TcpTransport
from pegaflow.node.tiers.ssd import SsdTier

log = structlog.get_logger("pegaflow.p2p")

HANDSHAKE_TIMEOUT = 5.0


class P2P:
    """The node's remote-read parts; construct before the gRPC server starts.

    ``checksums`` are the node's page checksums (a published node, which peers may pull
    from, hashes what it commits ahead of any pull: ``background=True``), which the SSD tier
    shares; ``metrics`` the remote reads' (theirs too); ``ssd`` the node's SSD tier, from
    which pins of blocks it holds only on SSD are read (None: none).
    """

    def __init__(self, config: PeerConfig, index: BlockIndex, pool: SharedPool, node_id: str,
                 metrics: PeerMetrics, checksums: PageChecksums, security: Security, *,
                 ssd: SsdTier | None = None, on_remote_hits: Callable[[int], None] | None = None) -> None:
        self.security = security
        self.metrics = metrics
        configured = config.advertise_addr or config.addr
        warn = routability_warning(configured)
        if warn:
            log.warning("p2p_address_not_routable", addr=configured, detail=warn)
        adv = advertised(config.addr, config.advertise_addr)
        self.checksums = checksums
        self.table = PinTable(index, pool.view, config.pin_ttl, self.metrics, self.checksums,
                              ssd.promoter if ssd is not None else None)
        bind_host, _ = split_host_port(config.addr)
        taddr = config.transfer_addr or join_host_port(bind_host, 0)
        self.data = TcpDataServer(taddr, pool.fd, pool.view, self.table.acquire, self.table.release_send,
                                  self.metrics.served_bytes.inc, self.checksums.of)
        thost, _ = split_host_port(taddr)
        if thost in WILDCARD:
            thost, _ = split_host_port(adv)
        self.data_addr = join_host_port(thost, self.data.port)
        self.engine = None
        rdma = None
        if config.nics:
            from pegaflow.node.tiers.remote.rdma import RdmaEngine, RdmaResponder

            try:
                self.engine = RdmaEngine(config.nics, pool.mm)
            except BaseException:
                self.data.close()
                raise
            rdma = RdmaResponder(self.engine)
        self.responder = rdma
        self.service = PeerService(self.table, self.data_addr, config.max_batch, rdma)
        self.puller: Puller | None = None
        self._peers: GrpcPeers | None = None
        self._lookup: MetaLookup | None = None
        self._sync_channels: dict[str, grpc.Channel] = {}
        if config.metaserver_addr:
            transport: Transport
            if self.engine is not None:
                from pegaflow.node.tiers.remote.rdma import RdmaTransport

                transport = RdmaTransport(self.engine, self._handshake, node_id, config.qps_per_peer)
            else:
                transport = TcpTransport(pool.view)
            self._peers = GrpcPeers(security, reconnect_max=config.peer_backoff)
            self._lookup = MetaLookup(config.metaserver_addr, security, reconnect_max=config.peer_backoff)
            self.puller = Puller(index, pool.view, node_id, self._lookup, self._peers, transport, self.metrics,
                                 pin_ttl=config.pin_ttl, backoff=config.peer_backoff, max_pull=config.max_batch,
                                 on_remote_hits=on_remote_hits, checksums=self.checksums)
        pulling = self.puller.transport if self.puller is not None and self.engine is not None else None
        self.metrics.bind_rdma(getattr(pulling, "qps", None), (lambda: len(rdma.qps)) if rdma is not None else None)
        log.info("p2p_ready", data_addr=self.data_addr, transport="rdma" if self.engine else "tcp",
                 sendfile=self.data.sendfile,
                 pulls=self.puller is not None, nics=list(config.nics))

    def _handshake(self, peer: str, req: peer_pb2.RdmaConnectRequest) -> peer_pb2.RdmaConnectResponse:
        """RdmaConnect from a transport worker thread (a blocking channel per peer)."""
        ch = self._sync_channels.get(peer)
        if ch is None:
            ch = self._sync_channels[peer] = sync_channel(peer, self.security)
        resp: peer_pb2.RdmaConnectResponse = peer_pb2_grpc.PegaPeerStub(ch).RdmaConnect(  # untyped stub
            req, timeout=HANDSHAKE_TIMEOUT)
        return resp

    def add_to_server(self, server: grpc.aio.Server) -> str:
        peer_pb2_grpc.add_PegaPeerServicer_to_server(self.service, server)
        return peer_pb2.DESCRIPTOR.services_by_name["PegaPeer"].full_name

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.table.loop = loop
        self.checksums.start()
        self.data.start()
        if self._lookup is not None:
            self._lookup.start()

    async def close(self) -> None:
        """Stop pulls and serving; must run before the pool is unmapped."""
        if self.puller is not None:
            await self.puller.close()
            self.puller.transport.close()
        await self.checksums.close()
        self.data.close()
        self.table.close()
        if self._peers is not None:
            await self._peers.close()
        if self._lookup is not None:
            await self._lookup.close()
        for ch in self._sync_channels.values():
            ch.close()
        if self.responder is not None:
            self.responder.close()
        if self.engine is not None:
            self.engine.close()
