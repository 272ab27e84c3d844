"""The L1 pool: one shared-memory region owned by the node, mapped by every engine.

The region is a memfd (``MFD_HUGETLB`` with huge pages), so a crashed node leaves nothing
behind in /dev/shm; engines map a descriptor the node passes over its local socket
(``SCM_RIGHTS``, after the token check: how ``--access-group`` members get in), else open
``/proc/<node pid>/fd/<fd>`` (same user: the file mode is 0600).

The pool is pre-faulted (every page allocated and mapped) because a first touch costs a
page fault per 4 KiB (~1.5-2 GB/s here), which would otherwise land on the first saves. It
is pre-faulted in the background, front to back, by one thread (``MADV_POPULATE_WRITE``
through ``pegaflow.common.memory``, so the GIL is free meanwhile): the node serves at once, and the owner
makes each chunk allocatable when it is done (``on_progress``), so a page handed out is
always already faulted. A 500 GiB pool no longer takes minutes before the first request.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import structlog
import xxhash

from pegaflow.common.memory import MADV_POPULATE_WRITE, madvise, meminfo
from pegaflow.common.priority import background_thread
from pegaflow.node.numa import SYSFS_NODES, NumaError, Part, mbind, node_free


def page_checksum(data: memoryview | bytes | bytearray) -> int:
    """The one checksum of a pool page (SSD records, peer pulls): xxh3_64, ~14 GB/s here,
    releases the GIL for large buffers."""
    return xxhash.xxh3_64_intdigest(data)

log = structlog.get_logger("pegaflow.pool")

HUGE_PAGE = 2 << 20
# Made allocatable one chunk at a time: ~25 ms of work here, a multiple of any huge page.
PREFAULT_CHUNK = 64 << 20


class PoolError(Exception):
    """The pool cannot be created as asked (a one-line reason for the operator)."""


def _hugepages_free() -> tuple[int, int]:
    """(free huge pages, huge page size in bytes) from /proc/meminfo."""
    info = meminfo()  # free, less those other mappings reserved and have not touched yet
    return info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0), info.get("Hugepagesize", HUGE_PAGE)


def _seal_size(fd: int) -> bool:
    """Seal the pool's size: every engine holds a read-write descriptor of it (the local
    socket passes one, ``/proc/<pid>/fd`` opens one), and one that shrank it (``ftruncate``,
    a bug or worse) would make every process touching the lost pages die of SIGBUS: the
    node and every other engine. False where the kernel cannot seal it (logged)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except OSError as exc:
        log.warning("pool_size_not_sealed", error=exc.strerror or str(exc),
                    detail="an engine could shrink the pool under the node and every other engine")
        return False
    return True


class SharedPool:
    def __init__(self, size: int, use_hugepages: bool = False, name: str = "pegaflow-pool") -> None:
        if size <= 0:
            raise PoolError("pool size must be > 0")
        flags = os.MFD_CLOEXEC
        self.page_size = mmap.PAGESIZE
        if use_hugepages:
            free, hp = _hugepages_free()
            self.page_size = hp
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
            avail = meminfo().get("MemAvailable", size)
            if size > avail:
                raise PoolError(
                    f"--pool-size {size / (1 << 30):.1f} GiB is more than the {avail / (1 << 30):.1f} GiB "
                    "of memory available on this host; choose a smaller --pool-size"
                )
        self.size = size
        self.use_hugepages = use_hugepages
        try:
            self.fd = os.memfd_create(name, flags | os.MFD_ALLOW_SEALING)
        except OSError:  # huge pages on a kernel before 4.16: no seals for them
            self.fd = os.memfd_create(name, flags)
        os.fchmod(self.fd, 0o600)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            os.close(self.fd)
            raise PoolError(f"cannot allocate a {size >> 20} MiB pool: {exc.strerror or exc}") from None
        self.sealed = _seal_size(self.fd)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.view = memoryview(self.mm)
        self._anchor = ctypes.c_char.from_buffer(self.mm)  # the mapping's address, for madvise
        self.base = ctypes.addressof(self._anchor)
        self.prefaulted = 0  # [0, prefaulted) is allocated and mapped
        self.prefault_error: str | None = None
        self.numa_parts: list[Part] = []  # as bound by bind_numa (empty: the kernel's default policy)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bind_numa(self, parts: Sequence[Part], nodes_root: str = SYSFS_NODES) -> None:
        """Bind each part of the pool to its NUMA node (``mbind``, pegaflow/node/numa.py),
        before the pre-fault touches it. Raises NumaError (the caller decides; a bind that
        failed part-way is undone first), or PoolError when a node has not the memory (or
        the huge pages) for its part: bound there, the pre-fault would fail on that node
        or the OOM killer end a process (an engine, whose RSS holds the pool's pages)."""
        if len(parts) > 1:  # one node: the host-wide check at creation was the same
            hp = self.page_size if self.use_hugepages else 0
            for p in parts:
                free = node_free(p.node, hp, nodes_root)
                if free is not None and free < p.size:
                    what = f"{free // hp} free huge pages of {hp >> 20} MiB" if hp else f"{free >> 20} MiB free"
                    fix = (f"reserve {-(-p.size // hp)} on it ({nodes_root}/node{p.node}/hugepages/"
                           f"hugepages-{hp >> 10}kB/nr_hugepages), " if hp else "")
                    raise PoolError(f"NUMA node {p.node} has {what} for its {p.size >> 20} MiB part of the pool: "
                                    f"{fix}choose a smaller --pool-size, or --disable-numa-affinity")
        try:
            for p in parts:
                mbind(self.base + p.start, p.size, p.node)
        except NumaError:
            with contextlib.suppress(NumaError):
                mbind(self.base, self.size, None)  # the parts bound so far: back to the default
            raise
        self.numa_parts = list(parts)

    def start_prefault(self, on_progress: Callable[[int], None] | None = None) -> None:
        """Pre-fault in a background thread; ``on_progress(prefaulted)`` is called from that
        thread after each chunk (hand it to the event loop with ``call_soon_threadsafe``)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._prefault_below, args=(on_progress,), name="pool-prefault",
                                        daemon=True)
        self._thread.start()

    def _prefault_below(self, on_progress: Callable[[int], None] | None) -> None:
        background_thread()  # pegaflow/common/priority.py: below the loop that serves engines
        self._prefault(on_progress)

    def prefault(self) -> None:
        """Pre-fault now, in this thread (tools and tests that want the whole pool at once)."""
        self._prefault(None)

    def _populate(self, start: int, n: int) -> None:
        err = madvise(self.base + start, n, MADV_POPULATE_WRITE)
        if not err:
            return
        if err != errno.EINVAL:  # EINVAL: a kernel older than 5.14; ENOMEM/EFAULT: out of memory
            raise OSError(err, os.strerror(err))
        np.frombuffer(self.mm, dtype=np.uint8, count=n, offset=start)[::4096] = 0

    def _prefault(self, on_progress: Callable[[int], None] | None) -> None:
        t0 = time.perf_counter()
        last_log = t0
        done = self.prefaulted
        while done < self.size and not self._stop.is_set():
            n = min(PREFAULT_CHUNK, self.size - done)
            try:
                self._populate(done, n)
            except OSError as exc:
                # The part already faulted keeps serving; the rest is never handed out.
                self.prefault_error = exc.strerror or str(exc)
                log.error("pool_prefault_failed", done_bytes=done, total_bytes=self.size, error=self.prefault_error)
                return
            done += n
            self.prefaulted = done
            if on_progress is not None:
                on_progress(done)
            now = time.perf_counter()
            if now - last_log > 2.0:
                log.info("pool_prefault_progress", done_bytes=done, total_bytes=self.size,
                         percent=round(100 * done / self.size, 1),
                         gb_per_s=round(done / max(now - t0, 1e-9) / 1e9, 2))
                last_log = now
        if done >= self.size:
            dt = time.perf_counter() - t0
            log.info("pool_ready", bytes=self.size, hugepages=self.use_hugepages, seconds=round(dt, 3),
                     gb_per_s=round(self.size / max(dt, 1e-9) / 1e9, 2))

    def stop_prefault(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        self.stop_prefault()
        try:
            self.view.release()
            del self._anchor
            self.mm.close()
        finally:
            os.close(self.fd)
