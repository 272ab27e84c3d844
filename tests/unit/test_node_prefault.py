"""What the node reports as pre-faulted (Health, Stats, /health, /metrics) is allocatable.

The pool's pre-fault thread counts a chunk before the event loop hands it to the allocator
(pegaflow/node/daemon.py, ``_start_prefault``). Reporting the thread's count let a client
that waited for the whole pool reserve before any page could be given (a Reserve that got
nothing, under load in ``make test-fast``). The pre-fault thread is the hardware edge
faked here: it counts the whole pool, then waits before the loop hears of it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from pegaflow.config.commands import node_config
from pegaflow.node.daemon import Node


def test_the_reported_prefault_never_runs_ahead_of_the_allocator() -> None:
    node = Node(node_config(pool_size=4 << 20, http_addr="", local_socket=""))
    counted, tell = threading.Event(), threading.Event()

    def fake_prefault(on_progress: Callable[[int], None] | None = None) -> None:
        def run() -> None:
            node.pool.prefaulted = node.pool.size  # the thread's own count moves first
            counted.set()
            tell.wait(10)
            assert on_progress is not None
            on_progress(node.pool.size)
        threading.Thread(target=run, daemon=True).start()

    node.pool.start_prefault = fake_prefault  # type: ignore[method-assign]

    async def run() -> None:
        node._start_prefault()  # noqa: SLF001 - the step under test
        assert await asyncio.to_thread(counted.wait, 10)
        # Counted by the thread, not yet allocatable: nothing reports it.
        assert node.allocator.free_bytes == 0
        assert node.service.pool_prefaulted() == 0
        assert node.health()["pool_prefaulted_bytes"] == 0 and node.health()["pool_ready"] is False
        tell.set()
        for _ in range(200):  # bounded: 10 s
            if node.service.pool_prefaulted() == node.pool.size:
                break
            await asyncio.sleep(0.05)
        # Reported once allocatable, and by then all of it is.
        assert node.service.pool_prefaulted() == node.pool.size
        assert node.allocator.free_bytes == node.allocator.capacity > 0
        assert node.health()["pool_ready"] is True

    try:
        asyncio.run(run())
    finally:
        node.pool.close()
