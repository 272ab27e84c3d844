"""The metaserver's background census is paced (pegaflow/meta/metrics.py, run_census): after
every step of a count it waits so that counting takes at most CENSUS_SHARE of the time, and a
stop during a count ends it without a warning or a half count served."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry

from pegaflow.meta.index import Census, Pause
from pegaflow.meta.metrics import CENSUS_SHARE, MetaMetrics, run_census

COUNT = Census(10, 12, (8, 2, 0, 0), 12)


class RecordingStop(threading.Event):
    """A stop event that records each wait and never sleeps; set after ``set_after`` waits."""

    def __init__(self, set_after: int) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.set_after = set_after

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0.0))
        if len(self.waits) >= self.set_after:
            self.set()
        return self.is_set()


def test_each_step_of_a_count_is_followed_by_a_wait_that_keeps_it_to_its_share() -> None:
    metrics = MetaMetrics(CollectorRegistry())
    steps = [0.010, 0.002, 0.030]

    def count(pause: Pause) -> Census:
        for s in steps:
            pause(s)
        return COUNT

    stop = RecordingStop(set_after=len(steps) + 1)  # the count's pauses, then the interval's wait: stop
    run_census(metrics, count, stop, interval=60.0)
    assert metrics.census == COUNT and metrics.census_at > 0
    pauses, interval = stop.waits[:-1], stop.waits[-1]
    assert interval == 60.0
    for busy, waited in zip(steps, pauses, strict=True):
        assert busy / (busy + waited) == pytest.approx(CENSUS_SHARE)


def test_a_stop_during_a_count_ends_it_and_serves_no_half_count() -> None:
    metrics = MetaMetrics(CollectorRegistry())
    reached: list[int] = []

    def count(pause: Pause) -> Census:
        for i in range(100):
            reached.append(i)
            pause(0.001)
        return COUNT

    stop = RecordingStop(set_after=3)
    run_census(metrics, count, stop, interval=60.0)  # returns: the third pause finds the stop set
    assert reached == [0, 1, 2]
    assert metrics.census is None
