"""Extent allocator for the L1 pool.

Holds the free space of one pool as aligned extents ``[start, start + size)``. Pages of
any size (several models share one pool) are carved best-fit and coalesced with their
neighbours when freed, so a pool that cycled through many page sizes still hands out
large pages when enough adjacent space is free.

Invariants a caller may rely on:
- every offset returned is a multiple of ``align`` and every page size is rounded up
  to a multiple of ``align`` (O_DIRECT and hugepage-friendly);
- free extents never overlap and never touch (touching extents are merged);
- ``free_bytes + allocated bytes == usable`` at all times: only ``[0, usable)`` is handed
  out; ``extend`` grows it towards ``capacity`` (the node pre-faults its pool in the
  background and makes each faulted chunk usable when it is done).

Costs are O(log n) in the number of free extents (a sorted list keyed by size), and O(1)
for a streak of pages of one size: best fit carves a streak's pages one after another from
the same extent (the remainder of the smallest extent that fits stays the smallest that
fits), so ``alloc`` takes the whole best-fit extent as the current *run* and hands out its
pages without touching the sorted list. The run's remainder counts as free; it goes back
to the free set (coalesced) before anything else looks at or changes the extents.
"""

from __future__ import annotations

from sortedcontainers import SortedList


class OutOfSpace(Exception):
    """No free extent is large enough (the caller may evict and retry)."""


class ExtentAllocator:
    def __init__(self, capacity: int, align: int = 4096, usable: int | None = None) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.align = align
        self.capacity = capacity - capacity % align
        self.usable = 0
        self.free_bytes = 0
        self._by_start: dict[int, int] = {}  # start -> size
        self._by_end: dict[int, int] = {}  # end -> start
        self._by_size: SortedList[tuple[int, int]] = SortedList()  # (size, start)
        # The current run: [run_start, run_end) is free, held outside the extents, and serves
        # pages of run_need bytes (0: no run).
        self._run_start = self._run_end = self._run_need = 0
        self.extend(self.capacity if usable is None else usable)

    def extend(self, usable: int) -> int:
        """Make ``[0, usable)`` (rounded down to ``align``, at most ``capacity``) allocatable;
        returns the bytes added. Never shrinks."""
        end = min(self.capacity, usable - usable % self.align)
        start = self.usable
        if end <= start:
            return 0
        self._flush_run()
        self._merge_add(start, end)
        self.usable = end
        self.free_bytes += end - start
        return end - start

    @property
    def used_bytes(self) -> int:
        """Bytes of allocated pages (resident and pending)."""
        return self.usable - self.free_bytes

    def round(self, size: int) -> int:
        """Bytes a page of ``size`` really occupies."""
        a = self.align
        return (size + a - 1) // a * a

    def alloc(self, size: int) -> int:
        """Best-fit allocation; returns the offset or raises :class:`OutOfSpace`."""
        if size <= 0:
            raise ValueError(f"page size must be > 0, got {size}")
        need = self.round(size)
        start = self._run_start
        if need == self._run_need and self._run_end - start >= need:
            self._run_start = start + need
            self.free_bytes -= need
            return start
        self._flush_run()
        i = self._by_size.bisect_left((need, -1))
        if i == len(self._by_size):
            raise OutOfSpace(need)
        ext_size, start = self._by_size[i]
        self._remove(start, ext_size)
        self._run_start, self._run_end, self._run_need = start + need, start + ext_size, need
        self.free_bytes -= need
        return start

    def free(self, offset: int, size: int) -> None:
        need = self.round(size)
        start, end = offset, offset + need
        if offset % self.align or end > self.usable or offset < 0:
            raise ValueError(f"bad extent to free: offset={offset} size={size}")
        self._flush_run()
        self._merge_add(start, end)
        self.free_bytes += need

    def _flush_run(self) -> None:
        """Give the current run's remainder back to the free set."""
        start, end = self._run_start, self._run_end
        self._run_start = self._run_end = self._run_need = 0
        if end > start:
            self._merge_add(start, end)

    def _merge_add(self, start: int, end: int) -> None:
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            self._remove(prev_start, start - prev_start)
            start = prev_start
        next_size = self._by_start.get(end)
        if next_size is not None:
            self._remove(end, next_size)
            end += next_size
        self._add(start, end - start)

    def largest_free(self) -> int:
        self._flush_run()
        return self._by_size[-1][0] if self._by_size else 0

    def extents(self) -> list[tuple[int, int]]:
        """Free extents sorted by start (for tests and diagnostics)."""
        self._flush_run()
        return sorted(self._by_start.items())

    def _add(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        self._by_size.add((size, start))

    def _remove(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        self._by_size.remove((size, start))
