"""`pegaflow status --metaserver`: a real redis-server, metaserver and two nodes that found
the metaserver's Redis themselves; each node's row shows its own figures, and a node that
died is a row saying so while the other still renders."""

from __future__ import annotations

from pathlib import Path

import pytest

from pegaflow.client import PegaClient
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures
from tests.integration.meta_harness import start_meta
from tests.integration.test_ssd_tier import NS, PAGE, hashes, save
from tests.integration.test_status import status, status_json
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server


def test_cluster_view_lists_every_node_and_survives_a_dead_one(node_factory, redis_server: RedisServer,
                                                               tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    meta = start_meta(redis_server.url, False, "m1", tmp_path / "meta.log")
    metaserver = f"127.0.0.1:{meta.port}"
    try:
        fast = ["--ceiling-publish-interval", "1"]  # the cluster ceiling's sketches, every second
        a = node_factory("4mb", ["--metaserver-addr", metaserver, "--node-id", "node-a", *fast])
        b = node_factory("8mb", ["--metaserver-addr", metaserver, "--node-id", "node-b", *fast])
        with PegaClient(a.addr) as c:
            c.register({NS: PAGE})
            save(c, hashes("cluster", 4))
            assert c.query([NS], hashes("cluster", 4), req_id="q1", lease=False).hit_blocks == 4

        def listed() -> dict:
            s = status_json("--metaserver", metaserver)
            ready = [n["node"] for n in s["nodes"]] == ["node-a", "node-b"] and s["ceiling"] is not None and \
                s["ceiling"]["nodes_merged"] == 2 and s["ceiling"]["windows"][0]["requested_blocks"] == 4
            return s if ready else {}

        # Both nodes registered, and their sketches (published every second, united by the
        # metaserver at most every 5 s) hold node-a's request.
        s = wait_until(listed, 40, "both nodes and their ceiling sketches at the metaserver", every=0.5)
        assert s["reachable"] and s["metaserver"] == metaserver
        na, nb = s["nodes"]
        assert (na["address"], nb["address"]) == (a.addr, b.addr) and na["alive"] and nb["alive"]
        assert na["status"]["requests"]["l1"] == 4 and nb["status"]["requests"]["l1"] == 0
        assert (na["status"]["pool"]["capacity_bytes"], nb["status"]["pool"]["capacity_bytes"]) == (4 << 20, 8 << 20)
        assert na["status"]["peers"] is not None  # in a cluster: remote reads are on
        t = s["totals"]
        assert (t["nodes"], t["reachable"], t["capacity_bytes"], t["used_bytes"]) == (2, 2, 12 << 20, 4 * PAGE)
        assert (t["requested_blocks"], t["hit_blocks"]) == (4, 4)
        # the cluster's windows are the metaserver's union: the same request, its 4 distinct blocks
        assert [(w["window"], w["requested_blocks"], w["hit_blocks"], w["ceiling_ratio"])
                for w in s["ceiling"]["windows"]] == [("15m", 4, 4, 0.0), ("1h", 4, 4, 0.0), ("1d", 4, 4, 0.0)]

        r = status("--metaserver", metaserver)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert all(len(ln) <= 80 for ln in lines), lines
        rows = {ln.split()[0]: ln.split() for ln in lines if ln.split()}
        assert rows["node-a"][1:6] == ["256K/4.0M", "6%", "100.0%", "0.0%", "4"]
        assert rows["node-b"][1:6] == ["0B/8.0M", "0%", "-", "-", "0"]
        assert rows["total"][1:5] == ["256K/12.0M", "2%", "100.0%", "0.0%"]
        assert rows["15m"] == ["15m", "4", "100.0%", "0.0%", "-"]

        # node-b misses node-a's blocks and pulls them from it (LOADING, then READY): a peer hit
        # on node-b, a pull on node-b and bytes served on node-a.
        hs = hashes("cluster", 4)
        with PegaClient(b.addr) as c:
            c.register({NS: PAGE})
            wait_until(lambda: c.query([NS], hs, req_id="pull", lease=False).hit_blocks == 4, 30,
                       "node-b to pull node-a's blocks", every=0.1)
        s = status_json("--metaserver", metaserver)
        na, nb = (n["status"] for n in s["nodes"])
        assert nb["requests"] == {"l1": 0, "ssd": 0, "remote": 4, "miss": 0}
        assert nb["peers"]["pulls"]["ok"] == 1 and nb["peers"]["pull_bytes"] == 4 * PAGE
        assert nb["peers"]["lookups"]["found"] >= 1
        assert na["peers"]["served_bytes"] == 4 * PAGE
        assert s["totals"]["requests"]["remote"] == 4 and s["totals"]["peers"]["pull_bytes"] == 4 * PAGE
        rows = {ln.split()[0]: ln.split() for ln in status("--metaserver", metaserver).stdout.splitlines() if ln.split()}
        assert rows["node-b"][5:8] == ["0", "0", "4"]  # L1, SSD, remote
        assert rows["peers"][:5] == ["peers", "pulls", "1", "ok", "0"]

        b.kill()  # its heartbeat has not expired yet: listed, alive, and not answering
        r = status("--metaserver", metaserver, "--timeout", "2")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        rows = {ln.split()[0]: ln for ln in lines if ln.split()}
        assert rows["node-a"].split()[1] == "256K/4.0M"
        assert "unreachable" in rows["node-b"] or "no heartbeat" in rows["node-b"], rows["node-b"]
        assert "2 nodes, 1 reachable" in lines[0]
        s = status_json("--metaserver", metaserver, "--timeout", "2")
        assert [n["status"]["reachable"] for n in s["nodes"]] == [True, False]
    finally:
        meta.stop()


def test_unreachable_metaserver_is_one_line(tmp_path: Path) -> None:
    from tests.harness.ports import free_port

    addr = f"127.0.0.1:{free_port()}"
    r = status("--metaserver", addr, "--timeout", "2")
    assert r.returncode == 1
    assert r.stdout.splitlines() == [f"metaserver {addr} unreachable: not answering (refused or no route)"]
