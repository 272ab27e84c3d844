"""`pegaflow status` against real nodes: --json says what the node did, the --watch screen in
a real terminal (tmux, 80x30) fits and refreshes, Ctrl-C ends it cleanly, and the token
and an unreachable node are one line each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from pegaflow.client import PegaClient
from tests.harness import forked
from tests.harness.ports import free_port
from tests.integration import redis_fixtures
from tests.integration.test_ssd_tier import (
    NS,
    PAGE,
    POOL,
    SSD_WAIT_S,
    ask_until_ready,
    hashes,
    save,
    ssd_args,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "status-test-token-0123456789abcdef"


def status(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return forked.run([sys.executable, "-m", "pegaflow.cli", "status", *args], timeout=timeout, cwd=ROOT,
                      env={**os.environ, **(env or {})})


def status_json(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    r = status(*args, "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_json_reports_what_the_node_did(node_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = node_factory("4mb", ssd_args(tmp_path))
    hs = hashes("status", 8)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        q = c.query([NS], hs + hashes("never-saved", 2), req_id="r1", lease=False)
        assert q.hit_blocks == 8
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") == 8, SSD_WAIT_S, "8 blocks on SSD")
        s = status_json("--addr", node.addr)
        assert s["reachable"] and s["addr"] == node.addr
        # blocks by tier: the request's 8 hits from L1 and its 2 misses, as the metrics count them
        assert s["requests"] == {"l1": 8, "ssd": 0, "remote": 0, "miss": 2}
        assert s["requests"] == {t: int(node.metric("pegaflow_node_request_blocks_total", f'outcome="{t}"'))
                                 for t in ("l1", "ssd", "remote", "miss")}
        # every window saw that one request: N = 10, 8 hits; the ceiling of 10 distinct blocks is 0
        assert [(w["requested_blocks"], w["hit_blocks"], w["hit_ratio"]) for w in s["windows"]] == [(10, 8, 0.8)] * 3
        assert [w["window"] for w in s["windows"]] == ["15m", "1h", "1d"]
        assert all(w["ceiling_ratio"] == 0.0 for w in s["windows"])
        pool = s["pool"]
        assert (pool["capacity_bytes"], pool["prefaulted_bytes"]) == (4 << 20, 4 << 20)
        assert (pool["used_bytes"], pool["resident_blocks"], pool["resident_bytes"]) == (8 * PAGE, 8, 8 * PAGE)
        assert s["save_bytes"] == 8 * PAGE
        assert s["namespaces"] == [{"name": NS, "page_bytes": PAGE, "blocks": 8, "bytes": 8 * PAGE}]
        assert s["engines"] == [{"instance_id": c.instance_id, "sessions": 1, "namespaces": [NS], "leases": 0,
                                 "reservations": 0}]
        assert (s["sessions"], s["leases"]) == (1, 0)
        assert s["ssd"]["blocks"] == 8 and s["ssd"]["write_bytes"] == 8 * PAGE
        assert s["ssd"]["capacity_bytes"] == int(node.metric("pegaflow_node_ssd_capacity_bytes"))
        assert s["peers"] is None  # not in a cluster
        assert s["node_id"] and s["uptime_seconds"] > 0
        # the screen shows the same figures
        r = status("--addr", node.addr)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert all(len(ln) <= 80 for ln in lines), lines
        assert "blocks    L1 8 80.0%  SSD 0 0.0%  remote 0 0.0%  miss 2 20.0%" in lines
        assert any(ln.split()[:4] == ["15m", "10", "80.0%", "0.0%"] for ln in lines), lines


def test_blocks_promoted_from_ssd_count_under_ssd(node_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = node_factory(POOL, ssd_args(tmp_path))  # 16 pages: the first of 48 blocks are only on SSD
    hs = hashes("status-ssd", 48)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 48, SSD_WAIT_S, "48 blocks on SSD")
        q, loading = ask_until_ready(c, hs[:12], req_id="from-ssd", lease=False)
        assert (q.hit_blocks, loading >= 1) == (12, True)
        s = status_json("--addr", node.addr)
        assert s["requests"] == {"l1": 0, "ssd": 12, "remote": 0, "miss": 0}
        assert s["ssd"]["promoted_blocks"] == 12 and s["ssd"]["read_bytes"] >= 12 * PAGE
        assert s["pool"]["evictions"] == int(node.metric("pegaflow_node_evictions_total")) > 0
        lines = status("--addr", node.addr).stdout.splitlines()
        assert "blocks    L1 0 0.0%  SSD 12 100.0%  remote 0 0.0%  miss 0 0.0%" in lines


redis_server = redis_fixtures.redis_server


def test_a_node_published_with_redis_url_alone_shows_its_peers_line(node_factory, redis_server) -> None:  # type: ignore[no-untyped-def]
    """A node given only --redis-url is published and serves peers (it pulls nothing: no
    --metaserver-addr); the screen said it was not in a cluster and hid what it served."""
    node = node_factory(extra=["--redis-url", redis_server.url, "--node-id", "status-pub"])
    s = status_json("--addr", node.addr)
    assert s["peers"] is not None and s["peers"]["served_bytes"] == 0 and not any(s["peers"]["pulls"].values())
    r = status("--addr", node.addr)
    assert r.returncode == 0 and "not in a cluster" not in r.stdout, r.stdout


def test_unreachable_node_is_one_line() -> None:
    addr = f"127.0.0.1:{free_port()}"
    r = status("--addr", addr, "--timeout", "2")
    assert r.returncode == 1
    assert r.stdout.splitlines() == [f"node {addr} unreachable: not answering (refused or no route)"]
    assert "Traceback" not in r.stderr
    r = status("--addr", addr, "--json", "--timeout", "2")
    assert r.returncode == 1 and json.loads(r.stdout)["reachable"] is False


@pytest.mark.parametrize("addr", ["off", "none"])
def test_no_node_address_is_a_bad_flag(addr: str) -> None:
    # was taken as no address: gRPC's core printed its own errors and status said "node  unreachable"
    r = status("--addr", addr)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and f"--addr: invalid address {addr!r}" in lines[0], r.stderr
    assert r.stdout == ""


def test_token(node_factory) -> None:  # type: ignore[no-untyped-def]
    node = node_factory("4mb", env={"PEGAFLOW_AUTH_TOKEN": TOKEN})
    assert status_json("--addr", node.addr, env={"PEGAFLOW_AUTH_TOKEN": TOKEN})["reachable"]
    r = status("--addr", node.addr, env={"PEGAFLOW_AUTH_TOKEN": "wrong-" + TOKEN})
    assert r.returncode == 1
    assert r.stdout.splitlines() == [f"node {node.addr} unreachable: token refused (set --auth-token-file)"]


# ---- the --watch screen in a real terminal -------------------------------------------
class Tmux:
    """A tmux server of our own (its own socket) with one 80x30 window running ``cmd``."""

    def __init__(self, cmd: str) -> None:
        self.sock = f"pegaflow-status-{uuid.uuid4().hex[:8]}"
        subprocess.run(["tmux", "-L", self.sock, "-f", "/dev/null", "new-session", "-d", "-s", "t", "-x", "80",
                        "-y", "30", cmd], check=True, cwd=ROOT, env={**os.environ, "TERM": "xterm"})

    def pane(self) -> list[str]:
        out = subprocess.run(["tmux", "-L", self.sock, "capture-pane", "-p", "-t", "t"], capture_output=True,
                             text=True, check=True).stdout
        lines = out.splitlines()
        while lines and not lines[-1].strip():  # the pane's empty rows below the screen
            lines.pop()
        return lines

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "-L", self.sock, "send-keys", "-t", "t", *keys], check=True)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True)


def _line(lines: list[str], prefix: str) -> str | None:
    return next((ln for ln in lines if ln.startswith(prefix)), None)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_watch_screen_in_tmux_fits_refreshes_and_quits(node_factory) -> None:  # type: ignore[no-untyped-def]
    node = node_factory("4mb")
    hs = hashes("watch", 8)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs)
        assert c.query([NS], hs + hashes("watch-miss", 2), req_id="w1", lease=False).hit_blocks == 8
        cmd = (f"{sys.executable} -m pegaflow.cli status --addr {node.addr} --watch 1; "
               "echo STATUS-EXITED-$?; sleep 60")
        t = Tmux(cmd)
        try:
            wait_until(lambda: _line(t.pane(), "blocks ") is not None and _line(t.pane(), "namespaces") is not None,
                       30, lambda: "the status screen: " + "\n".join(t.pane()), every=0.2)
            lines = t.pane()
            assert all(len(ln) <= 80 for ln in lines), lines
            assert len(lines) <= 30
            assert _line(lines, "blocks ") == "blocks    L1 8 80.0%  SSD 0 0.0%  remote 0 0.0%  miss 2 20.0%"
            assert _line(lines, "pool ") == (f"pool      {8 * PAGE >> 10} KiB of 4.0 MiB used (12.5%)  8 blocks  "
                                             "pre-fault 100%")
            assert _line(lines, "engines ") == "engines   1 engine  1 session  0 leases  0 reservations"
            assert any(ln.startswith(f"  {NS} ") and ln.split()[-3:] == ["8", str(8 * PAGE >> 10), "KiB"]
                       for ln in lines), lines
            assert lines[-1].startswith("every 1s, Ctrl-C quits")
            assert lines[0].startswith("node ") and node.addr in lines[0]
            # more traffic: the same screen, redrawn with the new figures (no scrolling)
            assert c.query([NS], hs, req_id="w2", lease=False).hit_blocks == 8
            wait_until(lambda: _line(t.pane(), "blocks ") == "blocks    L1 16 88.9%  SSD 0 0.0%  remote 0 0.0%  "
                                                            "miss 2 11.1%",
                       30, lambda: "the screen to refresh: " + "\n".join(t.pane()), every=0.2)
            lines = t.pane()
            assert sum(1 for ln in lines if ln.startswith("blocks ")) == 1 and len(lines) <= 30
            assert [ln.split()[:3] for ln in lines if ln.split()[:1] == ["15m"]] == [["15m", "18", "88.9%"]]
            t.keys("C-c")
            wait_until(lambda: any("STATUS-EXITED-0" in ln for ln in t.pane()), 20,
                       lambda: "status to exit on Ctrl-C: " + "\n".join(t.pane()), every=0.2)
            assert not any("Traceback" in ln or "KeyboardInterrupt" in ln for ln in t.pane())
        finally:
            t.close()
