"""Replacement classes by owner count: the rule (pegaflow/policy/classes.py) and the index's
scripts that apply it inside Redis (pegaflow/meta/index.py), on fakeredis (Lua via lupa).

The scripts' notices are held to the rule run on a model of the holder lists, over random
adds, evictions, tier changes, sweeps and liveness changes of several nodes."""

from __future__ import annotations

import random

import fakeredis
import pytest

from pegaflow.cluster import keys, notices
from pegaflow.core.tiers import Tier
from pegaflow.meta.events.schema import Op, Update
from pegaflow.meta.index import Index
from pegaflow.meta.owners import recount_once, uncounted
from pegaflow.policy.classes import class_notices

NS = "ns-owners"
TAG = keys.ns_tag(NS)


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    pytest.importorskip("lupa", reason="fakeredis runs Lua scripts only with lupa (pip install 'fakeredis[lua]')")
    return fakeredis.FakeRedis()


def h(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8  # 16 bytes; several per bucket


# ---- the rule ---------------------------------------------------------------------------


def test_the_holder_that_makes_the_threshold_demotes_every_holder():
    assert class_notices(2, [1, 2, 3], [3], 3) == ([1, 2, 3], [])


def test_a_holder_joining_past_the_threshold_demotes_only_itself():
    assert class_notices(3, [1, 2, 3, 4], [4], 3) == ([4], [])


def test_falling_below_the_threshold_restores_every_holder_left():
    assert class_notices(3, [1, 3], [], 3) == ([], [1, 3])


def test_the_last_holder_of_a_shared_block_is_restored():
    assert class_notices(2, [7], [], 3) == ([], [7])  # e.g. a pulled copy whose source evicted it


def test_changes_below_the_threshold_say_nothing():
    assert class_notices(1, [1, 2], [2], 3) == ([], [])
    assert class_notices(0, [1], [1], 3) == ([], [])
    assert class_notices(4, [1, 2, 3], [], 3) == ([], [])  # still at the threshold
    assert class_notices(2, [1, 2, 3], [3], 1) == ([], [])  # no threshold below 2


# ---- the scripts --------------------------------------------------------------------------


def publish(r, threshold: int, uncounted_nids=()) -> None:
    r.set(keys.OWNER_COUNT, threshold)
    r.delete(keys.UNCOUNTED)
    if uncounted_nids:
        r.sadd(keys.UNCOUNTED, *uncounted_nids)


def drain(r, nids) -> dict[int, list[tuple[bool, bytes]]]:
    """nid -> (reclaimable, hash) in the order sent."""
    out: dict[int, list[tuple[bool, bytes]]] = {}
    for nid, elements in ((n, notices.pop(r, n, [TAG]).get(TAG, [])) for n in nids):
        for el in elements:
            n = notices.decode(el)
            out.setdefault(nid, []).extend((n.reclaimable, x) for x in n.hashes)
    return out


def classes_of(sent: dict[int, list[tuple[bool, bytes]]]) -> dict[tuple[int, bytes], bool]:
    """The class each (holder, block) ends with: its last notice."""
    out = {}
    for nid, seq in sent.items():
        for reclaimable, x in seq:
            out[(nid, x)] = reclaimable
    return out


def test_a_third_holder_demotes_all_three_and_an_eviction_restores_the_other_two(r):
    publish(r, 3)
    idx = Index(r)
    for nid in (1, 2):
        idx.apply(Op.INSERT, NS, nid, [h(1)])
    assert drain(r, [1, 2, 3]) == {}
    idx.apply(Op.INSERT, NS, 3, [h(1), h(2)])
    assert drain(r, [1, 2, 3]) == {1: [(True, h(1))], 2: [(True, h(1))], 3: [(True, h(1))]}
    idx.apply(Op.INSERT, NS, 4, [h(1)])  # a fourth: only itself
    assert drain(r, [1, 2, 3, 4]) == {4: [(True, h(1))]}
    idx.apply(Op.EVICT, NS, 4, [h(1)])
    idx.apply(Op.EVICT, NS, 2, [h(1)])  # 3 -> 2 holders: both left are retained again
    assert drain(r, [1, 2, 3, 4]) == {1: [(False, h(1))], 3: [(False, h(1))]}
    idx.apply(Op.EVICT, NS, 1, [h(1)])  # 3 alone: told again (it is retained already)
    assert drain(r, [1, 2, 3, 4]) == {3: [(False, h(1))]}


def test_moving_back_from_ssd_into_dram_past_the_threshold_demotes_the_mover(r):
    publish(r, 2)
    idx = Index(r)
    idx.apply(Op.INSERT, NS, 1, [h(1)])
    idx.apply(Op.INSERT, NS, 2, [h(1)], Tier.SSD)
    drain(r, [1, 2])
    idx.apply(Op.INSERT, NS, 2, [h(1)], Tier.L1)  # promoted: a tier change, same count
    assert drain(r, [1, 2]) == {2: [(True, h(1))]}
    idx.apply(Op.INSERT, NS, 2, [h(1)], Tier.SSD)  # out of DRAM again: nothing to say
    assert drain(r, [1, 2]) == {}


def test_uncounted_holders_neither_count_nor_hear(r):
    publish(r, 2, [9])
    idx = Index(r)
    idx.apply(Op.INSERT, NS, 9, [h(1)])
    idx.apply(Op.INSERT, NS, 1, [h(1)])
    assert drain(r, [1, 9]) == {}
    idx.apply(Op.INSERT, NS, 2, [h(1)])
    assert drain(r, [1, 2, 9]) == {1: [(True, h(1))], 2: [(True, h(1))]}


def test_a_sweep_of_counted_holders_restores_the_survivors(r):
    publish(r, 2)
    idx = Index(r)
    for nid in (1, 2):
        idx.apply(Op.INSERT, NS, nid, [h(1), h(2)])
    drain(r, [1, 2])
    assert idx.sweep([TAG], [2]) == 2
    assert drain(r, [1, 2]) == {1: [(False, h(1)), (False, h(2))]}


def test_no_threshold_published_no_notices_and_none_on_a_rebuild_index(r):
    idx = Index(r)
    for nid in (1, 2, 3):
        idx.apply(Op.INSERT, NS, nid, [h(1)])
    assert drain(r, [1, 2, 3]) == {}
    publish(r, 2)
    scratch = Index(r, keys.REBUILD_PREFIX)
    for nid in (1, 2):
        scratch.apply(Op.INSERT, NS, nid, [h(5)])
    assert drain(r, [1, 2]) == {}


def test_a_node_that_dies_and_comes_back_is_recounted(r):
    """owners.recount_once: a node's visibility moves the counts of its blocks without any
    holder list changing; the pass after the uncounted set is stored sends the notices."""
    from pegaflow.cluster import registry

    publish(r, 2)
    nids = {n: registry.register(r, n, f"{n}:1", 60_000, True)[0] for n in ("a", "b")}
    idx = Index(r)
    for nid in nids.values():
        idx.apply(Op.INSERT, NS, nid, [h(1)])
    registry.add_namespace_tags(r, {TAG: NS})
    assert drain(r, nids.values()) == {nid: [(True, h(1))] for nid in nids.values()}
    assert recount_once(r, "t", None) == 0 and uncounted(r, None) == set()
    r.delete(keys.live_key("b"))  # b's liveness expired
    assert recount_once(r, "t", None) == 0  # stores {b}: consumers use it from now on
    assert r.smembers(keys.UNCOUNTED) == {str(nids["b"]).encode()}
    assert recount_once(r, "t", None) == 1  # ... and the next pass recounts
    assert drain(r, nids.values()) == {nids["a"]: [(False, h(1))]}
    registry.heartbeat(r, "b", nids["b"], 60_000)  # b is back with its entries
    recount_once(r, "t", None)
    assert recount_once(r, "t", None) == 1
    assert drain(r, nids.values()) == {nid: [(True, h(1))] for nid in nids.values()}
    assert recount_once(r, "t", None) == 0  # nothing moved since


def model_apply(holders: dict[bytes, dict[int, Tier]], skip: set[int], u: Update, threshold: int,
                sent: dict[int, list[tuple[bool, bytes]]]) -> None:
    """The rule on a Python model of the holder lists, for one update (what _APPLY does)."""
    blob = u.blob
    for i in range(0, len(blob), 16):
        x = blob[i : i + 16]
        cur = holders.setdefault(x, {})
        before = [n for n in cur if n not in skip]
        joined: list[int] = []
        if u.op == Op.EVICT:
            if u.nid not in cur:
                continue
            del cur[u.nid]
        elif u.nid not in cur:
            cur[u.nid] = u.tier
            joined = [u.nid]
        elif cur[u.nid] != u.tier:
            cur[u.nid] = u.tier
            if u.tier != Tier.L1:
                continue
            joined = [u.nid]
        else:
            continue
        after = [n for n in cur if n not in skip]
        dem, res = class_notices(len(before), after, [j for j in joined if j not in skip], threshold)
        for n in dem:
            sent.setdefault(n, []).append((True, x))
        for n in res:
            sent.setdefault(n, []).append((False, x))


@pytest.mark.parametrize("threshold", [2, 3])
def test_the_scripts_send_what_the_rule_says_on_random_updates(r, threshold):
    rng = random.Random(threshold)
    nids = list(range(1, 7))
    skip = {6}
    publish(r, threshold, skip)
    idx = Index(r)
    holders: dict[bytes, dict[int, Tier]] = {}
    want: dict[int, list[tuple[bool, bytes]]] = {}
    for _ in range(400):
        nid = rng.choice(nids)
        op = rng.choice([Op.INSERT, Op.INSERT, Op.EVICT])
        tier = Tier.SSD if op == Op.INSERT and rng.random() < 0.25 else Tier.L1
        blob = b"".join(h(rng.randrange(24)) for _ in range(rng.randint(1, 5)))
        u = Update(op, NS, nid, blob, tier)
        idx.apply_many([u], native=False)
        model_apply(holders, skip, u, threshold, want)
    got = drain(r, nids)
    # The same notices per holder, in the same order (within one script call the model's
    # order is the blob's and the script's is grouped by holder: compare per holder).
    assert got == want
    assert sum(map(len, got.values())) > 50  # not vacuous
    assert 6 not in got  # uncounted: never told
