"""bench/router.py without engines: the flags (one-line errors), the closed-loop scheduler
(trace order, C in flight, the next sent the moment one finishes), the one driver all
three modes send through, and the headline table."""

from __future__ import annotations

import asyncio
import heapq
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.router import CONCURRENCY, ENGINES, HEADLINE, RUNS, ClosedLoop, drive, headline, parse_args

ROOT = Path(__file__).resolve().parents[2]


# --- flags ---------------------------------------------------------------------------------


def test_modes_parse() -> None:
    a = parse_args([])
    assert (a.rate, a.concurrency) == (0.0, 0)  # one at a time
    assert parse_args(["--rate", "4"]).rate == 4.0
    assert parse_args(["--concurrency"]).concurrency == CONCURRENCY == 2 * ENGINES
    assert parse_args(["--concurrency", "3"]).concurrency == 3


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--rate", "4", "--concurrency", "8"], "exclude each other"),
        (["--concurrency", "--rate", "4"], "exclude each other"),
        (["--concurrency", "-1"], "--concurrency must be at least 1"),
        (["--rate", "-2"], "--rate must be positive"),
        (["--requests", "0"], "--requests must be at least 1"),
        (["--l1", "10"], "--l1 must be a percentage"),
        (["--l1", "x%"], "--l1 must be a percentage"),
    ],
)
def test_bad_flags_exit_with_one_line(argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert isinstance(e.value.code, str) and says in e.value.code and "\n" not in e.value.code


def test_the_script_refuses_rate_with_concurrency_before_starting_anything() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "router.py"), "--rate", "4", "--concurrency", "8"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "--rate (open loop) and --concurrency (closed loop) exclude each other: give one"]


# --- the closed-loop scheduler -----------------------------------------------------------------


def simulate(service: list[float], c: int) -> tuple[list[tuple[float, int]], list[float]]:
    """Requests with these service times through ClosedLoop: the (time, request) sends and
    the completion times in the order they happened (an event queue, no clock)."""
    loop = ClosedLoop(len(service), c)
    sends: list[tuple[float, int]] = []
    ends: list[float] = []
    events: list[tuple[float, int]] = []

    def send(t: float, ids: list[int]) -> None:
        for i in ids:
            sends.append((t, i))
            heapq.heappush(events, (t + service[i], i))
        assert len(loop.in_flight) == min(c, len(service) - loop.next + len(loop.in_flight))

    send(0.0, loop.start())
    while events:
        t, i = heapq.heappop(events)
        ends.append(t)
        send(t, loop.finished(i))
    assert loop.done
    return sends, ends


@pytest.mark.parametrize("c", [1, 2, 8, 50])
def test_closed_loop_sends_in_trace_order_the_moment_one_finishes(c: int) -> None:
    rng = random.Random(c)
    n = 40
    service = [rng.uniform(0.1, 3.0) for _ in range(n)]
    sends, ends = simulate(service, c)
    assert [i for _, i in sends] == list(range(n))  # each once, in trace order
    first = min(c, n)
    assert all(t == 0.0 for t, _ in sends[:first])  # C at the start
    # then request C-1+k goes at the k-th completion, whichever request that was
    assert [t for t, _ in sends[first:]] == ends[: n - first]
    # just after each of those completions, C in flight again
    for t in ends[: n - first]:
        assert sum(1 for s, j in sends if s <= t < s + service[j]) == c


def test_one_at_a_time_is_sequential() -> None:
    service = [1.0, 2.0, 0.5, 4.0]
    sends, _ = simulate(service, 1)
    assert sends == [(0.0, 0), (1.0, 1), (3.0, 2), (3.5, 3)]


def test_closed_loop_refuses_what_is_not_in_flight() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ClosedLoop(3, 0)
    loop = ClosedLoop(3, 2)
    assert loop.start() == [0, 1]
    with pytest.raises(ValueError, match="request 2 is not in flight"):
        loop.finished(2)
    assert loop.finished(1) == [2]
    with pytest.raises(ValueError, match="request 1 is not in flight"):
        loop.finished(1)
    assert loop.finished(0) == [] and loop.finished(2) == [] and loop.done


# --- the driver --------------------------------------------------------------------------


def test_drive_keeps_c_in_flight_and_returns_results_in_trace_order() -> None:
    """The test finishes requests in an order of its choosing (an event each, no timing)
    and sees which the driver sent after each."""
    n, c = 7, 3
    order = (2, 0, 4, 1, 3, 6, 5)

    async def settle() -> None:
        for _ in range(50):  # the driver's turns: a completion, its wait, the next send's start
            await asyncio.sleep(0)

    async def go() -> tuple[list[dict[str, Any]], list[list[int]]]:
        release = [asyncio.Event() for _ in range(n)]
        started: list[int] = []
        seen: list[list[int]] = []

        async def send(i: int) -> dict[str, Any]:
            started.append(i)
            await release[i].wait()
            return {"i": i}

        task = asyncio.create_task(drive(n, c, send, "t"))
        await settle()
        seen.append(list(started))
        for i in order:
            release[i].set()
            await settle()
            seen.append(list(started))
        out, wall = await task
        assert wall >= 0
        return out, seen

    out, seen = asyncio.run(go())
    assert out == [{"i": i} for i in range(n)]
    # three at the start, then the next in trace order per completion, whichever finished
    assert seen == [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]] + [list(range(7))] * 4


def test_a_failed_request_fails_the_run_and_cancels_the_rest() -> None:
    async def go() -> list[bool]:
        hold = asyncio.Event()
        cancelled: list[bool] = []

        async def send(i: int) -> dict[str, Any]:
            if i == 1:
                raise RuntimeError("HTTP 500")
            try:
                await hold.wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
            return {}

        with pytest.raises(RuntimeError, match="HTTP 500"):
            await drive(5, 3, send, "t")
        await asyncio.sleep(0)
        return cancelled

    assert asyncio.run(go()) == [True, True]  # requests 0 and 2 were in flight


# --- the headline table --------------------------------------------------------------------


def test_headline_sets_each_run_against_another() -> None:
    figures = {f"{r}+{p}": {"requests_per_s": 2.0 + k, "ttft_mean_ms": 100.0 * (k + 1),
                            "request_hit_rate": 0.1 * k}
               for k, (r, p) in enumerate(RUNS)}
    rows, md = headline(figures)
    assert [r["comparison"] for r in rows] == [h[0] for h in HEADLINE]
    for row, (_, a, b) in zip(rows, HEADLINE, strict=True):
        fa, fb = figures[a], figures[b]
        assert row["requests_per_s"] == [fa["requests_per_s"], fb["requests_per_s"]]
        assert row["requests_per_s_ratio"] == pytest.approx(fa["requests_per_s"] / fb["requests_per_s"])
        if fb["request_hit_rate"]:
            assert row["request_hit_rate_ratio"] == pytest.approx(fa["request_hit_rate"] / fb["request_hit_rate"])
        else:
            assert row["request_hit_rate_ratio"] is None  # round-robin + isolated hit nothing
    lines = md.splitlines()
    assert len(lines) == 2 + len(HEADLINE) and all(line.count("|") == 7 for line in lines)
    # kv-aware + shared (5.0 req/s, 30%) against kv-aware + isolated (3.0 req/s, 10%)
    assert lines[2] == ("| one shared pool vs isolated pools (kv-aware) | 5.00 vs 3.00 | 400 vs 200 ms "
                        "| 30.0% vs 10.0% | 1.67x | 3.00x |")
    assert "| n/a |" in lines[3]  # kv-aware vs round-robin, isolated: round-robin's 0% hit rate


# --- the prediction: replay at the run's measured times ------------------------------------


def test_predict_one_at_a_time_is_the_plain_sequence_for_every_run() -> None:
    # Each prefill over before the next send: the completions change nothing.
    from bench.router import TRACE, load_slice, predict

    slice_ = load_slice(TRACE, 160, 8)
    sent = [0.7 * k for k in range(len(slice_))]
    first = [t + 0.3 for t in sent]
    for route, pools in RUNS:
        plain = predict(slice_, 32, 120, route, pools, sent)
        timed = predict(slice_, 32, 120, route, pools, sent, first)
        assert plain.hit_blocks > 0
        assert (timed.request_hits, timed.request_instance, timed.evictions) == (
            plain.request_hits, plain.request_instance, plain.evictions)


def test_predict_with_requests_in_flight_together_counts_no_hits_between_them() -> None:
    from bench.router import ISOLATED, KV_AWARE, ROUND_ROBIN, SHARED, predict

    slice_ = [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    sent = [0.0, 0.1, 0.6]
    # r0's prefill ends at 0.5 s: r1 (sent at 0.1) cannot hit its blocks, r2 (0.6) can.
    assert predict(slice_, 32, 100, ROUND_ROBIN, SHARED, sent, [0.5, 0.55, 0.9]).request_hits == [0, 0, 2]
    assert predict(slice_, 32, 100, ROUND_ROBIN, SHARED, sent).request_hits == [0, 2, 2]
    # kv-aware sees only committed blocks too: r1 gets no prefix to follow.
    assert predict(slice_, 32, 100, KV_AWARE, ISOLATED, sent, [0.5, 0.55, 0.9]).request_hits[1] == 0


def test_predict_routes_a_request_without_a_hint_as_the_router_did() -> None:
    """The router had no prefix answer for r2 and chose by load (bound and turn): replay must
    not send it to the pool that holds its prefix."""
    from bench.router import ISOLATED, KV_AWARE, predict

    slice_ = [[1, 2, 3], [9, 8, 7], [1, 2, 4]]
    sent = [0.0, 100.0, 200.0]  # minutes apart: no load in the window, the bound is not in play
    hinted = predict(slice_, 32, 100, KV_AWARE, ISOLATED, sent)
    assert hinted.request_instance[2] == hinted.request_instance[0] and hinted.request_hits[2] == 2
    blind = predict(slice_, 32, 100, KV_AWARE, ISOLATED, sent, hinted=[True, True, False])
    # By turn: r0 on instance 0, r1 (nothing held anywhere) on 1, r2 on 2, where nothing is held.
    assert blind.request_instance == [0, 1, 2] and blind.request_hits == [0, 0, 0]


def test_the_summary_keeps_what_the_prediction_was_given() -> None:
    import json

    from bench.router import SHARED, predict, summarize

    slice_ = [[1, 2], [1, 2]]
    res = [{"ttft_s": 0.2, "cached": 0, "engine": "e0", "sent_s": 0.0, "first_s": 0.2, "done_s": 0.25,
            "hinted": True},
           {"ttft_s": 0.1, "cached": 64, "engine": "e1", "sent_s": 0.3, "first_s": 0.4, "done_s": 0.5,
            "hinted": False}]
    prompts = [[7] * 65, [7] * 65]
    predicted = predict(slice_, 32, 10, "round-robin", SHARED, [r["sent_s"] for r in res],
                        [r["first_s"] for r in res])
    out = summarize("x", res, prompts, 32, 1.0, predicted)
    assert out["per_request"] == [{k: r[k] for k in ("sent_s", "first_s", "done_s", "engine", "hinted")}
                                  for r in res]
    assert out["routed_without_hint"] == 1
    assert out["gap_pp"] == pytest.approx(0.0)  # 2 of 4 blocks hit, as replay says
    json.dumps(out)
