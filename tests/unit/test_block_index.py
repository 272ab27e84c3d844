import os

import pytest

from pegaflow.core.block_index import RESIDENT, BlockIndex


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(idx: BlockIndex, ns, keys) -> list:
    blocks = idx.reserve(ns, [h(k) for k in keys])
    assert all(b is not None for b in blocks)
    return idx.commit(blocks)


def test_pending_pages_are_invisible_until_commit():
    idx = BlockIndex(1 << 20)
    ns = idx.namespace("a", 4096)
    pending = idx.reserve(ns, [h(1), h(2)])
    assert idx.prefix(ns, [h(1), h(2)]) == []
    idx.commit([pending[0]])
    assert [b.hash for b in idx.prefix(ns, [h(1), h(2)])] == [h(1)]


def test_prefix_stops_at_first_missing_block():
    idx = BlockIndex(1 << 20)
    ns = idx.namespace("a", 4096)
    fill(idx, ns, [1, 2, 4])
    assert len(idx.prefix(ns, [h(1), h(2), h(3), h(4)])) == 2


def test_one_lru_order_across_namespaces_and_page_sizes():
    idx = BlockIndex(10 * 4096)
    small = idx.namespace("small", 4096)
    big = idx.namespace("big", 3 * 4096)
    fill(idx, small, [1, 2])      # 2 pages
    fill(idx, big, [10, 11])      # 6 pages
    fill(idx, small, [3, 4])      # 2 pages -> full
    idx.prefix(small, [h(1)])     # touch small/1: now newest
    fill(idx, big, [12])          # needs 3 pages: evicts small/2, big/10 (LRU order)
    assert idx.get(small, h(2)) is None
    assert idx.get(big, h(10)) is None
    assert idx.get(small, h(1)) is not None
    assert idx.get(big, h(11)) is not None and idx.get(big, h(12)) is not None
    assert idx.evictions == 2


def test_pinned_blocks_are_never_evicted_and_reservation_gets_fewer_pages():
    idx = BlockIndex(4 * 4096)
    ns = idx.namespace("a", 4096)
    blocks = fill(idx, ns, [1, 2, 3, 4])
    idx.pin(blocks)
    got = idx.reserve(ns, [h(5), h(6)])
    assert got == [None, None]          # nothing evictable: no page, no blocking
    assert idx.no_space == 1
    idx.unpin(blocks[:1])
    got = idx.reserve(ns, [h(5), h(6)])
    assert got[0] is not None and got[1] is None
    assert idx.get(ns, h(1)) is None and all(idx.get(ns, h(k)) for k in (2, 3, 4))


def test_pending_pages_are_never_evicted():
    idx = BlockIndex(2 * 4096)
    ns = idx.namespace("a", 4096)
    pend = idx.reserve(ns, [h(1), h(2)])
    assert idx.reserve(ns, [h(3)]) == [None]
    idx.discard(pend)
    assert idx.reserve(ns, [h(3)])[0] is not None


def test_reserve_skips_resident_and_in_flight_hashes():
    idx = BlockIndex(1 << 20)
    ns = idx.namespace("a", 4096)
    fill(idx, ns, [1])
    first = idx.reserve(ns, [h(2)])
    second = idx.reserve(ns, [h(1), h(2), h(3)])
    assert second[0] is None and second[1] is None and second[2] is not None
    assert first[0] is not None


def test_discarded_reservation_frees_its_pages():
    idx = BlockIndex(8 * 4096)
    ns = idx.namespace("a", 4096)
    pend = idx.reserve(ns, [h(i) for i in range(8)])
    assert idx.alloc.free_bytes == 0
    assert idx.discard(pend) == 8
    assert idx.alloc.free_bytes == idx.alloc.capacity
    assert all(b.state != RESIDENT for b in pend if b)


def test_namespaces_do_not_see_each_other():
    idx = BlockIndex(1 << 20)
    a, b = idx.namespace("a", 4096), idx.namespace("b", 4096)
    fill(idx, a, [1, 2])
    assert idx.prefix(b, [h(1), h(2)]) == []
    assert idx.reserve(b, [h(1)])[0] is not None  # same hash, other namespace: a new page


def test_namespace_page_size_is_fixed_by_first_registration():
    idx = BlockIndex(1 << 20)
    idx.namespace("a", 4096)
    try:
        idx.namespace("a", 8192)
    except ValueError as exc:
        assert "page_bytes" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_listeners_see_inserts_and_evictions():
    idx = BlockIndex(2 * 4096)
    ns = idx.namespace("a", 4096)
    seen: list[tuple[str, list[bytes]]] = []
    idx.add_listener(lambda op, n, hs: seen.append((op, hs)))
    fill(idx, ns, [1, 2])
    fill(idx, ns, [3])
    assert seen == [("insert", [h(1), h(2)]), ("evict", [h(1)]), ("insert", [h(3)])]
    idx.remove(idx.prefix(ns, [h(2)], touch=False))  # told to go (an operator's cleanup)
    assert seen[-1] == ("remove", [h(2)])


class RejectAll:
    def __init__(self):
        self.records = 0

    def record(self, key: int) -> None:
        self.records += 1

    def admit(self, candidate: int, victim: int) -> bool:
        return False


def test_admission_policy_can_refuse_a_block_that_needs_an_eviction():
    idx = BlockIndex(2 * 4096, admission=RejectAll())
    ns = idx.namespace("a", 4096)
    fill(idx, ns, [1, 2])
    assert idx.reserve(ns, [h(3)]) == [None]
    assert idx.admission_rejections == 1
    assert idx.get(ns, h(1)) and idx.get(ns, h(2))


def test_reclaimable_blocks_are_evicted_first():
    idx = BlockIndex(3 * 4096)
    ns = idx.namespace("a", 4096)
    fill(idx, ns, [1])
    remote = idx.reserve(ns, [h(2)], reclaimable=True)
    idx.commit(remote)
    fill(idx, ns, [3])
    fill(idx, ns, [4])
    assert idx.get(ns, h(2)) is None and idx.get(ns, h(1)) is not None
    assert (idx.evictions, idx.evicted_reclaimable) == (1, 1)  # counted by class
    fill(idx, ns, [5])  # then the oldest retained one
    assert idx.get(ns, h(1)) is None and (idx.evictions, idx.evicted_reclaimable) == (2, 1)


def test_random_hashes_round_trip():
    idx = BlockIndex(1 << 22)
    ns = idx.namespace("m", 65536)
    keys = [os.urandom(16) for _ in range(32)]
    idx.commit([b for b in idx.reserve(ns, keys) if b])
    assert [b.hash for b in idx.prefix(ns, keys)] == keys


def test_block_keys_in_c_equal_block_key():
    from pegaflow.core import identity

    hashes = [os.urandom(16) for _ in range(500)] + [h(0), h(2**128 - 1)]
    for salt in (0, 1, 2**64 - 1, identity.namespace_salt("ns")):
        assert identity.block_keys(salt, hashes) == [identity.block_key(salt, x) for x in hashes]
        assert identity.block_keys(salt, iter(hashes)) == [identity.block_key(salt, x) for x in hashes]


def test_native_block_behaves_like_the_python_block():
    from pegaflow.core import block_index
    from tests.oracles.block_index_py import PyBlock

    idx = BlockIndex(1 << 20)
    ns = idx.namespace("a", 4096)
    for cls in (block_index.Block, PyBlock):
        b = cls(ns, h(7), 8192)
        assert (b.ns, b.hash, b.offset, b.size, b.state, b.pins, b.reclaimable) == (ns, h(7), 8192, 4096, 0, 0, False)
        assert b.key == (ns.id, h(7))
        assert repr(b) == "Block(ns='a', hash=070000000000, offset=8192, pins=0)"
        b.pins += 2
        b.state = RESIDENT
        assert (b.pins, b.state) == (2, RESIDENT)
        assert cls(ns, h(1), 0, True).reclaimable is True
        assert cls(ns, h(1), 0, reclaimable=True).reclaimable is True
        assert b != cls(ns, h(7), 8192) and len({b, cls(ns, h(7), 8192)}) == 2  # identity, like the index's LRU
    assert all(type(b) is block_index.Block for b in fill(idx, ns, [1, 2]))


class SomeAdmitted(RejectAll):
    """Admits about two candidates in three, deterministically by key."""

    def admit(self, candidate: int, victim: int) -> bool:
        return (candidate + victim) % 3 != 0


def _random_ops(seed: int, idx: BlockIndex, use_insert: bool, one_namespace: bool = False) -> list:
    """A random mix of writes, lookups, pins, reclaimable copies and two page sizes (two
    namespaces of the small one, like two TP ranks; ``one_namespace``: only one of them)."""
    import random

    rng = random.Random(seed)
    if seed % 2:
        idx.admission = SomeAdmitted()
    smalls, big = [idx.namespace("s", 4096), idx.namespace("s2", 4096)], idx.namespace("b", 2 * 4096)
    events: list = []
    idx.add_listener(lambda op, n, hs: events.append((op, n.name, hs)))
    pinned: list = []
    for _ in range(400):
        r = rng.random()
        ns = smalls[0] if one_namespace else smalls[0] if r < 0.35 else smalls[1] if r < 0.7 else big
        keys = [h(rng.randrange(60)) for _ in range(rng.randint(1, 6))]
        r = rng.random()
        if r < 0.15 and pinned:
            idx.unpin([pinned.pop()])
        elif r < 0.22:
            got = idx.prefix(ns, keys)
            if got:
                idx.pin(got[:1])
                pinned.append(got[0])
        else:
            reclaimable = rng.random() < 0.15
            if use_insert:
                done = idx.insert(ns, keys, reclaimable)
            else:
                done = idx.commit([b for b in idx.reserve(ns, keys, reclaimable) if b])
            events.append(("done", [b.hash for b in done]))
    return [
        events,
        [(b.ns.name, b.hash, b.offset) for b in idx.lru_order()],
        (idx.resident_blocks, idx.resident_bytes, idx.evictions, idx.evicted_bytes, idx.no_space,
         idx.evicted_reclaimable),
        idx.admission_rejections,
    ]


def test_insert_equals_reserve_then_commit():
    for seed in range(6):
        a = _random_ops(seed, BlockIndex(12 * 4096), use_insert=True)
        b = _random_ops(seed, BlockIndex(12 * 4096), use_insert=False)
        assert a == b
        assert a[2][2] > 100  # evictions happened: the comparison is not vacuous
        assert (a[3] > 10) == bool(seed % 2)


def test_native_lru_behaves_like_ordereddict():
    import random
    from collections import OrderedDict

    from pegaflow.core import block_index

    rng = random.Random(1)
    keys = [object() for _ in range(150)]
    ref, lru = OrderedDict(), block_index.LRU()
    ops = [
        lambda d, k: d.__setitem__(k, None),
        lambda d, k: d.move_to_end(k),
        lambda d, k: d.move_to_end(k, last=False),
        lambda d, k: d.popitem(last=False),
        lambda d, k: d.popitem(),
        lambda d, k: d.pop(k, "absent"),
        lambda d, k: d.pop(k),
        lambda d, k: d.__delitem__(k),
        lambda d, k: d[k],
        lambda d, k: k in d,
        lambda d, k: len(d),
    ]
    for step in range(60_000):
        op, k = rng.choice(ops), rng.choice(keys)
        outcomes = []
        for d in (ref, lru):
            try:
                outcomes.append(("ok", op(d, k)))
            except KeyError:
                outcomes.append(("KeyError", None))
        assert outcomes[0] == outcomes[1], (step, outcomes)
        if step % 997 == 0:
            assert list(ref) == list(lru) and bool(ref) == bool(lru)
    assert list(ref) == list(lru)
    for k in keys[:3]:
        lru[k] = None
    it = iter(lru)
    next(it)
    lru.move_to_end(next(iter(lru)))
    with pytest.raises(RuntimeError):
        next(it)  # mutated during iteration, as OrderedDict refuses too


def test_native_placement_equals_the_python_loop(monkeypatch):
    """The C loop of the full-pool steady state (pegaflow.core._blockindex.place) changes nothing."""
    from pegaflow.core import block_index
    from tests.oracles.block_index_py import leave_everything_to_python

    calls = []
    real = block_index._native_place

    def counting(*args):
        calls.append(1)
        return real(*args)

    for seed in range(6):
        for use_insert in (True, False):
            for one in (True, False):  # several namespaces: victims of another one are Python's
                monkeypatch.setattr(block_index, "_native_place", counting)
                native = _random_ops(seed, BlockIndex(12 * 4096), use_insert, one_namespace=one)
                monkeypatch.setattr(block_index, "_native_place", leave_everything_to_python)
                python = _random_ops(seed, BlockIndex(12 * 4096), use_insert, one_namespace=one)
                assert native == python
                assert native[2][2] > 100
    assert len(calls) > 500  # the C loop really ran


# ---- pegaflow.core._blockindex memory safety: what Python code can do to the C paths -----------


class _FullPool:
    """An allocator with no free bytes: place() takes the LRU head's page."""

    free_bytes = 0

    def alloc(self, size: int) -> int:
        raise AssertionError("not called on a full pool")


def _native():
    from pegaflow.core import block_index

    assert block_index._native_place is not None, "pegaflow.core._blockindex is not built"
    return block_index


def _place(bi, blocks, lru, ns, hashes, alloc=None, made=None, out=None, start=0):
    made = [] if made is None else made
    alloc = _FullPool() if alloc is None else alloc
    return bi._native_place(blocks, lru, ns, hashes, start, False, made, [], out, alloc, 4096, None)


def _resident(bi, ns, key: int):
    b = bi.Block(ns, h(key), 0)
    b.state = RESIDENT
    lru = bi.LRU()
    lru[b] = None
    return b, lru


def test_native_block_with_a_deleted_attribute_raises_like_the_python_block():
    bi = _native()
    ns = BlockIndex(1 << 20).namespace("a", 4096)
    from tests.oracles.block_index_py import PyBlock

    for cls in (bi.Block, PyBlock):
        b = cls(ns, h(1), 0)
        del b.hash
        with pytest.raises(AttributeError):
            b.key  # noqa: B018 - was a segfault in C
        b = cls(ns, h(1), 0)
        del b.offset
        with pytest.raises(AttributeError):
            repr(b)


@pytest.mark.parametrize("attr", ["state", "pins", "size", "hash", "offset"])
def test_native_place_leaves_a_block_without_an_attribute_to_the_python_loop(attr):
    bi = _native()
    ns = BlockIndex(1 << 20).namespace("a", 4096)
    b, lru = _resident(bi, ns, 1)
    blocks = {b.hash: b}
    delattr(b, attr)
    # the resident block itself (state, pins), or a miss that would evict it (size, hash, offset)
    hashes = [h(1)] if attr in ("state", "pins") else [h(2)]
    made: list = []
    assert _place(bi, blocks, lru, ns, hashes, made=made) == (0, False)
    assert made == [] and list(lru) == [b]


def test_native_place_takes_counts_beyond_a_c_long():
    bi = _native()
    ns = BlockIndex(1 << 20).namespace("a", 4096)
    b, lru = _resident(bi, ns, 1)
    b.pins = 2**100  # was a SystemError (an OverflowError left set)
    assert _place(bi, {b.hash: b}, lru, ns, [h(1)]) == (0, False)
    b.pins, b.state = 0, 2**100  # not RESIDENT: a pending block, no touch
    out: list = []
    assert _place(bi, {b.hash: b}, lru, ns, [h(1)], out=out) == (1, False)
    assert out == [None]


def test_native_place_refuses_a_negative_start():
    bi = _native()
    ns = BlockIndex(1 << 20).namespace("a", 4096)
    with pytest.raises(ValueError):  # was a read before the start of the hashes
        _place(bi, {}, bi.LRU(), ns, [h(1)], start=-(10**9))


def test_native_place_holds_the_victim_while_python_code_compares_its_size():
    bi = _native()
    ns = BlockIndex(1 << 20).namespace("a", 4096)
    b, lru = _resident(bi, ns, 1)

    class Size:
        def __eq__(self, other):
            lru.popitem(last=False)  # drops the last reference to the head
            return True

    b.size = Size()
    blocks: dict = {}
    del b
    made: list = []
    assert _place(bi, blocks, lru, ns, [h(2)], made=made) == (0, False)
    assert made == [] and len(lru) == 0


def test_native_place_does_not_swallow_keyboard_interrupt_from_the_allocator():
    bi = _native()
    ns = BlockIndex(1 << 20).namespace("a", 4096)

    class Alloc:
        free_bytes = 1 << 30

        def __init__(self, exc: BaseException) -> None:
            self.exc = exc

        def alloc(self, size: int) -> int:
            raise self.exc

    # An ordinary exception stops the C loop (the Python loop retries and handles it) ...
    assert _place(bi, {}, bi.LRU(), ns, [h(1)], alloc=Alloc(RuntimeError())) == (0, False)
    # ... but an interrupt propagates, as from the Python loop (which catches OutOfSpace only).
    with pytest.raises(KeyboardInterrupt):
        _place(bi, {}, bi.LRU(), ns, [h(1)], alloc=Alloc(KeyboardInterrupt()))


def test_native_settle_holds_each_block_while_python_code_runs():
    bi = _native()
    made: list = []

    class NotABlock:  # a Python block whose state store empties made
        def __setattr__(self, name, value):
            made.clear()

    made.append(NotABlock())
    lru = bi.LRU()
    bi._native_settle(made, lru)
    assert len(lru) == 1 and type(next(iter(lru))) is NotABlock


def test_native_lru_iterator_ends_like_ordereddicts():
    """Once exhausted, an iterator stays exhausted even if the order changes afterwards."""
    from collections import OrderedDict

    bi = _native()
    for d in (OrderedDict(), bi.LRU()):
        d[object()] = None
        it = iter(d)
        assert len(list(it)) == 1
        d[object()] = None
        assert next(it, "end") == "end", type(d)
        it = iter(d)
        next(it)
        next(it)
        d[object()] = None  # after the last key: ended, the change is not looked at
        assert next(it, "end") == "end", type(d)
        it = iter(d)
        next(it)
        d[object()] = None  # before it: a mutation during iteration
        with pytest.raises(RuntimeError):
            next(it)


def test_clear_drops_a_namespace_and_frees_pinned_and_pending_pages_when_they_are_done():
    idx = BlockIndex(16 * 4096)
    a, b = idx.namespace("a", 4096), idx.namespace("b", 4096)
    events = []
    idx.add_listener(lambda op, ns, hs: events.append((op, ns.name, len(hs))))
    fill(idx, a, [1, 2, 3])
    fill(idx, b, [1])
    leased = idx.prefix(a, [h(1)])
    idx.pin(leased)
    writing = idx.reserve(a, [h(9)])  # a save in flight
    used = idx.alloc.used_bytes
    events.clear()

    hashes, busy = idx.clear(a)
    assert sorted(hashes) == [h(1), h(2), h(3)] and busy == 2  # one pinned, one pending
    assert [(str(op), n, k) for op, n, k in events] == [("remove", "a", 3)], "a reset is no eviction"
    assert idx.prefix(a, [h(1)]) == [] and idx.get(a, h(2)) is None
    assert [x.hash for x in idx.prefix(b, [h(1)])] == [h(1)], "other namespaces keep their blocks"
    assert idx.alloc.used_bytes == used - 2 * 4096, "unpinned pages are free at once"
    assert idx.resident_blocks == 1

    assert idx.commit(writing) == [], "a save in flight never becomes visible"
    assert idx.get(a, h(9)) is None
    idx.unpin(leased)
    assert idx.alloc.used_bytes == used - 4 * 4096, "the pinned and pending pages are freed once done"
    fill(idx, a, [1])  # the namespace works as before
    assert [x.hash for x in idx.prefix(a, [h(1)])] == [h(1)]


@pytest.mark.parametrize("ending", ["commit", "discard"])
def test_a_write_that_lands_after_its_namespace_was_cleared_and_dropped_frees_its_page(ending):
    """An SSD promotion or a peer pull writes into PENDING pages; the namespace is cleared,
    its last session ends, and the node drops it before the write lands."""
    idx = BlockIndex(16 * 4096)
    a = idx.namespace("a", 4096)
    writing = [b for b in idx.reserve(a, [h(1), h(2)]) if b is not None]
    idx.clear(a)
    assert idx.drop_namespace("a"), "nothing of it is left in the table"
    if ending == "commit":
        assert idx.commit(writing) == []
    else:
        idx.discard(writing)
    assert idx.alloc.used_bytes == 0, "the pages are free again"
    assert idx.get_namespace("a") is None
