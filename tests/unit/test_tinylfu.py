"""TinyLFU admission: scan resistance, count-min bounds, aging, doorkeeper, batch == scalar."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections import Counter, OrderedDict
from collections.abc import Iterable

import numpy as np
import pytest

from pegaflow.policy.tinylfu import COUNTER_MAX, TinyLFU
from tests.oracles.tinylfu_scalar import ScalarTinyLFU


def _lru_hot_hit_rate(
    accesses: list[int], capacity: int, lfu: TinyLFU | None, hot: set[int], measure_from: int
) -> float:
    """Hit rate of the ``hot`` keys in an LRU cache, optionally guarded by TinyLFU admission."""
    cache: OrderedDict[int, None] = OrderedDict()
    hot_hits = hot_seen = 0
    for i, k in enumerate(accesses):
        if lfu is not None:
            lfu.record(k)
        hit = k in cache
        if hit:
            cache.move_to_end(k)
        elif len(cache) < capacity:
            cache[k] = None
        else:
            victim = next(iter(cache))
            if lfu is None or lfu.admit(k, victim):
                del cache[victim]
                cache[k] = None
        if i >= measure_from and k in hot:
            hot_seen += 1
            hot_hits += hit
    return hot_hits / hot_seen


def test_one_pass_scan_does_not_flush_hot_working_set() -> None:
    rng = random.Random(7)
    capacity, hot_n = 1000, 500
    hot = list(range(hot_n))
    warm = [rng.choice(hot) for _ in range(5000)]
    # Then a one-pass scan: 3 never-repeated keys per hot access. The hot set fits the cache,
    # but its reuse distance (~1500 distinct keys) exceeds the capacity, so LRU loses it.
    scan: list[int] = []
    fresh = 10**12
    for _ in range(10_000):
        scan.append(rng.choice(hot))
        scan.extend(range(fresh, fresh + 3))
        fresh += 3
    trace = warm + scan
    lru = _lru_hot_hit_rate(trace, capacity, None, set(hot), len(warm))
    lfu = TinyLFU(capacity)
    guarded = _lru_hot_hit_rate(trace, capacity, lfu, set(hot), len(warm))
    assert lru < 0.6, f"workload too easy: plain LRU keeps {lru:.2f} of hot hits"
    assert guarded > 0.95, f"TinyLFU let the scan flush the hot set: {guarded:.3f} (LRU {lru:.3f})"
    assert lfu.rejected > 10 * lfu.admitted > 0


def _record_all(lfu: TinyLFU, keys: Iterable[int]) -> None:
    for k in keys:
        lfu.record(k)


def test_estimates_never_undercount_and_overcount_within_count_min_bound() -> None:
    rng = random.Random(11)
    lfu = TinyLFU(2000)  # width 8192, sample 20_000 accesses: no aging below
    counts = {rng.getrandbits(128): rng.randint(1, 12) for _ in range(1500)}
    trace = [k for k, c in counts.items() for _ in range(c)]
    rng.shuffle(trace)
    assert len(trace) < lfu.sample_size
    lfu.record_many(trace)
    assert lfu.agings == 0

    est = dict(zip(counts, lfu.estimate_many(list(counts)).tolist(), strict=True))
    under = {k: (est[k], c) for k, c in counts.items() if est[k] < min(c, COUNTER_MAX)}
    assert not under, f"under-counted: {list(under.items())[:5]}"

    # Count-min: err <= eps * N (+1 for a doorkeeper false positive) w.p. >= 1 - exp(-depth),
    # N = increments that reached the sketch (accesses minus first accesses).
    n_sketch = len(trace) - len(counts)
    bound = lfu.epsilon * n_sketch + 1
    errors = np.array([est[k] - c for k, c in counts.items()])
    beyond = float(np.mean(errors > bound))
    assert beyond <= math.exp(-lfu.depth), f"{beyond:.3%} of keys beyond eps*N+1={bound:.2f}"
    # The bound is loose; the typical error is far smaller (a broken hash would not be).
    assert errors.mean() < 0.25 * bound

    # Keys never seen: same bound, counted from 0.
    probes = lfu.estimate_many([rng.getrandbits(128) for _ in range(5000)])
    assert float(np.mean(probes > bound)) <= math.exp(-lfu.depth)


def test_counters_saturate_at_fifteen() -> None:
    lfu = TinyLFU(1000)
    _record_all(lfu, [42] * 100)
    assert lfu.estimate(42) == COUNTER_MAX + 1  # 15 in the sketch + the doorkeeper bit


def test_aging_halves_counts_and_clears_doorkeeper() -> None:
    lfu = TinyLFU(100)  # sample_size 1000
    _record_all(lfu, [7] * 9)
    assert lfu.estimate(7) == 9  # doorkeeper 1 + sketch 8
    lfu.age()
    assert lfu.estimate(7) == 4  # sketch halved, doorkeeper cleared
    assert lfu.samples == 4
    assert not lfu.door.any()


def test_aging_halves_every_counter_of_a_dense_table() -> None:
    rng = random.Random(2)
    lfu = TinyLFU(200)
    lfu.record_many([rng.randrange(300) for _ in range(lfu.sample_size - 1)])
    assert lfu.agings == 0
    low, high = lfu.table & 0x0F, lfu.table >> 4
    assert np.count_nonzero(low & 1) > 100 and np.count_nonzero(high & 1) > 100  # odd values
    lfu.age()
    assert np.array_equal(lfu.table & 0x0F, low >> 1)
    assert np.array_equal(lfu.table >> 4, high >> 1)


def test_aging_happens_after_sample_size_accesses() -> None:
    lfu = TinyLFU(100)
    _record_all(lfu, [7] * 9)
    _record_all(lfu, [8] * (lfu.sample_size - 10))
    assert lfu.estimate(7) == 9, "key 8 collides with key 7 in every row; choose another"
    assert lfu.agings == 0
    lfu.record(8)  # the sample_size-th access
    assert lfu.agings == 1
    assert lfu.samples == lfu.sample_size // 2
    assert lfu.estimate(7) == 4
    assert lfu.estimate(8) == COUNTER_MAX // 2


def test_doorkeeper_absorbs_one_hit_wonders() -> None:
    rng = random.Random(3)
    wonders = [rng.getrandbits(128) for _ in range(8000)]
    with_door = TinyLFU(1000)
    without = TinyLFU(1000, doorkeeper=False)
    for lfu in (with_door, without):
        lfu.record_many(wonders)
        assert lfu.agings == 0

    def nonzero_counters(lfu: TinyLFU) -> int:
        t = lfu.table
        return int(np.count_nonzero(t & 0x0F) + np.count_nonzero(t & 0xF0))

    total = with_door.depth * with_door.width
    # Only doorkeeper false positives reach the sketch (each touches `depth` counters).
    assert nonzero_counters(with_door) < 0.05 * total
    assert nonzero_counters(without) > 0.6 * total
    # So a key seen twice still beats a one-hit wonder, and unseen keys stay near zero.
    _record_all(with_door, [99, 99])
    assert with_door.estimate(99) == 2
    assert all(with_door.estimate(k) == 1 for k in wonders[:200])
    assert not with_door.admit(wonders[0], 99)
    fresh = [rng.getrandbits(128) for _ in range(2000)]
    assert with_door.estimate_many(fresh).mean() < 0.1
    assert without.estimate_many(fresh).mean() > 0.5


@pytest.mark.parametrize("batch", [1, 17, 300])
def test_batch_calls_equal_scalar_calls(batch: int) -> None:
    rng = random.Random(batch)
    universe = [rng.getrandbits(128) for _ in range(1500)] + list(range(-500, 1500))
    trace = [rng.choice(universe) for _ in range(12_000)]  # > 2 sample periods: crosses aging
    scalar, batched = TinyLFU(500, seed=5), TinyLFU(500, seed=5)
    _record_all(scalar, trace)
    for i in range(0, len(trace), batch):
        batched.record_many(trace[i : i + batch])
    assert scalar.agings == batched.agings >= 2
    assert scalar.samples == batched.samples
    assert np.array_equal(scalar.table, batched.table)
    assert np.array_equal(scalar.door, batched.door)
    est = batched.estimate_many(universe)
    assert est.tolist() == [scalar.estimate(k) for k in universe]
    assert est.max() > 2  # the trace is not degenerate


def test_large_batches_differ_from_scalar_only_by_in_batch_doorkeeper_false_positives() -> None:
    """The documented exception: a doorkeeper false positive between two keys of one batch."""
    rng = random.Random(1)
    universe = [rng.getrandbits(128) for _ in range(3000)]
    trace = [rng.choice(universe) for _ in range(4900)]
    scalar, batched = TinyLFU(500), TinyLFU(500)
    _record_all(scalar, trace)
    batched.record_many(trace)  # one batch, no aging
    assert scalar.agings == batched.agings == 0
    assert np.array_equal(scalar.door, batched.door)
    s = np.array([scalar.estimate(k) for k in universe])
    b = batched.estimate_many(universe)
    true = Counter(trace)
    assert all(b[i] >= min(true[k], COUNTER_MAX) for i, k in enumerate(universe))
    diff = s - b
    assert diff.min() >= 0, "the batch path counted more than the scalar path"
    assert 0 < np.count_nonzero(diff) < 0.02 * len(universe)


def test_numpy_keys_are_the_same_keys_as_python_ints() -> None:
    keys = [0, 1, 2**63 + 5, 2**64 - 1, -1, -(2**40)]
    a, b = TinyLFU(100), TinyLFU(100)
    _record_all(a, keys * 3)
    b.record_many(np.array([k % 2**64 for k in keys] * 3, dtype=np.uint64))
    assert np.array_equal(a.table, b.table)
    assert b.estimate_many(np.array([-1, 5], dtype=np.int64)).tolist() == [a.estimate(-1), a.estimate(5)]
    # Keys are taken mod 2**64: a 128-bit hash and its low 64 bits are one key.
    assert a.estimate(2**100 + 1) == a.estimate(1)


def test_admit_compares_estimates_and_counts_decisions() -> None:
    lfu = TinyLFU(1000)
    _record_all(lfu, [1] * 5 + [2] * 3)
    assert lfu.admit(1, 2)
    assert not lfu.admit(2, 1)
    assert not lfu.admit(2, 2)  # ties reject
    assert (lfu.admitted, lfu.rejected) == (1, 2)
    got = lfu.admit_many([1, 2, 3], [2, 1, 1])
    assert got.tolist() == [True, False, False]
    assert (lfu.admitted, lfu.rejected) == (2, 4)


def test_admit_in_order_matches_sequential_eviction_queue() -> None:
    rng = random.Random(5)
    lfu = TinyLFU(1000)
    keys = list(range(400))
    lfu.record_many([k for k in keys for _ in range(k % 7)])
    candidates = rng.sample(keys, 60)
    victims = sorted(rng.sample(keys, 60), key=lambda k: k % 7)  # colder first, like a queue

    expected, j = [], 0
    for c in candidates:
        ok = lfu.estimate(c) > lfu.estimate(victims[j])
        expected.append(ok)
        j += ok
    got = lfu.admit_in_order(candidates, victims)
    assert got.tolist() == expected
    assert 0 < sum(expected) < len(expected)
    assert lfu.admitted == sum(expected) and lfu.rejected == len(expected) - sum(expected)


_CHILD = """
import sys
from pegaflow.policy.tinylfu import TinyLFU
t = TinyLFU(1000, seed=3)
t.record_many([2**127 + i % 50 for i in range(3000)] + [10**30 + i for i in range(40)])
print(t.estimate_many([2**127 + i for i in range(60)] + [10**30 + i for i in range(40)]).tolist())
print(t.table.sum(), t.door.sum())
"""


def test_decisions_are_identical_across_processes_and_hash_seeds() -> None:
    outs = set()
    for hashseed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        res = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        outs.add(res.stdout)
    assert len(outs) == 1, outs


def test_seed_selects_an_independent_hash_family() -> None:
    a, b = TinyLFU(1000, seed=1), TinyLFU(1000, seed=2)
    keys = list(range(3000))
    for t in (a, b):
        t.record_many(keys + keys)
    assert not np.array_equal(a.table, b.table)


def test_sizes_follow_capacity() -> None:
    lfu = TinyLFU(1000)
    assert lfu.width == 4096 and lfu.sample_size == 10_000
    assert lfu.nbytes == lfu.depth * lfu.width // 2 + lfu.doorkeeper_bits // 8
    assert lfu.doorkeeper_bits >= 8 * lfu.sample_size
    with pytest.raises(ValueError):
        TinyLFU(0)


def test_exact_counter_agrees_on_small_distinct_sets() -> None:
    """With few keys and a wide sketch there are no collisions: estimates are exact."""
    rng = random.Random(9)
    lfu = TinyLFU(10_000)
    trace = [rng.randrange(50) for _ in range(400)]
    lfu.record_many(trace)
    exact = Counter(trace)
    assert {k: lfu.estimate(k) for k in exact} == {k: min(c, 16) for k, c in exact.items()}




def test_native_paths_are_built_and_equal_the_python_paths() -> None:
    rng = random.Random(11)
    universe = [rng.getrandbits(128) for _ in range(1200)] + list(range(-300, 900))
    trace = [rng.choice(universe) for _ in range(9000)]  # > 2 sample periods: crosses aging
    for doorkeeper in (True, False):
        native = TinyLFU(300, seed=7, doorkeeper=doorkeeper)
        python = ScalarTinyLFU(300, seed=7, doorkeeper=doorkeeper)
        for i in range(0, len(trace), 37):
            chunk = trace[i : i + 37]
            native.record_many(chunk)
            for k in chunk:
                python.record(k)
            native.record(chunk[0])
            python.record(chunk[0])
        assert native.agings == python.agings >= 2
        assert native.samples == python.samples
        assert np.array_equal(native.table, python.table)
        assert np.array_equal(native.door, python.door)
        assert [native.estimate(k) for k in universe] == [python.estimate(k) for k in universe]
        pairs = [(rng.choice(universe), rng.choice(universe)) for _ in range(500)]
        assert [native.admit(c, v) for c, v in pairs] == [python.admit(c, v) for c, v in pairs]
        assert (native.admitted, native.rejected) == (python.admitted, python.rejected)


def test_native_record_many_takes_uint64_arrays_and_rejects_bad_keys() -> None:
    a, b = TinyLFU(100), TinyLFU(100)
    keys = [0, 7, 2**64 - 1, 2**63] * 5
    a.record_many(keys)
    b.record_many(np.repeat(np.array(keys, dtype=np.uint64), 2)[::2])  # a strided view
    assert np.array_equal(a.table, b.table) and np.array_equal(a.door, b.door)
    with pytest.raises(TypeError):
        a.record_many(["not a key"])


def test_native_record_many_survives_keys_that_change_the_list() -> None:
    """A key converting through __index__ may empty the list of keys: read per key, held (was a use after
    free of the list's items)."""
    lfu = TinyLFU(100)
    keys: list = []

    class Key:
        def __index__(self) -> int:
            keys.clear()
            return 12345

    keys.extend([Key()] + [object() for _ in range(1000)])
    samples, _ = lfu._core.record_many(keys, 0)
    assert samples == 1  # the one key seen; the list was empty after it, as a Python for loop sees it


def test_native_sketch_refuses_geometry_whose_size_overflows() -> None:
    from pegaflow.core._sketch import Sketch

    depth = (1 << 61) + 1  # depth * width / 2 wraps to 8 bytes: was writes far past the table
    with pytest.raises(ValueError):
        Sketch(bytearray(8), bytearray(8), depth, 16, 64, 4, 0, 10, False)


def test_native_record_many_takes_only_integer_buffers() -> None:
    import array

    a, b = TinyLFU(100), TinyLFU(100)
    keys = [1, 2, 3, 2**63 - 1]
    a.record_many(array.array("q", keys))
    b.record_many(keys)
    assert np.array_equal(a.table, b.table) and np.array_equal(a.door, b.door)
    with pytest.raises(TypeError):  # eight bytes a key, but floats: the Python path refuses them too
        a.record_many(array.array("d", [1.0, 2.0]))
