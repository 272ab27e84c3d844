"""Hit-rate ceiling: HLL error at known cardinalities, rolling windows, memory bound, merge."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pegaflow.core.durations import format_duration, parse_duration, parse_windows
from pegaflow.policy.ceiling import MAX_BYTES, CeilingEstimator, choose_lg_k
from tests.oracles.ceiling import ExactCeiling, exact_ceiling


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _keys(n: int, salt: int) -> list[int]:
    """n distinct 128-bit-wide ints, as block hashes are."""
    base = (salt << 100) | 0x5BD1E995
    return [base + i * 0x9E3779B97F4A7C15 for i in range(n)]


@pytest.mark.parametrize("distinct", [10_000, 100_000, 1_000_000])
def test_distinct_error_within_one_percent_at_known_cardinalities(distinct: int) -> None:
    start = 90.0 * 200  # a bucket boundary of every window
    clock = FakeClock(start)
    est = CeilingEstimator(clock=clock)
    keys = _keys(distinct, salt=distinct)
    # Three accesses per key, spread over the 10 buckets of the 15m window, so every read
    # is a union of sketches (the less accurate estimator).
    chunk = len(keys) // 10
    for b in range(10):
        for rep in range(3):
            clock.t = start + 90 * b + 30 * rep
            est.observe(keys[b * chunk : (b + 1) * chunk], hits=chunk if rep == 2 else 0)
    clock.t = start + 899
    for window in est.windows:
        s = est.stats(window)
        assert s.requests == 3 * distinct
        assert abs(s.distinct - distinct) / distinct <= 0.01, (window, s.distinct)
        assert abs(s.ceiling - 2 / 3) <= 0.01 * (1 / 3) + 1e-12
        assert s.hit_rate == pytest.approx(1 / 3)
    assert est.rel_error(2) <= 0.01


def test_windows_roll_off_old_data_with_a_fake_clock() -> None:
    clock = FakeClock()
    windows, buckets = (60.0, 600.0), 6  # bucket lengths 10 s and 100 s
    est = CeilingEstimator(windows, buckets, clock=clock)
    exact = ExactCeiling(windows, buckets, clock=clock)
    rng = random.Random(4)
    batches: list[tuple[float, list[int], int]] = []
    for step in range(240):  # 0..1195 s, one batch every 5 s
        clock.t = step * 5.0
        keys = [rng.randrange(3000) for _ in range(rng.randint(1, 40))]
        hits = rng.randint(0, len(keys))
        batches.append((clock.t, keys, hits))
        est.observe(keys, hits)
        exact.observe(keys, hits)
        if step % 7 == 0:
            for w, length in ((60.0, 10.0), (600.0, 100.0)):
                # A batch is in the window iff its bucket is one of the last `buckets`.
                k = int(clock.t // length)
                live = [(ks, h) for t, ks, h in batches if k - buckets < t // length <= k]
                n = sum(len(ks) for ks, _ in live)
                u = len({x for ks, _ in live for x in ks})
                a, b = est.stats(w), exact.stats(w)
                assert a.requests == b.requests == n
                assert a.hits == b.hits == sum(h for _, h in live)
                assert b.distinct == u
                assert a.distinct == pytest.approx(u, rel=0.01)
                assert a.ceiling == pytest.approx((n - u) / n, abs=0.01)
    assert est.stats("1m").requests < est.stats("10m").requests
    # Nothing observed for a full window: it is empty again (and says 0, not NaN).
    clock.t += 60.0
    assert est.stats(60.0).requests == 0
    assert est.ceiling(60.0) == 0.0 and est.measured_hit_rate(60.0) == 0.0
    assert est.stats(600.0).requests > 0
    clock.t += 600.0
    assert est.stats(600.0).requests == exact.stats(600.0).requests == 0


def test_old_batches_are_dropped_not_misfiled() -> None:
    clock = FakeClock(1000.0)
    est = CeilingEstimator((60.0, 600.0), 6, clock=clock)
    est.observe([1, 2, 3])
    est.observe([4, 5], now=1000.0 - 60.0)  # its fine bucket was recycled for t=1000
    assert est.dropped == 2
    assert est.stats(60.0).requests == 3


def test_all_windows_together_fit_in_one_mebibyte() -> None:
    clock = FakeClock(0.0)
    est = CeilingEstimator(clock=clock)  # 15m, 1h, 1d x 10 buckets, lg_k 16
    assert est.lg_k == 16
    end = 86_400.0 * 3
    times = sorted(
        {end - 86_400 + 8640 * j + 1 for j in range(10)}
        | {end - 3600 + 360 * j + 2 for j in range(10)}
        | {end - 900 + 90 * j + 3 for j in range(10)}
    )
    for i, t in enumerate(times):
        clock.t = t
        est.observe(_keys(40_000, salt=i))  # enough to put every sketch in full HLL mode
    clock.t = end - 1
    blob = est.serialize()
    filled = [s for ring in est._rings for s in ring.live(ring.index_at(clock.t)) if s.n]
    assert len(filled) == 30, "the test must fill every bucket of every window"
    assert len(blob) <= MAX_BYTES
    assert len(blob) > 0.9 * MAX_BYTES, "sketches are not at full size; the bound is not exercised"


def test_merge_of_two_estimators_equals_estimator_of_the_union() -> None:
    clock = FakeClock(5000.0)
    a, b, both = (CeilingEstimator(clock=clock) for _ in range(3))
    rng = random.Random(8)
    universe = _keys(60_000, salt=3)
    for step in range(120):  # 2 hours, one batch per minute on each side
        clock.t = 5000.0 + 60 * step
        ka = rng.sample(universe, 500)
        kb = rng.sample(universe, 300)
        a.observe(ka, hits=100)
        b.observe(kb, hits=50)
        both.observe(ka, hits=100)
        both.observe(kb, hits=50)
    clock.t += 30
    blob_a, blob_b = a.serialize(), b.serialize()
    a.merge(blob_b)
    # A collector's view: the union of the latest snapshots, built fresh.
    cluster = CeilingEstimator.union_of([blob_a, blob_b], clock=clock)
    for merged in (a, cluster):
        for sm, sboth in zip(merged.snapshot(), both.snapshot(), strict=True):
            assert (sm.requests, sm.hits) == (sboth.requests, sboth.hits)
            # Same HLL registers; the estimates may differ in the 4th digit because HLL's HIP
            # estimator depends on the order in which sketches met. A union that double
            # counted would be off by ~40% here.
            assert sm.distinct == pytest.approx(sboth.distinct, rel=2e-3)
            assert sm.ceiling == pytest.approx(sboth.ceiling, abs=2e-3)
    # And the merge is not a no-op: b alone sees less.
    assert b.stats("1h").requests < a.stats("1h").requests
    with pytest.raises(ValueError):
        CeilingEstimator.union_of([])


def test_deserialize_round_trips_and_merge_rejects_foreign_bytes() -> None:
    clock = FakeClock(100.0)
    est = CeilingEstimator(clock=clock)
    est.observe(_keys(5000, salt=1) * 2, hits=4000)
    copy = CeilingEstimator.deserialize(est.serialize(), clock=clock)
    assert copy.snapshot() == est.snapshot()
    # Later observations fold into the coarse windows exactly once.
    for e in (est, copy):
        e.observe([1, 2, 3], now=100.0)
        clock.t = 500.0
        e.observe([4], now=500.0)
    assert copy.snapshot() == est.snapshot()
    assert copy.stats("1h").requests == 10_004

    blob = est.serialize()
    with pytest.raises(ValueError):
        est.merge(blob[:-5])
    with pytest.raises(ValueError):
        est.merge(b"XXXX" + blob[4:])
    other = CeilingEstimator((900, 3600), clock=clock)
    with pytest.raises(ValueError):
        other.merge(blob)


def test_lg_k_is_chosen_to_fit_the_budget() -> None:
    assert choose_lg_k(30) == 16
    assert choose_lg_k(45) == 15
    assert CeilingEstimator((60, 600, 3600, 86400)).lg_k == 15
    with pytest.raises(ValueError):
        CeilingEstimator(buckets=15, lg_k=16)


def test_observe_validates_hits_and_reads_validate_windows() -> None:
    est = CeilingEstimator(clock=FakeClock())
    with pytest.raises(ValueError):
        est.observe([1, 2], hits=3)
    with pytest.raises(KeyError):
        est.ceiling("5m")
    assert est.labels == ("15m", "1h", "1d")
    assert est.ceiling("15m") == est.ceiling(900) == 0.0


def test_numpy_key_arrays_count_like_lists() -> None:
    a, b = CeilingEstimator(clock=FakeClock()), CeilingEstimator(clock=FakeClock())
    keys = [i * 7919 for i in range(3000)] * 2
    a.observe(keys, hits=10)
    b.observe(np.array(keys, dtype=np.int64), hits=10)
    assert a.snapshot() == b.snapshot()
    assert a.stats("15m").distinct == pytest.approx(3000, rel=0.01)


def test_exact_ceiling_helper() -> None:
    assert exact_ceiling([]) == 0.0
    assert exact_ceiling([1, 2, 3]) == 0.0
    assert exact_ceiling([1, 1, 2, 1]) == 0.5


def test_durations() -> None:
    assert parse_windows("15m,1h,24h") == (900.0, 3600.0, 86400.0)
    assert parse_windows(" 1h , 90s ") == (90.0, 3600.0)
    assert parse_duration("300") == 300.0 and parse_duration("1.5h") == 5400.0
    assert [format_duration(w) for w in (90, 900, 3600, 86400, 36 * 3600, 7 * 86400, 1.5)] == [
        "90s",
        "15m",
        "1h",
        "1d",  # the original's label (its default window is 1d)
        "36h",
        "7d",
        "1.5s",
    ]
    assert [format_duration(w) for w in parse_windows("15m,60m,24h")] == ["15m", "1h", "1d"]  # as the original
    for bad in ("", "15x", "0m", "1h,60m", "-5s"):
        with pytest.raises(ValueError):
            parse_windows(bad)
