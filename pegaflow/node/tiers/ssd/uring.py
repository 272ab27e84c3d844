"""I/O engines of the SSD tier: io_uring through ``liburing``, or a thread pool.

Both move pages straight between the L1 pool and the cache files (O_DIRECT, no staging
copy): an :class:`IoOp` carries a list of buffers (a 4 KiB header block and a
memoryview of the pool page) for one ``readv``/``writev``.

Engine contract:
- :meth:`submit` may be called from any thread and never blocks.
- ``op.prepare()`` runs on an engine thread just before the I/O is issued (the writer
  computes checksums there, off the event loop); ``op.complete(res)`` runs on an engine
  thread after it, with the bytes transferred or ``-errno``. Exceptions in either are
  logged and turned into a failed op; they never kill the engine.
- At most ``depth`` I/Os are in flight; the rest wait in order.

Why ``liburing`` 2024.5.3 and not the newest release: the 2026.x wheels are built with
AVX-512 instructions and die with SIGILL on CPUs without them (this machine's EPYC), and
their ``Iovec`` takes only bytearrays; 2024.5.3 (Cython) runs anywhere and its ``iovec``
takes any buffer, so the kernel reads and writes pool memory directly. Its calls hold the
GIL, so the engine thread never blocks inside ``io_uring_enter``: it submits without
waiting, with every SQE marked for the kernel's workers (``IOSQE_ASYNC``: no I/O is issued
inside the submit call, see below), and sleeps in ``poll()`` on an eventfd registered with
the ring (woken by completions and by :meth:`submit`).
"""

from __future__ import annotations

import collections
import errno
import itertools
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import structlog

from pegaflow.common.priority import background_thread
from pegaflow.node.tiers.ssd.files import SsdError

log = structlog.get_logger("pegaflow.ssd")

IDLE_POLL_MS = 1000  # engine thread wake-up when idle (only to notice close())
# Every SQE goes straight to the kernel's io-wq workers (IOSQE_ASYNC, 1 << 4 in
# <linux/io_uring.h>; the wheel exports no constants) instead of being issued inline by
# io_uring_enter. liburing 2024.5.3 holds the GIL through io_uring_submit, and on a
# preallocated file an inline O_DIRECT issue builds the bios in that call: 31-111 us median,
# up to 263 us, per 16-60 buffer writev of 256 KiB pages, each a stall of the node's event
# loop (with all background work on, py-spy found the GIL held at the submit in 49 of 392
# samples; with the flag, 4 of 343). With IOSQE_ASYNC the submit takes 1 us median (60 us
# max); bench/ssd.py tier GB/s was the same within this host's run-to-run spread (write
# 1.86/1.86 against 1.90/1.68, read 2.20/2.11 against 1.99/1.64, A/B alternated) and
# bench/dataplane.py Query p99 on/off was 1.12x-1.31x in 4 runs against 1.23x-1.29x in 2.
IOSQE_ASYNC = 1 << 4
# Buffers per op: liburing 2024.5.3's iovec refuses more than its SC_IOV_MAX (60 here),
# far below the kernel's IOV_MAX (1024). Writers and readers coalesce up to this.
MAX_IOV = 60


class IoOp:
    """One vectored read or write at ``offset`` of ``fd``; see the module contract."""

    __slots__ = ("write", "fd", "offset", "bufs", "prepare", "complete")

    def __init__(
        self,
        write: bool,
        fd: int,
        offset: int,
        bufs: Sequence[memoryview | bytearray],
        complete: Callable[[int], None],
        prepare: Callable[[], None] | None = None,
    ) -> None:
        self.write = write
        self.fd = fd
        self.offset = offset
        self.bufs = list(bufs)
        self.prepare = prepare
        self.complete = complete

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.bufs)


class Engine(Protocol):
    name: str
    depth: int

    def submit(self, ops: Sequence[IoOp]) -> None: ...
    def inflight(self) -> int: ...
    def close(self) -> None: ...


def _finish(op: IoOp, res: int) -> None:
    try:
        op.complete(res)
    except Exception:
        log.exception("ssd_io_completion_failed")


def _prepare(op: IoOp) -> bool:
    if op.prepare is None:
        return True
    try:
        op.prepare()
        return True
    except Exception:
        log.exception("ssd_io_prepare_failed")
        _finish(op, -errno.EIO)
        return False


class ThreadEngine:
    """``os.preadv``/``os.pwritev`` on a pool of ``depth`` threads (they release the GIL)."""

    name = "threads"

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._ex = ThreadPoolExecutor(depth, thread_name_prefix="pegaflow-ssd-io", initializer=background_thread)
        self._inflight = 0
        self._lock = threading.Lock()

    def submit(self, ops: Sequence[IoOp]) -> None:
        with self._lock:
            self._inflight += len(ops)
        for op in ops:
            self._ex.submit(self._run, op)

    def _run(self, op: IoOp) -> None:
        try:
            if not _prepare(op):
                return
            try:
                res = os.pwritev(op.fd, op.bufs, op.offset) if op.write else os.preadv(op.fd, op.bufs, op.offset)
            except OSError as exc:
                res = -(exc.errno or errno.EIO)
            _finish(op, res)
        finally:
            with self._lock:
                self._inflight -= 1

    def inflight(self) -> int:
        return self._inflight

    def close(self) -> None:
        self._ex.shutdown(wait=True)


class UringEngine:
    """One io_uring driven by one thread; see the module docstring for why it polls an eventfd."""

    name = "uring"

    def __init__(self, depth: int) -> None:
        import liburing as L  # noqa: N812

        self.L = L
        self.depth = depth
        self.ring = L.io_uring()
        L.io_uring_queue_init(max(8, 2 * depth), self.ring, 0)
        self.cqe = L.io_uring_cqe()
        self.efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        L.io_uring_register_eventfd(self.ring, self.efd)
        self._jobs: collections.deque[IoOp] = collections.deque()
        self._inflight: dict[int, tuple[IoOp, object]] = {}
        self._tags = itertools.count(1)
        self._stop = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pegaflow-ssd-uring", daemon=True)
        self._thread.start()

    def submit(self, ops: Sequence[IoOp]) -> None:
        self._jobs.extend(ops)
        os.eventfd_write(self.efd, 1)

    def inflight(self) -> int:
        return len(self._inflight) + len(self._jobs)

    def _run(self) -> None:
        # Below the loop that serves engines (pegaflow/common/priority.py); io_uring's kernel
        # workers, started by this thread's submits, inherit it.
        background_thread()
        poller = select.poll()
        poller.register(self.efd, select.POLLIN)
        backlog: collections.deque[IoOp] = collections.deque()
        while True:
            try:
                if self._step(poller, backlog):
                    break
            except Exception:  # never let the engine die: pinned pages would leak
                log.exception("ssd_uring_engine_error")
                time.sleep(0.01)
        self.L.io_uring_queue_exit(self.ring)
        # The eventfd stays open: close() writes to it after setting _stop, and this thread,
        # woken by its poll timeout, may have seen _stop and ended first (close() then wrote
        # to a closed descriptor: EBADF, or another file's had the number been reused).

    def _step(self, poller: select.poll, backlog: collections.deque[IoOp]) -> bool:
        """One round: wait, reap, refill, run completions. True when closed and drained."""
        L = self.L  # noqa: N806
        ring, cqe = self.ring, self.cqe
        inflight = self._inflight
        busy = bool(backlog) and len(inflight) < self.depth
        poller.poll(0 if busy else IDLE_POLL_MS)
        try:
            os.eventfd_read(self.efd)
        except BlockingIOError:
            pass
        jobs = self._jobs
        while jobs:
            backlog.append(jobs.popleft())
        done: list[tuple[IoOp, int]] = []
        while L.io_uring_peek_cqe(ring, cqe) == 0:
            tag, res = cqe.user_data, cqe.res
            L.io_uring_cqe_seen(ring, cqe)
            item = inflight.pop(tag, None)
            if item is not None:
                done.append((item[0], res))
        # Refill the ring before running completions (checksums): the device stays
        # busy while this thread verifies what it just read.
        while backlog and len(inflight) < self.depth:
            op = backlog.popleft()
            if not _prepare(op):
                continue
            try:
                iov = L.iovec(op.bufs)
            except (OverflowError, ValueError, TypeError):
                log.exception("ssd_uring_bad_op")
                _finish(op, -errno.EINVAL)
                continue
            sqe = L.io_uring_get_sqe(ring)
            if op.write:
                L.io_uring_prep_writev(sqe, op.fd, iov, len(op.bufs), op.offset)
            else:
                L.io_uring_prep_readv(sqe, op.fd, iov, op.offset)
            L.io_uring_sqe_set_flags(sqe, IOSQE_ASYNC)
            tag = next(self._tags)
            L.io_uring_sqe_set_data64(sqe, tag)
            inflight[tag] = (op, iov)  # iov keeps the buffers alive until completion
            # Submit one op at a time: the first write need not wait for the next
            # ones' checksums (a syscall per >= 64 KiB I/O is cheap).
            try:
                L.io_uring_submit(ring)
            except OSError as exc:  # pragma: no cover - ring broken
                log.error("ssd_uring_submit_failed", error=str(exc))
        for op, res in done:
            _finish(op, res)
        return self._stop and not inflight and not backlog and not self._jobs

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop = True
        os.eventfd_write(self.efd, 1)
        self._thread.join()
        os.close(self.efd)


def uring_unavailable_reason() -> str | None:
    """Why the io_uring engine cannot run here (None: it can). Never touches a 2026.x wheel."""
    try:
        import liburing as L  # noqa: N812
    except ImportError as exc:
        return f"liburing is not installed ({exc})"
    if not hasattr(L, "io_uring") or not hasattr(L, "iovec"):
        ver = getattr(L, "__version__", "?")
        return (f"liburing {ver} has the 2026 API (its wheels need AVX-512 and take no memoryviews); "
                "install liburing==2024.5.3")
    try:
        ring = L.io_uring()
        L.io_uring_queue_init(2, ring, 0)
        L.io_uring_queue_exit(ring)
    except OSError as exc:
        return f"io_uring_setup failed: {exc}"
    return None


def make_engine(kind: str, depth: int) -> Engine:
    """``kind``: ``uring``, ``threads`` or ``auto`` (io_uring when it works here)."""
    if kind == "threads":
        return ThreadEngine(depth)
    why = uring_unavailable_reason()
    if why is None:
        return UringEngine(depth)
    if kind == "uring":
        raise SsdError(f"--ssd-io-engine uring: {why}")
    log.warning("ssd_uring_unavailable", reason=why, fallback="threads")
    return ThreadEngine(depth)
