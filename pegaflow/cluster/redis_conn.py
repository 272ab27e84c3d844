"""Redis connections and script calls that work the same on standalone Redis and Redis Cluster.

redis-py's cluster pipeline refuses EVALSHA, so script batches are grouped by the shard
that owns their first key and sent as one plain pipeline per shard. :func:`parallel`
sends command groups for different shards before reading any reply, which keeps a
cross-shard lookup (index slot + registry slot) at one network round trip.
:class:`RawPipe` streams commands the caller packed itself to one shard, for bulk writes
(the metaserver's index updates); :func:`raw_round_trip` sends packed command groups to
their shards and reads the replies in C, for lookups.
"""

from __future__ import annotations

import hashlib
import socket
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import hiredis
import redis
import structlog
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, SSLConnection, parse_url
from redis.exceptions import NoScriptError, RedisClusterException, ResponseError
from redis.typing import EncodableT, KeyT

from pegaflow.cluster.seeds import seed_urls

log = structlog.get_logger("pegaflow.redis")

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Client = redis.Redis | RedisCluster
# Replies are bytes: no client here sets decode_responses (connect() never does). redis-py
# types them ``bytes | str``, so the code that reads them casts to bytes.

Reply = Any  # a RESP reply (bytes, int, None, list, error value): redis-py and hiredis type it Any
Command = Sequence[EncodableT]  # one command's arguments, its name first: ("HGET", key, field)
Tag = TypeVar("Tag")


def error_text(exc: BaseException) -> str:
    """A Redis failure for a log line: its class and message on one line (redis-py 8's
    ``repr`` of its errors drops the message, which names the seeds tried)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": ")


def _host_port(url: str) -> tuple[str, int]:
    opts = parse_url(url)
    return str(opts.get("host", "localhost")), int(opts.get("port", 6379))


def _named(seeds: Sequence[str]) -> str:
    return ", ".join(f"{h}:{p}" for h, p in map(_host_port, seeds))


class _TrySeeds:
    """A redis-py connection to the first of ``seeds`` (HOST, PORT) that accepts it, tried in
    order each time the connection is made: at the first command and after it broke.

    The URL's other settings (credentials, db, TLS) are the connection's own; the option
    table makes every seed agree on them. When none accepts, the error names every seed
    with its reason (redis-py raises it as ``redis.ConnectionError``)."""

    host: str
    port: int

    def __init__(self, *args: Any, seeds: Sequence[tuple[str, int]] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seeds = tuple(seeds)

    def _connect(self) -> socket.socket:
        failed = []
        for host, port in self.seeds:
            self.host, self.port = host, port
            try:
                sock: socket.socket = super()._connect()  # type: ignore[misc]  # Connection's, after this mixin
                return sock
            except OSError as exc:
                failed.append(f"{host}:{port}: {' '.join(str(exc).split()) or type(exc).__name__}")
        self.host, self.port = self.seeds[0]
        raise OSError("; ".join(failed))

    def _host_error(self) -> str:
        return f"Redis (seeds tried in order: {', '.join(f'{h}:{p}' for h, p in self.seeds)})"


class _SeedsConnection(_TrySeeds, Connection):
    pass


class _SeedsSSLConnection(_TrySeeds, SSLConnection):
    pass


def connect(url: str | Sequence[str], cluster: bool = False, **kwargs: Any) -> Client:  # kwargs: redis-py's
    """A client for the Redis ``url`` names: one URL, or seeds (a sequence, or a comma-separated
    string), tried in order (standalone: whenever a connection is made; with ``cluster``: to
    discover every shard, which the cluster client then talks to directly).

    A cluster none of whose seeds answers raises ``redis.ConnectionError`` naming them (redis-py
    raises ``RedisClusterException``, which is not a ``RedisError``); standalone clients connect
    at their first command, and raise it then."""
    seeds = seed_urls(url)
    if not seeds:
        raise ValueError("no Redis URL")
    kwargs.setdefault("socket_timeout", 5.0)
    kwargs.setdefault("socket_connect_timeout", 2.0)
    if cluster:
        try:
            return RedisCluster.from_url(seeds[0], startup_nodes=[ClusterNode(*_host_port(u)) for u in seeds],
                                         **kwargs)
        except RedisClusterException as exc:
            detail = " ".join(str(exc).split())
            raise redis.ConnectionError(f"no seed of the Redis Cluster answered ({_named(seeds)}): {detail}") from None
    if len(seeds) == 1:
        return redis.Redis.from_url(seeds[0], **kwargs)
    tls = seeds[0].startswith("rediss://")
    pool = redis.ConnectionPool.from_url(seeds[0], connection_class=_SeedsSSLConnection if tls else _SeedsConnection,
                                         seeds=[_host_port(u) for u in seeds], **kwargs)
    return redis.Redis(connection_pool=pool)


def is_cluster(r: Client) -> TypeIs[RedisCluster]:
    return isinstance(r, RedisCluster)


def relearn(r: Client) -> None:
    """Make a cluster client re-learn which node owns which slots (after MOVED, a dead shard,
    a failover). Mid-failover that fails too (``RedisClusterException``, which is no
    ``RedisError``): then the next call tries again, and the caller's own error stands."""
    if not is_cluster(r):
        return
    try:
        r.nodes_manager.initialize()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.info("redis_cluster_relearn_failed", error=error_text(exc))


@dataclass(eq=False)
class Script:
    """A Lua script addressed by SHA; loaded on a shard the first time that shard lacks it."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def __call__(self, r: Client, keys: Sequence[KeyT], args: Sequence[EncodableT]) -> Reply:
        try:
            return r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            if is_cluster(r):
                r.get_redis_connection(r.get_node_from_key(keys[0])).script_load(self.source)
            else:
                r.script_load(self.source)
            return r.evalsha(self.sha, len(keys), *keys, *args)


Call = tuple[Script, Sequence[KeyT], Sequence[EncodableT]]


# A key held as a lease names its holder: renewed or released by that holder only, in one
# step (GET then PEXPIRE or DEL apart could act on a lease another took meanwhile).
RENEW_IF_HELD = Script(
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
)
RELEASE_IF_HELD = Script("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0")


@contextmanager
def held(r: Client, key: KeyT, owner: str, ms: int) -> Iterator[bool]:
    """Take the lease ``key`` for ``owner`` for ``ms`` if nobody holds it; yields whether it
    was taken, and gives it back at the end only while ``owner`` still holds it (a pass that
    outlived its lease never drops the lease another replica took meanwhile)."""
    if not r.set(key, owner, nx=True, px=ms):
        yield False
        return
    try:
        yield True
    finally:
        RELEASE_IF_HELD(r, [key], [owner])


def _node_client(r: Client, key: KeyT) -> redis.Redis:
    if is_cluster(r):
        return r.get_redis_connection(r.get_node_from_key(key))
    return r


def run_scripts(r: Client, calls: Sequence[Call]) -> list[Reply]:
    """Run script calls, one pipeline per shard, all shards in parallel; results in call order.

    Calls to the same shard execute in the order given. An error reply of one call is
    returned in its slot (as the exception object), never raised, so one bad call cannot
    hide the results of the others. A shard that lacks a script gets it loaded and the
    affected calls re-run.
    """
    groups: dict[int, tuple[KeyT, list[int]]] = {}
    for i, (_s, keys, _a) in enumerate(calls):
        nc = _node_client(r, keys[0])
        groups.setdefault(id(nc), (keys[0], []))[1].append(i)
    batches = [
        (key, [["EVALSHA", calls[i][0].sha, len(calls[i][1]), *calls[i][1], *calls[i][2]] for i in idx])
        for key, idx in groups.values()
    ]
    out: list[Reply] = [None] * len(calls)
    for (_key, idx), replies in zip(groups.values(), parallel(r, batches), strict=True):
        for i, v in zip(idx, replies, strict=True):
            out[i] = v
    for i, v in enumerate(out):
        if isinstance(v, NoScriptError) or (isinstance(v, ResponseError) and "MOVED" in str(v)):
            s, keys, args = calls[i]  # Script.__call__ loads the script; the cluster client follows MOVED
            out[i] = s(r, keys, args)
    return out


def parallel_one(r: redis.Redis, cmds: Sequence[Command]) -> list[Reply]:
    """Send ``cmds`` on one connection of ``r``, then read every reply (errors as objects)."""
    pool = r.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([tuple(c) for c in cmds]))
        replies: list[Reply] = []
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


def parallel(r: Client, groups: Sequence[tuple[KeyT, Sequence[Command]]]) -> list[list[Reply]]:
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
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            relearn(r)  # a shard died or failed over: the next call re-learns the topology
        raise
    finally:
        for pool, conn in conns:
            pool.release(conn)


RAW_READ_BYTES = 1 << 16  # one recv of replies
_MORE = object()  # what hiredis's reader returns while no complete reply is buffered


class RawPipe(Generic[Tag]):
    """Batches of RESP commands packed by the caller, streamed to the shard owning ``key``
    on one connection of its pool, with up to ``depth`` batches in flight: the next batch
    is on the wire while Redis works through the previous one.

    Why not a redis-py pipeline: its per-command packing and reply reading cost ~2 and
    ~1.5 us here, as much as Redis spends on a small command (~1.5-2.4 us an HSETNX),
    so the client, not Redis, set the rate of bulk index updates. Here a batch is one
    ``sendall`` and its replies are parsed by hiredis's reader in C, all those of one
    ``recv`` in one call (a Python loop over ``gets()`` was ~1.2 us a reply).
    It needs a real socket: :meth:`supported` is False for clients without one (fakeredis),
    and callers then use redis-py's paths.

    Replies come back per batch, in send order, with error replies as
    ``hiredis.ReplyError`` values (never raised). A socket error or timeout closes the
    connection and raises ``redis.ConnectionError`` / ``redis.TimeoutError``: every batch
    in flight is then lost to the caller, who retries as for any Redis failure.
    """

    def __init__(self, r: Client, key: KeyT, depth: int = 2) -> None:
        self._pool = _node_client(r, key).connection_pool
        self._conn: Connection | None = self._pool.get_connection()
        sock = _raw_socket(self._conn)
        if sock is None:
            self._pool.release(self._conn)
            raise TypeError("RawPipe needs a client on a real socket (see RawPipe.supported)")
        self._sock = sock
        self._reader = hiredis.Reader(notEnoughData=_MORE)
        self._buf = bytearray(RAW_READ_BYTES)
        self._inflight: deque[tuple[Tag, int]] = deque()  # (tag, replies) sent, not yet read
        self._early: list[Reply] = []  # replies read that belong to the next batch in flight
        self._depth = max(1, depth)

    @staticmethod
    def supported(r: Client) -> bool:
        pool = _node_client(r, "probe").connection_pool if is_cluster(r) else r.connection_pool
        conn = pool.get_connection()
        try:
            return _raw_socket(conn) is not None
        finally:
            pool.release(conn)

    def send(self, tag: Tag, data: bytes, replies: int) -> list[tuple[Tag, list[Reply]]]:
        """Send one batch of ``replies`` commands; returns the batches completed meanwhile
        as (tag, replies), oldest first (at most ``depth`` stay in flight)."""
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self._fail(exc)
        self._inflight.append((tag, replies))
        done = []
        while len(self._inflight) > self._depth:
            done.append(self._read_oldest())
        return done

    def drain(self) -> list[tuple[Tag, list[Reply]]]:
        """Every batch still in flight, read; the pipe stays usable."""
        return [self._read_oldest() for _ in range(len(self._inflight))]

    def close(self) -> None:
        """Give the connection back (drained first: a connection with replies pending
        would hand them to its next user)."""
        if self._conn is None:
            return
        try:
            self.drain()
        finally:
            if self._conn is not None:
                self._pool.release(self._conn)
                self._conn = None

    def __enter__(self) -> RawPipe[Tag]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_oldest(self) -> tuple[Tag, list[Reply]]:
        tag, n = self._inflight.popleft()
        out: list[Reply] = self._early
        self._early = []
        try:
            _read_replies(self._sock, self._reader, self._buf, n, out)
        except (OSError, hiredis.ProtocolError) as exc:
            self._fail(exc)
        if len(out) > n:  # replies of the next batch came in the same read
            self._early = out[n:]
            del out[n:]
        return tag, out

    def _fail(self, exc: BaseException) -> None:
        conn, self._conn = self._conn, None
        self._inflight.clear()
        if conn is not None:
            conn.disconnect()
            self._pool.release(conn)
        if isinstance(exc, TimeoutError):
            raise redis.TimeoutError(f"Redis did not answer: {exc}") from exc
        raise redis.ConnectionError(f"Redis connection lost: {exc}") from exc


def _raw_socket(conn: object) -> socket.socket | None:
    """The connected socket under a redis-py connection, or None (not a real socket).

    redis-py keeps it in the private ``_sock`` once connected; the raw paths depend on that
    and nothing else of its internals. tests/integration/test_meta_apply_paths.py fails
    loudly if a redis-py upgrade moves it (the raw paths would then quietly fall back to
    the slower script paths)."""
    sock = getattr(conn, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _read_replies(sock: socket.socket, reader: hiredis.Reader, buf: bytearray, want: int, out: list[Reply]) -> None:
    """Read from ``sock`` until ``out`` holds at least ``want`` replies: every complete reply
    of each ``recv`` is parsed by hiredis in C and appended (a Python loop over ``gets()``
    was ~1.2 us a reply). More than ``want`` may arrive (replies of a later batch); the
    caller keeps them. ``OSError``/``hiredis.ProtocolError`` on a broken connection."""
    while len(out) < want:
        got = sock.recv_into(buf)
        if got == 0:
            raise ConnectionResetError("Redis closed the connection")
        reader.feed(buf, 0, got)  # type: ignore[arg-type]  # hiredis's .pyi says str | bytes; its C takes any buffer
        out.extend(iter(reader.gets, _MORE))


RawGroup = tuple[KeyT, bytes | Sequence[Command], int]


def raw_round_trip(r: Client, groups: Sequence[RawGroup]) -> list[list[Reply]] | None:
    """Send each group ``(routing key, commands, number of commands)`` to the shard that
    owns its key, every shard written before any is read (one round trip, as
    :func:`parallel`); the commands are RESP the caller packed (bulk lookups) or command
    argument lists, packed by redis-py. Returns the replies per group, parsed by hiredis in
    C, error replies as ``hiredis.ReplyError`` values. Groups of one shard share its
    connection, in order. ``None`` when the client has no real socket (fakeredis): use
    :func:`parallel`.

    Why: reading a reply through redis-py costs ~1.5 us of Python, so a lookup of 128
    blocks as plain commands (~0.4 us each in Redis, against ~2.6 us as ``redis.call`` in
    a script) only pays off with the replies read in bulk (see ``pegaflow/meta/index.py``).
    A socket error or timeout closes the connections and raises ``redis.ConnectionError``
    / ``redis.TimeoutError``.
    """
    # id(pool) -> (pool, conn, its socket, group indexes)
    shards: dict[int, tuple[redis.ConnectionPool, Connection, socket.socket, list[int]]] = {}
    try:
        for i, (key, _data, _n) in enumerate(groups):
            pool = _node_client(r, key).connection_pool
            got = shards.get(id(pool))
            if got is None:
                conn = pool.get_connection()
                sock = _raw_socket(conn)
                if sock is None:
                    pool.release(conn)
                    return None
                got = shards[id(pool)] = (pool, conn, sock, [])
            got[3].append(i)
        for _pool, conn, sock, idx in shards.values():
            data = []
            for i in idx:
                cmds = groups[i][1]
                data.append(cmds if isinstance(cmds, bytes) else b"".join(conn.pack_commands([tuple(c) for c in cmds])))
            sock.sendall(b"".join(data))
        out: list[list[Reply]] = [[] for _ in groups]
        buf = bytearray(RAW_READ_BYTES)
        for _pool, _conn, sock, idx in shards.values():
            got_replies: list[Reply] = []
            _read_replies(sock, hiredis.Reader(notEnoughData=_MORE), buf, sum(groups[i][2] for i in idx), got_replies)
            pos = 0
            for i in idx:
                out[i] = got_replies[pos : pos + groups[i][2]]
                pos += groups[i][2]
        return out
    except (OSError, hiredis.ProtocolError) as exc:
        for _pool, conn, _sock, _idx in shards.values():
            conn.disconnect()
        relearn(r)  # a shard died or failed over: re-learn the topology
        if isinstance(exc, TimeoutError):
            raise redis.TimeoutError(f"Redis did not answer: {exc}") from exc
        raise redis.ConnectionError(f"Redis connection lost: {exc}") from exc
    finally:
        for pool, conn, _sock, _idx in shards.values():
            pool.release(conn)


def checked(replies: list[Reply]) -> list[Reply]:
    """``replies`` of :func:`raw_round_trip`, or the first error reply raised as redis-py
    would (``MOVED``/``ASK`` after re-learning the cluster's topology is the caller's retry)."""
    for v in replies:
        if isinstance(v, hiredis.ReplyError):
            raise ResponseError(str(v))
    return replies
