"""Assembles and runs one node: pool, block index, sessions, gRPC service, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from pegaflow._proto import node_pb2, node_pb2_grpc
from pegaflow.common import loop_lag, otel
from pegaflow.common.grpc_guard import AsyncGuard
from pegaflow.common.heap import freeze_startup_heap
from pegaflow.common.http import HttpEndpoint
from pegaflow.common.priority import background_thread
from pegaflow.common.security import (
    OwnToken,
    Security,
    SecurityError,
    default_socket_path,
    group_id,
    new_token,
    own_token_wanted,
    token_path,
)
from pegaflow.config.commands import NodeConfig
from pegaflow.config.options import NODE, default_of, options_for, without_effect
from pegaflow.config.tiers import PeerConfig, SsdConfig
from pegaflow.core.allocator import ExtentAllocator
from pegaflow.core.block_index import BlockIndex, IndexEvent, Namespace
from pegaflow.core.hosts import host_of
from pegaflow.core.tiers import Tier
from pegaflow.node import discovery
from pegaflow.node.accounting import RequestAccounting
from pegaflow.node.admin import NodeAdmin
from pegaflow.node.block_events import BlockEventFeed
from pegaflow.node.classes import Classes, NoticeReader
from pegaflow.node.idle import DataPathIdle, loop_hop
from pegaflow.node.metrics import ClassMetrics, NodeMetrics
from pegaflow.node.numa import NumaAllocator, place_pool
from pegaflow.node.pool import SharedPool
from pegaflow.node.query_trace import QueryTrace, QueryTraceError
from pegaflow.node.quota_metrics import register as register_quota_metrics
from pegaflow.node.residence import Residence
from pegaflow.node.service import NodeService
from pegaflow.node.sessions import Sessions
from pegaflow.node.tiers.remote import wiring
from pegaflow.node.tiers.remote.checksums import PageChecksums
from pegaflow.node.tiers.remote.metrics import PeerMetrics
from pegaflow.node.tiers.remote.rdma import RdmaUnavailable
from pegaflow.node.tiers.ssd import SsdError, SsdFiles, SsdTier, open_cache
from pegaflow.node.transports.unix_socket import LocalServer, LocalSocketError
from pegaflow.policy.quota import Quotas
from pegaflow.policy.tinylfu import TinyLFU

if TYPE_CHECKING:  # imported where it starts: it brings in redis
    from pegaflow.node.backup import BackupAgent
    from pegaflow.node.publishing import EventPublisher

log = structlog.get_logger("pegaflow.node")

EXPIRY_INTERVAL = 1.0  # seconds between sweeps of expired reservations and leases
CEILING_REFRESH = 5.0  # seconds between recomputations of the ceiling gauges (unions of HLLs)
# TinyLFU is sized in blocks, but page sizes are only known once engines register. Assume
# small pages (a 0.5B model's 16-token block is ~200 KiB): over-estimating the block count
# only costs sketch memory (~9 bytes per assumed block, 4 MiB per 64 GiB of pool) and a
# longer aging period, while under-estimating would saturate the counters.
ADMISSION_PAGE_GUESS = 128 << 10
LOOP_SWITCH_INTERVAL = 0.0001  # seconds a thread holding the GIL keeps it from the event loop (run())
GRPC_MAX_MESSAGE = 64 << 20  # a 16k-hash request is ~400 KiB; leave room for big batches


class StartupError(Exception):
    """A configuration the node cannot start with (one line for the operator)."""


class Node:
    """The composition root: builds every part of a node once, in dependency order, each
    with its collaborators in its constructor; :meth:`run` starts and stops them."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id or socket.gethostname()
        self.epoch = time.time_ns() // 1_000_000
        try:  # SSD tier: validate paths and open the files before allocating the pool (docs/ssd.md)
            ssd_files = open_cache(SsdConfig.from_node(config))
        except SsdError as exc:
            raise StartupError(str(exc)) from None
        self.ssd_files = ssd_files
        try:
            self._compose(config, ssd_files)
        except BaseException:
            if ssd_files is not None:  # a start that failed leaves no cache file it created
                ssd_files.discard()
            raise

    def _compose(self, config: NodeConfig, ssd_files: SsdFiles | None) -> None:
        """Every part but the SSD files, in dependency order (:meth:`__init__`)."""
        if config.metrics_otel_endpoint:
            try:  # before the pool is allocated: a missing extra is a one-line error
                otel.check_available(config.metrics_otel_endpoint)
            except otel.OtelUnavailable as exc:
                raise StartupError(str(exc)) from None
        try:
            self.security = Security.from_options(config, config.tls_ca)
            self.group = group_id(config.access_group) if config.access_group else None
        except SecurityError as exc:
            raise StartupError(str(exc)) from None
        if config.no_auth and self.security.token:
            raise StartupError("--no-auth and a token (--auth-token-file, PEGAFLOW_AUTH_TOKEN) exclude each other")
        # Safe by default on a shared host (docs/security.md): with no token and every listener
        # on loopback, the node makes its own, readable by its user (and --access-group) only.
        listeners = [config.addr]
        if config.joins_cluster:
            listeners.append(config.transfer_addr or config.addr)
        self.wants_own_token = own_token_wanted(self.security.token, config.no_auth, listeners)
        self.own_token: OwnToken | None = None
        self.query_trace: QueryTrace | None = None
        if config.query_trace:
            try:
                self.query_trace = QueryTrace(config.query_trace, config.trace_sample_rate)
            except QueryTraceError as exc:
                raise StartupError(str(exc)) from None
        try:  # guarantees over the whole pool, a name given twice: one line, before the pool
            quotas = Quotas(config.namespace_quota)
        except ValueError as exc:
            raise StartupError(f"--namespace-quota: {exc}") from None
        if config.page_align > config.pool_size:
            raise StartupError(f"--page-align {config.page_align} is larger than --pool-size {config.pool_size}: "
                               "no page fits in the pool")
        self.pool = SharedPool(config.pool_size, config.use_hugepages)
        # One part per NUMA node, bound to it before the pre-fault (pegaflow/node/numa.py).
        self.numa = place_pool(self.pool, config.disable_numa_affinity, config.page_align)
        self.metrics = NodeMetrics()
        admission = None
        if config.enable_lfu_admission:
            admission = TinyLFU(max(1, self.pool.size // (config.hint_value_size or ADMISSION_PAGE_GUESS)))
        # Pages become allocatable as the background pre-fault reaches them (start()).
        self.allocator = self.numa.allocator(self.pool.size, config.page_align, usable=0)
        # Bytes of the pool pre-faulted *and* handed to the allocator (set on the loop, with the
        # allocator): what Health, Stats and /metrics report. The pool's own count moves first,
        # in its thread, so a client that saw it could reserve before the pages were allocatable.
        self.faulted = 0
        self.index = BlockIndex(self.pool.size, admission=admission, allocator=self.allocator, quotas=quotas)
        register_quota_metrics(self.metrics.registry, self.index, quotas)
        self.ceiling = RequestAccounting(config.ceiling_windows, self.metrics, config.metric_hll_bucket_bits)
        self.sessions = Sessions(self.index, config.reservation_ttl, config.lease_ttl,
                                 max_namespaces=config.max_namespaces)
        self.index.add_listener(self._on_index_event)
        self.residence = Residence(self.metrics.registry)  # L1 residence times (its docstring: the cost)
        self.classes = Classes(self.index)  # replacement classes: what the metaserver says, applied
        ClassMetrics(self.metrics.registry, self.classes.figures)
        self.index.add_listener(self.residence.on_index_event)
        # Background hand-offs that a data-path call creates wait for a pause in the data
        # path (bounded): pegaflow/node/idle.py. The service stamps it, the tiers and the
        # publisher wait on it.
        self.idle = DataPathIdle()
        self.block_events = BlockEventFeed()  # SSD stores and removals: engines that watch, the publisher
        self.index.add_listener(self.block_events.on_index_event)
        # In a cluster, one checksum per page for SSD records and pulls, shared by both tiers.
        peer_metrics: PeerMetrics | None = None
        checksums: PageChecksums | None = None
        if config.joins_cluster:
            peer_metrics = PeerMetrics(self.metrics.registry)
            checksums = PageChecksums(self.index, self.pool.view, peer_metrics, background=True, idle=self.idle)
        self.ssd: SsdTier | None = None
        if ssd_files is not None:
            try:
                self.ssd = SsdTier(ssd_files, self.index, self.pool.view, self.metrics, feed=self.block_events,
                                   checksums=checksums, idle=self.idle)
            except SsdError as exc:
                raise StartupError(str(exc)) from None
        self.p2p: wiring.P2P | None = None  # remote reads (pegaflow/node/tiers/remote/), in a cluster
        if peer_metrics is not None and checksums is not None:  # in a cluster
            try:  # pins of blocks only on SSD read them from the SSD tier
                self.p2p = wiring.P2P(PeerConfig.from_node(config), self.index, self.pool, self.node_id,
                                      peer_metrics, checksums, self.security, ssd=self.ssd,
                                      on_remote_hits=self.metrics.hits.labels(Tier.REMOTE).inc)
            except (OSError, RdmaUnavailable) as exc:
                self.pool.close()
                raise StartupError(f"remote reads: {exc}") from None
        # The operator's side: `pegaflow cache` RPCs and the original's HTTP endpoints.
        self.admin = NodeAdmin(self.index, self.sessions, self.metrics, self.node_id, config.max_pinned_share,
                               config.max_batch, ssd=self.ssd)
        self.service = NodeService(
            self.index, self.sessions, self.metrics, self.pool.path, self.pool.size,
            self.node_id, self.epoch, config.max_batch,
            idle=self.idle, admin=self.admin,
            accounting=self.ceiling, ssd=self.ssd, query_trace=self.query_trace,
            remote=self.p2p.puller if self.p2p is not None else None,
            pool_prefaulted=lambda: self.faulted,
            block_events=self.block_events,
            peer_stats=self.p2p.metrics.stats if self.p2p is not None else None,
        )
        m = self.metrics
        m.pool_capacity.set(self.index.alloc.capacity)
        m.bind(
            pool_used=lambda: self.index.alloc.used_bytes,
            pool_prefaulted=lambda: self.faulted,
            resident_blocks=lambda: self.index.resident_blocks,
            resident_bytes=lambda: self.index.resident_bytes,
            leases=lambda: len(self.sessions.leases),
            reservations=lambda: len(self.sessions.reservations),
            sessions=lambda: len(self.sessions.sessions),
            pinned_bytes=lambda: self.admin.pinned_bytes,
            pins=lambda: len(self.admin.pins),
            admission_rejections=lambda: self.index.admission_rejections,
            evicted_bytes=lambda: self.index.evicted_bytes,
            removed_held=lambda: self.index.removed_held,
            load_pins=self.sessions.load_pins,
            evictions_by_class=lambda: (self.index.evictions, self.index.evicted_reclaimable),
        )
        self.server: grpc.aio.Server | None = None
        self.local: LocalServer | None = None  # the Unix-socket fast path (--local-socket)
        self.http: HttpEndpoint | None = None
        self.publisher: EventPublisher | None = None  # global-index event publisher (node/publishing.py, in the pegaflow.meta.events contract), with --redis-url
        self.otel: otel.OtelExport | None = None
        self._sketches: asyncio.Task[None] | None = None
        self.backup: BackupAgent | None = None  # the decode backup's tick, once publishing
        self._backup_task: asyncio.Task[None] | None = None
        self._joining: asyncio.Task[None] | None = None  # asking the metaserver for its Redis

    def _on_index_event(self, op: IndexEvent, ns: Namespace, hashes: list[bytes]) -> None:
        if op is IndexEvent.EVICT:
            self.metrics.evictions.labels(Tier.L1).inc(len(hashes))
        elif op is IndexEvent.INSERT:
            self.metrics.inserted.inc(len(hashes))

    def health(self) -> dict[str, object]:
        return {"ok": True, "node_id": self.node_id, "epoch": self.epoch, "pool_bytes": self.pool.size,
                "pool_prefaulted_bytes": self.faulted, "pool_ready": self.faulted >= self.pool.size,
                "pool_prefault_error": self.pool.prefault_error,
                "resident_blocks": self.index.resident_blocks}

    def _start_prefault(self) -> None:
        """Pre-fault the pool in the background; each faulted chunk becomes allocatable on the
        event loop (the allocator is the loop's)."""
        loop = asyncio.get_running_loop()

        def usable(done: int) -> None:
            self.allocator.extend(done)
            self.faulted = done

        def grew(done: int) -> None:
            try:
                loop.call_soon_threadsafe(usable, done)
            except RuntimeError:  # the loop is closed: the node is stopping
                pass

        self.pool.start_prefault(grew)

    async def start(self) -> None:
        for flag, reason in without_effect(NODE, self.config):  # the original's flags, once each
            log.info("option_without_effect", flag=flag, reason=reason)
        qps = next(o for o in options_for(NODE) if o.name == "qps-per-peer")
        if self.config.qps_per_peer != default_of(qps) and not (self.config.nics and self.config.metaserver_addr):
            log.info("option_without_effect", flag="--qps-per-peer",
                     reason="pages are pulled over TCP here (RDMA pulls need --nics and --metaserver-addr)")
        self._start_prefault()
        self.admin.start(asyncio.get_running_loop())
        guard = AsyncGuard(self.security.token)
        server = grpc.aio.server(interceptors=[guard], options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ])
        node_pb2_grpc.add_PegaNodeServicer_to_server(self.service, server)
        hs = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        names: tuple[str, ...] = (node_pb2.DESCRIPTOR.services_by_name["PegaNode"].full_name,
                                  health.SERVICE_NAME, reflection.SERVICE_NAME)
        if self.p2p is not None:
            names = (*names, self.p2p.add_to_server(server))
        reflection.enable_server_reflection(names, server)
        try:
            port = self.security.add_port(server, self.config.addr)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {self.config.addr}: {exc}") from None
        if port == 0:
            raise StartupError(f"cannot listen on {self.config.addr} (address in use?)")
        warn = self.security.exposure_warning(self.config.addr)
        if warn:
            log.warning("node_exposed_without_token", addr=self.config.addr, detail=warn)
        own = new_token() if self.wants_own_token else ""
        self._start_local(port, own)
        if self.local is not None:
            try:
                await self.local.start()
            except LocalSocketError as exc:
                raise StartupError(str(exc)) from None
            self.service.local_socket = self.local.path
        if own:  # once the socket is ours, before gRPC serves: no call is ever served without it
            self._write_own_token(guard, port, own)
        elif self.local is not None:
            # The socket is ours, so a token file beside it is a killed node's: clients would
            # send it to this node (refused under a configured token, misleading without one).
            stale = token_path(self.local.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
                log.info("stale_node_token_removed", path=stale)
        if self.ssd is not None:
            self.ssd.start(asyncio.get_running_loop())
        if self.p2p is not None:
            self.p2p.start(asyncio.get_running_loop())
        await server.start()
        r = hs.set("", health_pb2.HealthCheckResponse.SERVING)
        if asyncio.iscoroutine(r):
            await r
        r = hs.set(names[0], health_pb2.HealthCheckResponse.SERVING)
        if asyncio.iscoroutine(r):
            await r
        self.server = server
        if self.config.http_addr:
            # --enable-prometheus (the original's; on by default): off, /metrics serves nothing.
            served = self.metrics.registry if self.config.enable_prometheus else CollectorRegistry()
            self.http = HttpEndpoint(self.config.http_addr, served, self.health,
                                     routes=self.admin.routes(self._http_token, self._own_token_path),
                                     render_interval=self.config.metrics_render_interval,
                                     pause=self.idle.pause,  # renders fall in the data path's gaps
                                     settle=loop_hop(asyncio.get_running_loop()))  # after the counts queued
            try:
                self.http.start()
            except OSError as exc:
                raise StartupError(f"cannot listen on --http-addr {self.config.http_addr}: {exc.strerror}") from None
        if self.config.redis_url:
            self._start_publishing()
        elif self.config.metaserver_addr:  # the original's way: Redis from the metaserver
            self._joining = asyncio.create_task(self._join_via_metaserver())
        if self.config.metrics_otel_endpoint:
            # Last: every metric family exists now (the publisher's too), so all are mirrored.
            self.otel = otel.start_otel_export(self.config.metrics_otel_endpoint, self.metrics.registry,
                                               "pegaflow-node", self.config.metrics_period_secs)
        log.info("node_started", addr=self.config.addr, node_id=self.node_id, epoch=self.epoch,
                 pool_bytes=self.pool.size, pool_prefaulted_bytes=self.faulted, pool_path=self.pool.path,
                 local_socket=self.service.local_socket, pid=os.getpid())

    def _http_token(self) -> str:
        """The token the HTTP endpoints of pegaflow/node/admin.py ask for ('' = open): the
        node's own when it made one, else the configured one."""
        own = getattr(self, "own_token", None)
        return own.token if own is not None else self.security.token

    def _own_token_path(self) -> str:
        own = getattr(self, "own_token", None)
        return own.path if own is not None else ""

    def _start_publishing(self) -> None:
        from pegaflow.node.publishing import publish_block_index

        self.publisher = publish_block_index(
            self.config, self.index, self.node_id, asyncio.get_running_loop(), self.metrics.registry,
            ssd_entries=self.ssd.store.entries if self.ssd is not None else None, feed=self.block_events,
            idle=self.idle,  # its flushes wait for a pause (pegaflow/node/idle.py)
            notices=NoticeReader(self.classes, asyncio.get_running_loop()),  # class notices, read by its thread
        )
        self._sketches = asyncio.create_task(self.publish_sketches())
        self._start_backup()

    def _start_backup(self) -> None:
        """The decode backup's tick (pegaflow/node/backup.py): reports and offers through the
        Redis the node publishes to; pulls plans when it can pull (--metaserver-addr)."""
        from pegaflow.cluster.redis_conn import connect
        from pegaflow.node.backup import BackupAgent, BackupMetrics, BackupSettings

        c = self.config
        settings = BackupSettings(c.backup_reclaimable_percent, c.backup_max_candidates, c.backup_pull_max_bytes,
                                  c.backup_max_bandwidth)
        self.backup = BackupAgent(settings, self.index, self.sessions, self.node_id,
                                  lambda: connect(c.redis_url, c.redis_cluster),
                                  self.p2p.puller if self.p2p is not None else None, BackupMetrics(self.metrics.registry))
        self._backup_task = asyncio.create_task(self.backup.run())

    async def _join_via_metaserver(self) -> None:
        """Publish to the Redis the metaserver names (pegaflow/node/discovery.py); ``self.config``
        then holds it, as if it had been given with --redis-url."""
        target = await discovery.discover(self.config.metaserver_addr, self.security)
        self.config = dataclasses.replace(self.config, redis_url=target.urls, redis_cluster=target.cluster)
        log.info("publishing_to_metaserver_redis", metaserver=self.config.metaserver_addr,
                 redis_url=",".join(map(discovery.redacted, target.urls)), redis_cluster=target.cluster)
        self._start_publishing()

    def _socket_path(self, grpc_port: int) -> str:
        """The local socket's path ('' for none); 'auto' names it after --addr, under /tmp
        with --access-group (the group cannot enter a per-user $XDG_RUNTIME_DIR)."""
        path = self.config.local_socket
        if path == "auto":
            path = default_socket_path(host_of(self.config.addr), grpc_port, shared=self.group is not None)
        return path

    def _write_own_token(self, guard: AsyncGuard, grpc_port: int, token: str) -> None:
        # Beside the socket; with no socket, where the default one would be (clients look there).
        path = token_path(self._socket_path(grpc_port)
                          or default_socket_path(host_of(self.config.addr), grpc_port, shared=self.group is not None))
        try:
            self.own_token = OwnToken(path, self.group, token)
        except SecurityError as exc:
            raise StartupError(str(exc)) from None
        guard.gate.token = self.own_token.token
        guard.message = (f"a valid token is required: this node's own token is in {path}, readable by "
                         "its user" + (f" and group {self.config.access_group}" if self.group is not None else "")
                         + " (docs/security.md)")
        log.info("node_own_token", path=path, group=self.config.access_group or None,
                 detail="callers of other users are refused; --no-auth to accept anyone")

    def _start_local(self, grpc_port: int, own_token: str) -> None:
        path = self._socket_path(grpc_port)
        if path:
            token = own_token or self.security.token
            try:
                self.local = LocalServer(self.service, path, token, group=self.group)
            except LocalSocketError as exc:
                raise StartupError(str(exc)) from None

    async def publish_sketches(self) -> None:
        """Every --ceiling-publish-interval: serialize the ceiling here (the estimator lives on
        this loop) and store it in Redis from a worker thread; failures are logged and retried."""
        from pegaflow.cluster.redis_conn import connect, error_text
        from pegaflow.cluster.sketches import publish_sketch

        interval = self.config.ceiling_publish_interval
        loop = asyncio.get_running_loop()
        r = None
        while True:
            await self.idle.pause()  # in a gap of the data path: see housekeeping
            blob = self.ceiling.serialize()
            try:
                if r is None:
                    r = await loop.run_in_executor(None, connect, self.config.redis_url, self.config.redis_cluster)
                await loop.run_in_executor(None, publish_sketch, r, self.node_id, blob, interval)
                self.metrics.sketch_publications.labels("ok").inc()
            except Exception as exc:  # Redis down: the sketch expires, the next one replaces it
                self.metrics.sketch_publications.labels("error").inc()
                log.warning("ceiling_sketch_publish_failed", error=error_text(exc))
            await asyncio.sleep(interval)

    async def housekeeping(self) -> None:
        next_ceiling = 0.0
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL)
            if time.monotonic() >= next_ceiling:
                # The ceiling's unions (refresh) and its wire form (serialize, above) run on
                # the loop, where the estimator lives: 1.3 and 1.4 ms each at the default 16
                # bucket bits and 3 windows with keys arriving (measured on an idle core), so
                # they start in a pause of the data path (pegaflow/node/idle.py) rather than
                # on an engine's call, as the other background hand-offs do. In one
                # bench/dataplane.py run (3 x 15 s) Query p999 did not measurably move: the
                # host's noise is larger than one such stall every 1-5 s.
                await self.idle.pause()
                self.ceiling.refresh()
                next_ceiling = time.monotonic() + CEILING_REFRESH
            if self.residence.queued:  # counted off the loop; an unscraped node queues a second at most
                await asyncio.get_running_loop().run_in_executor(None, self.residence.fold)
            if isinstance(self.index.alloc, ExtentAllocator | NumaAllocator):  # read here, on the allocator's loop
                self.metrics.pool_largest_free.set(self.index.alloc.largest_free())
            if self.query_trace is not None:
                self.query_trace.flush()
            self._drop_unused_namespaces()
            e = self.sessions.expire()
            if e.reservations_overdue:  # kept: their engines live (pegaflow/node/sessions.py)
                self.metrics.expired.labels("reservation").inc(e.reservations_overdue)
                log.warning("reservations_past_ttl", count=e.reservations_overdue,
                            ttl=self.config.reservation_ttl, detail="kept until their sessions commit or end")
            if e.leases_overdue:
                self.metrics.expired.labels("lease").inc(e.leases_overdue)
                log.warning("leases_past_ttl", count=e.leases_overdue, ttl=self.config.lease_ttl,
                            detail="kept until released or their sessions end")
            if e.sessions_closed:
                self.metrics.expired.labels("session").inc(e.sessions_closed)
                self.metrics.sessions_closed.inc(e.sessions_closed)
                log.info("sessions_never_streamed_closed", count=e.sessions_closed,
                         reservations_freed=e.reservations_freed, leases_freed=e.leases_freed)

    def _drop_unused_namespaces(self) -> None:
        """Forget namespaces that hold nothing (no block in L1, none on SSD) and that no live
        session registered: a long-lived node meets many models and layouts, and
        ``--max-namespaces`` bounds only those in use."""
        store = self.ssd.store if self.ssd is not None else None
        dropped = 0
        for ns in self.index.namespaces():
            if self.sessions.uses(ns.name) or (store is not None and store.holds_namespace(ns.id)):
                continue
            dropped += self.index.drop_namespace(ns.name)
        if dropped:
            self.metrics.namespaces_dropped.inc(dropped)
            log.info("namespaces_dropped", count=dropped, left=len(self.index.namespaces()))

    async def run(self) -> None:
        # run_in_executor(None, ...) work (Redis connects, sketch publications, RDMA pins'
        # checksums) runs below the loop that serves engines (pegaflow/common/priority.py).
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="pf-executor", initializer=background_thread))
        try:
            await self.start()
        except BaseException:
            if self.ssd_files is not None:  # a start that failed leaves no cache file it created
                self.ssd_files.discard()
            raise
        assert self.server is not None
        frozen = freeze_startup_heap()
        log.debug("startup_heap_frozen", objects=frozen)
        gc_pauses = self.metrics.gc_pauses.install()  # pegaflow_node_gc_pause_seconds
        # The event loop that serves engines shares the GIL with the node's background threads
        # (the /metrics server, the SSD tier's I/O thread, checksums, the event publisher).
        # When one of them runs Python, the loop waits for the GIL until the holder is made to
        # drop it: a whole switch interval. Measured (a loop thread echoing another process's
        # calls while a thread renders this node's /metrics back to back): p50 5.1 ms at
        # CPython's default 5 ms, 1.2 ms at 1 ms, 0.6 ms at 0.5 ms; with the background on, its
        # threads held the GIL ~6% of the time (bench/dataplane.py --py-spy), so such waits
        # land in the data path's p99. A short interval is the loop's priority over them. On a
        # node (bench/dataplane.py's "on" background with 16 scrapers, 2 x 8 s interleaved, on
        # a shared 2-core host): Query p99 9.8 ms at 5 ms, 5.5 ms at 0.5 ms; p999 15.7 vs 11.0
        # ms; node CPU per call 947 vs 988 µs. What yields is best-effort work: SSD write-behind
        # with an unpaced writer (bench/spill.py --save-mbps 0, same host, 4 vs 3 runs) wrote
        # 704-998 MB/s at 5 ms and 568-788 MB/s at 0.5 ms (its queue skips what it cannot
        # take); paced at 800 MB/s, 255-539 vs 431-472 MB/s: within this host's noise.
        # Once the background's hand-offs waited for the data path's pauses, 0.1 ms beat 0.5:
        # bench/dataplane.py --rounds 3 --seconds 15, 4 runs each alternated (2026-12-04, a
        # 2-core host), Query p99 on/off 1.00x-1.13x against 1.12x-1.30x (per-round pairs:
        # median 1.11x against 1.17x), p999 1.03x-1.57x against 0.83x-1.82x. Its price did
        # not show: the unpaced spill (bench/spill.py --save-mbps 0) wrote 651/675 MB/s to
        # SSD against 613/645, and bench/saturation.py (256 KiB) saturated at 750 vs 753
        # requests/s. The interval works both ways: a thread waiting that long takes the GIL
        # from the loop, so a Query (~150 µs of Python) may now be cut once; the figures
        # above include that.
        sys.setswitchinterval(LOOP_SWITCH_INTERVAL)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        hk = asyncio.create_task(self.housekeeping())
        lag = asyncio.create_task(loop_lag.watch(self.metrics.loop_lag))
        await stop.wait()
        log.info("node_stopping")
        gc_pauses.remove()
        self.service.stopping.set()
        hk.cancel()
        lag.cancel()
        if self.query_trace is not None:
            self.query_trace.close()
        if self._joining is not None:
            self._joining.cancel()
        if self._sketches is not None:
            self._sketches.cancel()
        if self._backup_task is not None:
            self._backup_task.cancel()
        if self.backup is not None:
            await self.backup.close()  # before the puller closes: its pull runs there
        if self.otel is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.otel.stop)
        if self.local is not None:
            await self.local.close()
        await self.server.stop(grace=1.0)
        if self.publisher is not None:
            # After the server: commits landing in its grace are published too; then the
            # node's live key goes (peers are sent elsewhere at once, not for --liveness-ttl).
            await asyncio.get_running_loop().run_in_executor(None, self.publisher.stop)
        if self.http:
            await asyncio.get_running_loop().run_in_executor(None, self.http.stop)
        if self.p2p is not None:
            await self.p2p.close()  # before the pool: pulls write and the data port reads pool pages
        if self.ssd is not None:
            await self.ssd.close()  # before the pool: I/O reads and writes pool pages
        self.pool.close()
        if self.own_token is not None:
            self.own_token.remove()
        log.info("node_stopped")
