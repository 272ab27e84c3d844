"""The decode backup in replay's cluster model (pegaflow/replay/cluster.py, docs/replay.md): on
small hand-checked cases, a full busy pool's oldest retained blocks are copied to the idle node
and demoted, a later miss on them is a peer hit, and the idle node evicting the last other copy
makes the busy node's retained again; a paced backup (a step every few requests, a few blocks a
step, demoted a step later); the model's candidates are the node's own; and ``pegaflow replay
--nodes`` prints the model with and without the classes and the backup."""

from __future__ import annotations

import json
import random

import pytest

from pegaflow.config.capacity import parse_capacity
from pegaflow.core.block_index import BlockIndex
from pegaflow.core.trace import read_trace
from pegaflow.node.backup import pick_candidates
from pegaflow.policy.backup import backup_candidates
from pegaflow.replay.cluster import BackupSettings, NodeCluster, main, replay_cluster
from pegaflow.replay.command import main as command_main
from pegaflow.replay.model import Pool
from tests.unit.test_block_index import fill, h

NS = "m"


def hs(tag: str, n: int) -> list[bytes]:
    return [f"{tag}:{i}".encode().ljust(16, b".")[:16] for i in range(n)]


def order(pool: Pool) -> list[tuple[bytes, bool]]:
    """The pool's L1 in eviction order: (hash, reclaimable)."""
    return [(b.hash, b.reclaimable) for b in pool.l1.index.lru_order()]


def test_a_full_busy_pool_hands_its_oldest_blocks_to_the_idle_node_and_pulls_them_back() -> None:
    # 8-block pools, 25%: a full busy node keeps 2 blocks reclaimable, backed up on node 1.
    c = NodeCluster(2, (8, True), (0, True), {NS: 1}, idle=1, backup=BackupSettings(percent=25))
    x, y = hs("x", 8), hs("y", 2)
    assert c.serve(0, NS, x) == (0, 0, 0, 0)
    assert order(c.pools[0]) == [(x[0], True), (x[1], True), *((b, False) for b in x[2:])]
    assert order(c.pools[1]) == [(x[0], False), (x[1], False)]  # the idle node's copies: retained
    c.serve(0, NS, y)  # evicts the backed-up x0, x1 first; the next two oldest are backed up
    assert order(c.pools[0]) == [(x[2], True), (x[3], True), *((b, False) for b in (*x[4:], *y))]
    assert [b for b, _ in order(c.pools[1])] == x[:4]
    assert c.serve(0, NS, [x[0]]) == (0, 0, 1, 0)  # its miss is a peer hit from the idle node
    # the pulled copy is reclaimable and took x2's page (the oldest reclaimable); 2 reclaimable: no offer
    assert order(c.pools[0]) == [(x[3], True), (x[0], True), *((b, False) for b in (*x[4:], *y))]
    assert c.backup is not None and (c.backup.copied, c.backup.demoted) == (4, 4)

    off = NodeCluster(2, (8, True), (0, True), {NS: 1}, idle=1)
    for r in (x, y):
        off.serve(0, NS, r)
    assert off.serve(0, NS, [x[0]]) == (0, 0, 0, 0)  # without the backup: computed again
    assert order(off.pools[1]) == []  # the idle node never served a request


def test_the_idle_node_evicting_the_last_other_copy_restores_it_on_the_busy_node() -> None:
    # Two busy nodes, one idle, 4-block pools, 50%: node 1's overflow pushes node 0's copies out of node 2.
    c = NodeCluster(3, (4, True), (0, True), {NS: 1}, idle=1, backup=BackupSettings(percent=50))
    a, b, d = hs("a", 4), hs("b", 4), hs("d", 2)
    c.serve(0, NS, a)
    assert order(c.pools[0])[:2] == [(a[0], True), (a[1], True)]
    c.serve(1, NS, b)
    assert [h for h, _ in order(c.pools[2])] == [a[0], a[1], b[0], b[1]]  # the idle pool is full
    c.serve(1, NS, d)  # node 1 evicts b0, b1 (backed up) and offers b2, b3: node 2 evicts a0, a1
    assert [h for h, _ in order(c.pools[2])] == b
    # node 0's copies are the last now: retained again, at the newest end of the retained order
    assert order(c.pools[0]) == [(h_, False) for h_ in (*a[2:], *a[:2])]
    assert c.owners is not None and c.owners.restored == 2
    assert c.serve(1, NS, [b[0]]) == (0, 0, 1, 0)


def test_a_paced_backup_copies_a_step_s_blocks_and_demotes_them_a_delay_later() -> None:
    # Half of 8 blocks kept backed up; 2 blocks a step, demoted one step after the copy, a step every 2nd request.
    c = NodeCluster(2, (8, True), (0, True), {NS: 1}, idle=1,
                    backup=BackupSettings(percent=50, every=2, step_blocks=2, delay=1))
    x = hs("x", 8)
    c.serve(0, NS, x)  # request 1: no step
    assert order(c.pools[1]) == []
    c.serve(0, NS, [])  # request 2: step 1 copies x0, x1; in flight, still retained on node 0
    assert [h for h, _ in order(c.pools[1])] == x[:2] and c.pools[0].l1.index.reclaimable_bytes == 0
    c.serve(0, NS, [])
    c.serve(0, NS, [])  # step 2: x0, x1 demoted; x2, x3 copied (the percent's other two)
    assert order(c.pools[0])[:2] == [(x[0], True), (x[1], True)]
    assert [h for h, _ in order(c.pools[1])] == x[:4]
    c.serve(0, NS, [])
    c.serve(0, NS, [])  # step 3: x2, x3 demoted; the reclaimable class is at 50%: nothing more
    assert order(c.pools[0])[:4] == [(h_, True) for h_ in x[:4]]
    assert c.backup is not None and (c.backup.copied, c.backup.demoted) == (4, 4)


def test_an_idle_node_takes_one_plan_a_step_and_the_busy_nodes_take_turns() -> None:
    c = NodeCluster(3, (4, True), (0, True), {NS: 1}, idle=1, backup=BackupSettings(percent=50, every=2))
    a, b = hs("a", 4), hs("b", 4)
    c.serve(0, NS, a)
    c.serve(1, NS, b)  # step 1: both full; node 0 plans first, node 1's offer waits
    assert [h for h, _ in order(c.pools[2])] == a[:2]
    assert c.pools[1].l1.index.reclaimable_bytes == 0
    c.serve(0, NS, [])
    c.serve(1, NS, [])  # step 2: node 1's turn first; node 0 is at its percent
    assert [h for h, _ in order(c.pools[2])] == [*a[:2], *b[:2]]
    assert order(c.pools[1])[:2] == [(b[0], True), (b[1], True)]


@pytest.mark.parametrize("seed", range(5))
def test_the_models_candidates_are_the_nodes(seed: int) -> None:
    rng = random.Random(seed)
    page = 4096
    idx = BlockIndex(32 * page)
    ns = idx.namespace("a", page)
    blocks = fill(idx, ns, range(rng.randrange(28, 33)))
    idx.reclassify(ns, [h(k) for k in rng.sample(range(len(blocks)), rng.randrange(4))], True)
    idx.pin([blocks[k] for k in rng.sample(range(len(blocks)), rng.randrange(3))])
    for percent, most in ((rng.randrange(101), rng.randrange(1, 40)) for _ in range(10)):
        node = [x for g in pick_candidates(idx, percent, most) for x in g.hashes]
        assert [b.hash for b in backup_candidates(idx, percent, most)] == node


def test_the_cli_prints_the_hit_rate_with_and_without_the_backup(tmp_path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    rng = random.Random(1)
    trace.write_text("".join(f'{{"timestamp": {i}, "input_length": 512, "hash_ids": [{rng.randrange(60)}]}}\n'
                             for i in range(400)))
    assert main([str(trace), "--nodes", "2", "--idle-nodes", "1", "--enable-decode-backup", "--l1", "20blocks",
                 "--backup-reclaimable-percent", "50", "--no-peers"]) == 0
    assert "decode backup" not in capsys.readouterr().out  # no peer pulls: no backup
    assert main([str(trace), "--nodes", "2", "--idle-nodes", "1", "--enable-decode-backup", "--l1", "20blocks",
                 "--backup-reclaimable-percent", "50"]) == 0
    out = capsys.readouterr().out
    assert "2 nodes (1 idle), peer pulls, decode backup: hit rate" in out
    with_it = float(out.split("decode backup: hit rate ")[1].split("%")[0])
    without = float(out.split("; without it ")[1].split("%")[0])
    assert with_it > without  # 60 blocks, 20 per pool: the idle pool holds part of the overflow


def _trace(tmp_path) -> str:
    p = tmp_path / "t.jsonl"
    rng = random.Random(2)
    p.write_text("".join(f'{{"timestamp": {i}, "input_length": 1024, "hash_ids": [{rng.randrange(8)}, '
                         f'{rng.randrange(8, 90)}]}}\n' for i in range(300)))
    return str(p)


def test_pegaflow_replay_with_nodes_prints_the_cluster_model_with_and_without_classes_and_backup(
        tmp_path, capsys) -> None:
    trace = _trace(tmp_path)
    base = [trace, "--nodes", "3", "--l1-capacity", "24blocks", "--quiet"]
    assert command_main([*base, "--min-reclaimable-owner-count", "2"]) == 0
    out = capsys.readouterr().out
    with open(trace, encoding="utf-8") as f:
        t = read_trace(f)
    on = replay_cluster(t, 3, parse_capacity("24blocks"), parse_capacity("0"), owner_threshold=2)
    off = replay_cluster(t, 3, parse_capacity("24blocks"), parse_capacity("0"), owner_threshold=4)
    assert f"3 nodes, peer pulls: hit rate {on.hit_rate:.2%}" in out
    assert f"{on.demoted} blocks demoted, {on.restored} restored; without them {off.hit_rate:.2%}" in out
    assert "decode backup" not in out

    assert command_main([*base, "--idle-nodes", "1", "--enable-decode-backup", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["cluster"]
    assert [(r["owner_threshold"], r["backup"], r["idle"]) for r in runs] == [(3, True, 1), (4, True, 1), (3, False, 1)]
    assert runs[0]["backed_up"] > 0 and runs[2]["backed_up"] == 0


@pytest.mark.parametrize("args, needle", [
    (["--idle-nodes", "1"], "--idle-nodes needs --nodes"),
    (["--nodes", "2", "--idle-nodes", "2"], "--idle-nodes must be below --nodes"),
    (["--nodes", "2", "--enable-decode-backup"], "--enable-decode-backup needs --idle-nodes"),
    (["--nodes", "2", "--route", "kv-aware"], "round-robin or by field:NAME"),
    (["--nodes", "2", "--instances", "2"], "leave --instances at 1"),
    (["--nodes", "2", "--enable-lfu-admission"], "--enable-lfu-admission: not in the cluster model"),
])
def test_cluster_flags_that_cannot_run_are_one_line(tmp_path, capsys, args, needle) -> None:
    assert command_main([_trace(tmp_path), "--l1-capacity", "24blocks", "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
