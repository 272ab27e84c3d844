"""`--enable-lfu-admission` on a real daemon: a one-pass scan does not flush a hot working
set (and the rejections are counted); without the flag the same scan flushes it."""

from __future__ import annotations

import urllib.request

import pytest
import xxhash

from pegaflow.client import PegaClient

pytestmark = pytest.mark.integration

PAGE = 64 << 10  # 4 MiB pool / 64 KiB pages = 64 pages
# The sketch sized to those pages (not the 128 KiB guess): its sample period (10 x 64 accesses)
# then spans the hot set's and the scan's accesses, which it would otherwise partly forget.
LFU = ["--enable-lfu-admission", "--hint-value-size", "64kb"]


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def hot_blocks_left_after_a_scan(node) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    hot, scan = hashes("hot", 32), hashes("scan", 400)
    with PegaClient(node.addr) as c:
        c.register({"m": PAGE})
        res = c.reserve("m", hot)
        assert c.commit(res.reservation_id) == 32
        for _ in range(6):  # the working set is popular
            for i in range(0, 32, 8):
                assert c.query(["m"], hot[i : i + 8], lease=False).hit_blocks == 8
        for i in range(0, len(scan), 8):  # each scan block asked once, then offered for saving
            chunk = scan[i : i + 8]
            assert c.query(["m"], chunk, lease=False).hit_blocks == 0
            res = c.reserve("m", chunk)
            if res.reservation_id:
                c.commit(res.reservation_id)
        left = sum(c.query(["m"], [h], lease=False).hit_blocks for h in hot)
    body = urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/metrics", timeout=5).read().decode()
    rejected = next(float(ln.split()[1]) for ln in body.splitlines()
                    if ln.startswith("pegaflow_node_admission_rejections_total "))
    return left, rejected


def test_lfu_admission_keeps_the_hot_set_through_a_scan(node_factory) -> None:
    left, rejected = hot_blocks_left_after_a_scan(node_factory(pool_size="4mb", extra=LFU))
    assert left == 32
    # One decision per Reserve: the first 4 chunks fill the free pages, each later chunk is
    # turned away at its first block (the rest of a rejected batch is not asked: prefix rule).
    assert rejected == 400 // 8 - 4


def test_without_admission_the_scan_flushes_the_hot_set(node_factory) -> None:
    left, rejected = hot_blocks_left_after_a_scan(node_factory(pool_size="4mb"))
    assert left == 0
    assert rejected == 0


def hot_blocks_left_after_a_re_asked_scan(node, same_request: bool) -> int:  # type: ignore[no-untyped-def]
    """The hot set is asked for 6 times; every scan chunk is asked for 8 times before it is
    offered — as a LOADING poll or an engine that cannot schedule the request yet does."""
    hot, scan = hashes("hot", 32), hashes("scan", 400)
    with PegaClient(node.addr) as c:
        c.register({"m": PAGE})
        res = c.reserve("m", hot)
        assert c.commit(res.reservation_id) == 32
        for rnd in range(6):
            for i in range(0, 32, 8):
                assert c.query(["m"], hot[i : i + 8], lease=False, req_id=f"hot-{rnd}-{i}").hit_blocks == 8
        for i in range(0, len(scan), 8):
            chunk = scan[i : i + 8]
            for k in range(8):
                req = f"scan-{i}" if same_request else f"scan-{i}-{k}"
                assert c.query(["m"], chunk, lease=False, req_id=req).hit_blocks == 0
            res = c.reserve("m", chunk)
            if res.reservation_id:
                c.commit(res.reservation_id)
        return sum(c.query(["m"], [h], lease=False).hit_blocks for h in hot)


def test_a_request_asked_again_counts_its_accesses_once(node_factory) -> None:
    node = node_factory(pool_size="4mb", extra=LFU)
    assert hot_blocks_left_after_a_re_asked_scan(node, same_request=True) == 32
    # Control: the same queries as 8 different requests make the scan the popular set.
    node2 = node_factory(pool_size="4mb", extra=LFU)
    assert hot_blocks_left_after_a_re_asked_scan(node2, same_request=False) < 32
