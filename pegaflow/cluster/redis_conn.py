"""Redis connections and script calls that work the same on standalone Redis and Redis Cluster.

redis-py's cluster pipeline refuses EVALSHA, so script batches are grouped by the shard
that owns their first key and sent as one plain pipeline per shard. :func:`parallel`
sends command groups for different shards before reading any reply, which keeps a
cross-shard lookup (index slot + registry slot) at one network round trip.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

Client = redis.Redis | RedisCluster


def connect(url: str, cluster: bool = False, **kwargs: Any) -> Client:
    """A client for ``url``; with ``cluster`` a cluster client that discovers every shard."""
    kwargs.setdefault("socket_timeout", 5.0)
    kwargs.setdefault("socket_connect_timeout", 2.0)
    if cluster:
        return RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def is_cluster(r: Client) -> bool:
    return isinstance(r, RedisCluster)


@dataclass(eq=False)
class Script:
    """A Lua script addressed by SHA; loaded on a shard the first time that shard lacks it."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def __call__(self, r: Client, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            if is_cluster(r):
                r.get_redis_connection(r.get_node_from_key(keys[0])).script_load(self.source)
            else:
                r.script_load(self.source)
            return r.evalsha(self.sha, len(keys), *keys, *args)


Call = tuple[Script, Sequence[Any], Sequence[Any]]


def _node_client(r: Client, key: Any) -> redis.Redis:
    if is_cluster(r):
        return r.get_redis_connection(r.get_node_from_key(key))
    return r


def run_scripts(r: Client, calls: Sequence[Call]) -> list[Any]:
    """Run script calls, one pipeline per shard, all shards in parallel; results in call order.

    Calls to the same shard execute in the order given. An error reply of one call is
    returned in its slot (as the exception object), never raised, so one bad call cannot
    hide the results of the others. A shard that lacks a script gets it loaded and the
    affected calls re-run.
    """
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, (_s, keys, _a) in enumerate(calls):
        nc = _node_client(r, keys[0])
        groups.setdefault(id(nc), (keys[0], []))[1].append(i)
    batches = [
        (key, [["EVALSHA", calls[i][0].sha, len(calls[i][1]), *calls[i][1], *calls[i][2]] for i in idx])
        for key, idx in groups.values()
    ]
    out: list[Any] = [None] * len(calls)
    for (_key, idx), replies in zip(groups.values(), parallel(r, batches), strict=True):
        for i, v in zip(idx, replies, strict=True):
            out[i] = v
    for i, v in enumerate(out):
        if isinstance(v, NoScriptError) or (isinstance(v, ResponseError) and "MOVED" in str(v)):
            s, keys, args = calls[i]  # Script.__call__ loads the script; the cluster client follows MOVED
            out[i] = s(r, keys, args)
    return out


def parallel_one(r: redis.Redis, cmds: Sequence[Sequence[Any]]) -> list[Any]:
    """Send ``cmds`` on one connection of ``r``, then read every reply (errors as objects)."""
    pool = r.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([tuple(c) for c in cmds]))
        replies: list[Any] = []
        for _ in cmds:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def parallel(r: Client, groups: Sequence[tuple[Any, Sequence[Sequence[Any]]]]) -> list[list[Any]]:
    """Send each group of raw commands to the shard owning its routing key, all before reading.

    ``groups`` is ``[(routing_key, [command args, ...]), ...]``; returns the replies per
    group. Error replies come back as exception objects. Each shard (standalone Redis: the
    one server) gets its own connection, written first, read after.
    """
    # Raw connections, not a redis-py pipeline, on standalone Redis too: the pipeline's
    # per-command bookkeeping was ~150 us of a ~1 ms QueryPrefix here (cProfile).
    if not is_cluster(r):  # one server: every group on one connection, one round trip
        flat = parallel_one(r, [c for _k, cmds in groups for c in cmds])
        out, i = [], 0
        for _k, cmds in groups:
            out.append(flat[i : i + len(cmds)])
            i += len(cmds)
        return out
    conns = []
    try:
        for key, cmds in groups:
            pool = _node_client(r, key).connection_pool
            conn = pool.get_connection()
            conns.append((pool, conn))
            conn.send_packed_command(conn.pack_commands([tuple(c) for c in cmds]))
        out = []
        for (_pool, conn), (_k, cmds) in zip(conns, groups, strict=True):
            replies = []
            for _ in cmds:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            out.append(replies)
        return out
    except BaseException as exc:
        for _pool, conn in conns:
            conn.disconnect()
        if is_cluster(r) and isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            # A shard died or failed over: make the next call re-learn the topology.
            r.nodes_manager.initialize()
        raise
    finally:
        for pool, conn in conns:
            pool.release(conn)
