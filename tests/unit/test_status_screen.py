"""`pegaflow status` screens on fully populated fake snapshots: 80 columns, numbers right."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pegaflow._proto import node_pb2
from pegaflow.ops.status import _watch_argv, frame, node_snapshot, totals, unreachable
from pegaflow.ops.status_screen import (
    MAX_ROWS,
    WIDTH,
    clip,
    cluster_lines,
    fmt_bytes,
    fmt_count,
    fmt_duration,
    fmt_pct,
    fmt_rate,
    node_lines,
)

GiB = 1 << 30
LONG = "Qwen/Qwen2.5-72B-Instruct-with-a-very-long-revision-name|tp7|layer-group-3|bf16"


def full_stats(node_id: str = "node-with-a-rather-long-host-name.example.internal", engines: int = 9,
               namespaces: int = 11) -> node_pb2.StatsResponse:
    """Every field set, with large values and names longer than any column."""
    return node_pb2.StatsResponse(
        pool_bytes=30 * GiB, used_bytes=12 * GiB + 300 * (1 << 20), resident_blocks=1_234_567, evictions=98_765_432,
        pool_prefaulted_bytes=15 * GiB, sessions=engines * 2, active_leases=1, active_reservations=12,
        node_id=node_id, epoch=1_796_311_608_282, uptime_seconds=3 * 86400 + 5 * 3600 + 17,
        resident_bytes=12 * GiB, save_bytes=5 * (1 << 40), load_bytes=700 * GiB,
        windows=[
            node_pb2.CeilingWindow(window="15m", requested_blocks=12_345, hit_blocks=5_086, distinct_blocks=4_567.8,
                                   hit_ratio=5_086 / 12_345, ceiling_ratio=(12_345 - 4_567.8) / 12_345),
            node_pb2.CeilingWindow(window="1h", requested_blocks=123_456_789, hit_blocks=61_728_394,
                                   distinct_blocks=1e7, hit_ratio=0.5, ceiling_ratio=0.919),
            node_pb2.CeilingWindow(window="24h"),  # nothing requested: ratios show '-'
        ],
        request_blocks=node_pb2.TierBlocks(l1=12_000_000, ssd=300, remote=45_678, miss=17_600_000),
        hit_blocks=node_pb2.TierBlocks(l1=12_000_300, ssd=300, remote=45_678, miss=17_600_000),
        ssd=node_pb2.SsdStats(capacity_bytes=2 << 40, used_bytes=(2 << 40) - GiB, blocks=8_888_888,
                              write_bytes=3 << 40, read_bytes=1 << 40, write_bytes_per_second=1.5 * GiB,
                              read_bytes_per_second=123.4 * (1 << 20), write_queue_blocks=7, promoted_blocks=99,
                              skipped_writes={"queue_full": 3}),
        peers=node_pb2.PeerStats(pulls={"ok": 1_234, "error": 5, "checksum": 1}, pull_bytes=42 * GiB,
                                 served_bytes=7 * GiB, active_pins=3, backed_off_peers=2,
                                 lookups={"found": 10, "none": 2, "error": 0}),
        engines=[node_pb2.EngineStats(instance_id=f"{node_id}:{1000 + i}:deadbeef", sessions=2,
                                      namespaces=[f"{LONG}-{i}", f"{LONG}-{i}b"], leases=i, reservations=1)
                 for i in range(engines)],
        namespaces=[node_pb2.NamespaceStats(name=f"{LONG}-{i}", page_bytes=(i + 1) << 20, blocks=1000 * (i + 1),
                                            bytes=1000 * (i + 1) * ((i + 1) << 20)) for i in range(namespaces)],
        blocks_by_namespace={f"{LONG}-{i}": 1000 * (i + 1) for i in range(namespaces)},
    )


def assert_fits(lines: list[str]) -> None:
    too_long = [ln for ln in lines if len(ln) > WIDTH]
    assert not too_long, too_long
    assert all(ln.isprintable() for ln in lines)


def test_formatters() -> None:
    assert [fmt_bytes(v) for v in (0, 512, 1536, 30 * GiB, 120 * GiB, 12 * GiB + 300 * (1 << 20))] == [
        "0 B", "512 B", "1.5 KiB", "30.0 GiB", "120 GiB", "12.3 GiB"]
    assert fmt_rate(1.5 * GiB) == "1.5 GiB/s"
    assert [fmt_count(v) for v in (0, 999, 12_345, 99_999, 100_000, 1_234_567, 98_765_432, 5_000_000_000)] == [
        "0", "999", "12,345", "99,999", "100.0k", "1.2M", "98.8M", "5.0G"]
    assert (fmt_pct(None), fmt_pct(0.41234), fmt_pct(1.0, 0)) == ("-", "41.2%", "100%")
    assert [fmt_duration(s) for s in (5, 65, 3 * 3600 + 120, 3 * 86400 + 5 * 3600)] == ["5s", "1m05s", "3h02m", "3d05h"]
    assert clip("abcdefghij", 6) == "ab..ij" and clip("abc", 6) == "abc" and len(clip(LONG, 17)) == 17


def test_node_screen_fits_80_columns_and_shows_every_figure() -> None:
    snap = node_snapshot("10.0.0.17:50055", full_stats())
    lines = node_lines(snap, now=0)
    assert_fits(lines)
    text = "\n".join(lines)
    # pool: used of capacity, share, resident blocks, pre-fault progress
    assert "pool      12.3 GiB of 30.0 GiB used (41.0%)  1.2M blocks  pre-fault 50%" in text
    assert "saved 5.0 TiB  loaded 700 GiB  evicted 98.8M blocks" in text
    assert "up 3d05h" in lines[0] and "node-with-a-rather" in lines[0]
    # hit rate beside its ceiling, per window; an empty window shows '-'
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.startswith(" " * 10) and ln.split()[0] in
            ("15m", "1h", "24h")}
    assert rows["15m"] == ["15m", "12,345", "41.2%", "63.0%", "65%"]
    assert rows["1h"] == ["1h", "123.5M", "50.0%", "91.9%", "54%"]
    assert rows["24h"] == ["24h", "0", "-", "-", "-"]
    # blocks by tier, each with its share of all requested blocks
    total = 12_000_000 + 300 + 45_678 + 17_600_000
    assert (f"blocks    L1 12.0M {100 * 12_000_000 / total:.1f}%  SSD 300 0.0%  "
            f"remote 45,678 {100 * 45_678 / total:.1f}%  miss 17.6M") in text
    assert "SSD       2.0 TiB of 2.0 TiB (100.0%)  8.9M blocks  w 1.5 GiB/s  r 123 MiB/s" in text
    assert "peers     pulls 1,234 ok 6 failed  pulled 42.0 GiB  served 7.0 GiB  backed off 2" in text
    assert "engines   9 engines  18 sessions  1 lease  12 reservations" in text
    assert f"... and {9 - MAX_ROWS} more" in text and f"... and {11 - MAX_ROWS} more" in text
    # namespaces: the biggest first, with page size, blocks and bytes
    ns_rows = [ln for ln in lines if ln.startswith("  Qwen")]
    assert [r.split()[1:] for r in ns_rows[:2]] == [["11.0", "MiB", "11,000", "118", "GiB"],
                                                    ["10.0", "MiB", "10,000", "97.7", "GiB"]]
    assert ns_rows[0].startswith("  Qwen/Qwen2.5-72B-In..") and ns_rows[0].split()[0].endswith("bf16-10")
    # an engine's namespaces: the first (clipped) and how many more
    assert [ln for ln in lines if ":1001:deadbeef" in ln][0].split()[1:] == ["2", "1", clip(f"{LONG}-1", 22), "+1"]
    assert "namespaces 11 holding" in text


def test_node_screen_without_ssd_peers_engines_or_windows() -> None:
    r = node_pb2.StatsResponse(pool_bytes=GiB, pool_prefaulted_bytes=GiB, node_id="n", uptime_seconds=5)
    lines = node_lines(node_snapshot("127.0.0.1:1", r), now=0)
    assert_fits(lines)
    text = "\n".join(lines)
    assert "SSD       off (no --ssd-cache-path)" in text
    assert "peers     none" in text
    assert "engines   0 engines  0 sessions  0 leases  0 reservations" in text
    assert "no window" in text and "namespaces 0 holding 0 B" in text


def test_unreachable_node_is_one_line() -> None:
    lines = node_lines(unreachable("127.0.0.1:9", "not answering (refused or no route)"))
    assert lines == ["node 127.0.0.1:9 unreachable: not answering (refused or no route)"]


@pytest.mark.parametrize("width", [80, 60])
def test_cluster_screen_with_an_unreachable_and_a_dead_node(width: int) -> None:
    a = node_snapshot("10.0.0.1:50055", full_stats("node-a"))
    b = node_snapshot("10.0.0.2:50055", full_stats("node-b-with-a-long-name", engines=1, namespaces=2))
    nodes: list[dict[str, Any]] = [
        {"node": "node-a", "address": "10.0.0.1:50055", "epoch": 1, "alive": True, "status": a},
        {"node": "node-b-with-a-long-name", "address": "10.0.0.2:50055", "epoch": 1, "alive": True, "status": b},
        {"node": "node-c", "address": "10.0.0.3:50055", "epoch": 1, "alive": True,
         "status": unreachable("10.0.0.3:50055", "no answer in time (--timeout)")},
        {"node": "node-d", "address": "10.0.0.4:50055", "epoch": 1, "alive": False,
         "status": unreachable("10.0.0.4:50055", "no heartbeat (not alive)")},
    ]
    union = [{"window": "15m", "requested_blocks": 24_690, "hit_blocks": 10_172, "distinct_blocks": 5000.0,
              "hit_ratio": 10_172 / 24_690, "ceiling_ratio": (24_690 - 5000) / 24_690},
             {"window": "1h", "requested_blocks": 0, "hit_blocks": 0, "distinct_blocks": 0.0, "hit_ratio": 0.0,
              "ceiling_ratio": 0.0}]
    c = {"metaserver": "10.0.0.9:50056", "reachable": True, "error": "", "nodes": nodes, "totals": totals(nodes),
         "ceiling": {"nodes_merged": 2, "nodes_skipped": 0, "windows": union}}
    json.dumps(c)  # what --json prints
    lines = cluster_lines(c, now=0, width=width)
    assert all(len(ln) <= width for ln in lines), lines
    row = {ln.split()[0]: ln for ln in lines if ln.split()}
    assert row["node-a"].split()[1:6] == ["12.3G/30.0G", "41%", "41.2%", "63.0%", "12.0M"]
    assert clip("node-b-with-a-long-name", 14) == "node-b..g-name" and "node-b..g-name" in row
    assert "unreachable: no answ" in row["node-c"]
    assert "no heartbeat" in row["node-d"]
    t = c["totals"]
    assert (t["nodes"], t["reachable"], t["capacity_bytes"], t["engines"]) == (4, 2, 60 * GiB, 10)
    assert t["requested_blocks"] == 2 * 12_345 and t["hit_blocks"] == 2 * 5_086
    # the total's ceiling is the metaserver's union, not a sum; so are the window rows
    assert row["total"].split()[1:5] == ["24.6G/60.0G", "41%", "41.2%", "79.7%"]
    assert row["15m"].split()[:4] == ["15m", "24,690", "41.2%", "79.7%"]
    assert row["1h"].split()[:4] == ["1h", "0", "-", "-"]
    assert "union of the sketches of 2 nodes" in "\n".join(lines) or width < WIDTH
    no_union = cluster_lines({**c, "ceiling": None}, now=0, width=width)
    assert [ln.split()[4] for ln in no_union if ln.startswith("total")] == ["-"]
    assert any(ln.startswith("hit rate  no cluster ceiling") for ln in no_union)
    assert t["peers"]["pulls"] == {"checksum": 2, "error": 10, "ok": 2_468}
    assert {n["name"]: n["blocks"] for n in t["namespaces"]}[f"{LONG}-0"] == 2000
    if width == WIDTH:
        assert "4 nodes, 2 reachable" in lines[0]
        assert row["15m"].split()[4] == "52%"


def test_unreachable_metaserver_is_one_line() -> None:
    assert cluster_lines({"metaserver": "h:1", "reachable": False, "error": "not answering"}) == [
        "metaserver h:1 unreachable: not answering"]


def test_watch_alone_takes_the_default_period() -> None:
    assert _watch_argv(["--watch"]) == ["--watch=2"]
    assert _watch_argv(["--watch", "--json"]) == ["--watch=2", "--json"]
    assert _watch_argv(["--watch", "0.5"]) == ["--watch", "0.5"]


def test_a_watch_frame_never_scrolls() -> None:
    lines = [f"line {i}" for i in range(40)]
    f = frame(lines, 30, "every 1s, Ctrl-C quits")
    assert len(f) == 30 and f[-1] == "every 1s, Ctrl-C quits" and f[-2] == "... 12 more lines: a taller terminal shows them"
    assert frame(lines[:5], 30, "x") == [*lines[:5], "x"]


def test_cluster_without_nodes() -> None:
    lines = cluster_lines({"metaserver": "m:1", "reachable": True, "nodes": [], "totals": totals([]),
                           "ceiling": None}, now=0)
    assert_fits(lines)
    assert "0 nodes, 0 reachable" in lines[0] and lines[2].startswith("no node has registered")
