"""Lazily mapped pools: this process's page tables for the pool, made before the copies need them.

A process that maps the pool takes a page fault on its first touch of every 4 KiB of it
(the node has allocated the pages; this process has no page-table entries yet): a first
copy ran at ~2.3 GB/s here against ~10 GB/s once mapped. MAP_POPULATE at map time fixes
that but costs the whole pool up front (~33 GB/s here: 30 s for 1 TB, and it would allocate
what the node has not pre-faulted yet). So the client maps lazily (``map_lazily``) and,
before each copy, populates the parts the copy touches that this process has not populated
yet (``lazy_pools[base].ensure``; MADV_POPULATE_READ, ~33 GB/s; the entries it makes are
writable for a shared mapping), while a background thread populates the 2 MiB chunks the
node has allocated, front to back.
"""

from __future__ import annotations

import os
import threading
import weakref

import numpy as np
import torch

from pegaflow.common.memory import MADV_POPULATE_READ, PAGE_SIZE, madvise, resident

POPULATE_CHUNK_SHIFT = 21  # the background thread's unit and what ``done`` counts (2 MiB)
# Copies populate what they touch in these units (256 KiB: a page of a small model; a
# unit containing a page the node handed out is inside its pre-faulted front, which moves
# in 64 MiB steps, so populating the whole unit touches nothing the node did not allocate).
POPULATE_UNIT_SHIFT = 18
BACKGROUND_CHUNKS = 64  # chunks per background madvise call (128 MiB, ~4 ms here)
BACKGROUND_GIVE_UP_S = 600.0  # no chunk allocated by the node for this long: stop trying


class Populated:
    """Which parts of one lazily mapped pool this process has populated.

    Copies populate the units they touch (``ensure``); a low-priority background thread
    populates whole chunks, front to back, so that the first pass over the pool does not
    pay it either (a save into fresh chunks ran ~1 ms slower per 16 MiB request). The thread
    populates only chunks the node has already allocated (``mincore`` of the chunk's last
    page: the node pre-faults front to back): a page this process faulted first would be
    charged to the engine's memory cgroup, not the node's.
    """

    def __init__(self, base: int, size: int) -> None:
        self.base, self.size = base, size
        chunks = (size + (1 << POPULATE_CHUNK_SHIFT) - 1) >> POPULATE_CHUNK_SHIFT
        self.done = np.zeros(chunks, dtype=bool)
        self.left = chunks
        units = (size + (1 << POPULATE_UNIT_SHIFT) - 1) >> POPULATE_UNIT_SHIFT
        self.units = np.zeros(units, dtype=bool)  # populated by a copy (chunks: ``done``)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.busy = False

    def _populate(self, first: int, count: int) -> None:
        start = first << POPULATE_CHUNK_SHIFT
        n = min(count << POPULATE_CHUNK_SHIFT, self.size - start)
        # A failure (kernel < 5.14) only means the copy takes the page faults itself.
        madvise(self.base + start, n, MADV_POPULATE_READ)
        with self.lock:
            fresh = np.arange(first, first + count)
            fresh = fresh[~self.done[fresh]]
            self.done[fresh] = True
            self.left -= int(fresh.size)

    def ensure(self, pool_off: np.ndarray, lens: np.ndarray) -> None:
        """Populate what a copy of these pieces touches and nobody populated yet, by units
        of ``POPULATE_UNIT_SHIFT``, not whole chunks (measured: 1.0 ms for 64 scattered
        256 KiB pages against 5.1 ms for their 64 chunks of 2 MiB; a warm engine's first
        load paid the latter on top of its copy)."""
        if not self.left:
            return
        ends = pool_off + lens - 1
        u0, u1 = pool_off >> POPULATE_UNIT_SHIFT, ends >> POPULATE_UNIT_SHIFT
        c0, c1 = pool_off >> POPULATE_CHUNK_SHIFT, ends >> POPULATE_CHUNK_SHIFT
        need = ~((self.done[c0] | self.units[u0]) & (self.done[c1] | self.units[u1]))
        if not need.any():
            return
        first, count = u0[need], u1[need] - u0[need] + 1  # every unit of each piece
        skip = np.repeat(np.cumsum(count) - count, count)
        todo = np.unique(np.repeat(first, count) + (np.arange(int(count.sum())) - skip))
        # Runs of adjacent units (a page's segments lie back to back) -> one call each.
        for run in np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1):
            start = int(run[0]) << POPULATE_UNIT_SHIFT
            n = min(len(run) << POPULATE_UNIT_SHIFT, self.size - start)
            # A failure (kernel < 5.14) only means the copy takes the page faults itself.
            madvise(self.base + start, n, MADV_POPULATE_READ)
            self.units[run] = True

    def _allocated(self, chunk_end: int) -> bool:
        """The node has allocated chunks ``[0, chunk_end)``: the last page is resident
        (the node pre-faults front to back)."""
        end = min(chunk_end << POPULATE_CHUNK_SHIFT, self.size)
        return resident(self.base + ((end - 1) & ~(PAGE_SIZE - 1)))

    def background(self) -> None:
        """Populate the chunks the node has allocated, front to back; ``busy`` while it does
        (not while it waits for the node's pre-fault)."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            pass
        c, total, waited = 0, self.done.size, 0.0
        try:
            while c < total and not self.stop.is_set() and waited < BACKGROUND_GIVE_UP_S:
                if self.done[c]:
                    c += 1
                    continue
                k = min(BACKGROUND_CHUNKS, total - c)
                if not self._allocated(c + k):
                    k = 1
                    if not self._allocated(c + 1):
                        # The node's pre-fault has not got here yet (or the pool is on huge
                        # pages, which mincore does not report for another process's faults).
                        self.busy = False
                        self.stop.wait(0.05)
                        waited += 0.05
                        continue
                self.busy = True
                self._populate(c, k)
                c += k
                waited = 0.0
        finally:
            self.busy = False


lazy_pools: dict[int, Populated] = {}  # by the mapping's base address; the copies look their pool up here


def populating() -> bool:
    """A background thread of this process is populating a pool mapping right now."""
    return any(p.busy for p in list(lazy_pools.values()))


def map_lazily(pool: torch.Tensor) -> None:
    """Say that ``pool`` (a whole mapping) was mapped without MAP_POPULATE: copies
    populate the units they touch first, and a background thread the rest. Forgotten
    (and the thread stopped) when the tensor dies."""
    ptr = pool.data_ptr()
    p = Populated(ptr, pool.numel())
    lazy_pools[ptr] = p
    weakref.finalize(pool, _forget, ptr, p)
    threading.Thread(target=p.background, name="pegaflow-pool-populate", daemon=True).start()


def _forget(ptr: int, p: Populated) -> None:
    p.stop.set()
    if lazy_pools.get(ptr) is p:
        del lazy_pools[ptr]
