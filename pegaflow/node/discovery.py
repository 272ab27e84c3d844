"""How a node finds the Redis it publishes its block events to.

``--redis-url`` names it. A node started the original's way, with only
``--metaserver-addr``, asks the metaserver (``GetClusterConfig``) for the Redis the
metaserver consumes from, so ``pegaflow-server --metaserver-addr http://HOST:50056`` joins
the cluster: it pulls what it misses *and* is published for others to pull from.

The metaserver reports its Redis as it was configured (several seeds comma-separated, tried
in order here as there). A loopback or wildcard host there
(``redis://127.0.0.1:6379/0``, the metaserver's default) means "the metaserver's host", so it
is replaced by the host this node dialed the metaserver at.

Until the metaserver answers, the node serves local hits and pulls nothing new from the
index it cannot reach; :func:`discover` retries with capped exponential backoff (tenacity),
forever, logging the first failure and the recovery once each.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import grpc
import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.cluster.seeds import seed_urls
from pegaflow.common.security import Security, aio_channel
from pegaflow.core.hosts import LOOPBACK, WILDCARD, bracketed, host_of

log = structlog.get_logger("pegaflow.node.discovery")

ASK_TIMEOUT = 2.0  # seconds per GetClusterConfig call
RETRY_MAX = 10.0  # seconds between attempts at most while the metaserver is unreachable
LOCAL_HOSTS = LOOPBACK | WILDCARD


@dataclass(frozen=True)
class RedisTarget:
    urls: tuple[str, ...]  # the seeds, in the metaserver's order
    cluster: bool


def as_seen_from(url: str, metaserver_addr: str) -> str:
    """``url`` with a loopback/wildcard host replaced by the metaserver's host."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or (parts.hostname or "") not in LOCAL_HOSTS:
        return url
    host = host_of(metaserver_addr)
    if host in LOCAL_HOSTS:
        return url
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + bracketed(host) + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


async def ask(metaserver_addr: str, sec: Security, timeout: float = ASK_TIMEOUT) -> RedisTarget:
    """One GetClusterConfig call; raises ``grpc.aio.AioRpcError`` (or ValueError: no Redis)."""
    async with aio_channel(metaserver_addr, sec) as ch:
        res = await meta_pb2_grpc.MetaServiceStub(ch).GetClusterConfig(
            meta_pb2.ClusterConfigRequest(), timeout=timeout
        )
    seeds = seed_urls(res.redis_url)  # several seeds come comma-separated
    if not seeds:
        raise ValueError(f"the metaserver at {metaserver_addr} reports no Redis")
    return RedisTarget(tuple(as_seen_from(u, metaserver_addr) for u in seeds), res.redis_cluster)


async def discover(metaserver_addr: str, sec: Security, retry_max: float = RETRY_MAX) -> RedisTarget:
    """The metaserver's Redis, asking until it answers (cancel the task to stop)."""
    failures = 0
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type((grpc.aio.AioRpcError, ValueError)),
        wait=wait_exponential(multiplier=0.25, max=retry_max),
        reraise=True,
    ):
        with attempt:
            try:
                target = await ask(metaserver_addr, sec)
            except (grpc.aio.AioRpcError, ValueError) as exc:
                if failures == 0:
                    detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    log.warning("metaserver_unreachable", addr=metaserver_addr, error=detail,
                                detail="not published to the global index until it answers; retrying")
                failures += 1
                raise
    if failures:
        log.info("metaserver_reachable", addr=metaserver_addr, attempts=failures + 1)
    return target


def redacted(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
