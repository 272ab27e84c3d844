"""bench.common.socket_round_trip: the host's floor for a local call, two bare processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import socket_round_trip  # noqa: E402


@pytest.mark.serial  # a p99.9 under 200 ms, pinned to one CPU
def test_round_trips_are_counted_and_the_caller_keeps_its_cpus() -> None:
    before = os.sched_getaffinity(0)
    for same_cpu in (False, True):
        f = socket_round_trip(0.2, same_cpu=same_cpu, gap=0.001)
        # 0.2 s of round trips with 1 ms pauses, and never fewer than min_samples (20).
        assert f["n"] >= 20, f
        assert 0 < f["p50_us"] <= f["p99_us"] <= f["p999_us"] < 200_000, f
    assert os.sched_getaffinity(0) == before  # pinned only while it measured


def test_the_echo_process_is_gone_afterwards() -> None:
    import psutil

    me = psutil.Process()
    # Shorter than one round trip on a slow host: it still waits for its minimum count.
    f = socket_round_trip(0.0, same_cpu=False, min_samples=5)
    assert f["n"] == 5
    assert not [c for c in me.children() if "socket.socket(fileno" in " ".join(c.cmdline())]
