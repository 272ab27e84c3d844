"""The ceiling r* = (N - U) / N: exact, per window, the HLL estimate, and the synthetic trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pegaflow.config.capacity import Capacity
from pegaflow.core.trace import read_trace
from pegaflow.replay.files import iter_lines
from pegaflow.replay.model import Scenario
from pegaflow.replay.run import replay
from pegaflow.replay.windows import ceiling_report

DATA = Path(__file__).parents[1] / "data"
SLICE = DATA / "mooncake_slice.jsonl"  # the last 300 lines of the synthetic trace
FULL = Path(__file__).resolve().parents[2] / "traces" / "mooncake_synthetic_trace.jsonl.gz"


def lines(*reqs: tuple[float, list[int]]) -> list[str]:
    return [
        json.dumps({"timestamp": ms, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids})
        for ms, ids in reqs
    ]


def test_per_window_ceilings_are_counted_per_tumbling_window():
    # 2 s windows from the first request: [1,2,3] [1,2,4] | [1,2,3] [5].
    trace = read_trace(lines((0, [1, 2, 3]), (1000, [1, 2, 4]), (2000, [1, 2, 3]), (3500, [5])))
    run = replay(trace, Scenario(Capacity.parse("inf")))
    rep = ceiling_report(trace, run.request_hits, [2.0])
    assert rep.ceiling == 0.5 and rep.blocks == 10 and rep.unique == 5
    w0, w1 = rep.windows
    assert (w0.index, w0.blocks, w0.unique, w0.ceiling) == (0, 6, 4, pytest.approx(2 / 6))
    assert (w1.index, w1.start, w1.blocks, w1.unique, w1.ceiling) == (1, 2.0, 4, 4, 0.0)
    # Hit rates inside windows come from the run: window 1 hits 3 blocks cached earlier.
    assert (w0.hit_rate, w1.hit_rate) == (pytest.approx(2 / 6), 0.75)
    # HLL is exact at these sizes, and reads the same requests as the exact column.
    assert (w0.ceiling_hll, w1.ceiling_hll) == (pytest.approx(2 / 6), 0.0)
    assert rep.ceiling_hll == pytest.approx(0.5)


def test_windows_without_requests_are_not_listed():
    trace = read_trace(lines((0, [1]), (10_000, [1])))
    run = replay(trace, Scenario(Capacity.parse("inf")))
    rep = ceiling_report(trace, run.request_hits, [2.0])
    assert [w.index for w in rep.windows] == [0, 5]


def check_synthetic(path: Path) -> None:
    trace = read_trace(iter_lines(path))
    n = u = 0
    seen: set[int] = set()
    for line in iter_lines(path):
        ids = json.loads(line)["hash_ids"]
        n += len(ids)
        seen.update(ids)
    u = len(seen)
    assert (trace.blocks, trace.unique) == (n, u)
    # The trace's ids name whole prefixes, so an unbounded cache hits exactly the ceiling.
    run = replay(trace, Scenario(Capacity.parse("inf")))
    assert run.hit_blocks == n - u
    assert run.hit_rate == (n - u) / n
    rep = ceiling_report(trace, run.request_hits, [900.0, 3600.0])
    assert rep.ceiling == (n - u) / n
    assert rep.ceiling_hll == pytest.approx((n - u) / n, abs=0.01)
    for w in rep.windows:
        assert w.ceiling_hll == pytest.approx(w.ceiling, abs=0.02)
    # Windows partition the trace.
    for label in ("15m", "1h"):
        assert sum(w.blocks for w in rep.windows if w.window == label) == n
    # A bounded cache stays at or below the ceiling and grows with capacity.
    small, big = (replay(trace, Scenario(Capacity.parse(c))).hit_rate for c in ("5%", "50%"))
    assert small < big <= (n - u) / n


def test_synthetic_trace_slice_hits_its_ceiling_exactly():
    check_synthetic(SLICE)


def test_full_synthetic_trace_hits_its_ceiling_exactly():
    check_synthetic(FULL)
