"""The event-loop lag watcher observes how late its timer ran."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from pegaflow.common.loop_lag import lag_histogram, watch


def sampled(reg: CollectorRegistry, name: str) -> tuple[float, float]:
    return (reg.get_sample_value(f"{name}_count") or 0.0, reg.get_sample_value(f"{name}_sum") or 0.0)


def test_a_callback_that_holds_the_loop_shows_as_lag() -> None:
    reg = CollectorRegistry()
    hist = lag_histogram("t_loop_lag_seconds", "the test", reg)

    async def main() -> None:
        task = asyncio.create_task(watch(hist, interval=0.02))
        await asyncio.sleep(0.1)  # a few quiet samples first
        quiet = sampled(reg, "t_loop_lag_seconds")
        time.sleep(0.3)  # the loop is held: the watcher's timer is due meanwhile
        await asyncio.sleep(0.05)
        task.cancel()
        held = sampled(reg, "t_loop_lag_seconds")
        assert quiet[0] >= 2 and held[0] > quiet[0]
        # The one late wake-up carries nearly the whole hold; the quiet ones far less.
        assert held[1] - quiet[1] >= 0.25
        assert reg.get_sample_value("t_loop_lag_seconds_bucket", {"le": "0.25"}) < held[0]

    asyncio.run(main())
