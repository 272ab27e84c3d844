"""`--namespace-quota` on a real daemon: a namespace whose working set fits its guarantee keeps
it while another namespace scans; a namespace at its maximum evicts its own blocks; bad
quotas stop the node with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import xxhash

from pegaflow.client import PegaClient

pytestmark = pytest.mark.integration

PAGE = 64 << 10  # 4 MiB pool / 64 KiB pages = 64 pages


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def save(c: PegaClient, ns: str, hs: list[bytes]) -> int:
    """Reserve, write real pages (the block's hash at the start), commit: blocks committed."""
    res = c.reserve(ns, hs)
    assert res.pool is not None
    for h, off in zip(hs, res.offsets, strict=True):
        if off >= 0:
            res.pool[off : off + 16].numpy()[:] = list(h)
    return c.commit(res.reservation_id) if res.reservation_id else 0


def left_after_scan(node, blocks: int = 400) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Hot blocks still served (pages checked) after `scan` saved `blocks` new blocks, the
    scan's blocks still held."""
    hot, scan = hashes("hot", 16), hashes("scan", blocks)
    with PegaClient(node.addr) as c:
        c.register({"hot": PAGE, "scan": PAGE})
        assert save(c, "hot", hot) == 16
        for i in range(0, len(scan), 8):  # each scan block asked once, then saved
            chunk = scan[i : i + 8]
            assert c.query(["scan"], chunk, lease=False).hit_blocks == 0
            save(c, "scan", chunk)
        q = c.query(["hot"], hot)
        assert q.pool is not None
        for h, off in zip(hot[: q.hit_blocks], q.offsets.get("hot", [])[: q.hit_blocks], strict=True):
            assert bytes(q.pool[off : off + 16].numpy()) == h  # the very pages saved
        c.release(q.lease_id)
        scan_left = sum(c.query(["scan"], [h], lease=False).hit_blocks for h in scan)
    return q.hit_blocks, scan_left


def test_a_guaranteed_namespace_keeps_its_working_set_while_another_scans(node_factory) -> None:
    node = node_factory(pool_size="4mb", extra=["--namespace-quota", "hot=0.25"])
    hot_left, scan_left = left_after_scan(node)
    assert hot_left == 16  # its 16 pages are exactly its quarter of the pool
    assert scan_left == 64 - 16  # the scan had the rest, and only the rest
    for kind, want in (("held", 16), ("min", 16), ("max", 64)):
        assert node.metric("pegaflow_node_namespace_quota_bytes", f'kind="{kind}",quota="hot"') == want * PAGE


def test_without_a_quota_the_same_scan_flushes_it(node_factory) -> None:
    hot_left, scan_left = left_after_scan(node_factory(pool_size="4mb"))
    assert hot_left == 0 and scan_left == 64


def test_a_namespace_at_its_maximum_evicts_its_own_blocks(node_factory) -> None:
    node = node_factory(pool_size="4mb", extra=["--namespace-quota", "scan=max:0.5"])
    hot_left, scan_left = left_after_scan(node)
    assert hot_left == 16 and scan_left == 32  # half the pool, though a quarter stays free
    assert node.metric("pegaflow_node_namespace_quota_evictions_total") == 400 - 32


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--namespace-quota", "a=0.6", "--namespace-quota", "b=0.5"], "sum to 1.1, more than the whole pool"),
        (["--namespace-quota", "a=1.5"], "outside (0, 1]"),
        (["--namespace-quota", "a=avg:0.1"], "unknown or repeated term"),
    ],
)
def test_bad_quotas_stop_the_node_with_one_line(flags: list[str], says: str) -> None:
    out = subprocess.run([sys.executable, "-m", "pegaflow.node.cli", "--pool-size", "4mb", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    err = out.stderr.strip()
    assert says in err and len(err.splitlines()) == 1, err
