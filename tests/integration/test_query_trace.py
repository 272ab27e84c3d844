"""The node records its queries when asked, and `pegaflow replay` reads that trace."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import xxhash

from pegaflow.client import PegaClient

pytestmark = pytest.mark.integration


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def test_node_writes_a_query_trace_that_replay_reads(node_factory, tmp_path):
    trace = tmp_path / "queries.jsonl"
    n = node_factory(extra=["--query-trace", str(trace)])
    with PegaClient(n.addr, instance_id="engine-7") as c:
        c.register({"m": 8192})
        hs = hashes("t", 4)
        c.query(["m"], hs, lease=False)                 # miss: 4 blocks
        r = c.reserve("m", hs)
        c.commit(r.reservation_id)
        c.query(["m"], hs, lease=False)                 # hit: 4 blocks
    n.stop()                                            # flushes the trace
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 2
    assert lines[0]["namespace"] == "m" and lines[0]["instance"] == "engine-7"
    assert lines[0]["hashes"] == [h.hex() for h in hs] and lines[0]["page_bytes"] == 8192
    assert abs(lines[1]["time"] - time.time()) < 120
    p = subprocess.run([sys.executable, "-m", "pegaflow.cli", "replay", str(trace), "--json", "--quiet",
                        "--l1-capacity", "inf"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    ceiling = json.loads(p.stdout)["ceiling"]
    # 8 block requests, 4 distinct: the exact ceiling is (8 - 4) / 8
    assert (ceiling["blocks"], ceiling["unique"], ceiling["ceiling"]) == (8, 4, 0.5)


def test_unwritable_query_trace_is_a_one_line_error(node_factory, tmp_path):
    n = node_factory(extra=["--query-trace", str(tmp_path / "no" / "such" / "dir" / "q.jsonl")], start=False)
    p = subprocess.run(n.argv(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("pegaflow-node: error: cannot open --query-trace")
    assert "Traceback" not in p.stderr
