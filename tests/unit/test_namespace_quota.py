"""--namespace-quota: the grammar (pegaflow.policy.quota) and the eviction rule BlockIndex applies."""

import random

import pytest

from pegaflow.core.block_index import BlockIndex
from pegaflow.policy.quota import Quota, Quotas, parse_quota
from tests.unit.test_block_index import _random_ops, fill, h

# ---- grammar ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("llama=0.3", Quota("llama", 0.3, 1.0)),
        ("llama=min:0.3", Quota("llama", 0.3, 1.0)),
        ("llama=max:0.5", Quota("llama", 0.0, 0.5)),
        ("llama=min:0.2/max:0.5", Quota("llama", 0.2, 0.5)),
        ("llama=max:50%/min:20%", Quota("llama", 0.2, 0.5)),
        ("llama=1", Quota("llama", 1.0, 1.0)),
        # a full connector namespace contains '=' and '/': NAME is what precedes the last '='
        ("pf1|org/m|cfg=ab|tp=1=0.25", Quota("pf1|org/m|cfg=ab|tp=1", 0.25, 1.0)),
    ],
)
def test_quota_grammar_accepts(text: str, want: Quota) -> None:
    assert parse_quota(text) == want


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("llama", "expected NAME=SHARE"),
        ("=0.3", "expected NAME=SHARE"),
        ("llama=", "expected NAME=SHARE"),
        ("llama=0", "outside (0, 1]"),
        ("llama=1.5", "outside (0, 1]"),
        ("llama=120%", "outside (0, 1]"),
        ("llama=lots", "invalid share"),
        ("llama=avg:0.3", "unknown or repeated term"),
        ("llama=min:0.1/min:0.2", "unknown or repeated term"),
        ("llama=min:0.6/max:0.5", "exceeds max"),
    ],
)
def test_quota_grammar_rejects_with_one_line(text: str, says: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_quota(text)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_guarantees_over_the_whole_pool_and_repeated_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="sum to 1.1, more than the whole pool"):
        Quotas.parse(["a=0.6", "b=min:0.5"])
    with pytest.raises(ValueError, match="given twice"):
        Quotas.parse(["a=0.1", "a=max:0.2"])
    assert Quotas.parse(["a=0.5", "b=0.5", "c=max:1"]).limits(1000) == [(500, 1000), (500, 1000), (0, 1000)]


def test_a_name_covers_the_namespace_itself_or_every_namespace_of_its_model() -> None:
    q = Quotas.parse(["llama=0.3", "pf1|llama|cfg=x|shard=1/2=0.1"])
    assert q.group("llama") == 0
    assert q.group("pf1|llama|cfg=x|shard=0/2") == 0
    assert q.group("pf1|llama|cfg=x|shard=0/2|state=64") == 0
    assert q.group("pf1|llama|cfg=x|shard=1/2") == 1  # the exact name wins over the model
    assert q.group("pf1|qwen|cfg=x") is None and q.group("other") is None


# ---- eviction rule ----------------------------------------------------------------------


def _pool(blocks: int, *quotas: str) -> BlockIndex:
    return BlockIndex(blocks * 4096, quotas=Quotas.parse(quotas))


def test_a_namespace_under_its_guarantee_keeps_its_blocks_while_another_scans() -> None:
    idx = _pool(10, "hot=0.4")
    hot, scan = idx.namespace("hot", 4096), idx.namespace("scan", 4096)
    fill(idx, hot, range(4))  # its working set: exactly its guarantee
    for k in range(100, 400):  # a scan of unique blocks, far larger than the pool
        idx.insert(scan, [h(k)])
    assert len(idx.prefix(hot, [h(k) for k in range(4)], touch=False)) == 4
    assert idx.blocks_by_namespace() == {"hot": 4, "scan": 6}
    assert idx.quota_usage() == [(4 * 4096, 4 * 4096, 10 * 4096)]


def test_without_a_quota_the_same_scan_flushes_the_working_set() -> None:
    idx = BlockIndex(10 * 4096)
    hot, scan = idx.namespace("hot", 4096), idx.namespace("scan", 4096)
    fill(idx, hot, range(4))
    for k in range(100, 400):
        idx.insert(scan, [h(k)])
    assert idx.prefix(hot, [h(0)], touch=False) == []


def test_above_its_guarantee_a_namespace_loses_its_lru_blocks_down_to_it() -> None:
    idx = _pool(10, "hot=0.3")
    hot, scan = idx.namespace("hot", 4096), idx.namespace("scan", 4096)
    fill(idx, hot, range(6))
    for k in range(100, 200):
        idx.insert(scan, [h(k)])
    assert idx.blocks_by_namespace()["hot"] == 3
    assert len(idx.prefix(hot, [h(3), h(4), h(5)], touch=False)) == 3  # its most recent three


def test_the_inserting_namespace_may_evict_itself_below_its_guarantee_order() -> None:
    idx = _pool(4, "hot=1")
    hot = idx.namespace("hot", 4096)
    fill(idx, hot, range(4))
    fill(idx, hot, [9])  # full, all its own: its own LRU block goes
    assert idx.prefix(hot, [h(0)], touch=False) == [] and idx.get(hot, h(9)) is not None


def test_a_namespace_at_its_maximum_evicts_its_own_lru_block_though_pages_are_free() -> None:
    idx = _pool(10, "scan=max:0.3")
    scan, other = idx.namespace("scan", 4096), idx.namespace("other", 4096)
    fill(idx, other, [1])
    for k in range(100, 150):
        idx.insert(scan, [h(k)])
    assert idx.blocks_by_namespace() == {"scan": 3, "other": 1}
    assert idx.alloc.free_bytes == 6 * 4096
    assert [b.hash for b in idx.resident(scan)] == [h(147), h(148), h(149)]
    assert idx.quota_evictions == 47 and idx.evictions == 47


def test_a_capped_namespace_whose_blocks_are_all_pinned_gets_no_page() -> None:
    idx = _pool(10, "a=max:0.2")
    a = idx.namespace("a", 4096)
    idx.pin(fill(idx, a, [1, 2]))
    assert idx.reserve(a, [h(3)]) == [None]
    assert idx.no_space == 1


def test_pinned_blocks_of_an_unprotected_namespace_are_never_victims() -> None:
    idx = _pool(4, "hot=0.5")
    hot, scan = idx.namespace("hot", 4096), idx.namespace("scan", 4096)
    fill(idx, hot, [1, 2])
    pinned = fill(idx, scan, [10, 11])
    idx.pin(pinned)
    assert idx.reserve(scan, [h(12)]) == [None]  # hot is at its guarantee, scan's are pinned
    idx.unpin(pinned)
    assert idx.reserve(scan, [h(12)])[0] is not None and idx.get(scan, h(10)) is None


def test_every_namespace_of_a_model_shares_its_quota() -> None:
    idx = _pool(8, "m=0.5")
    s0, s1 = idx.namespace("pf1|m|shard=0/2", 4096), idx.namespace("pf1|m|shard=1/2", 4096)
    scan = idx.namespace("scan", 4096)
    fill(idx, s0, [1, 2])
    fill(idx, s1, [1, 2])
    for k in range(100, 150):
        idx.insert(scan, [h(k)])
    assert idx.blocks_by_namespace() == {"pf1|m|shard=0/2": 2, "pf1|m|shard=1/2": 2, "scan": 4}


def test_quotas_that_protect_nobody_change_nothing() -> None:
    """A quota matching no namespace keeps the C fast path; a max:1 quota on every namespace
    takes the quota path on every eviction: both must evict exactly as no quota does
    (random writes, lookups, pins, reclaimable copies, two page sizes, admission)."""
    for seed in range(6):
        plain = _random_ops(seed, BlockIndex(12 * 4096), use_insert=True)
        for quotas in (["nobody=0.5"], ["s=max:1", "s2=max:1", "b=max:1"]):
            assert _random_ops(seed, BlockIndex(12 * 4096, quotas=Quotas.parse(quotas)), use_insert=True) == plain


def test_held_bytes_follow_every_way_a_block_leaves() -> None:
    rng = random.Random(5)
    idx = _pool(24, "a=min:0.25/max:0.5", "b=max:0.4")
    spaces = [idx.namespace("a", 4096), idx.namespace("b", 2 * 4096), idx.namespace("c", 4096)]
    pinned: list = []
    pending: list = []
    for _ in range(1500):
        ns = rng.choice(spaces)
        keys = [h(rng.randrange(80)) for _ in range(rng.randint(1, 5))]
        r = rng.random()
        if r < 0.1 and pinned:
            idx.unpin([pinned.pop()])
        elif r < 0.2:
            got = idx.prefix(ns, keys)
            if got:
                idx.pin(got[:1])
                pinned.append(got[0])
        elif r < 0.3:
            pending += [b for b in idx.reserve(ns, keys) if b]
        elif r < 0.4 and pending:
            idx.discard(pending[: len(pending) // 2])
            idx.commit(pending[len(pending) // 2 :])
            pending.clear()
        elif r < 0.42:
            idx.clear(ns)
        elif r < 0.45:
            idx.remove(idx.prefix(ns, keys, touch=False))
        else:
            idx.insert(ns, keys, reclaimable=rng.random() < 0.1)
        held = {n.name: sum(b.size for b in idx._blocks.get(n.id, {}).values()) for n in spaces}
        assert idx.held == [held["a"], held["b"]]
        lo, hi = 6 * 4096, int(0.4 * 24 * 4096)
        assert held["b"] <= hi
        assert idx.evictions > 0 or _ < 50
    assert idx.quota_evictions > 0 and lo > 0


def test_under_its_guarantee_a_namespace_takes_others_blocks_before_its_own() -> None:
    """Its own blocks are the oldest, yet it grows to its guarantee at the scan's expense."""
    idx = _pool(8, "hot=0.5")
    hot, scan = idx.namespace("hot", 4096), idx.namespace("scan", 4096)
    fill(idx, hot, [1, 2])
    for k in range(100, 106):
        idx.insert(scan, [h(k)])  # full: hot's two are the LRU head
    fill(idx, hot, [3, 4])
    assert idx.blocks_by_namespace() == {"hot": 4, "scan": 4}
    fill(idx, hot, [5])  # at its guarantee now: the global LRU (its own) goes
    assert idx.get(hot, h(1)) is None and idx.blocks_by_namespace() == {"hot": 4, "scan": 4}


def test_every_victim_is_the_oldest_block_the_rule_allows() -> None:
    """Random single-block inserts, lookups and pins in four namespaces (two with quotas):
    each victim is the first block of the eviction order (``lru_order``, parked blocks
    included) that the rule allows, computed here from the order and the held bytes."""
    rng = random.Random(11)
    idx = _pool(16, "a=min:0.25", "b=min:0.25/max:0.5", "c=max:0.25")
    spaces = {n: idx.namespace(n, 4096) for n in ("a", "b", "c", "d")}
    group = {"a": 0, "b": 1, "c": 2}
    lo = [4 * 4096, 4 * 4096, 0]
    hi = [16 * 4096, 8 * 4096, 4 * 4096]
    gone: list = []
    idx.add_listener(lambda op, ns, hs: gone.extend((ns.name, x) for x in hs) if op.value == "evict" else None)
    pinned: list = []
    checked = parked = 0
    for step in range(3000):
        parked = max(parked, len(idx._park_seq))
        name = rng.choice("aabcdd")
        ns = spaces[name]
        key = h(rng.randrange(40 if name in "ab" else 400))
        r = rng.random()
        if r < 0.05 and pinned:
            idx.unpin([pinned.pop(rng.randrange(len(pinned)))])
            continue
        if r < 0.1:
            got = idx.prefix(ns, [key])
            if got and len(pinned) < 4:
                idx.pin(got)
                pinned += got
            continue
        if r < 0.4:
            idx.prefix(ns, [key])
            continue
        if idx.get(ns, key) is not None:
            continue
        order = idx.lru_order()
        assert len(order) == len(set(order)) == idx.resident_blocks - len(set(pinned))
        g = group.get(name)
        held = list(idx.held)
        full = idx.alloc.free_bytes < 4096
        capped = g is not None and held[g] + 4096 > hi[g]
        def cls(b):  # noqa: ANN001, ANN202
            return group.get(b.ns.name, -1)
        if capped:
            allowed = [b for b in order if cls(b) == g]
        else:
            blocked = {i for i in range(3) if i != g and lo[i] and held[i] <= lo[i]}
            allowed = [b for b in order if cls(b) not in blocked and cls(b) != g] if (
                g is not None and held[g] + 4096 <= lo[g]) else [b for b in order if cls(b) not in blocked]
            if not allowed and g is not None and held[g] + 4096 <= lo[g]:
                allowed = [b for b in order if cls(b) == g]
        gone.clear()
        idx.insert(ns, [key])
        if capped or full:
            want = [(allowed[0].ns.name, allowed[0].hash)] if allowed else []
            assert gone == want, (step, name, held)
            checked += bool(want)
        else:
            assert gone == []
    assert checked > 500 and parked > 5  # the rule was exercised, parked blocks included
