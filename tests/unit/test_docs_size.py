"""docs/benchmarks.md holds one current table per benchmark, not their history (git has that):
it stays at most 300 lines, so a run that adds figures replaces stale ones."""

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
MAX_LINES = 300


def test_benchmarks_page_stays_within_its_budget() -> None:
    lines = BENCHMARKS.read_text().count("\n")
    assert lines <= MAX_LINES, (
        f"docs/benchmarks.md has {lines} lines (at most {MAX_LINES}): replace superseded figures, "
        "move history out (git keeps it)"
    )
