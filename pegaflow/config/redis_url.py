"""A ``--redis-url`` seed checked as the option table reads it, so a URL no client can be made
from is one line at the flag, for both daemons alike, instead of a metaserver's traceback and
a node that starts and fails every publish.

redis-py is imported only for a URL with query options (``?socket_timeout=5``): a node
imports it when it first publishes (pegaflow/cluster/seeds.py), and a bad flag answers fast.
"""

from __future__ import annotations

from urllib.parse import urlsplit

SCHEMES = ("redis", "rediss", "unix")


def check_seed(url: str) -> str:
    """``url`` if a Redis client can be made from it; else ValueError with the reason in one
    line. The scheme, a port in 1..65535 (redis-py raises on a port past 65535 only when it
    connects, and reads port 0 as 6379), a socket path for ``unix://``; and the query options,
    by redis-py itself: each must be one its connection takes, with a value it reads (a name
    it does not know failed every connection, a value it cannot read the client's making). A
    host may be left out of one seed (redis-py's localhost), not of several (the option
    table's check of the seeds together)."""
    if not url.startswith(tuple(f"{s}://" for s in SCHEMES)):
        raise ValueError(f"invalid Redis URL {url!r} (expected redis://HOST:PORT[/DB], rediss:// or unix://)")
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"invalid Redis URL {url!r}: unix:// names no socket path")
    else:
        try:
            port = parts.port
        except ValueError:  # past 65535, or not a number
            port = 0
        if port == 0 or (port is None and parts.netloc.rpartition("@")[2].endswith(":")):
            raise ValueError(f"invalid Redis URL {url!r}: the port must be in 1..65535")
    if parts.query:
        import redis

        try:  # the connection redis-py would make, not connected
            redis.ConnectionPool.from_url(url).make_connection()
        except (ValueError, TypeError, redis.RedisError) as exc:
            raise ValueError(f"invalid Redis URL {url!r}: {exc}") from None
    return url
