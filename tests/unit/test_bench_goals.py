"""``python -m bench``: every goal reads a benchmark that exists, and a goal holds exactly
when its bound is met (a missing figure never counts as met)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.__main__ import dig, evaluate
from bench.goals import GOALS, RUNS, Goal

ROOT = Path(__file__).resolve().parents[2]


def test_every_goal_reads_a_run_whose_script_exists_and_names_are_unique() -> None:
    runs = {r.name: r for r in RUNS}
    assert len(runs) == len(RUNS)
    for r in RUNS:
        assert (ROOT / "bench" / r.script).is_file(), r.script
        assert r.summary_flag in (ROOT / "bench" / r.script).read_text(), f"{r.script} has no {r.summary_flag}"
    for g in GOALS:
        assert g.run in runs, g
        assert g.on in ("ratio", "value"), g


@pytest.mark.parametrize(
    ("goal", "summary", "holds"),
    [
        (Goal("x", "m", "v", "GB/s", "p", "peer", 0.7), {"v": 7.0, "p": 10.0}, True),
        (Goal("x", "m", "v", "GB/s", "p", "peer", 0.7), {"v": 6.9, "p": 10.0}, False),
        (Goal("x", "m", "a.v", "µs", "a.p", "peer", 2000, on="value", higher_is_better=False),
         {"a": {"v": 1999.0, "p": 900.0}}, True),
        (Goal("x", "m", "a.v", "µs", "a.p", "peer", 2000, on="value", higher_is_better=False),
         {"a": {"v": 2001.0, "p": 900.0}}, False),
        (Goal("x", "m", "v", "GB/s", "p", "peer", 0.85, ratio="r"), {"v": 1.0, "p": 2.0, "r": 0.9}, True),
        (Goal("x", "m", "v", "GB/s", "p", "peer", 0.7), {"p": 10.0}, False),  # the figure is missing
        (Goal("x", "m", "v", "GB/s", "p", "peer", 0.7), None, False),  # the benchmark failed
    ],
)
def test_a_goal_holds_exactly_when_its_bound_is_met(goal: Goal, summary: dict | None, holds: bool) -> None:
    row, ok = evaluate(goal, summary)
    assert ok is holds
    assert row[-1] == ("yes" if holds else "**no**")


def test_dig_follows_dotted_paths_and_misses_cleanly() -> None:
    d = {"connectors": {"pega": {"warm_mean_ms": 54.0}}}
    assert dig(d, "connectors.pega.warm_mean_ms") == 54.0
    assert dig(d, "connectors.lmcache.warm_mean_ms") is None
    assert dig(None, "a") is None
