"""The decode backup end to end (docs/architecture.md, "Decode backup"): a real redis-server, a
real pegaflow-meta with --enable-decode-backup and two real nodes (in network namespaces where
they can be made). node-0 has an engine (a client holding its session) and a full pool; node-1
has none. node-1 becomes a backup target, pulls node-0's oldest retained blocks, node-0 demotes
them (reason backup_hint); once node-0 evicted them, a Query there pulls them back from node-1,
byte-identical, instead of missing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.harness.p2p import P2PCluster, wait_line
from tests.harness.p2p_client import NS
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PAGE = 16 << 10  # the client's default page: 4 layers x 2 heads x 16 tokens x 64 dims x fp16
POOL_PAGES = 64
HALF = POOL_PAGES // 2
WAIT_S = 60


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[P2PCluster]:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    c = P2PCluster(tmp_path_factory.mktemp("backup"), 2,
                   per_node_args={0: ("--pool-size", str(POOL_PAGES * PAGE), "--backup-reclaimable-percent", "50")},
                   meta_args=("--enable-decode-backup", "--backup-target-delay-secs", "1"))
    if c.fallback_reason:
        print(f"network namespaces unavailable ({c.fallback_reason}): loopback addresses instead")
    yield c
    c.close()


def test_an_idle_node_backs_up_a_busy_nodes_overflow_and_serves_it_back(cluster: P2PCluster) -> None:
    engine = cluster.client_proc(0, "save", "old", str(POOL_PAGES), "--hold", "300")  # fills node-0's pool
    try:
        saved = wait_line(engine, WAIT_S)
        assert saved == {"committed": POOL_PAGES, "page_bytes": PAGE}, saved
        wait_until(lambda: cluster.metric(1, "pegaflow_node_backup_target") == 1, WAIT_S, "node-1 to be a target")
        # node-0 was idle too until its engine came: a target no more within a pass or two
        wait_until(lambda: cluster.metric(0, "pegaflow_node_backup_target") == 0, WAIT_S, "node-0 not a target")
        # node-1 copies node-0's oldest half; node-0 demotes what node-1 holds.
        wait_until(lambda: cluster.metric(0, "pegaflow_node_class_demotions_total", 'reason="backup_hint"') >= HALF,
                   WAIT_S, "node-0 to demote what node-1 backed up")
        assert cluster.metric(0, "pegaflow_node_backup_candidates_offered_total") >= HALF
        assert cluster.metric(1, "pegaflow_node_backup_pulled_blocks_total") >= HALF
        assert cluster.metric(1, "pegaflow_node_backup_pulled_bytes_total") >= HALF * PAGE
        assert cluster.metric(0, "pegaflow_node_resident_bytes_by_class", 'class="reclaimable"') >= HALF * PAGE
        assert cluster.metric(1, "pegaflow_backup_role") == 1  # the original's name too
        wait_until(lambda: cluster.holders(NS, "old", HALF).get("node-1") == HALF, WAIT_S,
                   "node-1 to hold the oldest half in the index")
        # New blocks on node-0 evict the reclaimable (backed-up) ones first.
        assert cluster.client(0, "save", "new", str(HALF))["committed"] == HALF
        wait_until(lambda: cluster.metric(0, "pegaflow_node_evicted_blocks_by_class_total", 'class="reclaimable"')
                   >= HALF, WAIT_S, "node-0 to evict the backed-up blocks")
        remote0 = cluster.metric(0, "pegaflow_node_hit_blocks_total", 'tier="remote"')
        out = cluster.client(0, "load", "old", str(HALF), "--until-hit")
        assert out["hit"] == HALF and out["identical"], out
        assert out["statuses"][0].startswith("LOADING:0:remote"), out  # pulled back, not recomputed
        assert cluster.metric(0, "pegaflow_node_hit_blocks_total", 'tier="remote"') > remote0
    finally:
        engine.kill()
        engine.wait(10)
