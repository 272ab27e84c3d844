"""How late an asyncio event loop runs what is due: a timer asks to wake every
``interval`` and observes how much later than that it woke.

The lag is time the loop spent on other callbacks, or waiting for a CPU or for the GIL
(a thread of the same process running Python). Every request the loop serves waits the
same way, so a process whose answers are slow while its handlers are fast shows it here.
One timer wake-up per ``interval``: nothing measurable beside the work it watches. Its
floor is the poller's timer granularity: epoll waits whole milliseconds, so an idle loop
reads ~0.5-1 ms; lags well above that are the loop's.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

INTERVAL_S = 0.1
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def lag_histogram(name: str, what: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, f"How much later than due {what}'s event loop ran a timer (asked every "
                     f"{INTERVAL_S:g} s): time on other work or waiting for a CPU or the GIL; every "
                     "request waits it too.", registry=registry, buckets=BUCKETS)


async def watch(hist: Histogram, interval: float = INTERVAL_S) -> None:
    """Observe the running loop's lag into ``hist`` every ``interval``, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        hist.observe(max(0.0, loop.time() - due))
