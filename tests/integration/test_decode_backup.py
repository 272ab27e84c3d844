"""The decode backup (docs/architecture.md, "Decode backup").

End to end: a real redis-server, a real pegaflow-meta with --enable-decode-backup and real
nodes (in network namespaces where they can be made). A busy node (an engine: a client holding
its session; a full pool) hands its oldest retained blocks to an idle one, demotes them (reason
backup_hint) and, once it evicted them, pulls them back from the idle node instead of missing.

The planner's failure cases on a real redis-server, its steps driven by hand: a target that
evicts its copy between the planner's read and the notice, a target that dies, a source that
is gone, a planning replica that stops and one that takes over.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from pegaflow.cluster import backup, keys, notices, registry
from pegaflow.meta import backup as planning
from pegaflow.meta.events.schema import Op
from pegaflow.meta.index import Index
from tests.harness.p2p import P2PCluster, wait_line
from tests.harness.p2p_client import NS, hashes
from tests.harness.redis import RedisServer
from tests.integration.redis_fixtures import redis_server  # noqa: F401
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


# ---- the planner's steps on a real redis-server --------------------------------------------


class World:
    """Nodes registered in a real Redis as the planner sees them (reports, offers, the index);
    a source ``src`` with an engine and targets without one."""

    def __init__(self, r: redis.Redis, targets: tuple[str, ...] = ("tgt",), ttl_ms: int = 600_000) -> None:
        self.r = r
        self.index = Index(r)
        r.set(keys.OWNER_COUNT, 3)  # pegaflow-meta's default: the index sends its owner-count notices
        self.nid = {"src": registry.register(r, "src", "127.0.0.1:1", ttl_ms, switch=True)[0]}
        backup.report(r, "src", True, 1 << 20)
        for t in targets:
            self.nid[t] = registry.register(r, t, "127.0.0.1:2", 600_000, switch=True)[0]
            backup.report(r, t, False, 4 * PAGE)

    def offer(self, hs: list[bytes]) -> None:
        self.index.apply(Op.INSERT, NS, self.nid["src"], hs)
        backup.offer(self.r, "src", [backup.Candidates(NS, PAGE, hs)], 600_000)

    def planner(self, owner: str = "replica-a") -> tuple[planning.Planner, CollectorRegistry]:
        reg = CollectorRegistry()
        return planning.Planner(self.r, 0, None, planning.BackupMetrics(reg), owner), reg

    def source_classes(self) -> dict[bytes, bool]:
        """hash -> reclaimable, as the source ends up after applying its notice list in order."""
        out: dict[bytes, bool] = {}
        for element in self.r.lrange(keys.notice_key(keys.ns_tag(NS), self.nid["src"]), 0, -1):
            n = notices.decode(element)
            out.update(dict.fromkeys(n.hashes, n.reclaimable))
        return out


def test_a_target_evicting_between_the_read_and_the_notice_leaves_the_source_retained(
        redis_server: RedisServer) -> None:  # noqa: F811
    w = World(redis_server.client())
    hs = hashes("race", 4)
    w.offer(hs)
    w.index.apply(Op.INSERT, NS, w.nid["tgt"], hs)  # the target holds all four
    p, reg = w.planner()
    targets = [planning.Target("tgt", w.nid["tgt"], 4 * PAGE)]
    src = planning.Source("src", w.nid["src"], "127.0.0.1:1", backup.read_offer(w.r, "src"))
    # Step 1 (pair) reads the holders: every block is backed already.
    out = planning.pair([src], targets, p.index.holders, lambda *_: False)
    assert out.backed == [(src, NS, hs)] and not out.plans
    # In between, the target evicts block 0: the index restores the source's last copy.
    w.index.apply(Op.EVICT, NS, w.nid["tgt"], [hs[0]])
    assert w.source_classes() == {hs[0]: False}
    # Step 2 (the notice) checks again in the same step as it pushes: no backup for block 0.
    assert p._notify(out.backed, targets) == 3
    assert w.source_classes() == {hs[0]: False, hs[1]: True, hs[2]: True, hs[3]: True}
    # A plan in flight: its target evicts before the settle (no notice, the plan stays) ...
    p.flights[("src", NS, hs[0])] = planning._Flight("src", w.nid["src"], "tgt", w.nid["tgt"], p.clock() + 60)
    p._settle({"tgt"})
    assert ("src", NS, hs[0]) in p.flights and w.source_classes()[hs[0]] is False
    # ... or after it: the backup notice, then the index's restore, in that order.
    w.index.apply(Op.INSERT, NS, w.nid["tgt"], [hs[0]])
    p._settle({"tgt"})
    assert ("src", NS, hs[0]) not in p.flights and w.source_classes()[hs[0]] is True
    w.index.apply(Op.EVICT, NS, w.nid["tgt"], [hs[0]])
    assert w.source_classes()[hs[0]] is False


def test_a_dead_targets_plans_go_to_a_live_target_at_once(redis_server: RedisServer) -> None:  # noqa: F811
    r = redis_server.client()
    w = World(r, targets=("tgt-a", "tgt-b"))
    hs = hashes("dies", 8)
    w.offer(hs)
    p, reg = w.planner()
    first = p.pass_once()
    assert first is not None
    planned_a = [h for t, plan in first.plans if t.name == "tgt-a" for h in plan.blocks.hashes]
    assert planned_a, first.plans  # round robin: tgt-a got a plan
    # tgt-a takes its plans and dies before any lands: its registration's live key is gone.
    while backup.pop_plan(r, "tgt-a") is not None:
        pass
    r.delete(keys.live_key("tgt-a"))
    second = p.pass_once()
    assert second is not None
    replanned = {h for t, plan in second.plans for h in plan.blocks.hashes if t.name == "tgt-b"}
    assert replanned == set(planned_a), second.plans
    assert all(f.target == "tgt-b" for f in p.flights.values())


def test_offers_of_a_source_that_is_gone_are_counted_not_planned(redis_server: RedisServer) -> None:  # noqa: F811
    r = redis_server.client()
    w = World(r)
    hs = hashes("gone", 5)
    w.offer(hs)
    r.delete(keys.live_key("src"))  # the source died; its offer has not expired yet
    p, reg = w.planner()
    out = p.pass_once()
    assert out is not None and not out.plans
    assert reg.get_sample_value("pegaflow_meta_backup_candidates_filtered_total", {"reason": "source_gone"}) == 5


def test_a_second_replica_takes_over_the_planning(redis_server: RedisServer) -> None:  # noqa: F811
    r = redis_server.client()
    w = World(r)
    hs = hashes("takeover", 4)
    w.offer(hs)
    a, _ = w.planner("replica-a")
    b, reg_b = w.planner("replica-b")
    planned_a = a.pass_once()
    assert planned_a is not None and planned_a.plans
    assert b.pass_once() is None  # a holds the lock
    # a stops the way pegaflow-meta stops it: run() hands the lock over at once.
    stop = threading.Event()
    t = threading.Thread(target=planning.run, args=(a, stop, 0.05))
    t.start()
    stop.set()
    t.join(10)
    assert not t.is_alive() and r.get(keys.BACKUP_LOCK) is None
    planned_b = b.pass_once()
    assert planned_b is not None
    # b never saw a's plans in flight: it plans the same blocks again (documented; the target
    # skips what it holds already).
    assert {h for _, plan in planned_b.plans for h in plan.blocks.hashes} == set(hs)
    assert reg_b.get_sample_value("pegaflow_meta_backup_dispatched_blocks_total",
                                  {"source": "src", "target": "tgt"}) == len(hs)
    # A replica that dies holding the lock hands over when the lock expires (LOCK_MS).
    assert b.pass_once() is not None
    a2, _ = w.planner("replica-c")
    assert a2.pass_once() is None
    wait_until(lambda: a2.pass_once() is not None, planning.LOCK_MS / 1000 + 5, "replica-c to take over")
