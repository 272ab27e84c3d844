"""Remote reads between three real nodes in Linux network namespaces (veth + bridge), with a
real redis-server and pegaflow-meta: a prefix saved through one node is served to a client
of another byte-identical; a puller killed mid-pull leaves pins that expire on the peer;
a peer killed mid-pull is a miss with no partial page.

Falls back to loopback addresses (printing why) when namespaces cannot be created; the
tests that kill a process mid-pull need link shaping (tc) and are skipped then.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Iterator

import pytest

from tests.harness.node import EVERY_SCRAPE
from tests.harness.p2p import P2PCluster, wait_line
from tests.harness.p2p_client import NS, namespace
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

BIG = ("--heads", "8", "--dim", "128")  # 128 KiB pages
BIG_NS = namespace(8, 128)
BIG_N = 64  # 8 MiB per prefix: seconds on a shaped link
SHAPED = "20mbit"
# A peer killed mid-pull still delivers what its kernel already buffered (socket buffers,
# the qdisc queue: up to ~40 MiB over 4 streams), so that test pulls more than that.
HUGE = ("--heads", "8", "--dim", "512")  # 512 KiB pages
HUGE_NS = namespace(8, 512)
HUGE_N = 160  # 80 MiB: ~8 s at HUGE_RATE
HUGE_RATE = "80mbit"
PIN_TTL = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[P2PCluster]:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    tmp = tmp_path_factory.mktemp("p2p")
    c = P2PCluster(tmp, 3, node_args=("--pin-ttl", str(PIN_TTL), "--peer-backoff", "1"), render_interval=EVERY_SCRAPE)
    if c.fallback_reason:
        print(f"network namespaces unavailable ({c.fallback_reason}): loopback addresses instead")
    yield c
    c.close()


def need_shaping(c: P2PCluster) -> None:
    if c.fallback_reason:
        pytest.skip(f"needs link shaping in namespaces ({c.fallback_reason})")


def test_prefix_saved_on_a_is_served_byte_identical_to_a_client_of_b(cluster: P2PCluster) -> None:
    saved = cluster.client(0, "save", "ident", "24")
    assert saved["committed"] == 24
    cluster.wait_indexed(NS, "ident", 24, "node-0")
    out = cluster.client(1, "load", "ident", "24", "--until-hit", "--probe-each")
    assert out["hit"] == 24 and out["identical"], out
    # The first Query started the pull, and says how long the prefix is once it lands.
    assert out["statuses"][0] == "LOADING:0:remote:24", out
    assert cluster.metric(1, "pegaflow_node_p2p_pulls_total", 'status="ok"') >= 1
    assert cluster.metric(1, "pegaflow_node_hit_blocks_total", 'tier="remote"') == 24
    assert cluster.metric(0, "pegaflow_node_p2p_served_bytes_total") == 24 * saved["page_bytes"]
    # the pulled copy is published: the index now lists node-1 too, and no pin is left behind
    wait_until(lambda: cluster.holders(NS, "ident", 24).get("node-1") == 24, 20, "node-1 in the index")
    wait_until(lambda: cluster.metric(0, "pegaflow_node_p2p_active_pins") == 0, 10, "pins released")


def test_the_pulls_hold_on_its_pages_ends_when_the_engines_query_leases_them(cluster: P2PCluster) -> None:
    # Pulled pages are held (pinned) for the engine's next Query; they used to stay held
    # 2 s after that Query had leased them, and pinned pages cannot be evicted: a small
    # pool found no room for the blocks its engine computed next.
    leased0 = cluster.metric(2, "pegaflow_node_p2p_hold_ended_blocks_total", 'reason="leased"')
    expired0 = cluster.metric(2, "pegaflow_node_p2p_hold_ended_blocks_total", 'reason="expired"')
    cluster.client(0, "save", "hold", "16")
    cluster.wait_indexed(NS, "hold", 16, "node-0")
    out = cluster.client(2, "load", "hold", "16", "--until-hit")  # LOADING, then READY leasing all 16
    assert out["hit"] == 16 and out["identical"], out
    assert out["statuses"][0] == "LOADING:0:remote:16", out
    # The READY Query ended the hold on every page it leased (the client polls every 20 ms,
    # the hold's timeout is 2 s), and the client has released its lease since.
    assert cluster.metric(2, "pegaflow_node_p2p_hold_ended_blocks_total", 'reason="leased"') == leased0 + 16
    assert cluster.metric(2, "pegaflow_node_p2p_hold_ended_blocks_total", 'reason="expired"') == expired0
    assert cluster.metric(2, "pegaflow_node_p2p_held_blocks") == 0


def test_puller_killed_mid_pull_its_pins_on_the_peer_expire(cluster: P2PCluster) -> None:
    need_shaping(cluster)
    cluster.client(0, "save", "pins", str(BIG_N), *BIG)
    cluster.wait_indexed(BIG_NS, "pins", BIG_N, "node-0")
    a = cluster.nodes[0].host
    a.shape(SHAPED)
    try:
        loader = cluster.client_proc(2, "load", "pins", str(BIG_N), *BIG, "--timeout", "60")
        assert wait_line(loader, 60) == {"status": "LOADING", "hit": 0}
        wait_until(lambda: cluster.metric(0, "pegaflow_node_p2p_active_pins") == 1, 10, "the pin on node-0")
        sent = a.tx_bytes()
        wait_until(lambda: a.tx_bytes() - sent >= 1 << 20, 30, "pages flowing to the puller")
        cluster.kill_node(2)  # the puller dies mid-pull
        loader.kill()
        t0 = time.monotonic()
        wait_until(lambda: cluster.metric(0, "pegaflow_node_p2p_active_pins") == 0, PIN_TTL + 10, "pin expiry")
        assert time.monotonic() - t0 <= PIN_TTL + 10
        assert cluster.metric(0, "pegaflow_node_p2p_pins_expired_total") >= 1
    finally:
        a.shape("")
    # the pages the dead puller had pinned are intact and still served
    out = cluster.client(1, "load", "pins", str(BIG_N), *BIG, "--until-hit")
    assert out["hit"] == BIG_N and out["identical"], out


def test_peer_killed_mid_pull_is_a_miss_with_no_partial_page(cluster: P2PCluster) -> None:
    need_shaping(cluster)
    cluster.client(0, "save", "kill", str(HUGE_N), *HUGE)
    cluster.wait_indexed(HUGE_NS, "kill", HUGE_N, "node-0")
    a = cluster.nodes[0].host
    a.shape(HUGE_RATE)
    errors0 = cluster.metric(1, "pegaflow_node_p2p_pulls_total", 'status="error"')
    sent = a.tx_bytes()
    loader = cluster.client_proc(1, "load", "kill", str(HUGE_N), *HUGE, "--timeout", "90", "--probe-each")
    assert wait_line(loader, 60) == {"status": "LOADING", "hit": 0}
    wait_until(lambda: a.tx_bytes() - sent >= 15 << 20, 30, "~15 MiB of 80 MiB across the shaped link")
    cluster.kill_node(0)  # the peer dies mid-pull
    lines = [wait_line(loader, 60)]
    while "identical" not in lines[-1]:
        lines.append(wait_line(loader, 60))
    out = lines[-1]
    assert out["hit"] == 0, out  # the engine recomputes
    assert out["visible"] == 0, out  # no block of the broken pull became readable, not even one
    assert "READY:0" in out["statuses"]
    errs = cluster.metric(1, "pegaflow_node_p2p_pulls_total", 'status="error"')
    assert not math.isnan(errs) and errs >= errors0 + 1
    # node-1 is fine and keeps serving what it holds
    again = cluster.client(1, "load", "ident", "24", "--until-hit")
    assert again["hit"] == 24 and again["identical"]
