"""Replay's time model and load report (pegaflow/replay/run.py): queues, delays, imbalance,
and kv-aware running the router's own decision."""

from __future__ import annotations

import json

import pytest

from pegaflow.config.capacity import KV_AWARE, ROUND_ROBIN, Capacity
from pegaflow.core.trace import read_trace
from pegaflow.policy.routing import BoundedLoadKV
from pegaflow.replay.model import ISOLATED, SHARED, Cluster, Scenario, TimeModel
from pegaflow.replay.run import replay


def line(t_ms: int, ids: list[int], tokens: int | None = None) -> str:
    return json.dumps({"timestamp": t_ms, "input_length": tokens or 512 * len(ids), "output_length": 1,
                       "hash_ids": ids})


def test_a_queue_builds_when_requests_arrive_faster_than_one_instance_prefills():
    # 20 requests of 4 distinct blocks (2048 tokens, nothing held), one every 100 ms; at
    # 100 us per token each takes 204.8 ms: request k waits k * 104.8 ms.
    lines = [line(100 * k, [4 * k + j for j in range(4)]) for k in range(20)]
    tm = TimeModel(prefill_us_per_token=100.0, decode_s=0.0)
    res = replay(read_trace(lines), Scenario(Capacity.parse("inf"), time=tm))
    assert res.hit_blocks == 0
    assert res.queue_delays == pytest.approx([k * 0.1048 for k in range(20)])
    assert res.delay_mean == pytest.approx(0.1048 * 9.5)
    # Slower arrivals (one every 300 ms) never queue.
    slow = [line(300 * k, [4 * k + j for j in range(4)]) for k in range(20)]
    assert replay(read_trace(slow), Scenario(Capacity.parse("inf"), time=tm)).delay_p99 == 0.0


def test_held_tokens_are_not_prefilled():
    # The same 4 blocks twice at once: the second is all hits (the last block's tokens too),
    # so it waits only for the first one's prefill and adds nothing itself.
    lines = [line(0, [1, 2, 3, 4]), line(0, [1, 2, 3, 4]), line(0, [9])]
    tm = TimeModel(prefill_us_per_token=100.0, decode_s=0.0)
    res = replay(read_trace(lines), Scenario(Capacity.parse("inf"), time=tm))
    assert res.queue_delays == pytest.approx([0.0, 0.2048, 0.2048])


def hot_prefix_trace(n: int = 1600, per_s: int = 8) -> list[str]:
    """Every request: one popular 2-block prefix + 2 blocks of its own (a conversation's
    system prompt), per_s requests a second."""
    return [line(1000 * k // per_s, [1, 2, 100 + 2 * k, 101 + 2 * k]) for k in range(n)]


def scenario(route: str, bound: float, pools: str = ISOLATED) -> Scenario:
    return Scenario(Capacity.parse("inf"), instances=4, pools=pools, route=route,
                    time=TimeModel(prefill_us_per_token=10.0, decode_s=0.5, load_bound=bound, load_window=60))


def test_imbalance_is_reported_per_route():
    trace = read_trace(hot_prefix_trace())
    rr = replay(trace, scenario(ROUND_ROBIN, 0.25))
    unbounded = replay(trace, scenario(KV_AWARE, 1e9))
    bounded = replay(trace, scenario(KV_AWARE, 0.25))
    assert rr.imbalance == pytest.approx(1.0)
    # Prefix alone: the first holder of the popular prefix takes every request.
    assert unbounded.imbalance == pytest.approx(4.0)
    assert set(unbounded.request_instance) == {0}
    # Bounded: within 1.25x of the mean (the cap's rounding adds at most one request per window).
    assert bounded.imbalance <= 1.25 + 4 / (8 * 60)
    assert bounded.hit_rate == pytest.approx(unbounded.hit_rate, abs=0.01)  # every pool gets the prefix
    for r in (rr, unbounded, bounded):
        assert len(r.request_instance) == len(r.queue_delays) == len(trace.requests)
    d = bounded.to_dict()
    assert {"imbalance", "imbalance_max", "delay_mean_s", "delay_p99_s"} <= set(d)
    # The bound moved requests off the holder of the longest prefix; prefix alone never did.
    assert bounded.load_redirects > 0 and unbounded.load_redirects == 0 and rr.load_redirects == 0


def test_kv_aware_replay_runs_the_routers_decision():
    trace = read_trace(hot_prefix_trace(40))
    c = Cluster(scenario(KV_AWARE, 0.25), trace.unique, trace.namespaces)
    assert isinstance(c.policy, BoundedLoadKV) and c.kv_aware
    # One shared pool: every instance holds the same, so the bound and the turn decide.
    shared = replay(trace, scenario(KV_AWARE, 0.25, SHARED))
    assert shared.imbalance <= 1.25 + 0.1


def test_the_routers_policy_and_replay_choose_alike():
    """The live router's Policy, given what replay's pools hold, picks replay's instance for
    every request (one decision code; loads from the same window at the same times)."""
    from pegaflow.router.routing import KV_AWARE as POLICY_KV
    from pegaflow.router.routing import Candidate, Policy

    # conversations of 2-3 turns behind two system prompts, 5 requests a second
    lines, k = [], 0
    for conv in range(150):
        ids = [1, 2] if conv % 3 else [3, 4, 5]
        for _ in range(2 + conv % 2):
            ids = ids + [1000 + k]
            lines.append(line(200 * k, ids))
            k += 1
    trace = read_trace(lines)
    tm = TimeModel(prefill_us_per_token=0.0, decode_s=0.0, load_bound=0.15, load_window=20)
    sc = Scenario(Capacity.parse("60blocks"), instances=4, pools=ISOLATED, route=KV_AWARE, time=tm)
    got = replay(trace, sc).request_instance

    mirror = Cluster(sc, trace.unique, trace.namespaces)
    policy = Policy(POLICY_KV, tm.load_bound, tm.load_window)
    urls = [f"http://e{i}" for i in range(4)]
    chosen = []
    for r in trace.requests:
        held = [len(p.l1.index.prefix(p.l1.ns[r.namespace], r.hashes, touch=False)) * r.block_tokens
                for p in mirror.pools]
        d = policy.choose([Candidate(u, prefix_tokens=h) for u, h in zip(urls, held, strict=True)], r.tokens,
                          now=r.time)
        i = urls.index(d.url)
        chosen.append(i)
        mirror.pools[i].serve(r.namespace, r.hashes, r.saved)
    assert chosen == got
    assert len(set(got)) == 4 and policy.kv.redirected > 0  # the bound was in play
