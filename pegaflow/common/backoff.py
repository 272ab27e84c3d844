"""Keys taken out of rotation after failures: peers a node pulls from, the metaserver it
asks, the engines a router sends to.

One rule of exponential backoff for the whole product: the period is tenacity's
``wait_exponential`` (the strategy the retried calls use: the node's discovery and event
publishing, the connector's reconnects), applied per key. The first failure in a row skips a
key for ``base`` seconds, each further one doubles it up to ``cap``; a success forgets the
key. tenacity retries one call in a loop; here many keys fail independently and callers
ask whether to skip one, so only the bookkeeping per key is ours.

Not thread-safe: each user runs it on one event loop. The clock is injected (tests move it
by hand).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import tenacity


class Backoff:
    def __init__(self, base: float, cap: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._wait = tenacity.wait_exponential(multiplier=base, max=cap)
        self._until: dict[str, tuple[float, int]] = {}  # key -> (skip until, failures in a row)

    def skip(self, key: str) -> bool:
        """Whether ``key`` is still backed off."""
        e = self._until.get(key)
        return e is not None and self.clock() < e[0]

    def fail(self, key: str) -> float:
        """Record a failure of ``key``; returns how long it is skipped from now."""
        failures = self._until.get(key, (0.0, 0))[1] + 1
        # tenacity's waits read attempt_number only: no Retrying object behind the state.
        state = tenacity.RetryCallState(None, None, (), {})  # type: ignore[arg-type]  # retry_object: none needed
        state.attempt_number = failures
        period = float(self._wait(state))
        self._until[key] = (self.clock() + period, failures)
        return period

    def ok(self, key: str) -> None:
        """``key`` worked: forget its failures."""
        self._until.pop(key, None)

    def active(self) -> int:
        """How many keys are backed off now."""
        now = self.clock()
        return sum(1 for until, _ in self._until.values() if until > now)
