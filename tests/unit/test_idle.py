"""Background hand-offs wait for a pause in the data path, bounded (pegaflow/node/idle.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pegaflow.node import idle as idle_mod
from pegaflow.node.idle import DataPathIdle, loop_hop

# Millisecond bounds (a 10 ms quiet time timed from just after a call, a 40 ms hop): alone
# in a parallel run, where a neighbour's burst cannot stretch them.
pytestmark = pytest.mark.serial


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_delay_waits_for_quiet_and_never_past_the_bound() -> None:
    c = Clock()
    idle = DataPathIdle(quiet_s=0.001, max_defer_s=0.02, clock=c)
    assert idle.delay(c.t) == 0.0  # no call yet: quiet
    idle.touch()
    assert abs(idle.delay(c.t) - 0.001) < 1e-12  # a call just ended: wait the quiet time
    c.t += 0.0004
    assert abs(idle.delay(c.t - 0.0004) - 0.0006) < 1e-12
    c.t += 0.0006
    assert idle.delay(c.t - 0.001) == 0.0  # quiet long enough
    since = c.t
    for _ in range(41):  # calls every 0.5 ms: never quiet, but the bound holds
        c.t += 0.0005
        idle.touch()
        d = idle.delay(since)
        assert d <= max(0.0, 0.02 - (c.t - since)) + 1e-12
    assert c.t - since >= 0.02 and idle.delay(since) == 0.0


def test_call_runs_in_order_after_the_pause_and_not_inside_the_caller() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        idle = DataPathIdle(quiet_s=0.01, max_defer_s=1.0)
        ran: list[str] = []
        idle.touch()
        t0 = time.perf_counter()
        idle.call(loop, ran.append, "a")
        idle.call(loop, ran.append, "b")
        assert ran == []  # never inline
        while len(ran) < 2:
            await asyncio.sleep(0.001)
        assert time.perf_counter() - t0 >= 0.009  # waited for the quiet time
        assert idle.deferred >= 1
        idle.call(loop, ran.append, "c")  # long quiet now: at the next turn of the loop
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return ran

    assert asyncio.run(main()) == ["a", "b", "c"]


def test_a_busy_data_path_delays_background_work_by_the_bound_only() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        idle = DataPathIdle(quiet_s=0.005, max_defer_s=0.05)
        done = asyncio.Event()
        t0 = time.perf_counter()
        idle.touch()
        idle.call(loop, done.set)
        while not done.is_set():  # a call at every turn of the loop: never a 5 ms pause
            idle.touch()
            await asyncio.sleep(0)
        return time.perf_counter() - t0

    took = asyncio.run(main())
    assert 0.045 <= took < 1.0, took


def test_pause_and_wait_blocking_return_after_quiet() -> None:
    idle = DataPathIdle(quiet_s=0.01, max_defer_s=1.0)
    idle.touch()
    t0 = time.perf_counter()
    asyncio.run(idle.pause())
    assert time.perf_counter() - t0 >= 0.009
    idle.touch()
    out: list[float] = []
    th = threading.Thread(target=lambda: (idle.wait_blocking(), out.append(time.perf_counter())))
    t1 = time.perf_counter()
    th.start()
    th.join(5)
    assert out and out[0] - t1 >= 0.009


def test_loop_hop_returns_after_what_the_loop_queued_before_it() -> None:
    """A Query's counts are queued behind its answer: a scrape sent after the answer
    arrived hops through the loop first and finds them counted, even when the loop is
    busy with something queued before them."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    answered, counted = threading.Event(), []

    def answer() -> None:  # the handler: something slow is queued, then the counts, then the answer is out
        loop.call_soon(time.sleep, 0.3)
        loop.call_soon(counted.append, 1)
        answered.set()

    try:
        loop.call_soon_threadsafe(answer)
        assert answered.wait(5)
        assert counted == []  # the scrape's race: without the hop it would read nothing yet
        asyncio.run(loop_hop(loop)())
        assert counted == [1]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_loop_hop_is_bounded_and_returns_at_once_on_a_closed_loop(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(idle_mod, "HOP_TIMEOUT_S", 0.05)
    stopped = asyncio.new_event_loop()  # not running: the hop's callback never runs
    try:
        t = time.perf_counter()
        asyncio.run(loop_hop(stopped)())
        assert 0.04 <= time.perf_counter() - t < 2
    finally:
        stopped.close()
    t = time.perf_counter()
    asyncio.run(loop_hop(stopped)())  # closed
    assert time.perf_counter() - t < 0.04
