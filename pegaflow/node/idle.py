"""Background hand-offs wait for a pause in the data path (bounded).

The node's background threads (the SSD tier's I/O thread, the peers' checksum hasher, the
event publisher) run Python for every block a Commit adds, and they share the GIL with the
event loop that serves engines. Woken by the Commit itself, they ran exactly when the same
engine's next calls arrived (the connector's Release, the next request's Query): each GIL
hand-back to the loop then waits for a switch interval, several times per call
(``bench/dataplane.py --parts ssd``: Release p99 5.6x the quiet node's; ``--parts redis``:
8.1x; their handlers' own p99 stayed at 100 µs).

So work a data-path call creates is handed to the background only once the data path has
been quiet for :data:`QUIET_S`, or once it has waited :data:`MAX_DEFER_S` (a node that is
never quiet still spills, publishes and hashes, a few milliseconds late). This is the
loop's priority over its background; nothing is dropped or reordered by it.

The service stamps the end of every data-path call (:meth:`DataPathIdle.touch`, on the
loop); the background reads the stamp from any thread (a float: one atomic read).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVarTuple

HOP_TIMEOUT_S = 1.0  # a loop_hop gives up waiting for a loop this busy (or stopping)
QUIET_S = 0.001  # the data path has served no call this long: background work may start
MAX_DEFER_S = 0.02  # however busy the data path, deferred work starts within this

Ts = TypeVarTuple("Ts")  # a deferred call's arguments


class DataPathIdle:
    """When the data path last served a call, and hand-offs that wait for it to pause.

    One per node, built first by the node (``daemon.py``) and given to the service, which
    stamps it, and to what waits on it: the SSD tier, the page checksums, the publisher, the
    housekeeping and the ``/metrics`` renders.
    """

    def __init__(self, quiet_s: float = QUIET_S, max_defer_s: float = MAX_DEFER_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.quiet_s, self.max_defer_s, self.clock = quiet_s, max_defer_s, clock
        self.last_call = -1e9
        # (queued at, fn, its arguments): each pair checked where queued (``call``)
        self._queue: deque[tuple[float, Callable[..., object], tuple[object, ...]]] = deque()
        self._timer: asyncio.Handle | None = None
        self.deferred = 0  # times a hand-off had to wait (tests read it)

    def touch(self) -> None:
        """A data-path call just ended (the service, on the loop)."""
        self.last_call = self.clock()

    def delay(self, since: float) -> float:
        """Seconds work queued at ``since`` should still wait (0: start it now)."""
        now = self.clock()
        quiet = now - self.last_call
        if quiet >= self.quiet_s or now - since >= self.max_defer_s:
            return 0.0
        return min(self.quiet_s - quiet, self.max_defer_s - (now - since))

    def call(self, loop: asyncio.AbstractEventLoop, fn: Callable[[*Ts], object], *args: *Ts) -> None:
        """Run ``fn(*args)`` on ``loop`` (the caller's) once the data path pauses; in call order."""
        self._queue.append((self.clock(), fn, args))
        if self._timer is None:  # never inline: the caller is inside a data-path call
            self._timer = loop.call_soon(self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        while self._queue:
            d = self.delay(self._queue[0][0])
            if d > 0:
                self.deferred += 1
                self._timer = loop.call_later(d, self._run, loop)
                return
            _, fn, args = self._queue.popleft()
            fn(*args)

    async def pause(self) -> None:
        """Return once the data path pauses (at most :data:`MAX_DEFER_S` from now)."""
        since = self.clock()
        while (d := self.delay(since)) > 0:
            self.deferred += 1
            await asyncio.sleep(d)

    def wait_blocking(self, sleep: Callable[[float], None] = time.sleep) -> None:
        """:meth:`pause` for a background thread (sleeps release the GIL)."""
        since = self.clock()
        while (d := self.delay(since)) > 0:
            sleep(d)


def loop_hop(loop: asyncio.AbstractEventLoop) -> Callable[[], Awaitable[None]]:
    """An async function for another thread's loop that returns once ``loop`` has run every
    callback queued on it before the call (or after :data:`HOP_TIMEOUT_S`). The node's
    ``/metrics`` renders await it first (``Renders(settle=...)``): a Query's counts are
    queued behind its answer, so a scrape sent after the answer arrived counts it."""

    async def hop() -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            loop.call_soon_threadsafe(done.set_result, None)
        except RuntimeError:  # the loop is closed: nothing is queued on it any more
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(done), HOP_TIMEOUT_S)
        except TimeoutError:
            pass

    return hop
