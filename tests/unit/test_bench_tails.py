"""bench/common.py's ``p99_ratio_interval``: how far a run's p99 ratio moves with the calls
that happened to land in its tail (bench/backup.py's Query p99 on / off, bench/meta.py's
lookups beside the original's metaserver)."""

from __future__ import annotations

import pytest

from bench.common import p99_ratio_interval

CALLS = [float(x) for x in range(1, 1001)]


def test_the_p99_ratios_spread_comes_from_the_calls_in_the_tail() -> None:
    assert p99_ratio_interval(CALLS, CALLS) == pytest.approx((1.0, 1.0), abs=0.02)  # the same calls
    lo, hi = p99_ratio_interval([2 * x for x in CALLS], CALLS)
    assert lo < 2.0 < hi and hi - lo < 0.1  # every call of a twice its call of b
    # One slow call in a hundred: whether resamples catch it moves the ratio far.
    slow = CALLS[:-10] + [50_000.0] * 10
    lo, hi = p99_ratio_interval(slow, CALLS)
    assert lo < 1.5 and hi > 10


def test_paired_resamples_keep_a_slow_moment_of_the_host_on_both_sides() -> None:
    # Rounds of one call to each server; in 15 rounds the host stalled both calls alike.
    a = [100.0 + i % 7 for i in range(1000)]
    b = [100.0 + (3 * i) % 7 for i in range(1000)]  # the same calls, in another order
    for i in range(0, 1000, 67):
        a[i] += 5000.0
        b[i] += 5000.0
    lo, hi = p99_ratio_interval(a, b, paired=True)
    assert 0.97 < lo <= hi < 1.03  # the tails are the same moments
    lo_u, hi_u = p99_ratio_interval(a, b)
    assert hi_u - lo_u > 10 * (hi - lo)  # unpaired, a resample may catch a stall on one side only


def test_paired_calls_need_as_many_on_each_side() -> None:
    with pytest.raises(ValueError, match="1000 and 999"):
        p99_ratio_interval(CALLS, CALLS[1:], paired=True)
