"""Extent allocator for the L1 pool.

Holds the free space of one pool as aligned extents ``[start, start + size)``. Pages of
any size (several models share one pool) are carved best-fit and coalesced with their
neighbours when freed, so a pool that cycled through many page sizes still hands out
large pages when enough adjacent space is free.

Invariants a caller may rely on:
- every offset returned is a multiple of ``align`` and every page size is rounded up
  to a multiple of ``align`` (O_DIRECT and hugepage-friendly);
- free extents never overlap and never touch (touching extents are merged);
- ``free_bytes + allocated bytes == capacity`` at all times.

Costs are O(log n) in the number of free extents (a sorted list keyed by size).
"""

from __future__ import annotations

from sortedcontainers import SortedList


class OutOfSpace(Exception):
    """No free extent is large enough (the caller may evict and retry)."""


class ExtentAllocator:
    def __init__(self, capacity: int, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.align = align
        self.capacity = capacity - capacity % align
        self.free_bytes = self.capacity
        self._by_start: dict[int, int] = {}  # start -> size
        self._by_end: dict[int, int] = {}  # end -> start
        self._by_size: SortedList = SortedList()  # (size, start)
        if self.capacity:
            self._add(0, self.capacity)

    def round(self, size: int) -> int:
        """Bytes a page of ``size`` really occupies."""
        a = self.align
        return (size + a - 1) // a * a

    def alloc(self, size: int) -> int:
        """Best-fit allocation; returns the offset or raises :class:`OutOfSpace`."""
        if size <= 0:
            raise ValueError(f"page size must be > 0, got {size}")
        need = self.round(size)
        i = self._by_size.bisect_left((need, -1))
        if i == len(self._by_size):
            raise OutOfSpace(need)
        ext_size, start = self._by_size[i]
        self._remove(start, ext_size)
        if ext_size > need:
            self._add(start + need, ext_size - need)
        self.free_bytes -= need
        return start

    def free(self, offset: int, size: int) -> None:
        need = self.round(size)
        start, end = offset, offset + need
        if offset % self.align or end > self.capacity or offset < 0:
            raise ValueError(f"bad extent to free: offset={offset} size={size}")
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            self._remove(prev_start, start - prev_start)
            start = prev_start
        next_size = self._by_start.get(end)
        if next_size is not None:
            self._remove(end, next_size)
            end += next_size
        self._add(start, end - start)
        self.free_bytes += need

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def extents(self) -> list[tuple[int, int]]:
        """Free extents sorted by start (for tests and diagnostics)."""
        return sorted(self._by_start.items())

    def _add(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        self._by_size.add((size, start))

    def _remove(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        self._by_size.remove((size, start))
