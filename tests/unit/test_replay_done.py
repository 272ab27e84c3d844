"""Replay's commit time (pegaflow/replay/run.py): a request's computed blocks become visible
at its completion (a measured ``done`` in the trace, or the modelled end of prefill), not at
its arrival; with zero service time nothing changes."""

from __future__ import annotations

import json
import random

import pytest

from pegaflow.config.capacity import KV_AWARE, ROUND_ROBIN, Capacity
from pegaflow.core.trace import TraceError, encode_query, read_trace
from pegaflow.replay.model import ISOLATED, SHARED, Scenario, TimeModel
from pegaflow.replay.run import RunResult, replay

ZERO = TimeModel(prefill_us_per_token=0.0, decode_s=0.0)


def line(t_ms: float, ids: list[int], done_ms: float | None = None) -> str:
    d: dict[str, object] = {"timestamp": t_ms, "input_length": 512 * len(ids), "hash_ids": ids}
    if done_ms is not None:
        d["done"] = done_ms
    return json.dumps(d)


def hits(lines: list[str], sc: Scenario | None = None) -> list[int]:
    return replay(read_trace(lines), sc or Scenario(Capacity.parse("inf"), time=ZERO)).request_hits


def test_requests_in_flight_together_do_not_hit_each_others_blocks():
    # r0 (blocks 1 2 3) runs from 0 to 1000 ms; r1 (1 2 4) arrives at 500 ms, r2 (1 2 5) at 2 s.
    timed = [line(0, [1, 2, 3], 1000), line(500, [1, 2, 4], 1800), line(2000, [1, 2, 5], 2100)]
    assert hits(timed) == [0, 0, 2]
    # Without completion times each request's blocks are there for the next one at once.
    untimed = [line(0, [1, 2, 3]), line(500, [1, 2, 4]), line(2000, [1, 2, 5])]
    assert hits(untimed) == [0, 2, 2]
    # Done exactly when the next arrives: visible to it (the live run's send-after-done).
    assert hits([line(0, [1, 2, 3], 500), line(500, [1, 2, 4])]) == [0, 2]


def test_blocks_enter_the_lru_in_completion_order():
    # 3 blocks of room. a (1) runs 0-5 s, b (2) 1-2 s, c (3) completes on arrival at 3 s: the
    # LRU holds b, c, a (completion order); d (4) at 6 s evicts b, the oldest commit, so b
    # misses at 7 s (and evicts c) and a still hits at 8 s.
    sc = Scenario(Capacity.parse("3blocks"), time=ZERO)
    timed = [line(0, [1], 5000), line(1000, [2], 2000), line(3000, [3]), line(6000, [4]), line(7000, [2]),
             line(8000, [1])]
    res = replay(read_trace(timed), sc)
    assert res.request_hits == [0, 0, 0, 0, 0, 1]
    # In arrival order (no completion times) a is the oldest and goes first: b hits, a not.
    untimed = [json.dumps({**json.loads(x), "done": None}) for x in timed]
    assert replay(read_trace(untimed), sc).request_hits == [0, 0, 0, 0, 1, 0]


def test_blocks_of_requests_still_in_flight_at_the_end_land_after_the_trace():
    # Both commits wait past the last arrival; they still happen (the evictions they cause count).
    sc = Scenario(Capacity.parse("1blocks"), time=ZERO)
    res = replay(read_trace([line(0, [1], 9000), line(1000, [2], 9500)]), sc)
    assert res.request_hits == [0, 0]
    assert res.evictions == 1


def random_lines(n: int, seed: int, done: str) -> list[str]:
    """n requests over a few shared prefixes, 0-3 per second; ``done``: "none" (no field),
    "arrival" (done == time) or "later" (done up to 2 s after)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):  # the same requests whatever ``done`` is
        t += rng.choice((0.0, 0.25, 0.5, 1.0))
        p = rng.randrange(6)
        ids = [1000 * p + j for j in range(rng.randrange(1, 6))] + [rng.randrange(10**6, 2 * 10**6)]
        later = t + rng.uniform(0, 2)
        d = None if done == "none" else t * 1000 if done == "arrival" else later * 1000
        out.append(line(t * 1000, ids, d))
    return out


def same(a: RunResult, b: RunResult) -> None:
    assert a.request_hits == b.request_hits
    assert a.request_instance == b.request_instance
    assert a.queue_delays == b.queue_delays
    assert (a.evictions, a.ssd_evictions, a.ssd_hit_blocks, a.admission_rejections, a.load_redirects) == (
        b.evictions, b.ssd_evictions, b.ssd_hit_blocks, b.admission_rejections, b.load_redirects)


@pytest.mark.parametrize("route,pools", [(ROUND_ROBIN, ISOLATED), (KV_AWARE, ISOLATED), (KV_AWARE, SHARED)])
@pytest.mark.parametrize("ssd", ["0blocks", "40blocks"])
def test_zero_service_time_is_todays_replay(route: str, pools: str, ssd: str) -> None:
    # done == arrival, or the modelled end of prefill with zero service: bit-identical runs.
    base = Scenario(Capacity.parse("30blocks"), ssd=Capacity.parse(ssd), instances=4, pools=pools, route=route,
                    time=TimeModel(prefill_us_per_token=0.0, decode_s=0.0, load_window=5))
    plain = replay(read_trace(random_lines(400, 7, "none")), base)
    assert plain.hit_blocks > 0 and plain.evictions > 0
    same(plain, replay(read_trace(random_lines(400, 7, "arrival")), base))
    at_end = TimeModel(prefill_us_per_token=0.0, decode_s=0.0, load_window=5, commit_at_prefill_end=True)
    same(plain, replay(read_trace(random_lines(400, 7, "none")), Scenario(**{**base.__dict__, "time": at_end})))
    # Later completions change what hits, and never add hits on an unbounded pool.
    later = replay(read_trace(random_lines(400, 7, "later")), base)
    assert later.request_hits != plain.request_hits


def test_later_completion_never_adds_hits_on_an_unbounded_pool():
    sc = Scenario(Capacity.parse("inf"), time=ZERO)
    plain = replay(read_trace(random_lines(300, 3, "none")), sc)
    later = replay(read_trace(random_lines(300, 3, "later")), sc)
    assert all(x <= y for x, y in zip(later.request_hits, plain.request_hits, strict=True))
    assert later.hit_blocks < plain.hit_blocks


def test_commit_at_prefill_end_uses_the_modelled_prefill():
    # 2 blocks (1024 tokens) at 1000 us per token: r0 prefills from 0 to 1.024 s.
    lines = [line(0, [1, 2]), line(1000, [1, 2, 3]), line(1100, [1, 2, 4])]
    tm = TimeModel(prefill_us_per_token=1000.0, decode_s=0.0, commit_at_prefill_end=True)
    assert hits(lines, Scenario(Capacity.parse("inf"), time=tm)) == [0, 0, 2]
    # Off (the default): at arrival, whatever the service time.
    tm_off = TimeModel(prefill_us_per_token=1000.0, decode_s=0.0)
    assert hits(lines, Scenario(Capacity.parse("inf"), time=tm_off)) == [0, 2, 2]


def test_ssd_hits_are_promoted_at_arrival_computed_blocks_at_completion():
    # L1 of 1 block, SSD behind it. r0 puts 1 in L1; r1 (2) evicts it to the SSD. r2 (1 5)
    # runs 3-9 s: its SSD hit 1 is promoted at once (r3 at 4 s finds it in L1), 5 only at 9 s.
    sc = Scenario(Capacity.parse("1blocks"), ssd=Capacity.parse("inf"), time=ZERO)
    lines = [line(0, [1]), line(1000, [2]), line(3000, [1, 5], 9000), line(4000, [1])]
    res = replay(read_trace(lines), sc)
    assert res.request_hits == [0, 0, 1, 1]
    assert res.ssd_hit_blocks == 1  # r2's; r3's hit is in L1


def test_the_trace_reads_done_in_its_time_unit_and_refuses_it_before_the_request():
    (r,) = read_trace([line(1500, [1], 2500)]).requests
    assert (r.time, r.done) == (1.5, 2.5)
    (q,) = read_trace([encode_query(1.5, "ns", [bytes(16)], done=2.25)]).requests
    assert (q.time, q.done) == (1.5, 2.25)
    assert read_trace([line(1500, [1])]).requests[0].done is None
    with pytest.raises(TraceError, match="'done'.*before the request's time"):
        read_trace([line(1500, [1], 1000)])
    with pytest.raises(TraceError, match="'done' must be a number"):
        read_trace([json.dumps({"timestamp": 0, "input_length": 1, "hash_ids": [1], "done": "x"})])


def test_the_cli_reads_done_and_takes_commit_at_prefill_end(tmp_path):
    import subprocess
    import sys

    def run(lines: list[str], *flags: str) -> dict[str, object]:
        path = tmp_path / "t.jsonl"
        path.write_text("\n".join(lines) + "\n")
        out = subprocess.run(
            [sys.executable, "-m", "pegaflow.cli", "replay", str(path), "--l1-capacity", "inf", "--sweep", "none",
             "--json", "--quiet", "--prefill-us-per-token", "1000", *flags],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        (r,) = json.loads(out.stdout)["runs"]
        return r  # type: ignore[no-any-return]

    untimed = [line(0, [1, 2]), line(1000, [1, 2, 3])]  # r0 prefills 1024 tokens: 0 to 1.024 s
    assert run(untimed)["hit_blocks"] == 2
    on = run(untimed, "--commit-at-prefill-end")
    assert on["hit_blocks"] == 0
    assert on["scenario"]["time"]["commit_at_prefill_end"] is True  # type: ignore[index]
    assert run([line(0, [1, 2], 1500), line(1000, [1, 2, 3])])["hit_blocks"] == 0  # measured: done at 1.5 s
