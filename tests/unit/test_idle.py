"""Background hand-offs wait for a pause in the data path, bounded (pegaflow/node/idle.py)."""

from __future__ import annotations

import asyncio
import threading
import time

from pegaflow.node.idle import DataPathIdle


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
