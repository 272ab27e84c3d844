"""bench/backup.py in a tiny mode: the mechanics, not the figures.

Both runs (backup off and on, at once) must finish on three real nodes; with the backup on the
idle node must have pulled the busy nodes' pages (paced: several plans seen, so a bandwidth
was measured), the busy nodes must have demoted what it holds, and some accesses must have
been pulled back from it; with the backup off nothing is pulled, and node-2 holds none of the
busy nodes' pages. Every printed ratio must
be the one computed from the two runs' own figures. Timings on a shared test machine mean
nothing, so no hit rate, bandwidth or latency bound is checked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.backup import accesses, bandwidth

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")
def test_backup_bench_runs_both_modes_and_computes_its_ratios(tmp_path: Path) -> None:
    summary = tmp_path / "s.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "backup.py"), "--pages", "64", "--page-kib", "64",
                        "--bandwidth-mb", "1", "--accesses", "60", "--rate", "50", "--summary", str(summary)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = json.loads(summary.read_text())
    on, off = s["on"], s["off"]
    assert on["plans_seen"] >= 3 and on["bandwidth_bytes_per_s"] > 0
    assert on["warm_pulled_bytes"] > 0 and on["demoted_backup"] > 0 and on["remote_hits"] > 0
    assert off["warm_pulled_bytes"] == 0 and off["measure_pulled_bytes"] == 0 and off["remote_hits"] == 0
    # Both measures start from one go, the on run's requests half a request after the off run's.
    assert on["measure_start"] - off["measure_start"] == pytest.approx(0.5 / 50)
    for run in (on, off):
        assert run["accesses"] == 60 and run["query_calls"] >= 60 and run["query_p99_us"] > 0
    assert s["gain_pp"] == pytest.approx((on["hit_rate"] - off["hit_rate"]) * 100)
    # The idle pool's share is counted from the pools: node-2 holds none of the busy nodes' pages
    # with the backup off, some with it on; a busy pool holds at most its pages.
    assert off["idle_only_pages_mean"] == [0.0, 0.0] and sum(on["idle_only_pages_mean"]) > 0
    assert all(0 < own <= 64 for run in (on, off) for own in run["own_pages_mean"])
    assert s["idle_useful_pages"] == pytest.approx(sum(on["idle_only_pages_mean"]))
    overflow = 2 * 64
    assert s["predicted_gain_pp"] == pytest.approx(
        (1 - off["hit_rate"]) * s["idle_useful_pages"] / overflow * 100)
    assert s["hit_rate_error_pp"] == pytest.approx(abs(on["hit_rate"] - s["predicted_hit_rate_on"]) * 100)
    assert s["bandwidth_ratio"] == pytest.approx(on["bandwidth_bytes_per_s"] / (1 << 20))
    assert s["query_p99_on_over_off"] == pytest.approx(on["query_p99_us"] / off["query_p99_us"])
    lo, hi = s["query_p99_on_over_off_90pct"]
    assert 0 < lo <= hi


def test_the_bandwidth_leaves_out_the_first_plan() -> None:
    # The counter steps at 1 s (the burst), then 2 MB at 3 s and 5 s: 4 MB over 4 s.
    samples = [(0.0, 0.0), (1.0, 1e6), (2.0, 1e6), (3.0, 3e6), (4.0, 3e6), (5.0, 5e6), (6.0, 5e6)]
    assert bandwidth(samples) == (1e6, 3)
    assert bandwidth(samples[:4]) == (0.0, 2)  # two changes: nothing paced to measure


def test_both_runs_see_the_same_accesses() -> None:
    a = accesses(100, 128, seed=3)
    assert a == accesses(100, 128, seed=3)
    assert [k for k, _ in a[:4]] == [0, 1, 0, 1] and all(0 <= b < 128 for _, b in a)
