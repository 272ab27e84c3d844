"""Index updates through plain HSETNX batches (``RawPipe``) leave exactly the index that the
``_APPLY`` script leaves, on a real redis-server and a real Redis Cluster: the same random
sequences of inserts, snapshots and evictions by several nids over a small set of blocks
(so that blocks have several holders and updates collide), applied both ways under two key
prefixes, must dump equal and report the same number of changes. Queries through plain
HGET batches answer what the ``_QUERY`` script answers on the index they build. The census
counted in Redis (``_CENSUS``) equals a count of the holder lists written: holders in both
tiers, dead and live, one to five per block, two namespaces."""

from __future__ import annotations

import math
import os
import random

import pytest
import redis

from pegaflow.cluster import keys
from pegaflow.cluster.redis_conn import RawPipe, connect
from pegaflow.core.tiers import Tier
from pegaflow.meta import index as index_mod
from pegaflow.meta.events.schema import Op, Update
from pegaflow.meta.index import CENSUS_CHUNK, CENSUS_GROUP, Census, Index
from tests.harness.redis import RedisClusterProc, RedisServer
from tests.integration import redis_fixtures

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server
redis_cluster = redis_fixtures.redis_cluster

NAMESPACES = ("paths-a|fp16|bs16|tp1", "paths-b|fp16|bs16|tp1")


def test_redis_py_still_exposes_the_socket_the_raw_paths_read(redis_server: RedisServer) -> None:
    """RawPipe and raw_round_trip read replies straight from the socket redis-py keeps in a
    private attribute (``redis_conn._raw_socket``). Without it they fall back, silently and
    ~2x slower, to the script paths: this fails loudly instead when a redis-py upgrade moves
    it."""
    import socket

    from pegaflow.cluster.redis_conn import _raw_socket, raw_round_trip

    r = connect(redis_server.url)
    pool = r.connection_pool
    conn = pool.get_connection()
    try:
        conn.connect()
        assert isinstance(_raw_socket(conn), socket.socket), (
            f"redis-py {redis.__version__} no longer keeps its socket in Connection._sock: "
            "pegaflow/cluster/redis_conn.py's raw paths need another way to reach it")
    finally:
        pool.release(conn)
    assert RawPipe.supported(r)
    assert raw_round_trip(r, [("k", [("PING",), ("ECHO", "x")], 2)]) == [[b"PONG", b"x"]]


def random_updates(seed: int, n: int = 300) -> list[Update]:
    rng = random.Random(seed)
    universe = [rng.randbytes(16) for _ in range(400)]
    out = []
    for _ in range(n):
        op = rng.choice((Op.INSERT, Op.INSERT, Op.SNAPSHOT, Op.EVICT))
        k = rng.randint(1, 40)
        start = rng.randrange(len(universe) - k)
        blob = b"".join(universe[start : start + k])
        out.append(Update(op, rng.choice(NAMESPACES), rng.randint(1, 4), blob))
    return out


def tags() -> set[str]:
    return {keys.ns_tag(ns) for ns in NAMESPACES}


def check_paths_agree(r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    assert RawPipe.supported(r)
    batches = []
    real = index_mod._hsetnx_batch

    def counting(prefix: bytes, blob: bytes, nid: bytes) -> bytes:
        batches.append(len(blob) // 16)
        return real(prefix, blob, nid)

    monkeypatch.setattr(index_mod, "_hsetnx_batch", counting)
    native, scripted = Index(r), Index(r, keys.REBUILD_PREFIX)
    for seed in range(4):
        native.clear(tags())
        scripted.clear(tags())
        ups = random_updates(seed)
        # All at once (runs of adds and evictions alternate), then in small slices as a
        # consumer's steps would hand them over.
        got = native.apply_many(ups[:150])
        for i in range(150, len(ups), 7):
            got += native.apply_many(ups[i : i + 7])
        want = scripted.apply_many(ups, native=False)
        assert got == want
        assert native.dump(tags()) == scripted.dump(tags())
    assert sum(batches) > 1000  # the HSETNX path really ran


def test_native_and_scripted_updates_and_queries_agree_on_redis(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_paths_agree(connect(redis_server.url), monkeypatch)
    check_queries_agree(connect(redis_server.url), monkeypatch)


def test_native_and_scripted_updates_and_queries_agree_on_a_cluster(
    redis_cluster: RedisClusterProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_cluster.flush()
    check_paths_agree(connect(redis_cluster.url, cluster=True), monkeypatch)
    check_queries_agree(connect(redis_cluster.url, cluster=True), monkeypatch)


def test_an_evict_after_a_colliding_insert_is_not_undone(redis_server: RedisServer) -> None:
    """nid 2 inserts a block nid 1 holds (its HSETNX finds the field: a merge) and evicts it
    in the same batch of updates: the merge must land before the eviction, not after."""
    r = connect(redis_server.url)
    ix = Index(r)
    ix.clear(tags())
    hs = [os.urandom(16) for _ in range(64)]
    ns = NAMESPACES[0]
    ix.apply(Op.INSERT, ns, 1, hs)
    changed = ix.apply_many([Update(Op.INSERT, ns, 2, b"".join(hs)), Update(Op.EVICT, ns, 2, b"".join(hs[:32]))])
    assert changed == 64 + 32
    holders = ix.holders(ns, hs)
    assert all(h == {1} for h in holders[:32]) and all(h == {1, 2} for h in holders[32:])


def test_a_pipe_whose_connection_is_killed_raises_and_the_client_recovers(redis_server: RedisServer) -> None:
    r = connect(redis_server.url)
    prefix = keys.bucket_prefix(keys.ns_tag(NAMESPACES[0]))
    pipe = RawPipe(r, keys.anchor_key(keys.ns_tag(NAMESPACES[0])))
    other = redis.Redis.from_url(redis_server.url)
    other.client_kill_filter(skipme=True)  # every connection but this one: the pipe's too
    with pytest.raises(redis.ConnectionError):
        pipe.send("t", index_mod._hsetnx_batch(prefix, os.urandom(16 * 4), b"\0\0\0\1"), 4)
        pipe.drain()
    pipe.close()
    assert r.ping()  # the pool reconnects; nothing is left half-read on a pooled connection
    with RawPipe(r, keys.anchor_key(keys.ns_tag(NAMESPACES[0]))) as p:
        p.send("t", index_mod._hsetnx_batch(prefix, os.urandom(16 * 4), b"\0\0\0\1"), 4)
        assert p.drain() == [("t", [1, 1, 1, 1])]


def check_queries_agree(r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """QueryPrefix through plain HGET batches answers what the ``_QUERY`` script answers: an
    index built from the random updates (blocks with one to four holders, holders that
    drop out along a prefix, holes), queried with prefixes of the blocks it holds and of
    blocks it does not."""
    batches = []
    real = index_mod._hget_batch

    def counting(prefix: bytes, blob: bytes) -> bytes:
        batches.append(len(blob) // 16)
        return real(prefix, blob)

    monkeypatch.setattr(index_mod, "_hget_batch", counting)
    ix = Index(r)
    ix.ensure_scripts()
    for seed in range(4):
        ix.clear(tags())
        rng = random.Random(100 + seed)
        ups = random_updates(seed)
        ix.apply_many(ups)
        several = 0
        for u in ups[:120]:
            hs = [u.blob[i : i + 16] for i in range(0, len(u.blob), 16)]
            start = rng.randrange(len(hs))
            for q in (hs, hs[start:], hs[:start] + [rng.randbytes(16)] + hs[start:], [rng.randbytes(16), *hs]):
                got = ix.query(u.namespace, q, script=False)
                assert got == ix.query(u.namespace, q, script=True), (seed, u)
                several += len(set(got.values())) > 1
        assert several > 20  # holders that drop out along a prefix were compared, not only runs of one
    assert sum(batches) > 10_000  # the HGET path really ran


def test_a_query_that_times_out_leaves_no_late_reply_for_the_next_one(redis_server: RedisServer) -> None:
    """Redis stops answering (CLIENT PAUSE): the lookup raises TimeoutError, and the replies
    that arrive after it never reach a later query (the connection was dropped, not pooled)."""
    from pegaflow.meta.lookup import Lookup

    r = connect(redis_server.url, socket_timeout=0.3)
    ix = Index(r)
    ix.clear(tags())
    a, b = [os.urandom(16) for _ in range(32)], [os.urandom(16) for _ in range(8)]
    ix.apply(Op.INSERT, NAMESPACES[0], 1, a)
    ix.apply(Op.INSERT, NAMESPACES[0], 2, b)
    lk = Lookup(r)
    assert lk.query_prefix(NAMESPACES[0], a) == []  # nid 1 is not a live node: nothing visible
    redis.Redis.from_url(redis_server.url).execute_command("CLIENT", "PAUSE", "1000", "ALL")
    with pytest.raises(redis.TimeoutError):
        ix.query(NAMESPACES[0], a, script=False)
    redis.Redis.from_url(redis_server.url).execute_command("CLIENT", "UNPAUSE")
    assert ix.query(NAMESPACES[0], b, script=False) == {2: 8}
    assert ix.query(NAMESPACES[0], a, script=False) == {1: 32}


# ---- the census ----------------------------------------------------------------------------

CENSUS_NAMESPACES = ("census-a|fp16", "census-b|bf16")
TAGS = [keys.ns_tag(ns) for ns in CENSUS_NAMESPACES]  # what the census is given: the namespaces' tags
NIDS = (3, 5, 8, 13, 21)
LIVE = {3, 8, 13, 21}


def census_fill(index: Index) -> dict[tuple[str, bytes], dict[int, Tier]]:
    """Blocks with 1-5 holders each, some on SSD only; returns what was written."""
    rng = random.Random(7)
    truth: dict[tuple[str, bytes], dict[int, Tier]] = {}
    for ns in CENSUS_NAMESPACES:
        blocks = [rng.randbytes(16) for _ in range(3000)]
        for nid in NIDS:
            held = [b for b in blocks if rng.random() < 0.45]
            for tier in (Tier.L1, Tier.SSD):
                part = [b for b in held if (rng.random() < 0.3) == (tier == Tier.SSD)]
                if part:
                    index.apply(Op.INSERT, ns, nid, part, tier)
                    for b in part:
                        truth.setdefault((ns, b), {})[nid] = tier
    return truth


def census_expected(truth: dict[tuple[str, bytes], dict[int, Tier]]) -> Census:
    red = [0, 0, 0, 0]
    copies = 0
    for holders in truth.values():
        n = sum(1 for nid in holders if nid in LIVE)
        if n:
            copies += n
            red[min(n, 4) - 1] += 1
    r1, r2, r3, r4 = red
    return Census(len(truth), sum(map(len, truth.values())), (r1, r2, r3, r4), copies)


def test_the_census_counts_every_holder_list_on_redis(redis_server: RedisServer) -> None:
    index = Index(redis_server.client())
    want = census_expected(census_fill(index))
    assert want.redundancy[3] > 0 and want.owners > want.entries  # every case is there
    assert index.census(TAGS, LIVE) == want
    assert index.census(TAGS, set()) == Census(want.entries, want.owners, (0, 0, 0, 0), 0)


def test_a_paced_census_pauses_after_every_round_trip_and_counts_the_same(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon paces its census (metrics.run_census): a pause after every CENSUS_SCAN keys the
    SCAN returned and every round trip of CENSUS_GROUP script calls, each told how long its
    step took."""
    monkeypatch.setattr(index_mod, "CENSUS_SCAN", 64)  # several SCAN steps at this size
    r = redis_server.client()
    index = Index(r)
    want = census_expected(census_fill(index))
    steps: list[float] = []
    assert index.census(TAGS, LIVE, steps.append) == want
    buckets = [len(set(r.scan_iter(match=keys.bucket_prefix(t, index.prefix) + b"*"))) for t in TAGS]
    trips = sum(math.ceil(math.ceil(b / CENSUS_CHUNK) / CENSUS_GROUP) for b in buckets)
    pages = sum(b // 64 for b in buckets)  # a pause every CENSUS_SCAN keys SCAN returned
    assert trips > len(TAGS) and pages > len(TAGS) and len(steps) == trips + pages, (buckets, len(steps))
    assert all(s > 0 for s in steps)


def test_the_census_counts_every_holder_list_on_a_redis_cluster(redis_cluster: RedisClusterProc) -> None:
    redis_cluster.flush()
    index = Index(redis_cluster.client())
    want = census_expected(census_fill(index))
    assert index.census(TAGS, LIVE) == want
