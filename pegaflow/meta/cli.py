"""``pegaflow-meta`` (alias ``pegaflow-metaserver``): the global index server.

    pegaflow-meta [options]           consume node streams, serve lookups over gRPC
    pegaflow-meta rebuild [options]   recompute the index from the streams, print a JSON report

Any number of replicas may run against one Redis or Redis Cluster; they share the node
streams (see ``pegaflow/meta/events/consumer.py``). Options: ``pegaflow/config/options.py`` (META rows).
This module parses, checks and reaches Redis; ``pegaflow/meta/daemon.py`` assembles and runs the replica.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from pegaflow.common.startup import structlog_without_rich
from pegaflow.config.commands import load
from pegaflow.config.options import META

# grpc core's EventEngine off (its listener, endpoints, callback queue and client): the older
# iomgr poller, where the thread waiting on the completion queue polls the sockets itself,
# answered a unary call sooner here (bench/grpc_floor.py; docs/meta.md, "Serving").
GRPC_EXPERIMENTS = "-event_engine_listener,-event_engine_for_all_other_endpoints,-event_engine_callback_cq,-event_engine_client"


def grpc_without_event_engine() -> None:
    """Set ``GRPC_EXPERIMENTS`` for this process and its children, unless the operator did.
    grpc reads it once, when it loads, so only where it has not loaded yet (this process is
    ``pegaflow-meta``, nothing imported it before ``main``); a process that already runs grpc
    (a test calling :func:`main`, a tool) is left as it is."""
    if "grpc" not in sys.modules:
        os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)


def main(argv: Sequence[str] | None = None) -> None:
    grpc_without_event_engine()
    structlog_without_rich()
    args = list(sys.argv[1:] if argv is None else argv)
    rebuild = bool(args) and args[0] == "rebuild"
    prog = "pegaflow-meta rebuild" if rebuild else "pegaflow-meta"
    opts = load(META, prog, args[1:] if rebuild else args)
    try:
        opts.check()
    except ValueError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        raise SystemExit(2) from None
    # Imported here: after the EventEngine choice (they load grpc), and once the flags parsed,
    # so --help and a bad flag answer without loading grpc, redis-py and structlog.
    import redis
    from redis.exceptions import RedisClusterException

    from pegaflow.cluster.redis_conn import connect
    from pegaflow.common.logging import configure_logging
    from pegaflow.common.security import Security, SecurityError
    from pegaflow.meta.daemon import MetaServer, StartupError
    from pegaflow.meta.rebuild import RebuildError
    from pegaflow.meta.rebuild import rebuild as do_rebuild

    configure_logging(opts.log_level, opts.log_format)
    try:
        security = Security.from_options(opts)
    except SecurityError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        raise SystemExit(2) from None
    try:
        r = connect(opts.redis_url, opts.redis_cluster)
        r.ping()
    except (redis.RedisError, RedisClusterException, OSError) as exc:
        sys.stderr.write(f"{prog}: error: {unreachable_redis(opts.redis_url, exc)}\n")
        raise SystemExit(1) from None
    except ValueError as exc:  # redis-py's reading of a URL (a port out of range, a bad query option)
        sys.stderr.write(f"{prog}: error: --redis-url {','.join(opts.redis_url)}: {exc}\n")
        raise SystemExit(2) from None
    if rebuild:
        try:
            report = do_rebuild(r)
        except RebuildError as exc:
            sys.stderr.write(f"{prog}: error: {exc}\n")
            raise SystemExit(1) from None
        sys.stdout.write(json.dumps(report.__dict__) + "\n")
        return
    try:
        MetaServer(opts, r, security).run()
    except StartupError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        raise SystemExit(1) from None


def unreachable_redis(urls: Sequence[str], exc: BaseException) -> str:
    """The one-line start-up error for a Redis none of whose seeds answers (each named), with
    how to get one."""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    where = f"Redis at {urls[0]}" if len(urls) == 1 else f"Redis through any of {', '.join(urls)}"
    return (
        f"cannot reach {where} ({detail}); start one (infra/redis/redis-standalone.sh start DIR PORT "
        "in the PegaFlow repository, or redis-server --port PORT) or point --redis-url at yours"
    )


if __name__ == "__main__":
    main()
