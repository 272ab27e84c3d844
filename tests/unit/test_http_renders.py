"""/metrics renders at most once per interval, and never answers with an older render.

pegaflow/common/http.py's :class:`Renders` against a registry whose one collector counts
its collects and serves a value the test changes: the figures come from the collector.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pegaflow.common.http import Renders

INTERVAL = 0.3

# Waits timed against a 0.3 s interval (one render within 0.15 s, the next slot no sooner than
# 0.24 s): alone in a parallel run, where a neighbour's burst cannot stretch them.
pytestmark = pytest.mark.serial


class Counting(Collector):
    def __init__(self) -> None:
        self.value = 0.0
        self.collects = 0

    def collect(self) -> list[GaugeMetricFamily]:
        self.collects += 1
        return [GaugeMetricFamily("probe_value", "the test's value", value=self.value)]


def value_in(body: bytes) -> float:
    line = next(x for x in body.decode().splitlines() if x.startswith("probe_value "))
    return float(line.split()[1])


def setup() -> tuple[Counting, Renders]:
    reg = CollectorRegistry()
    c = Counting()
    reg.register(c)
    c.collects = 0  # register() may describe/collect once
    return c, Renders(reg, INTERVAL)


def test_scrapes_within_an_interval_share_one_render_and_none_is_older_than_its_request() -> None:
    c, r = setup()

    async def main() -> None:
        c.value = 1.0
        assert value_in(await r.text()) == 1.0  # the first scrape renders at once
        assert c.collects == 1
        c.value = 2.0  # changed after the last render: every later scrape must see it
        t0 = time.monotonic()
        bodies = await asyncio.gather(*(r.text() for _ in range(8)))
        took = time.monotonic() - t0
        assert [value_in(b) for b in bodies] == [2.0] * 8
        assert c.collects == 2, "eight scrapes inside one interval share one render"
        assert INTERVAL * 0.8 <= took < INTERVAL + 2.0, took  # they waited for the next render slot

    asyncio.run(main())


def test_a_scrape_after_the_interval_renders_at_once() -> None:
    c, r = setup()

    async def main() -> None:
        await r.text()
        await asyncio.sleep(INTERVAL)
        c.value = 3.0
        t0 = time.monotonic()
        assert value_in(await r.text()) == 3.0
        assert time.monotonic() - t0 < INTERVAL / 2  # no wait: the interval had passed
        assert c.collects == 2

    asyncio.run(main())


def test_interval_bounds_the_render_rate_under_steady_scrapers() -> None:
    """Four scrapers, each every 0.1 s for 1.2 s: at most one render per interval (+ the first)."""
    c, r = setup()

    async def scraper() -> int:
        n = 0
        end = time.monotonic() + 1.2
        while time.monotonic() < end:
            await r.text()
            n += 1
            await asyncio.sleep(0.1)
        return n

    async def main() -> None:
        scrapes = sum(await asyncio.gather(*(scraper() for _ in range(4))))
        elapsed_slots = 1.2 / INTERVAL + 2  # the first render, and one that may end past the window
        assert scrapes >= 8 and c.collects <= elapsed_slots, (scrapes, c.collects)
        assert c.collects < scrapes

    asyncio.run(main())


def test_a_paced_render_is_the_same_text_with_pauses_between_slices(monkeypatch) -> None:  # noqa: ANN001
    """With ``pause`` the render goes family by family and awaits ``pause()`` before it starts
    and after every SLICE_S of rendering; the text is exactly the unpaced one."""
    from prometheus_client import Counter, Gauge, Histogram, generate_latest

    from pegaflow.common import http

    reg = CollectorRegistry()
    Counter("probe_calls", "calls", ["method"], registry=reg).labels("query").inc(3)
    Gauge("probe_level", "level", registry=reg).set(2.5)
    Histogram("probe_seconds", "latency", registry=reg).observe(0.004)
    families = len(list(reg.collect()))
    pauses: list[int] = []

    async def pause() -> None:
        pauses.append(len(pauses))

    async def run() -> bytes:
        return await Renders(reg, 0.0, pause).render()

    monkeypatch.setattr(http, "SLICE_S", 0.0)  # a pause after every family
    assert asyncio.run(run()) == generate_latest(reg)
    assert len(pauses) == 1 + families
    pauses.clear()
    monkeypatch.setattr(http, "SLICE_S", 60.0)  # one slice: only the pause before it starts
    assert asyncio.run(run()) == generate_latest(reg)
    assert len(pauses) == 1



def test_settle_is_awaited_once_before_each_render() -> None:
    from prometheus_client import Counter, generate_latest

    reg = CollectorRegistry()
    c = Counter("probe_calls", "calls", registry=reg)
    order: list[str] = []

    async def settle() -> None:  # the node's hop: what it counts lands before the render
        order.append("settle")
        c.inc()

    async def pause() -> None:
        order.append("pause")

    async def run() -> bytes:
        return await Renders(reg, 0.0, pause, settle).render()

    body = asyncio.run(run())
    assert order[0] == "settle" and order.count("settle") == 1 and "pause" in order
    assert body == generate_latest(reg) and b"probe_calls_total 1.0" in body
