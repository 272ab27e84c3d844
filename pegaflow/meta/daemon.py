"""Assembles and runs one metaserver replica: consumer, in-memory view, lookups, gRPC service, metrics.

The composition root of ``pegaflow-meta`` (``pegaflow/meta/cli.py`` parses and connects to
Redis, then hands over here), as ``pegaflow/node/daemon.py`` is the node's. The constructor
builds every part in dependency order from the typed config and binds nothing;
:meth:`MetaServer.start` binds and starts them, :meth:`MetaServer.stop` stops them in the
reverse order, :meth:`MetaServer.run` does both around the process's signals.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
import structlog
from prometheus_client import REGISTRY, CollectorRegistry

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.cluster import registry as node_registry
from pegaflow.cluster.redis_conn import Client
from pegaflow.cluster.sketches import ClusterCeilingCollector
from pegaflow.common import cq_server, otel
from pegaflow.common.cq_server import CqServer
from pegaflow.common.grpc_guard import SyncGuard
from pegaflow.common.heap import freeze_startup_heap
from pegaflow.common.http import HttpEndpoint
from pegaflow.common.priority import name_thread
from pegaflow.common.security import Security
from pegaflow.common.startup import set_on_signals
from pegaflow.config.commands import MetaConfig
from pegaflow.config.options import META, without_effect
from pegaflow.meta import admin, backup, owners, sweeper
from pegaflow.meta.apply_process import ConsumerProcess
from pegaflow.meta.events.consumer import default_consumer_name
from pegaflow.meta.index import Census, Index, Pause
from pegaflow.meta.lookup import Lookup
from pegaflow.meta.metrics import MetaMetrics, run_census
from pegaflow.meta.service import MetaServicer
from pegaflow.meta.view_feed import ViewFeed

log = structlog.get_logger("pegaflow.meta")

# Calls answered on the thread that polls grpc (pegaflow/common/cq_server.py): from the view a
# lookup is ~50 us and holds the GIL start to end, so a hand-over to another thread would only
# add two wake-ups (bench/grpc_floor.py: the cheapest call 475 / 839 us p50 / p99 that way, 317 /
# 557 inline; the original's 311 / 588). A lookup the view cannot answer reads Redis there too
# (one round trip). Without the view lookups wait on Redis, and run on the pool like the rest.
_SERVICE = "/" + meta_pb2.DESCRIPTOR.services_by_name["MetaService"].full_name + "/"
INLINE_VIEW = tuple(_SERVICE + m for m in ("QueryPrefix", "RouteHint", "GetClusterConfig"))
INLINE = (_SERVICE + "GetClusterConfig",)
# Pool threads for the other calls (ListNodes, ClusterCeiling: Redis). Without the view, every
# lookup waits on Redis with the GIL released: 8 overlap them.
GRPC_THREADS_VIEW = 2
GRPC_THREADS = 8
GRPC_GRACE_S = 1.0  # calls in flight at stop get this long to finish
# grpc's default lets a second server bind a port in use (SO_REUSEPORT): a leftover replica
# then answered half the connections from its own index, and the new one logged started.
GRPC_OPTIONS = (("grpc.so_reuseport", 0),)
JOIN_TIMEOUT_S = 5.0  # the sweeper and the census finish their pass (they stop at their next wait)


def _thread(target: Callable[..., object], args: tuple[object, ...], name: str) -> threading.Thread:
    """A daemon thread running ``target(*args)``, its OS thread named ``name`` (``top -H``
    tells the metaserver's parts apart; pegaflow/common/priority.py)."""

    def run() -> None:
        name_thread()
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


class StartupError(Exception):
    """A listener the replica cannot have, or an exporter it cannot start (one line for the operator)."""


class MetaServer:
    """One replica. Any number run against one Redis or Redis Cluster and share the node
    streams (``pegaflow/meta/events/consumer.py``); a replica holds no state of its own but
    its in-memory view, a projection of the same streams it rebuilds at start
    (``pegaflow/meta/view_feed.py``).

    ``registry`` is what ``--http-addr`` serves (and OTLP mirrors): the process's default
    one unless given, so the client library's process metrics are in it.
    """

    def __init__(self, config: MetaConfig, redis: Client, security: Security,
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.config = config
        self.redis = redis
        self.security = security
        self.registry = registry
        self.metrics = MetaMetrics(registry)
        # The consumer runs in a child process (pegaflow/meta/apply_process.py says why),
        # under this replica's name.
        self.consumer = ConsumerProcess(config.redis_url, config.redis_cluster,
                                        config.consumer_name or default_consumer_name(),
                                        int(config.stream_lease_ttl * 1000), self.metrics.consumer,
                                        config.log_level, config.log_format)
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        # --node-stale-secs hides silent nodes, alike everywhere a node's visibility is judged
        # (lookups, the view, owner counts, the backup planner); 0: off, its live key alone.
        stale_ms = config.node_stale_secs * 1000 or None
        if config.sweep_interval > 0:
            self.threads.append(_thread(
                sweeper.run, (redis, self.stopping, config.sweep_interval, self.consumer.name, self.metrics,
                              round(config.ttl_minutes * 60_000)), "pf-meta-sweeper"))
        # Owner counts of the replacement classes (pegaflow/meta/owners.py): who counts, recounted.
        self.threads.append(_thread(
            owners.run, (redis, self.stopping, self.consumer.name, config.min_reclaimable_owner_count,
                         stale_ms), "pf-meta-owners"))
        if config.enable_decode_backup:  # the decode backup's planner (pegaflow/meta/backup.py)
            planner = backup.Planner(redis, config.backup_target_delay_secs * 1000,
                                     stale_ms, backup.BackupMetrics(registry),
                                     self.consumer.name)
            self.threads.append(_thread(backup.run, (planner, self.stopping), "pf-meta-backup"))
        if config.index_census_interval > 0:
            self.threads.append(_thread(
                run_census, (self.metrics, self._census, self.stopping, config.index_census_interval),
                "pf-meta-census"))
        self.ceiling = ClusterCeilingCollector(redis, config.ceiling_windows, lg_k=config.metric_hll_bucket_bits)
        registry.register(self.ceiling)
        # The in-memory view lookups read while it is fresh (--view-max-lag-ms; 0: Redis only).
        self.view = ViewFeed(redis, config.view_max_lag_ms / 1000, stale_ms) if config.view_max_lag_ms > 0 else None
        if self.view is not None:
            self.metrics.bind_view(self.view)
        self.lookup = Lookup(redis, stale_ms=stale_ms, view=self.view, sources=self.metrics.lookups)
        self.metrics.bind_nodes(self.lookup.nodes)  # pegaflow_metaserver_nodes{state}, at scrape time
        self.servicer = MetaServicer(self.lookup, config.query_max_blocks, self.metrics, self.ceiling.current,
                                     config.redis_url, config.redis_cluster)
        # /health: liveness, as the original's (200 while the process serves; Redis's state is
        # in /metrics, so a Redis outage does not get every replica restarted by its probe).
        self.http = (HttpEndpoint(config.http_addr, registry, self.health, routes=admin.routes(redis, security.token))
                     if config.http_addr else None)
        self.otel: otel.OtelExport | None = None
        self.server: grpc.Server | CqServer | None = None
        self.port = 0  # the gRPC port bound (--addr may name port 0)

    def health(self) -> dict[str, object]:
        """``GET /health`` on ``--http-addr``: 200 while the replica runs."""
        return {"ok": True, "consumer": self.consumer.name, "port": self.port}

    def _census(self, pause: Pause) -> Census:
        """Count the index's entries of live nodes (``--index-census-interval``), paced by ``pause``."""
        live = set(node_registry.visible(self.redis, sorted(node_registry.nodes(self.redis)),
                                       self.config.node_stale_secs * 1000))
        return Index(self.redis).census(sorted(node_registry.namespace_tags(self.redis)), live, pause)

    def start(self) -> None:
        """Bind and start everything; :class:`StartupError` when a listener or the exporter
        cannot be had (what had started is stopped again)."""
        try:
            self._start_listeners()
        except StartupError:
            self._close()
            raise
        self.consumer.start()
        if self.view is not None:
            self.view.start()
        for t in self.threads:
            t.start()
        warn = self.security.exposure_warning(self.config.addr)
        if warn:
            log.warning("metaserver_exposed_without_token", addr=self.config.addr, detail=warn)
        log.info("metaserver started", addr=self.config.addr, port=self.port, consumer=self.consumer.name,
                 grpc_server="inline" if isinstance(self.server, CqServer) else "pool")

    def _start_listeners(self) -> None:
        c = self.config
        if self.http is not None:
            try:
                self.http.start()
            except OSError as exc:
                raise StartupError(f"cannot listen on --http-addr {c.http_addr}: {exc.strerror or exc}") from None
        if c.metrics_otel_endpoint:
            try:
                self.otel = otel.start_otel_export(c.metrics_otel_endpoint, self.registry, "pegaflow-meta",
                                                   c.metrics_period_secs)
            except otel.OtelUnavailable as exc:
                raise StartupError(str(exc)) from None
        threads = GRPC_THREADS_VIEW if self.view is not None else GRPC_THREADS
        guard: list[grpc.ServerInterceptor] = [SyncGuard(self.security.token)]
        server: grpc.Server | CqServer
        if cq_server.supported():
            server = CqServer(INLINE_VIEW if self.view is not None else INLINE, workers=threads, interceptors=guard,
                              options=GRPC_OPTIONS)
        else:  # a grpcio whose internals moved: the stock server, two thread hand-overs a call
            log.warning("grpc_cq_server_unsupported; serving with grpc.server", grpc=grpc.__version__)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), interceptors=guard,
                                 options=GRPC_OPTIONS)
        meta_pb2_grpc.add_MetaServiceServicer_to_server(self.servicer, server)
        try:
            port = self.security.add_port(server, c.addr)
            if port == 0:
                raise OSError(f"cannot bind {c.addr}")
            server.start()
        except (RuntimeError, OSError) as exc:
            raise StartupError(f"cannot listen on {c.addr}: {exc}") from None
        self.server, self.port = server, port

    def stop(self) -> None:
        """Stop serving, then the consumer (it releases its leases), then the rest."""
        self._close()
        log.info("metaserver stopped", consumer=self.consumer.name)

    def _close(self) -> None:
        self.stopping.set()
        if self.server is not None:
            self.server.stop(grace=GRPC_GRACE_S).wait()
        self.consumer.stop()
        if self.view is not None:
            self.view.stop()
        for t in self.threads:
            if t.is_alive():
                t.join(timeout=JOIN_TIMEOUT_S)
        if self.otel is not None:
            self.otel.stop()
        if self.http is not None:
            self.http.stop()

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT (from the main thread: it installs their handlers)."""
        for flag, reason in without_effect(META, self.config):  # the original's flags, once each
            log.info("option_without_effect", flag=flag, reason=reason)
        set_on_signals(self.stopping, signal.SIGTERM, signal.SIGINT)
        self.start()
        freeze_startup_heap()
        self.stopping.wait()
        self.stop()
