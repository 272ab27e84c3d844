"""The io_uring engine hands every I/O to the kernel's workers (IOSQE_ASYNC): the wheel's
``io_uring_submit`` holds the GIL, and an inline O_DIRECT issue on a preallocated file
builds the bios inside it, a stall of the node's event loop (pegaflow/node/tiers/ssd/uring.py).
A real ring and a real preallocated O_DIRECT file; the spy only watches the calls."""

from __future__ import annotations

import mmap
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from pegaflow.node.tiers.ssd.uring import IOSQE_ASYNC, IoOp, UringEngine
from tests.unit.test_ssd_store import WAIT_S, _engine_or_skip

PAGE = 64 << 10


class Spy:
    """liburing, with each SQE's flags recorded by the SQE it was set on."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.sqes: list[Any] = []
        self.flags: dict[int, int] = {}
        self.unflagged_at_submit = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def io_uring_get_sqe(self, ring: Any) -> Any:
        sqe = self.real.io_uring_get_sqe(ring)
        self.sqes.append(sqe)
        return sqe

    def io_uring_sqe_set_flags(self, sqe: Any, flags: int) -> None:
        self.flags[id(sqe)] = flags
        self.real.io_uring_sqe_set_flags(sqe, flags)

    def io_uring_submit(self, ring: Any) -> int:
        self.unflagged_at_submit += sum(1 for s in self.sqes if not self.flags.get(id(s), 0) & IOSQE_ASYNC)
        return self.real.io_uring_submit(ring)


def test_every_read_and_write_goes_to_the_kernels_workers_and_lands_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _engine_or_skip("uring")
    import liburing

    spy = Spy(liburing)
    monkeypatch.setitem(sys.modules, "liburing", spy)  # what the engine imports
    path = tmp_path / "cache.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    eng = UringEngine(4)
    assert eng.L is spy
    try:
        os.posix_fallocate(fd, 0, 16 * PAGE)  # allocated blocks: the inline-issue case
        src = mmap.mmap(-1, 8 * PAGE)
        src.write(os.urandom(8 * PAGE))
        dst = mmap.mmap(-1, 8 * PAGE)
        done = threading.Semaphore(0)
        results: list[int] = []

        def finished(res: int) -> None:
            results.append(res)
            done.release()

        def run(ops: list[IoOp]) -> None:
            eng.submit(ops)
            for _ in ops:
                assert done.acquire(timeout=WAIT_S), "an I/O did not complete"

        view_s, view_d = memoryview(src), memoryview(dst)
        run([IoOp(True, fd, k * 4 * PAGE, [view_s[(k * 4 + j) * PAGE:(k * 4 + j + 1) * PAGE] for j in range(4)],
                  finished) for k in range(2)])
        run([IoOp(False, fd, k * 4 * PAGE, [view_d[(k * 4 + j) * PAGE:(k * 4 + j + 1) * PAGE] for j in range(4)],
                  finished) for k in range(2)])
        assert results == [4 * PAGE] * 4
        assert bytes(dst) == bytes(src)
        assert len(spy.sqes) == 4
        assert all(spy.flags.get(id(s), 0) & IOSQE_ASYNC for s in spy.sqes)
        assert spy.unflagged_at_submit == 0
    finally:
        eng.close()
        os.close(fd)


def test_close_after_the_engine_thread_ended_on_its_own_is_clean() -> None:
    """close() sets the stop flag, then wakes the thread; the thread, woken by its own poll
    timeout in between, may end first. It used to close the eventfd as it ended, so close()
    wrote to a closed descriptor (EBADF in a loaded CI run). Here the thread ends first."""
    _engine_or_skip("uring")
    eng = UringEngine(4)
    eng._stop = True  # noqa: SLF001 - what close() sets first
    eng._thread.join(timeout=WAIT_S)  # noqa: SLF001 - it ends at its next poll timeout
    assert not eng._thread.is_alive()  # noqa: SLF001
    eng.close()
    with pytest.raises(OSError):
        os.fstat(eng.efd)  # closed by close(), once
    eng.close()  # a second close does nothing
