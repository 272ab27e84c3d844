"""Replacement classes in the block index: BlockIndex.reclassify (docs/architecture.md,
"Replacement classes") moves blocks between the retained and the reclaimable order, and
eviction takes every evictable reclaimable block before any retained one."""

import random

import pytest

from pegaflow.core import block_index
from pegaflow.core.block_index import RESIDENT, BlockIndex
from pegaflow.policy.quota import Quotas
from tests.oracles.block_index_py import reclass as python_reclass
from tests.unit.test_block_index import fill, h


def resident(idx: BlockIndex, ns, keys) -> list[int]:
    return [k for k in keys if idx.get(ns, h(k)) is not None]


def class_counts(idx: BlockIndex) -> tuple[int, int]:
    """(blocks, bytes) of the reclaimable class, counted from the blocks themselves."""
    rs = [b for b in idx.resident() if b.reclaimable]
    return len(rs), sum(b.size for b in rs)


def test_demoted_blocks_are_evicted_before_any_retained_block():
    idx = BlockIndex(4 * 4096)
    ns = idx.namespace("a", 4096)
    fill(idx, ns, [1, 2, 3, 4])  # 1 is the oldest
    assert idx.reclassify(ns, [h(3), h(4)], True) == 2
    assert (idx.demoted, idx.reclaimable_blocks, idx.reclaimable_bytes) == (2, 2, 2 * 4096)
    fill(idx, ns, [5])
    assert resident(idx, ns, [1, 2, 3, 4, 5]) == [1, 2, 4, 5]  # the oldest reclaimable one went
    assert (idx.evictions, idx.evicted_reclaimable) == (1, 1)
    fill(idx, ns, [6])
    assert resident(idx, ns, [1, 2, 3, 4, 5, 6]) == [1, 2, 5, 6]
    fill(idx, ns, [7])  # none reclaimable left: the oldest retained one
    assert resident(idx, ns, [1, 2, 5, 6, 7]) == [2, 5, 6, 7]
    assert (idx.evictions, idx.evicted_reclaimable, idx.reclaimable_blocks, idx.reclaimable_bytes) == (3, 2, 0, 0)


def test_a_restored_copy_is_retained_again():
    idx = BlockIndex(3 * 4096)
    ns = idx.namespace("a", 4096)
    idx.commit(idx.reserve(ns, [h(1)], reclaimable=True))  # a pulled copy
    fill(idx, ns, [2, 3])
    assert idx.reclaimable_blocks == 1
    assert idx.reclassify(ns, [h(1)], False) == 1
    assert (idx.restored, idx.reclaimable_blocks, idx.reclaimable_bytes) == (1, 0, 0)
    fill(idx, ns, [4])  # 2 is the oldest retained block now: 1 went to the newest end
    assert resident(idx, ns, [1, 2, 3, 4]) == [1, 3, 4]
    assert [b.hash for b in idx.lru_order()] == [h(3), h(1), h(4)]


def test_a_demoted_block_goes_to_the_newest_end_of_the_reclaimable_order():
    idx = BlockIndex(8 * 4096)
    ns = idx.namespace("a", 4096)
    idx.commit(idx.reserve(ns, [h(1), h(2)], reclaimable=True))
    fill(idx, ns, [3, 4])
    idx.reclassify(ns, [h(3)], True)
    assert [b.hash for b in idx.lru_order()] == [h(1), h(2), h(3), h(4)]


def test_absent_pending_and_same_class_blocks_are_left_alone():
    idx = BlockIndex(8 * 4096)
    ns = idx.namespace("a", 4096)
    fill(idx, ns, [1])
    pending = idx.reserve(ns, [h(2)])
    idx.commit(idx.reserve(ns, [h(3)], reclaimable=True))
    before = [b.hash for b in idx.lru_order()]
    assert idx.reclassify(ns, [h(2), h(3), h(9)], True) == 0  # pending, already reclaimable, absent
    assert idx.reclassify(idx.namespace("other", 4096), [h(1)], True) == 0  # another namespace's
    assert idx.reclassify(ns, [], True) == 0
    assert [b.hash for b in idx.lru_order()] == before and pending[0] is not None
    assert pending[0].reclaimable is False and idx.demoted == 0


def test_a_pinned_block_changes_class_and_joins_its_order_when_unpinned():
    idx = BlockIndex(3 * 4096)
    ns = idx.namespace("a", 4096)
    fill(idx, ns, [1, 2, 3])
    b = idx.get(ns, h(3))
    idx.pin([b])
    assert idx.reclassify(ns, [h(3)], True) == 1
    assert b.reclaimable and (idx.reclaimable_blocks, idx.reclaimable_bytes) == (1, 4096)
    assert b not in idx.lru_order()  # pinned: in no order
    fill(idx, ns, [4])
    assert resident(idx, ns, [1, 2, 3, 4]) == [2, 3, 4]
    idx.unpin([b])
    assert idx.lru_order()[0] is b  # the reclaimable order comes first
    fill(idx, ns, [5])
    assert resident(idx, ns, [2, 3, 4, 5]) == [2, 4, 5]
    assert (idx.evicted_reclaimable, idx.reclaimable_blocks, idx.reclaimable_bytes) == (1, 0, 0)


def test_a_block_parked_by_a_quota_search_can_be_demoted():
    idx = BlockIndex(4 * 4096, quotas=Quotas.parse(["b=max:0.5"]))
    a, b = idx.namespace("a", 4096), idx.namespace("b", 4096)
    fill(idx, a, [1])
    fill(idx, b, [2, 3])
    fill(idx, a, [4])
    fill(idx, b, [5])  # b at its maximum evicts its own oldest (2), parking a's 1 on the way
    assert resident(idx, b, [2, 3, 5]) == [3, 5]
    assert idx.reclassify(a, [h(1)], True) == 1
    assert idx.lru_order()[0] is idx.get(a, h(1))
    fill(idx, a, [6])  # the demoted block goes first
    assert resident(idx, a, [1, 4, 6]) == [4, 6]
    assert class_counts(idx) == (0, 0) and idx.reclaimable_bytes == 0


def _ops(seed: int, idx: BlockIndex) -> list:
    """Writes, lookups, pins, removals, resets and class changes at random, two page sizes;
    after every step the index's class counts equal a count of its blocks."""
    rng = random.Random(seed)
    nss = [idx.namespace("s", 4096), idx.namespace("s2", 4096), idx.namespace("b", 2 * 4096)]
    pinned: list = []
    for step in range(600):
        ns = rng.choice(nss)
        keys = [h(rng.randrange(40)) for _ in range(rng.randint(1, 6))]
        r = rng.random()
        if r < 0.12 and pinned:
            idx.unpin([pinned.pop()])
        elif r < 0.2:
            got = idx.prefix(ns, keys)
            if got:
                idx.pin(got[:1])
                pinned.append(got[0])
        elif r < 0.4:
            idx.reclassify(ns, keys, rng.random() < 0.6)
        elif r < 0.43:
            idx.remove([b for k in keys if (b := idx.get(ns, k)) is not None])
        elif r < 0.44:
            idx.clear(ns)
        else:
            idx.commit([b for b in idx.reserve(ns, keys, rng.random() < 0.2) if b])
        assert (idx.reclaimable_blocks, idx.reclaimable_bytes) == class_counts(idx), step
        order = idx.lru_order()
        first_retained = next((i for i, b in enumerate(order) if not b.reclaimable), len(order))
        assert all(not b.reclaimable for b in order[first_retained:]), step  # reclaimable first
    return [
        [(b.ns.name, b.hash, b.offset, b.reclaimable) for b in idx.lru_order()],
        (idx.resident_blocks, idx.evictions, idx.evicted_reclaimable, idx.demoted, idx.restored,
         idx.reclaimable_blocks, idx.reclaimable_bytes),
    ]


@pytest.mark.parametrize("quotas", [None, ["s=max:0.4", "b=min:0.3"]])
def test_native_reclass_equals_the_python_oracle(monkeypatch, quotas):
    totals = [0, 0, 0, 0]
    for seed in range(4):
        make = lambda: BlockIndex(12 * 4096, quotas=Quotas.parse(quotas) if quotas else None)  # noqa: E731
        native = _ops(seed, make())
        monkeypatch.setattr(block_index, "_native_reclass", python_reclass)
        python = _ops(seed, make())
        monkeypatch.undo()
        assert native == python
        totals = [t + x for t, x in zip(totals, native[1][1:5], strict=True)]
    evictions, of_reclaimable, demoted, restored = totals
    assert evictions > 400 and of_reclaimable > 80 and demoted > 20 and restored > 5  # not vacuous


def test_native_reclass_refuses_wrong_arguments():
    bi = block_index
    lru = bi.LRU()
    with pytest.raises(TypeError):
        bi._native_reclass({}, [], 1, lru, bi.LRU(), [], [])  # reclaimable must be a bool
    with pytest.raises(ValueError):
        bi._native_reclass({}, [], True, lru, lru, [], [])
    ns = BlockIndex(4096).namespace("a", 4096)
    b = bi.Block(ns, h(1), 0)
    b.state = RESIDENT
    moved: list = []
    bi._native_reclass({h(1): b, h(2): object()}, [h(1), h(2)], True, lru, bi.LRU(), moved, parked := [])
    assert moved == [b] and parked == [b] and b.reclaimable is True  # not in the source order: parked


def test_the_native_placement_takes_reclaimable_victims_first(monkeypatch):
    """place() (the reserve loop's steady state in C) evicts the reclaimable order first and
    moves hits within their own class's order, so a node with reclaimable blocks keeps the C path."""
    stops = []
    real = block_index._native_place

    def recording(*args):
        out = real(*args)
        stops.append((out[0], len(args[3])))
        return out

    monkeypatch.setattr(block_index, "_native_place", recording)
    idx = BlockIndex(4 * 4096)
    ns = idx.namespace("a", 4096)
    fill(idx, ns, [1, 2, 3, 4])
    idx.reclassify(ns, [h(2), h(3)], True)
    stops.clear()
    got = idx.reserve(ns, [h(3), h(5), h(6)])  # 3: a reclaimable hit, moved to its order's end; victims 2, 3
    assert got[0] is None and idx.commit([b for b in got if b is not None])
    assert stops == [(3, 3)]  # every hash done in C
    assert resident(idx, ns, [1, 2, 3, 4, 5, 6]) == [1, 4, 5, 6]
    assert (idx.evictions, idx.evicted_reclaimable, idx.reclaimable_blocks, idx.reclaimable_bytes) == (2, 2, 0, 0)
