"""A lazily mapped pool: populated in the background where the node allocated, and by
copies where they touch it."""

import torch

from pegaflow.client import populate
from tests.waiting import wait_until


def _memfd_pool(nbytes: int):  # type: ignore[no-untyped-def]
    import mmap
    import os

    fd = os.memfd_create("pf-test-pool")
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)


def test_a_lazily_mapped_pool_is_populated_in_the_background_only_where_the_node_allocated():
    """The engine's mapping gets its page tables in the background, but only for chunks
    the node has already faulted in: a page the engine faulted first would be charged to
    the engine's memory cgroup."""
    import mmap
    import os

    chunk = 1 << populate.POPULATE_CHUNK_SHIFT
    fd, node_view = _memfd_pool(8 * chunk)
    try:
        node_view[: 3 * chunk] = b"\x01" * (3 * chunk)  # the node pre-faulted the first 3 chunks
        engine = mmap.mmap(fd, 8 * chunk, flags=mmap.MAP_SHARED)
        t = torch.frombuffer(engine, dtype=torch.uint8)
        populate.map_lazily(t)
        p = populate.lazy_pools[t.data_ptr()]
        wait_until(lambda: p.done[:3].all(), 10, "the allocated chunks populated in the background", every=0.01)
        allocated = os.fstat(fd).st_blocks * 512
        assert not p.done[3:].any() and allocated == 3 * chunk, (p.done, allocated)
        node_view[3 * chunk:] = b"\x02" * (5 * chunk)  # the pre-fault goes on
        wait_until(lambda: p.left == 0, 10, "every chunk populated", every=0.01)
        assert bytes(engine[5 * chunk: 5 * chunk + 4]) == b"\x02" * 4
        p.stop.set()
        t = None  # type: ignore[assignment]  # releases the buffer export so the mapping can close
        engine.close()
    finally:
        node_view.close()
        os.close(fd)


def test_a_copy_populates_the_units_it_touches_not_their_chunks(monkeypatch):
    """Before the background thread gets there, a copy populates what it touches, by
    units: a page's unit, not its 2 MiB chunk (that cost a warm engine's first load)."""
    import numpy as np

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(populate, "madvise", lambda addr, n, advice: calls.append((addr, n)) or 0)
    chunk, unit = 1 << populate.POPULATE_CHUNK_SHIFT, 1 << populate.POPULATE_UNIT_SHIFT
    base = 1 << 40  # never touched: madvise is recorded, not run
    p = populate.Populated(base, 4 * chunk)
    # a half-unit piece in chunk 1, and a piece over three units across chunks 2 and 3
    offs = np.array([chunk + 3 * unit, 3 * chunk - unit], dtype=np.int64)
    lens = np.array([unit // 2, 3 * unit], dtype=np.int64)
    p.ensure(offs, lens)
    assert calls == [(base + chunk + 3 * unit, unit), (base + 3 * chunk - unit, 3 * unit)]
    assert set(np.flatnonzero(p.units)) == {chunk // unit + 3, *range(3 * chunk // unit - 1, 3 * chunk // unit + 2)}
    assert not p.done.any()  # whole chunks are the background thread's
    p.ensure(offs, lens)  # populated already: nothing more
    p.done[0] = True
    p.ensure(np.array([unit], dtype=np.int64), np.array([unit], dtype=np.int64))  # a chunk the thread did
    assert len(calls) == 2
