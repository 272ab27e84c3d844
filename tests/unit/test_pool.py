"""The node's shared-memory pool as engines get it: a read-write descriptor of a memfd.

Its size is sealed: an engine that shrank it (``ftruncate``, a bug or worse) would make
every process touching the lost pages die of SIGBUS, the node and every other engine."""

from __future__ import annotations

import os

import pytest

from pegaflow.node.pool import SharedPool


def test_an_engine_holding_the_pool_cannot_change_its_size() -> None:
    pool = SharedPool(1 << 20, name="test-sealed")
    try:
        assert pool.sealed
        fd = os.open(pool.path, os.O_RDWR)  # as an engine opens it (or receives it over the socket)
        try:
            for size in (0, 2 << 20):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            assert os.fstat(fd).st_size == 1 << 20
            pool.view[:4] = b"kept"  # the pages stay writable
            assert os.pread(fd, 4, 0) == b"kept"
        finally:
            os.close(fd)
    finally:
        pool.close()
