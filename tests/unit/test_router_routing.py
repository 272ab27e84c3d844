"""The router's policies: pure arithmetic over candidates (pegaflow/router/routing.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from pegaflow.router.routing import KV_AWARE, LEAST_LOADED, ROUND_ROBIN, Candidate, Policy


def test_round_robin_takes_every_engine_in_turn():
    p = Policy(ROUND_ROBIN)
    cands = [Candidate("http://b"), Candidate("http://a"), Candidate("http://c")]
    got = [p.choose(cands).url for _ in range(6)]
    assert got == ["http://a", "http://b", "http://c"] * 2


def test_least_loaded_takes_the_fewest_requests_counting_the_engines_own_queue():
    p = Policy(LEAST_LOADED)
    cands = [Candidate("http://a", in_flight=3), Candidate("http://b", in_flight=1, engine_queue=5),
             Candidate("http://c", in_flight=2)]
    assert p.choose(cands).url == "http://c"  # b has 5 running or waiting (other clients')


def test_least_loaded_rotates_among_equals():
    p = Policy(LEAST_LOADED)
    cands = [Candidate("http://a"), Candidate("http://b")]
    assert Counter(p.choose(cands).url for _ in range(10)) == {"http://a": 5, "http://b": 5}


def test_kv_aware_prefers_the_engine_whose_node_holds_the_prefix():
    p = Policy(KV_AWARE, load_window=0)
    cands = [Candidate("http://a", prefix_tokens=0), Candidate("http://b", prefix_tokens=960)]
    for _ in range(4):
        d = p.choose(cands, prompt_tokens=1000, now=0.0)
        assert (d.url, d.prefix_tokens, d.cost) == ("http://b", 960, 40.0)


def test_kv_aware_leaves_the_holder_once_its_load_passes_the_bound():
    # b holds the prefix but has 3 in flight; a and c none: mean with this request (3+1)/3,
    # cap ceil(1.25 * 4 / 3) = 2, so b (3) may not take it for its prefix.
    p = Policy(KV_AWARE, load_bound=0.25, load_window=0)
    busy = Candidate("http://b", prefix_tokens=960, in_flight=3)
    idle = [Candidate("http://a"), Candidate("http://c")]
    assert p.choose([*idle, busy], prompt_tokens=1000, now=0.0).url != "http://b"
    # vLLM's own queue counts as load too.
    queued = Candidate("http://b", prefix_tokens=960, engine_queue=3)
    assert p.choose([*idle, queued], prompt_tokens=1000, now=0.0).url != "http://b"
    # Within the bound the prefix wins: loads 1, 1, 2, cap ceil(1.25 * 5 / 3) = 3.
    ones = [Candidate("http://a", in_flight=1), Candidate("http://c", in_flight=1)]
    ok = Candidate("http://b", prefix_tokens=960, in_flight=2)
    assert p.choose([*ones, ok], prompt_tokens=1000, now=0.0).url == "http://b"


def test_kv_aware_counts_requests_routed_in_the_window_as_load():
    # Every request holds its prefix on a only: a takes requests until its recent count
    # passes the bound, then the others take turns; within a window the split stays bounded.
    p = Policy(KV_AWARE, load_bound=0.25, load_window=60)
    cands = [Candidate("http://a", prefix_tokens=512), Candidate("http://b"), Candidate("http://c")]
    got = Counter(p.choose(cands, prompt_tokens=600, now=i * 0.1).url for i in range(300))
    assert max(got.values()) <= 1.25 * 100 + 1 and got["http://a"] == max(got.values())
    # After the window, a's count is forgotten and it takes the next request again.
    assert p.choose(cands, prompt_tokens=600, now=1000.0).url == "http://a"


def test_kv_aware_weighs_an_ssd_held_prefix_below_the_same_in_dram():
    from pegaflow.policy.routing import TierCosts

    p = Policy(KV_AWARE, load_window=0, costs=TierCosts(ssd=0.5))
    dram = Candidate("http://a", prefix_tokens=512)
    ssd = Candidate("http://b", prefix_tokens=768, ssd_tokens=768)  # 768 * 0.5 = 384 < 512
    assert p.choose([dram, ssd], prompt_tokens=1000, now=0.0).url == "http://a"
    ssd_long = Candidate("http://b", prefix_tokens=1000, ssd_tokens=600)  # 400 + 300 = 700 > 512
    assert p.choose([dram, ssd_long], prompt_tokens=1000, now=0.0).url == "http://b"


def test_kv_aware_without_prefixes_takes_turns_within_the_bound():
    p = Policy(KV_AWARE, load_window=0)
    cands = [Candidate("http://a", in_flight=1, prefix_tokens=900), Candidate("http://b"), Candidate("http://c")]
    got = Counter(p.choose(cands, prompt_tokens=1000, use_prefixes=False, now=0.0).url for _ in range(6))
    # Loads 1, 0, 0: the cap is ceil(1.25 * 2 / 3) = 1, so a is out and b and c take turns.
    assert got == {"http://b": 3, "http://c": 3}


def test_a_prefix_longer_than_the_prompt_counts_as_the_whole_prompt():
    p = Policy(KV_AWARE)
    assert p.saved(Candidate("http://a", prefix_tokens=4096), 100) == 100.0


def test_bad_policy_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        Policy("random")
    with pytest.raises(ValueError):
        Policy(KV_AWARE, load_bound=-1)
    with pytest.raises(ValueError):
        Policy(KV_AWARE, load_window=-1)
    with pytest.raises(ValueError):
        Policy(KV_AWARE).choose([])
