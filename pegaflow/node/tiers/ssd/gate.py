"""Per-direction bounds in front of the I/O engine: the original's SSD queue depths and
in-flight limits.

The original runs one writer loop and one prefetch loop, each fed by a bounded channel of
batches (``--ssd-write-queue-depth`` 8, ``--ssd-prefetch-queue-depth`` 2: a batch offered
to a full channel is dropped, never waited for) and each keeping at most
``--ssd-write-inflight`` 2 / ``--ssd-prefetch-inflight`` 16 I/Os in flight. An
:class:`IoGate` is one such direction here:

- A batch is the ops of one write-behind issue (the blocks one Commit added) or of one
  Query's promotion. :meth:`IoGate.offer` queues it unless ``queue_depth`` batches are
  already waiting (False: the caller drops it, as the original does). A batch waits only
  while some of its ops are not submitted yet; one that fits the free in-flight slots at
  once never counts against the depth.
- At most ``inflight`` ops of the direction are submitted to the engine and not completed.
  One op is one ``readv``/``writev`` of adjacent records (coalesced up to 4 MiB), so the
  bound is on I/Os, as the engine's own ``--ssd-queue-depth`` (which still bounds both
  directions together).
- Event loop only: ops are submitted from the loop, and an op's completion hands its slot
  back through ``post`` (the tier's ``call_soon``), after the completion the op itself posted.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from pegaflow.node.tiers.ssd.uring import Engine, IoOp


class IoGate:
    def __init__(
        self,
        engine: Engine,
        post: Callable[..., None],
        inflight: int,
        queue_depth: int,
        on_change: Callable[[IoGate], None] | None = None,
    ) -> None:
        if inflight < 1 or queue_depth < 1:
            raise ValueError(f"in-flight limit and queue depth must be >= 1, got {inflight}, {queue_depth}")
        self.engine = engine
        self.post = post
        self.limit = inflight
        self.queue_depth = queue_depth
        self.inflight = 0
        self.peak = 0  # most ops of this direction in flight at once since start
        self._queue: collections.deque[collections.deque[IoOp]] = collections.deque()
        self._on_change = on_change

    def waiting(self) -> int:
        """Batches with ops not submitted yet."""
        return len(self._queue)

    def full(self) -> bool:
        return len(self._queue) >= self.queue_depth

    def offer(self, ops: Sequence[IoOp]) -> bool:
        """Queue one batch; False (nothing queued) when ``queue_depth`` batches wait."""
        if not ops:
            return True
        if self.full():
            return False
        self._queue.append(collections.deque(ops))
        self._pump()
        return True

    def _pump(self) -> None:
        out: list[IoOp] = []
        q = self._queue
        while q and self.inflight < self.limit:
            head = q[0]
            op = head.popleft()
            if not head:
                q.popleft()
            op.complete = self._wrap(op.complete)
            self.inflight += 1
            out.append(op)
        if out:
            self.peak = max(self.peak, self.inflight)
            self.engine.submit(out)
        if self._on_change is not None:
            self._on_change(self)

    def _wrap(self, complete: Callable[[int], None]) -> Callable[[int], None]:
        post = self.post

        def done(res: int) -> None:  # engine thread
            try:
                complete(res)
            finally:
                post(self._released)

        return done

    def _released(self) -> None:
        self.inflight -= 1
        self._pump()

    def stats(self) -> dict[str, int]:
        return {"inflight": self.inflight, "peak": self.peak, "waiting": len(self._queue),
                "limit": self.limit, "queue_depth": self.queue_depth}
