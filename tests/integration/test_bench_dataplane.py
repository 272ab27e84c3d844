"""bench/dataplane.py and bench/saturation.py in a tiny mode: the mechanics, not the figures.

The data-path benchmark must switch the node's background work as a whole (SSD write-behind,
L1 eviction, event publishing to a real redis-server, scrapers, Stats) and prove from the
node's own metrics that it ran in the "on" windows and not in the "off" ones; the
saturation benchmark must ramp its engine clients, copy real pages and find a saturation
rate. Timings on a shared test machine mean nothing, so none is checked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.dataplane import BLOCKS, CALLS, PARTS, quiet

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, args: list[str], summary: Path) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--summary", str(summary)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(summary.read_text())


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")
def test_dataplane_switches_the_whole_background_and_proves_it_ran(tmp_path: Path) -> None:
    s = run("dataplane.py", ["--seconds", "2", "--rounds", "1", "--engines", "1", "--rate", "20",
                             "--save-every", "2", "--scrapers", "2", "--dir", str(tmp_path)], tmp_path / "s.json")
    on, off = s["on"]["background"], s["off"]["background"]
    assert on["ssd_written_bytes"] > 0 and on["l1_evicted_blocks"] > 0 and on["events_published_blocks"] > 0
    assert on["scrapes"] >= 2 and on["stats_calls"] >= 1 and on["sketches_published"] >= 1
    assert not any(off.values()), off
    for mode in ("on", "off"):
        calls = s[mode]["calls"]
        assert set(calls) == set(CALLS)
        assert calls["query"]["n"] == calls["release"]["n"] >= 20  # 2 s at 20/s (warm-up excluded)
        assert calls["reserve"]["n"] == calls["commit"]["n"] == calls["query"]["n"] // 2
        assert s[mode]["query_misses"] == 0 and s[mode]["node_cpu_us_per_call"] > 0
        assert all(s[mode]["node_p99_us"][k] > 0 for k in CALLS)  # read from the node's histogram
    for p in ("p50", "p99", "p999"):
        assert s[f"query_{p}_us_background_on"] == s["on"]["calls"]["query"][p] > 0
        assert s[f"query_{p}_us_background_off"] == s["off"]["calls"]["query"][p] > 0


def test_a_quiet_background_window_is_named() -> None:
    bg = {"ssd_written_bytes": 1.0, "l1_evicted_blocks": 3.0, "events_published_blocks": 0.0, "scrapes": 4,
          "stats_calls": 0}
    assert quiet({"background": bg}, list(PARTS)) == ["events_published_blocks", "stats_calls"]
    assert quiet({"background": bg}, ["ssd", "scrape"]) == []  # only the parts switched on count


def test_parts_switch_one_part_of_the_background_alone(tmp_path: Path) -> None:
    s = run("dataplane.py", ["--seconds", "2", "--rounds", "1", "--engines", "1", "--rate", "20", "--save-every", "2",
                             "--parts", "evict,stats", "--dir", str(tmp_path)], tmp_path / "s.json")
    on = s["on"]["background"]
    assert s["parts"] == ["evict", "stats"]
    assert on["l1_evicted_blocks"] > 0 and on["stats_calls"] >= 1
    assert on["ssd_written_bytes"] == on["events_published_blocks"] == on["scrapes"] == 0
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "dataplane.py"), "--parts", "ssd,gc"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and "unknown part 'gc'" in p.stderr and "Traceback" not in p.stderr


def test_saturation_ramps_until_the_clients_fall_behind(tmp_path: Path) -> None:
    s = run("saturation.py", ["--engines", "2", "--pages", "256", "--level-seconds", "1", "--half-seconds", "1",
                              "--start-rate", "4", "--max-levels", "3", "--floor-seconds", "0.3"], tmp_path / "s.json")
    # The host's floor, measured before the node started, in both placements.
    assert set(s["host_round_trip"]) == {"two_cpus", "one_cpu"}
    for f in s["host_round_trip"].values():
        assert f["n"] > 10 and 0 < f["p50_us"] <= f["p99_us"] <= f["p999_us"]
    r = s["256k"]
    rates = [lv["rate_per_client"] for lv in r["levels"]]
    assert rates == [4 * 2**i for i in range(len(rates))]
    assert r["saturation_requests_per_s"] == max(lv["requests_per_s"] for lv in r["levels"]) > 0
    request_bytes = BLOCKS * (256 << 10)  # the bench's blocks per request, of the pages asked for above
    assert r["saturation_gbps"] == pytest.approx(r["saturation_requests_per_s"] * request_bytes / 1e9)
    assert r["half"]["rate_per_client"] == pytest.approx(r["saturation_requests_per_s"] / 2 / 2)
    assert r["half_p99_us_max"] == max(r["half_p99_us"].values()) > 0
    assert set(r["half_without_copies_p99_us"]) == set(r["half_p99_us"])  # the same calls, copies skipped
    assert all(v > 0 for v in r["half_without_copies_p99_us"].values())
    # Every request at 50% copied its 64 pages: on the clients' SCHED_IDLE copy threads (a GPU
    # engine's DMA), then, for attribution, on the calling threads at their own policy; none skipped.
    assert r["half"]["copied_bytes"] == r["half"]["requests"] * request_bytes > 0
    assert r["half"]["copy_policies"] == [os.SCHED_IDLE]
    cpu = r["half_cpu_copies"]
    assert cpu["copied_bytes"] == cpu["requests"] * request_bytes > 0
    assert cpu["copy_policies"] == [os.sched_getscheduler(0)] != [os.SCHED_IDLE]
    assert set(r["half_cpu_copies_p99_us"]) == set(r["half_p99_us"])
    assert r["half_without_copies"]["copied_bytes"] == 0
    assert r["misses"] == 0
