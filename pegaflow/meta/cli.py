"""``pegaflow-meta`` (alias ``pegaflow-metaserver``): the global index server.

    pegaflow-meta [options]           consume node streams, serve lookups over gRPC
    pegaflow-meta rebuild [options]   recompute the index from the streams, print a JSON report

Any number of replicas may run against one Redis or Redis Cluster; they share the node
streams (see ``pegaflow/meta/events/consumer.py``). Options: ``pegaflow/config/options.py`` (META rows).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Sequence

import redis
import structlog

from pegaflow.cluster.redis_conn import Client
from pegaflow.common.logging import configure_logging
from pegaflow.common.security import Security, SecurityError
from pegaflow.config.commands import MetaConfig, load
from pegaflow.config.options import META, without_effect


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    rebuild = bool(args) and args[0] == "rebuild"
    prog = "pegaflow-meta rebuild" if rebuild else "pegaflow-meta"
    opts = load(META, prog, args[1:] if rebuild else args)
    try:
        opts.check()
    except ValueError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        raise SystemExit(2) from None
    configure_logging(opts.log_level, opts.log_format)
    try:
        security = Security.from_options(opts)
    except SecurityError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        raise SystemExit(2) from None
    from pegaflow.cluster.redis_conn import connect

    try:
        r = connect(opts.redis_url, opts.redis_cluster)
        r.ping()
    except (redis.RedisError, OSError) as exc:
        sys.stderr.write(f"{prog}: error: {unreachable_redis(opts.redis_url, exc)}\n")
        raise SystemExit(1) from None
    if rebuild:
        from pegaflow.meta.rebuild import rebuild as do_rebuild

        report = do_rebuild(r)
        sys.stdout.write(json.dumps(report.__dict__) + "\n")
        return
    serve_forever(r, opts, security)


def unreachable_redis(url: str, exc: BaseException) -> str:
    """The one-line start-up error for a Redis that does not answer, with how to get one."""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return (
        f"cannot reach Redis at {url} ({detail}); start one (infra/redis/redis-standalone.sh start DIR PORT "
        "in the PegaFlow repository, or redis-server --port PORT) or point --redis-url at yours"
    )


def serve_forever(r: Client, opts: MetaConfig, security: Security) -> None:
    from pegaflow.common.http import HttpEndpoint
    from pegaflow.meta import sweeper
    from pegaflow.meta.apply_process import ConsumerProcess
    from pegaflow.meta.events.consumer import default_consumer_name
    from pegaflow.meta.lookup import Lookup
    from pegaflow.meta.service import serve

    log = structlog.get_logger("pegaflow.meta")
    for flag, reason in without_effect(META, opts):  # the original's flags, once each
        log.info("option_without_effect", flag=flag, reason=reason)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from prometheus_client import REGISTRY

    from pegaflow.meta.metrics import MetaMetrics

    metrics = MetaMetrics(REGISTRY)  # what --http-addr serves
    # The consumer runs in a child process (pegaflow/meta/apply_process.py says why), under
    # this replica's name.
    consumer = ConsumerProcess(opts.redis_url, opts.redis_cluster, opts.consumer_name or default_consumer_name(),
                               int(opts.stream_lease_ttl * 1000), metrics.consumer, opts.log_level, opts.log_format)
    threads: list[threading.Thread] = []
    if opts.sweep_interval > 0:
        threads.append(
            threading.Thread(
                target=sweeper.run,
                args=(r, stop, opts.sweep_interval, consumer.name, metrics, opts.ttl_minutes * 60_000),
                name="pf-meta-sweeper",
                daemon=True,
            )
        )
    if opts.index_census_interval > 0:
        from pegaflow.cluster import registry
        from pegaflow.meta.index import Census, Index
        from pegaflow.meta.metrics import run_census

        def count() -> Census:
            live = set(registry.visible(r, sorted(registry.nodes(r)), opts.node_stale_secs * 1000))
            return Index(r).census(sorted(registry.namespace_tags(r)), live)

        threads.append(threading.Thread(target=run_census, args=(metrics, count, stop, opts.index_census_interval),
                                        name="pf-meta-census", daemon=True))
    from pegaflow.cluster.sketches import ClusterCeilingCollector

    ceiling = ClusterCeilingCollector(r, opts.ceiling_windows, lg_k=opts.metric_hll_bucket_bits)
    REGISTRY.register(ceiling)
    http = None
    if opts.http_addr:
        http = HttpEndpoint(opts.http_addr, REGISTRY)
        try:
            http.start()
        except OSError as exc:
            sys.stderr.write(f"pegaflow-meta: error: cannot listen on --http-addr {opts.http_addr}: "
                             f"{exc.strerror or exc}\n")
            raise SystemExit(1) from None
    export = None
    if opts.metrics_otel_endpoint:
        from pegaflow.common import otel

        try:
            export = otel.start_otel_export(opts.metrics_otel_endpoint, REGISTRY, "pegaflow-meta",
                                            opts.metrics_period_secs)
        except otel.OtelUnavailable as exc:
            sys.stderr.write(f"pegaflow-meta: error: {exc}\n")
            raise SystemExit(1) from None
    try:
        lookup = Lookup(r, stale_ms=opts.node_stale_secs * 1000)  # --node-stale-secs hides silent nodes
        server, port = serve(lookup, opts.addr, opts.query_max_blocks, opts.redis_url, opts.redis_cluster,
                             security, metrics, ceiling=ceiling.current)
    except (RuntimeError, OSError) as exc:
        sys.stderr.write(f"pegaflow-meta: error: cannot listen on {opts.addr}: {exc}\n")
        raise SystemExit(1) from None
    consumer.start()
    for t in threads:
        t.start()
    warn = security.exposure_warning(opts.addr)
    if warn:
        log.warning("metaserver_exposed_without_token", addr=opts.addr, detail=warn)
    log.info("metaserver started", addr=opts.addr, port=port, consumer=consumer.name)
    from pegaflow.common.heap import freeze_startup_heap

    freeze_startup_heap()
    stop.wait()
    server.stop(grace=1.0).wait()
    consumer.stop()
    for t in threads:
        t.join(timeout=5)
    if export is not None:
        export.stop()
    if http is not None:
        http.stop()
    log.info("metaserver stopped", consumer=consumer.name)


if __name__ == "__main__":
    main()
