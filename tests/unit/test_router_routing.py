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
    p = Policy(KV_AWARE)
    cands = [Candidate("http://a", prefix_tokens=0), Candidate("http://b", prefix_tokens=960)]
    for _ in range(4):
        d = p.choose(cands, prompt_tokens=1000)
        assert (d.url, d.prefix_tokens, d.cost) == ("http://b", 960, 40.0)


def test_kv_aware_leaves_the_holder_when_its_queue_outweighs_the_recompute():
    p = Policy(KV_AWARE)
    busy = Candidate("http://b", prefix_tokens=960, queued_tokens=2000, in_flight=2)
    idle = Candidate("http://a")
    assert p.choose([idle, busy], prompt_tokens=1000).url == "http://a"  # 1000 < 40 + 2000
    # A higher overlap weight values the hit more than the queue.
    assert Policy(KV_AWARE, overlap_weight=3.0).choose([idle, busy], prompt_tokens=1000).url == "http://b"


def test_kv_aware_among_engines_of_one_node_balances_by_load():
    p = Policy(KV_AWARE)
    same = [Candidate("http://a", prefix_tokens=512, in_flight=2), Candidate("http://b", prefix_tokens=512)]
    assert p.choose(same, prompt_tokens=600).url == "http://b"


def test_kv_aware_without_prefixes_routes_as_least_loaded():
    p = Policy(KV_AWARE)
    cands = [Candidate("http://a", in_flight=1, prefix_tokens=900), Candidate("http://b")]
    assert p.choose(cands, prompt_tokens=1000, use_prefixes=False).url == "http://b"


def test_a_prefix_longer_than_the_prompt_counts_as_the_whole_prompt():
    p = Policy(KV_AWARE)
    assert p.cost(Candidate("http://a", prefix_tokens=4096), 100) == 0.0


def test_bad_policy_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        Policy("random")
    with pytest.raises(ValueError):
        Policy(KV_AWARE, overlap_weight=-1)
    with pytest.raises(ValueError):
        Policy(KV_AWARE).choose([])
