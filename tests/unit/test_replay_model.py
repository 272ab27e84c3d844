"""Replay on small hand-computed traces: hit rates, tiers, admission, shared vs isolated."""

from __future__ import annotations

import json

import pytest

from pegaflow.config.capacity import Capacity, parse_sweep
from pegaflow.core.allocator import OutOfSpace
from pegaflow.core.trace import read_trace
from pegaflow.replay.model import ISOLATED, SHARED, Scenario, UniformAllocator
from pegaflow.replay.run import replay


def mooncake(*reqs: list[int], tokens: list[int] | None = None, extra: list[dict] | None = None) -> list[str]:
    lines = []
    for i, ids in enumerate(reqs):
        d = {
            "timestamp": 1000 * i,
            "input_length": tokens[i] if tokens else 512 * len(ids),
            "output_length": 1,
            "hash_ids": ids,
        }
        if extra:
            d.update(extra[i])
        lines.append(json.dumps(d))
    return lines


# N = 10, U = 5: the ceiling is 1/2.
TRACE_A = mooncake([1, 2, 3], [1, 2, 4], [1, 2, 3], [5], tokens=[1200, 1100, 1200, 100])


def run(lines: list[str], l1: str, **kw) -> object:
    route = kw.pop("route_field", None)
    trace = read_trace(lines, route_field=route)
    return replay(trace, Scenario(Capacity.parse(l1), **kw))


def test_unbounded_cache_hits_exactly_the_ceiling():
    r = run(TRACE_A, "inf")
    assert (r.blocks, r.hit_blocks) == (10, 5)
    assert r.hit_rate == 0.5 == read_trace(TRACE_A).ceiling
    assert r.request_hits == [0, 2, 3, 0]


def test_lru_of_three_blocks_matches_hand_computation():
    # r1 stores 1,2,3; r2 hits 1,2 and evicts 3 for 4; r3 hits 1,2 and evicts 4 for 3;
    # r4 misses and evicts 1.
    r = run(TRACE_A, "3blocks")
    assert r.request_hits == [0, 2, 2, 0]
    assert r.evictions == 3
    # Tokens: a partial last block is worth only its tokens.
    assert r.tokens == 1200 + 1100 + 1200 + 100
    assert r.hit_tokens == 1024 + 1024
    assert r.token_hit_rate == pytest.approx(2048 / 3600)


def test_pending_blocks_of_the_same_request_are_not_evicted_for_its_later_blocks():
    # With 2 blocks, r1 can store only 1,2 (its own pending pages are never victims); r3
    # finds 1 evicted, so it hits nothing, and can again store only two blocks.
    r = run(TRACE_A, "2blocks")
    assert r.request_hits == [0, 2, 0, 0]
    assert r.hit_rate == 0.2


def test_capacity_in_bytes_holds_whole_pages_only():
    # 3.5 pages of 1 MiB hold 3 blocks: the same as 3blocks.
    r = run(TRACE_A, str(3 * (1 << 20) + (1 << 19)), page_bytes=1 << 20)
    assert r.l1_capacity_blocks == 3
    assert r.request_hits == [0, 2, 2, 0]


def test_percent_capacity_is_of_distinct_blocks():
    r = run(TRACE_A, "60%")  # 60% of U=5 -> 3 blocks
    assert r.l1_capacity_blocks == 3
    assert r.request_hits == [0, 2, 2, 0]


def test_ssd_tier_takes_l1_evictions_and_serves_them_back():
    # L1 holds 1 block. r0 stores 1 (2 does not fit beside its pending 1). r1 hits 1 in
    # L1, stores 2 by evicting 1 to the SSD. r2 finds 1 on the SSD, then 2 in L1.
    lines = mooncake([1, 2], [1, 2], [1, 2])
    r = run(lines, "1blocks", ssd=Capacity.parse("4blocks"))
    assert r.request_hits == [0, 1, 2]
    assert (r.l1_hit_blocks, r.ssd_hit_blocks) == (2, 1)
    assert r.ssd_hit_tokens == 512 and r.l1_hit_tokens == 1024
    without = run(lines, "1blocks")
    assert without.request_hits == [0, 1, 0]


def test_tinylfu_admission_keeps_the_popular_block():
    # L1 of one block: block 1 is asked three times, then 2 once, then 1 again. LRU evicts
    # 1 for 2; TinyLFU (the node's own) refuses 2 because 1 is more popular.
    lines = mooncake([1], [1], [1], [2], [1])
    lru = run(lines, "1blocks")
    lfu = run(lines, "1blocks", tinylfu=True)
    assert lru.request_hits == [0, 1, 1, 0, 0]
    assert lfu.request_hits == [0, 1, 1, 0, 1]
    assert (lru.admission_rejections, lfu.admission_rejections) == (0, 1)


SAME_PREFIX_4X = mooncake([1, 2], [1, 2], [1, 2], [1, 2])  # N = 8, U = 2


def test_shared_pool_beats_isolated_pools_under_round_robin():
    shared = run(SAME_PREFIX_4X, "4blocks", instances=2, pools=SHARED)
    isolated = run(SAME_PREFIX_4X, "4blocks", instances=2, pools=ISOLATED)
    assert shared.request_hits == [0, 2, 2, 2]  # 6/8
    assert isolated.request_hits == [0, 0, 2, 2]  # each pool (2 blocks) misses once: 4/8
    assert (shared.hit_rate, isolated.hit_rate) == (0.75, 0.5)


def test_isolated_pools_split_the_capacity():
    # 3 blocks over 2 pools: 1 block each. A pool's second request hits block 1, then
    # evicts it to store 2 (its own pending page cannot be a victim).
    isolated = run(SAME_PREFIX_4X, "3blocks", instances=2, pools=ISOLATED)
    assert isolated.l1_capacity_blocks == 2
    assert isolated.request_hits == [0, 0, 1, 1]


def test_routing_by_field_sends_equal_values_to_one_pool():
    lines = mooncake([1, 2], [1, 2], [1, 2], [1, 2], extra=[{"user": "a"}] * 4)
    r = run(lines, "4blocks", instances=2, pools=ISOLATED, route="field:user", route_field="user")
    assert r.request_hits == [0, 2, 2, 2]


def test_kv_aware_routing_sends_a_prefix_to_the_pool_that_holds_it():
    # A A B B over 2 isolated pools of 2 blocks: round-robin splits each pair and never hits;
    # kv-aware (the router's policy, replayed) sends the second of each to its holder.
    lines = mooncake([1, 2], [1, 2], [3, 4], [3, 4])
    rr = run(lines, "4blocks", instances=2, pools=ISOLATED)
    kv = run(lines, "4blocks", instances=2, pools=ISOLATED, route="kv-aware")
    assert rr.request_hits == [0, 0, 0, 0]
    assert kv.request_hits == [0, 2, 0, 2]


def test_one_instance_isolated_equals_shared():
    a = run(TRACE_A, "3blocks", instances=1, pools=ISOLATED)
    b = run(TRACE_A, "3blocks", instances=1, pools=SHARED)
    assert a.request_hits == b.request_hits


def test_mixed_page_sizes_use_the_nodes_extent_allocator():
    from pegaflow.core.trace import encode_query

    h = [i.to_bytes(16, "little") for i in range(4)]
    lines = [
        encode_query(0.0, "small", h[:2], page_bytes=4096),
        encode_query(1.0, "big", h[:1], page_bytes=8192),
        encode_query(2.0, "small", h[:2], page_bytes=4096),
    ]
    trace = read_trace(lines)
    # 16 KiB: small 1+2 (8 KiB) and big 0 (8 KiB) fit together.
    r = replay(trace, Scenario(Capacity.parse("16kb")))
    assert r.request_hits == [0, 0, 2]
    # 12 KiB: big 0 must evict small 1, which frees 4 KiB that does not touch the free
    # 4 KiB at the end, so small 2 goes too (the node's allocator, fragmentation and all);
    # the third request misses, and storing its second block evicts big 0.
    r = replay(trace, Scenario(Capacity.parse("12kb")))
    assert r.request_hits == [0, 0, 0]
    assert r.evictions == 3


def test_uniform_allocator_holds_whole_pages_and_recycles():
    a = UniformAllocator(10, 3)
    offs = [a.alloc(3) for _ in range(3)]
    assert offs == [0, 3, 6] and a.free_bytes == 0
    with pytest.raises(OutOfSpace):
        a.alloc(3)
    a.free(3, 3)
    assert a.alloc(3) == 3


def test_capacity_and_sweep_parsing():
    assert Capacity.parse("20000blocks") == Capacity(20000, "blocks")
    assert Capacity.parse("1gb") == Capacity(1 << 30, "bytes")
    assert Capacity.parse("25%").blocks_or_bytes(400) == (100, True)
    assert Capacity.parse("inf").blocks_or_bytes(7) == (7, True)
    assert len(parse_sweep("auto")) == 7 and parse_sweep("none") == []
    assert [str(c) for c in parse_sweep("1%,10blocks,2gb")] == ["1%", "10blocks", "2gb"]
    with pytest.raises(ValueError):
        Capacity.parse("lots")


def test_inf_gives_every_isolated_pool_the_whole_trace():
    r = run(SAME_PREFIX_4X, "inf", instances=2, pools=ISOLATED)
    assert r.l1_capacity_blocks == 4  # U = 2 per pool, not split
    assert r.request_hits == [0, 0, 2, 2]


def test_ssd_written_on_commit_holds_what_l1_never_evicted():
    # As the node's write-behind: every block committed into L1 also goes to the SSD. r0
    # stores 1 (L1 and SSD); r1 hits 1 in L1 and stores 2 (evicting 1 from L1 only); r2
    # finds both 1 and 2 on the SSD, since 2 was written at commit.
    from pegaflow.replay.model import SSD_WRITES_COMMITS

    lines = mooncake([1, 2], [1, 2], [1, 2])
    r = run(lines, "1blocks", ssd=Capacity.parse("4blocks"), ssd_writes=SSD_WRITES_COMMITS)
    assert r.request_hits == [0, 1, 2]
    assert (r.l1_hit_blocks, r.ssd_hit_blocks) == (1, 2)
    victim = run(lines, "1blocks", ssd=Capacity.parse("4blocks"))
    assert (victim.l1_hit_blocks, victim.ssd_hit_blocks) == (2, 1)


def test_blocks_a_request_saved_beyond_its_query_are_hit_by_the_next_turn():
    from pegaflow.core.trace import encode_query

    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    # Turn 1 queries [a] and the engine also stores b (its answer's block); turn 2 queries [a, b, c].
    with_saves = [encode_query(0.0, "ns", [a], saved=[b], block_tokens=16), encode_query(1.0, "ns", [a, b, c])]
    without = [encode_query(0.0, "ns", [a], block_tokens=16), encode_query(1.0, "ns", [a, b, c])]
    assert run(with_saves, "inf").request_hits == [0, 2]
    assert run(without, "inf").request_hits == [0, 1]
    trace = read_trace(with_saves)
    assert trace.blocks == 4, "saved blocks are not accesses"
    with pytest.raises(Exception, match="saved"):
        read_trace([json.dumps({"time": 0, "namespace": "ns", "hashes": [], "saved": "ab"})])


def test_inf_holds_the_saved_blocks_too():
    """``inf`` was sized on the requested blocks only: a trace whose requests save blocks
    beyond their queries evicted at "nothing is ever evicted"."""
    from pegaflow.core.trace import encode_query

    def h(i: int) -> bytes:
        return i.to_bytes(16, "little")

    lines = [encode_query(float(i), "ns", [h(i % 50)], saved=[h(1000 + 3 * i + k) for k in range(3)])
             for i in range(200)]
    trace = read_trace(lines)
    assert (trace.unique, trace.storable) == (50, 650)
    r = run(lines, "inf")
    assert r.evictions == 0 and r.hit_blocks == 150, (r.evictions, r.hit_blocks)
