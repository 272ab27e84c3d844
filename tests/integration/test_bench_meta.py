"""bench/meta.py in a tiny mode, beside the Rust original's metaserver: the mechanics, not the figures.

The benchmark must give the original (pegaflow-llm's metaserver, fetched into the bench's
cache) the same nodes and events as ours, check every lookup answer of both, and write every
figure the goals of issue #55 read (bench/goals.py); where the original cannot run, those
goals must not hold (and the benchmark must still finish). Timings on a shared test machine
mean nothing, so none is checked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import evaluate
from bench.goals import GOALS
from bench.original_meta import MAX_HASHES_PER_RPC, Session, Unavailable, pip_reason, plan, stubs

ROOT = Path(__file__).resolve().parents[2]
PEER_GOALS = [g for g in GOALS if g.run == "meta" and g.peer and g.peer.startswith("original.")]


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")
def test_both_metaservers_get_the_same_work_and_every_goal_figure_is_written(tmp_path: Path) -> None:
    summary = tmp_path / "meta.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "meta.py"), "--blocks", "4096", "--queries", "50",
                        "--standalone-only", "--summary", str(summary)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = json.loads(summary.read_text())
    o = s["original"]
    if "skipped" in o:
        assert "skipped" in p.stdout and "Traceback" not in p.stdout + p.stderr
        pytest.skip(f"the original's metaserver cannot run here: {o['skipped']}")
    assert s["grpc_lookups_checked"] == o["lookups_checked"] == 50
    # Every update of ours reached the original too: the same events, counted once each; under
    # load both sets of nodes sent them at least once, as long as each answered the idle rounds'
    # lookups, ours at the rate the original ingested them; the fresh load ours ingests idle is
    # as large.
    assert o["updates"] == s["updates"] and s["ingest_updates"] >= s["indexed_blocks"]
    assert o["loaded_passes"] >= 1 and s["loaded_passes"] >= 1
    assert s["loaded_offered_pairs_per_s"] == o["loaded_ingest_pairs_per_s"]
    assert s["loaded_publish_pairs_per_s"] <= 1.02 * s["loaded_offered_pairs_per_s"]  # paced, never ahead
    assert s["loaded_queries"] >= 50 and o["loaded_queries"] >= 50
    # Ours is measured as it serves: from its in-memory view, read from the streams it keeps.
    assert s["lookups_from_view"] + s["lookups_from_redis"] == 2 * 50 and s["lookups_from_view"] >= 90
    for g in PEER_GOALS:
        row, _ = evaluate(g, s)
        assert row[3] != "—", (g.metric, row)  # a ratio: both figures are there
    assert "ours ÷ original" in p.stdout
    for k in ("route", "query"):  # how far each idle p99 ratio moves over resamples of the rounds
        lo, hi = o[f"{k}_p99_ratio_90pct"]
        assert 0 < lo <= hi
    assert "over resamples of their rounds" in p.stdout


def test_goals_against_an_absent_original_do_not_hold() -> None:
    assert len(PEER_GOALS) == 6
    ours = {"grpc_route_p99_us": 900.0, "grpc_query_p99_us": 950.0, "ingest_pairs_per_s": 5e5,
            "memory_bytes_per_block": 90.0, "loaded_grpc_route_p99_us": 2000.0, "loaded_grpc_query_p99_us": 2100.0}
    for summary in (ours, {**ours, "original": {"version": "0.25.1", "skipped": "no package index"}}, None):
        for g in PEER_GOALS:
            _, holds = evaluate(g, summary)
            assert not holds, g.metric


def test_the_original_is_sent_each_nodes_events_in_order_in_calls_of_at_most_its_chunk() -> None:
    try:
        pb, _ = stubs()
    except Unavailable as e:
        pytest.skip(str(e))
    sessions = [Session("10.0.0.0:50055", "a"), Session("10.0.0.1:50055", "b")]
    big = [i.to_bytes(16, "big") for i in range(MAX_HASHES_PER_RPC + 10)]
    events = [(0, "ns", True, big[:100]), (1, "ns", True, big[:5]), (0, "ns", True, big[100:]),
              (0, "ns", False, big[:3]), (0, "other", True, big[:2]), (1, "ns", False, big[:5])]
    calls = plan(pb, sessions, events)
    got = []
    for node_calls in calls:
        out = []
        for method, raw, n in node_calls:
            kind = pb.InsertBlockHashesRequest if method == "InsertBlockHashes" else pb.RemoveBlockHashesRequest
            req = kind.FromString(raw)
            assert len(req.block_hashes) == n <= MAX_HASHES_PER_RPC
            out.append((method, req.namespace, req.node, list(req.block_hashes)))
        got.append(out)
    assert got[0] == [("InsertBlockHashes", "ns", "10.0.0.0:50055", big[:MAX_HASHES_PER_RPC]),
                      ("InsertBlockHashes", "ns", "10.0.0.0:50055", big[MAX_HASHES_PER_RPC:]),
                      ("RemoveBlockHashes", "ns", "10.0.0.0:50055", big[:3]),
                      ("InsertBlockHashes", "other", "10.0.0.0:50055", big[:2])]
    assert got[1] == [("InsertBlockHashes", "ns", "10.0.0.1:50055", big[:5]),
                      ("RemoveBlockHashes", "ns", "10.0.0.1:50055", big[:5])]


def test_an_unreachable_package_index_is_the_one_line_reason() -> None:
    out = ("WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError('<HTTPConnection "
           "object at 0x7f>: Failed to establish a new connection: [Errno 111] Connection refused')': /simple/x/\n"
           "ERROR: Could not find a version that satisfies the requirement x==1 (from versions: none)\n"
           "ERROR: No matching distribution found for x==1\n")
    assert pip_reason(out) == ("the package index is unreachable (Failed to establish a new connection: "
                               "[Errno 111] Connection refused)")
    assert pip_reason("ERROR: No matching distribution found for x==1\n") == "ERROR: No matching distribution found for x==1"
