"""Holder tiers in the Redis index, on a real redis-server: adds set a holder's tier (an
SSD add over an L1 entry is a tier change, and back), EVICT removes a holder whatever its
tier, the sweeper removes SSD entries of dead nids, the HSETNX path equals the _APPLY
script on random tiered sequences, the HGET batch and the _QUERY script answer the same
tiers, and a publisher -> consumer -> Lookup chain answers QueryPrefix with the tier."""

from __future__ import annotations

import random

import pytest

from pegaflow.cluster.keys import ns_tag
from pegaflow.cluster.redis_conn import connect
from pegaflow.core.tiers import LOCAL_TIERS, Tier
from pegaflow.meta.events.consumer import Consumer
from pegaflow.meta.events.schema import Op, Update
from pegaflow.meta.index import Held, Index
from pegaflow.meta.lookup import Lookup
from pegaflow.node.publishing import EventPublisher
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server

NS = "tiers|fp16|bs16|tp1"
H = [random.Random(i).randbytes(16) for i in range(64)]


def test_adds_set_the_tier_and_evict_removes_any_tier(redis_server: RedisServer) -> None:
    r = connect(redis_server.url)
    ix = Index(r)
    ix.ensure_scripts()
    for native in (True, False):
        ix.clear([ns_tag(NS)])
        assert ix.apply_many([Update(Op.INSERT, NS, 1, b"".join(H[:4]))], native=native) == 4
        assert ix.apply_many([Update(Op.INSERT, NS, 2, b"".join(H[:4]), Tier.SSD)], native=native) == 4
        # nid 1's first two blocks leave its DRAM for its SSD: a tier change of the same entry
        assert ix.apply_many([Update(Op.INSERT, NS, 1, b"".join(H[:2]), Tier.SSD)], native=native) == 2
        assert ix.apply_many([Update(Op.INSERT, NS, 1, b"".join(H[:2]), Tier.SSD)], native=native) == 0
        assert ix.holder_tiers(NS, H[:4]) == [{1: Tier.SSD, 2: Tier.SSD}] * 2 + [{1: Tier.L1, 2: Tier.SSD}] * 2
        assert ix.holders(NS, H[:1]) == [frozenset({1, 2})]
        for script in (False, True):
            assert ix.query_tiers(NS, H[:6], script=script) == {1: Held(4, 2), 2: Held(4, 4)}
            assert ix.query(NS, H[:6], script=script) == {1: 4, 2: 4}
        # promoted back into DRAM
        assert ix.apply_many([Update(Op.INSERT, NS, 1, H[0])], native=native) == 1
        assert ix.holder_tiers(NS, H[:1]) == [{1: Tier.L1, 2: Tier.SSD}]
        # EVICT of an SSD entry (nid 2) and of a mixed holder (nid 1)
        assert ix.apply_many([Update(Op.EVICT, NS, 2, b"".join(H[:4])),
                              Update(Op.EVICT, NS, 1, b"".join(H[1:3]))], native=native) == 6
        assert ix.holder_tiers(NS, H[:4]) == [{1: Tier.L1}, {}, {}, {1: Tier.L1}]


def test_sweep_removes_a_dead_nids_ssd_entries(redis_server: RedisServer) -> None:
    r = connect(redis_server.url)
    ix = Index(r)
    ix.ensure_scripts()
    ix.apply(Op.INSERT, NS, 7, H[:3], Tier.SSD)
    ix.apply(Op.INSERT, NS, 8, H[:3])
    assert ix.sweep([ns_tag(NS)], [7]) == 3
    assert ix.holder_tiers(NS, H[:3]) == [{8: Tier.L1}] * 3


def test_native_and_script_paths_agree_on_random_tiered_sequences(redis_server: RedisServer) -> None:
    r = connect(redis_server.url)
    rng = random.Random(3)
    a, b = Index(r, "pf:x:"), Index(r, "pf:y:")
    a.ensure_scripts()
    pool = H[:24]
    for _ in range(20):
        ups = []
        for _ in range(rng.randint(1, 30)):
            op = rng.choice([Op.INSERT, Op.SNAPSHOT, Op.EVICT])
            hs = rng.sample(pool, rng.randint(1, 6))
            tier = rng.choice(LOCAL_TIERS) if op != Op.EVICT else Tier.L1
            ups.append(Update(op, NS, rng.randint(1, 4), b"".join(hs), tier))
        assert a.apply_many(ups, native=True) == b.apply_many(ups, native=False)
        assert a.holder_tiers(NS, pool) == b.holder_tiers(NS, pool)
        for k in range(0, 24, 6):
            q = pool[k:]
            assert a.query_tiers(NS, q, script=False) == b.query_tiers(NS, q, script=True)


def test_query_prefix_answers_the_tier_a_publisher_published(redis_server: RedisServer) -> None:
    r = connect(redis_server.url)
    l1, ssd = H[:4], H[4:8]
    pub = EventPublisher(r, "tn", "h:1", lambda: [(NS, l1), (NS, ssd, Tier.SSD)], flush_interval=0.01)
    pub.start(wait=5)
    c = Consumer(r, Index(r), "c")
    try:
        assert c.wait_caught_up(10)
        lk = Lookup(r)
        (p,) = lk.query_prefix(NS, H[:8])
        assert (p.node, p.prefix_len, p.ssd_blocks, p.tier) == ("tn", 8, 4, Tier.SSD)
        # a DRAM eviction of blocks on SSD publishes a tier change: still held
        pub.on_tier(NS, l1[2:], Tier.SSD)
        pub.on_evict(NS, ssd[2:])
        assert pub.wait_idle(5)

        def answer() -> tuple:
            c.step()
            got = lk.query_prefix(NS, H[:8])
            return tuple((x.prefix_len, x.ssd_blocks) for x in got)

        wait_until(lambda: answer() == ((6, 4),), 10, "tier change and SSD eviction applied")
    finally:
        pub.stop()


def test_rebuild_keeps_the_tiers_of_the_streams(redis_server: RedisServer) -> None:
    from pegaflow.meta.rebuild import rebuild

    r = connect(redis_server.url)
    ns2 = "tiers-rebuild|fp16|bs16|tp1"
    l1, ssd = H[10:14], H[14:18]
    pub = EventPublisher(r, "rb", "h:2", lambda: [(ns2, l1), (ns2, ssd, Tier.SSD)], flush_interval=0.01)
    pub.start(wait=5)
    c = Consumer(r, Index(r), "c-rb")
    try:
        pub.on_tier(ns2, l1[:1], Tier.SSD)  # a later tier change, after the snapshot
        assert pub.wait_idle(5)
        assert c.wait_caught_up(10)
        live = Index(r).holder_tiers(ns2, l1 + ssd)
        assert [next(iter(x.values())) for x in live] == [Tier.SSD] + [Tier.L1] * 3 + [Tier.SSD] * 4
        Index(r).clear([ns_tag(ns2)])  # damage: the rebuild must bring the tiers back
        c.release_all()  # as a stopped replica does: the rebuild waits for no lease
        rebuild(r, wait_leases=5)
        assert Index(r).holder_tiers(ns2, l1 + ssd) == live
    finally:
        pub.stop()
