import random

import pytest

from pegaflow.core.allocator import ExtentAllocator, OutOfSpace


def test_pages_of_mixed_sizes_are_aligned_and_disjoint():
    a = ExtentAllocator(1 << 20, align=4096)
    sizes = [4096, 10000, 65536, 5000, 131072, 4096]
    got = [(a.alloc(s), a.round(s)) for s in sizes]
    for off, _size in got:
        assert off % 4096 == 0
    spans = sorted(got)
    for (o1, s1), (o2, _) in zip(spans, spans[1:], strict=False):
        assert o1 + s1 <= o2
    assert a.free_bytes == a.capacity - sum(s for _, s in got)


def test_freed_neighbours_coalesce_into_one_extent():
    a = ExtentAllocator(64 * 4096, align=4096)
    offs = [a.alloc(4096) for _ in range(64)]
    with pytest.raises(OutOfSpace):
        a.alloc(4096)
    for o in offs[10:20]:
        a.free(o, 4096)
    assert a.extents() == [(10 * 4096, 10 * 4096)]
    assert a.alloc(10 * 4096) == 10 * 4096


def test_fragmented_pool_refuses_large_page_until_neighbours_free():
    a = ExtentAllocator(16 * 4096, align=4096)
    offs = [a.alloc(4096) for _ in range(16)]
    for o in offs[::2]:  # free every other page: 8 pages free, none adjacent
        a.free(o, 4096)
    assert a.free_bytes == 8 * 4096
    with pytest.raises(OutOfSpace):
        a.alloc(2 * 4096)
    a.free(offs[1], 4096)  # joins pages 0,1,2
    assert a.largest_free() == 3 * 4096
    assert a.alloc(3 * 4096) == 0


def test_random_churn_keeps_accounting_exact():
    rng = random.Random(7)
    a = ExtentAllocator(8 << 20, align=4096)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.choice([4096, 12288, 65536, 262144, 5000])
            try:
                live[a.alloc(size)] = size
            except OutOfSpace:
                pass
        used = sum(a.round(s) for s in live.values())
        assert a.free_bytes + used == a.capacity
    ext = a.extents()
    for (s1, n1), (s2, _) in zip(ext, ext[1:], strict=False):
        assert s1 + n1 < s2, "free extents must neither overlap nor touch"
    for off in list(live):
        a.free(off, live.pop(off))
    assert a.extents() == [(0, a.capacity)]


def test_only_the_usable_prefix_is_handed_out_and_extend_grows_it():
    """The node's pool is pre-faulted in the background: pages past the faulted frontier
    (``usable``) are never handed out; each extension is allocatable at once and merges
    with a free extent that ends at the old frontier."""
    a = ExtentAllocator(16 * 4096, align=4096, usable=0)
    assert (a.capacity, a.usable, a.free_bytes, a.used_bytes) == (16 * 4096, 0, 0, 0)
    with pytest.raises(OutOfSpace):
        a.alloc(4096)
    assert a.extend(4 * 4096 + 100) == 4 * 4096  # rounded down to align
    offs = [a.alloc(4096) for _ in range(3)]
    assert max(offs) < 4 * 4096 and a.used_bytes == 3 * 4096
    with pytest.raises(OutOfSpace):
        a.alloc(2 * 4096)  # one page left below the frontier
    assert a.extend(8 * 4096) == 4 * 4096
    assert a.alloc(2 * 4096) == 3 * 4096  # the free page at the old frontier merged with the new space
    assert a.extend(4 * 4096) == 0  # never shrinks
    assert a.extend(1 << 30) == 8 * 4096  # at most the capacity
    assert a.usable == a.capacity and a.free_bytes + a.used_bytes == a.usable
    with pytest.raises(ValueError):
        ExtentAllocator(16 * 4096, usable=4096).free(8 * 4096, 4096)  # past the frontier
