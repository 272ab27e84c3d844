"""The L1 pool: one shared-memory region owned by the node, mapped by every engine.

The region is a memfd (``MFD_HUGETLB`` with huge pages), so a crashed node leaves nothing
behind in /dev/shm; engines open it through ``/proc/<node pid>/fd/<fd>`` (same user: the
file mode is 0600). It is allocated and pre-faulted at start-up because the first touch
of fresh memory runs at ~0.1-0.4 GB/s here, which would otherwise land on the first saves.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import structlog
import xxhash


def page_checksum(data: memoryview | bytes | bytearray) -> int:
    """The one checksum of a pool page (SSD records, peer pulls): xxh3_64, ~14 GB/s here,
    releases the GIL for large buffers."""
    return xxhash.xxh3_64_intdigest(data)

log = structlog.get_logger("pegaflow.pool")

HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = 23  # not exported by the mmap module
PREFAULT_CHUNK = 1 << 30


class PoolError(Exception):
    """The pool cannot be created as asked (a one-line reason for the operator)."""


def _meminfo() -> dict[str, int]:
    """/proc/meminfo as {field: value}; kB fields in bytes, counts as they are."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _hugepages_free() -> tuple[int, int]:
    """(free huge pages, huge page size in bytes) from /proc/meminfo."""
    info = _meminfo()
    return info.get("HugePages_Free", 0), info.get("Hugepagesize", HUGE_PAGE)


class SharedPool:
    def __init__(self, size: int, use_hugepages: bool = False, name: str = "pegaflow-pool") -> None:
        if size <= 0:
            raise PoolError("pool size must be > 0")
        flags = os.MFD_CLOEXEC
        if use_hugepages:
            free, hp = _hugepages_free()
            size = (size + hp - 1) // hp * hp
            need = size // hp
            if free < need:
                raise PoolError(
                    f"--use-hugepages needs {need} free huge pages of {hp >> 20} MiB but only {free} are "
                    f"reserved (echo {need} > /proc/sys/vm/nr_hugepages)"
                )
            flags |= os.MFD_HUGETLB
        else:
            # Pre-faulting more than the host has would end in the OOM killer, not an error.
            avail = _meminfo().get("MemAvailable", size)
            if size > avail:
                raise PoolError(
                    f"--pool-size {size / (1 << 30):.1f} GiB is more than the {avail / (1 << 30):.1f} GiB "
                    "of memory available on this host; choose a smaller --pool-size"
                )
        self.size = size
        self.use_hugepages = use_hugepages
        self.fd = os.memfd_create(name, flags)
        os.fchmod(self.fd, 0o600)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
            self._prefault()
        except OSError as exc:
            os.close(self.fd)
            raise PoolError(f"cannot allocate a {size >> 20} MiB pool: {exc.strerror or exc}") from None
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.view = memoryview(self.mm)

    def _prefault(self) -> None:
        """Allocate every page of the region now, with progress for large pools."""
        t0 = time.perf_counter()
        done = 0
        last_log = t0
        while done < self.size:
            n = min(PREFAULT_CHUNK, self.size - done)
            # fallocate reserves the pages; only a write fault clears them, so populate
            # writable mappings too (MADV_POPULATE_WRITE, Linux >= 5.14; else touch).
            os.posix_fallocate(self.fd, done, n)
            try:
                self.mm.madvise(MADV_POPULATE_WRITE, done, n)
            except OSError:
                np.frombuffer(self.mm, dtype=np.uint8, count=n, offset=done)[::4096] = 0
            done += n
            now = time.perf_counter()
            if now - last_log > 2.0:
                log.info("pool_prefault_progress", done_bytes=done, total_bytes=self.size,
                         percent=round(100 * done / self.size, 1))
                last_log = now
        dt = time.perf_counter() - t0
        log.info("pool_ready", bytes=self.size, hugepages=self.use_hugepages, seconds=round(dt, 3),
                 gb_per_s=round(self.size / max(dt, 1e-9) / 1e9, 2))

    def close(self) -> None:
        try:
            self.view.release()
            self.mm.close()
        finally:
            os.close(self.fd)
