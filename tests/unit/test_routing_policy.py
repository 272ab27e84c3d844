"""The kv-aware decision (pegaflow/policy/routing.py): the bound, the floor, the tier weights, the turn."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from pegaflow.policy.routing import BoundedLoadKV, RecentLoad, TierCosts


def test_the_bound_is_never_crossed_for_a_prefix():
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(1, 9)
        eps = rng.choice([0.0, 0.1, 0.25, 1.0])
        loads = [rng.randint(0, 12) for _ in range(n)]
        saved = [rng.choice([0.0, 100.0, 512.0, 2048.0]) for _ in range(n)]
        kv = BoundedLoadKV(eps)
        i = kv.choose(loads, saved)
        cap = math.ceil((1 + eps) * (sum(loads) + 1) / n)
        low = (1 - eps) * (sum(loads) + 1) / n
        assert loads[i] < cap  # integer loads: someone is always under the cap
        # Under the floor (once the mean is 1 / eps or more), only those under it may be
        # chosen; else those under the cap.
        under = [j for j in range(n) if loads[j] + 1 < low] if eps * (sum(loads) + 1) >= n else []
        allowed = under or [j for j in range(n) if loads[j] < cap]
        assert i in allowed
        # and nobody allowed saves more than the one chosen
        assert all(saved[j] <= saved[i] for j in allowed)


def test_an_engine_holding_less_than_the_others_is_not_starved():
    """Seven engines hold the prefix every request starts with, the eighth (new) holds
    nothing. With eps 0.2 >= 1/7 the seven could carry all the load under the bound and the
    eighth would never be the best; the floor gives it its share."""
    eps, n = 0.2, 8
    kv = BoundedLoadKV(eps)
    saved = [512.0] * (n - 1) + [0.0]
    loads = [0] * n
    for _ in range(800):
        loads[kv.choose(loads, saved)] += 1
    mean = sum(loads) / n
    assert loads[-1] >= (1 - eps) * mean - 1, loads
    assert max(loads) <= math.ceil((1 + eps) * mean), loads
    # Above the floor, the prefix still wins: the eighth is chosen no more than it must be.
    assert loads[-1] <= (1 - eps) * mean + 1, loads


def test_the_floor_leaves_a_light_load_to_the_prefix():
    """Below a mean of 1 / eps requests the floor does not apply: one request is more than eps
    of the mean, and spreading it would only scatter a light load."""
    kv = BoundedLoadKV(0.2)
    # 4 engines, 5 requests in the window, mean with this one 1.5 < 5: the holder (load 1,
    # under the cap of ceil(1.2 * 1.5) = 2) wins over the idle engine.
    assert kv.choose([1, 2, 2, 0], [512.0, 0.0, 0.0, 0.0]) == 0
    # 4 engines, 40 in the window (mean 10.25 >= 5): the idle engine is under the floor.
    assert kv.choose([11, 15, 14, 0], [512.0, 0.0, 0.0, 0.0]) == 3
    assert kv.last_redirected


def test_the_longest_allowed_prefix_wins_over_an_overloaded_longer_one():
    kv = BoundedLoadKV(0.25)
    # mean with this request (9 + 1) / 3; cap ceil(1.25 * 10 / 3) = 5: the 7-load holder is out.
    assert kv.choose([7, 1, 1], [4096.0, 1024.0, 0.0]) == 1
    assert kv.last_redirected and kv.redirected == 1
    assert kv.choose([4, 3, 2], [4096.0, 1024.0, 0.0]) == 0  # 4 < 5: in
    assert not kv.last_redirected and kv.redirected == 1


def test_fractional_loads_are_bounded_too():
    kv = BoundedLoadKV(0.0)
    # cap ceil((7.6 + 1) / 3) = 3: all in; with one at 4.5, cap ceil(10.2 / 3) = 4 keeps it out.
    assert kv.choose([2.5, 2.2, 2.9], [9.0, 0.0, 0.0]) == 0
    assert kv.choose([4.5, 2.2, 2.5], [9.0, 0.0, 0.0]) in (1, 2)


def test_tier_costs_weigh_what_a_held_token_saves():
    c = TierCosts(l1=0.0, ssd=0.25, remote=0.5)
    assert c.saved(100) == 100
    assert c.saved(0, 100) == 75
    assert c.saved(0, 0, 100) == 50
    assert c.saved(100, 100, 100) == 225
    kv = BoundedLoadKV(1.0, c)
    # 600 tokens in DRAM beat 700 on SSD (525) and lose to 900 on SSD (675).
    assert kv.choose([0, 0], [c.saved(600), c.saved(0, 700)]) == 0
    assert kv.choose([0, 0], [c.saved(600), c.saved(0, 900)]) == 1
    with pytest.raises(ValueError):
        TierCosts(ssd=1.5)


def test_ties_go_in_turn():
    kv = BoundedLoadKV(100.0)  # no bound in play
    got = [kv.choose([0, 0, 0, 0], [5.0, 5.0, 5.0, 5.0]) for _ in range(8)]
    assert got == [0, 1, 2, 3, 0, 1, 2, 3]
    # Among the holders only: the one holding nothing is never picked while they tie.
    got = [kv.choose([0, 0, 0], [5.0, 0.0, 5.0]) for _ in range(6)]
    assert Counter(got) == {0: 3, 2: 3}


def test_recent_load_counts_the_window_and_in_flight_whichever_is_more():
    r = RecentLoad(window=10.0)
    for t in (0.0, 1.0, 2.0):
        r.routed("a", t)
    assert r.loads(["a", "b"], [1, 2], 5.0) == [3, 2]
    assert r.loads(["a", "b"], [1, 2], 11.5) == [1, 2]  # routed at 0 and 1 have left the window
    assert r.recent("a", 11.5) == 1
    off = RecentLoad(window=0.0)
    off.routed("a", 0.0)
    assert off.loads(["a"], [0], 0.0) == [0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        BoundedLoadKV(-0.1)
    with pytest.raises(ValueError):
        BoundedLoadKV().choose([], [])
    with pytest.raises(ValueError):
        BoundedLoadKV().choose([0, 1], [0.0])
    with pytest.raises(ValueError):
        RecentLoad(-1)
