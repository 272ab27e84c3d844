"""Wires remote reads into a node: pin table + PegaPeer service + data plane + puller.

P2P is on when the node joins a cluster: it is published, so peers may pull from it
(``--redis-url``, or the metaserver's Redis when only ``--metaserver-addr`` is given), and
it pulls what it misses (``--metaserver-addr``). Serving needs nothing else; pulling needs
the metaserver. ``--nics`` switches both sides from the TCP data plane to RDMA READ.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import Any

import grpc
import structlog

from pegaflow._proto import peer_pb2, peer_pb2_grpc
from pegaflow.common.security import Security, sync_channel
from pegaflow.node.block_index import BlockIndex
from pegaflow.node.pool import SharedPool
from pegaflow.node.transfer import Transport
from pegaflow.node.transfer.checksums import PageChecksums
from pegaflow.node.transfer.metrics import PeerMetrics
from pegaflow.node.transfer.pins import PeerService, PinTable
from pegaflow.node.transfer.puller import GrpcPeers, MetaLookup, Puller
from pegaflow.node.transfer.tcp import TcpDataServer, TcpTransport, split_host_port

log = structlog.get_logger("pegaflow.p2p")

WILDCARD = ("0.0.0.0", "::", "[::]", "")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
HANDSHAKE_TIMEOUT = 5.0


def enabled(opts: argparse.Namespace) -> bool:
    """Whether the node is in a cluster: published (peers may pull from it) and, with a
    metaserver, pulling."""
    return bool(getattr(opts, "redis_url", "") or getattr(opts, "metaserver_addr", ""))


def advertised(opts: argparse.Namespace) -> str:
    """The gRPC address peers reach this node at (what the index publishes)."""
    return getattr(opts, "advertise_addr", "") or opts.addr


def routability_warning(addr: str) -> str:
    """A warning for an advertised address other hosts cannot use ('' if it looks routable)."""
    host, _ = split_host_port(addr)
    if host in WILDCARD or host in LOOPBACK:
        return (f"P2P is on but peers would reach this node at {addr!r}, which is not routable from "
                "other hosts; set --addr or --advertise-addr to this host's cluster IP")
    return ""


class P2P:
    """The node's remote-read parts; construct before the gRPC server starts."""

    def __init__(self, opts: argparse.Namespace, index: BlockIndex, pool: SharedPool, node_id: str,
                 metrics_registry: Any, security: Security, on_remote_hits: Any = None) -> None:
        self.security = security
        self.metrics = PeerMetrics(metrics_registry)
        adv = advertised(opts)
        warn = routability_warning(adv)
        if warn:
            log.warning("p2p_address_not_routable", addr=adv, detail=warn)
        # A published node (peers may pull from it) hashes what it commits ahead of any pull.
        self.checksums = PageChecksums(index, pool.view, self.metrics, background=True)
        self.table = PinTable(index, pool.view, opts.pin_ttl, self.metrics, self.checksums)
        bind_host, _ = split_host_port(opts.addr)
        taddr = opts.transfer_addr or f"{bind_host}:0"
        self.data = TcpDataServer(taddr, pool.fd, pool.view, self.table.acquire, self.table.release_send,
                                  self.metrics.served_bytes.inc, self.checksums.of)
        thost, _ = split_host_port(taddr)
        if thost in WILDCARD:
            thost, _ = split_host_port(adv)
            if thost in WILDCARD:
                thost = socket.gethostname()
        self.data_addr = f"{thost}:{self.data.port}"
        self.engine = None
        rdma = None
        if opts.nics:
            from pegaflow.node.transfer.rdma import RdmaEngine, RdmaResponder

            try:
                self.engine = RdmaEngine(opts.nics, pool.mm)
            except BaseException:
                self.data.close()
                raise
            rdma = RdmaResponder(self.engine)
        self.service = PeerService(self.table, self.data_addr, opts.max_batch, rdma)
        self.puller: Puller | None = None
        self._peers: GrpcPeers | None = None
        self._lookup: MetaLookup | None = None
        self._sync_channels: dict[str, grpc.Channel] = {}
        if opts.metaserver_addr:
            transport: Transport
            if self.engine is not None:
                from pegaflow.node.transfer.rdma import RdmaTransport

                transport = RdmaTransport(self.engine, self._handshake, node_id)
            else:
                transport = TcpTransport(pool.view)
            self._peers = GrpcPeers(security)
            self._lookup = MetaLookup(opts.metaserver_addr, security)
            self.puller = Puller(index, pool.view, node_id, self._lookup, self._peers, transport, self.metrics,
                                 pin_ttl=opts.pin_ttl, backoff=opts.peer_backoff, max_pull=opts.max_batch,
                                 on_remote_hits=on_remote_hits, checksums=self.checksums)
        log.info("p2p_ready", data_addr=self.data_addr, transport="rdma" if self.engine else "tcp",
                 sendfile=self.data.sendfile,
                 pulls=self.puller is not None, nics=list(opts.nics))

    def _handshake(self, peer: str, req: peer_pb2.RdmaConnectRequest) -> peer_pb2.RdmaConnectResponse:
        """RdmaConnect from a transport worker thread (a blocking channel per peer)."""
        ch = self._sync_channels.get(peer)
        if ch is None:
            ch = self._sync_channels[peer] = sync_channel(peer, self.security)
        return peer_pb2_grpc.PegaPeerStub(ch).RdmaConnect(req, timeout=HANDSHAKE_TIMEOUT)

    def add_to_server(self, server: grpc.aio.Server) -> str:
        peer_pb2_grpc.add_PegaPeerServicer_to_server(self.service, server)
        return peer_pb2.DESCRIPTOR.services_by_name["PegaPeer"].full_name

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.table.loop = loop
        self.checksums.start()
        self.data.start()

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
        if self.engine is not None:
            self.engine.close()
