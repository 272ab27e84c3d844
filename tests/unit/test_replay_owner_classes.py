"""Replacement classes by owner count in replay's cluster model (pegaflow/replay/cluster.py):
what three nodes hold is reclaimable on each, retained again when one lets it go; and the
model's notices are the metaserver's: the same requests' index events, published as the node
publishes them (HolderTiers) and applied by the index's scripts (fakeredis + lupa), give
every holder the same notices in the same order."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import fakeredis
import pytest

from pegaflow.cluster import keys, notices
from pegaflow.core.block_index import IndexEvent, Namespace
from pegaflow.core.tiers import Tier
from pegaflow.meta.events.schema import Op, Update
from pegaflow.meta.index import Index
from pegaflow.node.publishing import HolderTiers
from pegaflow.replay.cluster import NodeCluster, main
from pegaflow.replay.model import Pool

NS = "m"


def hs(tag: str, n: int) -> list[bytes]:
    return [f"{tag}:{i}".encode().ljust(16, b".")[:16] for i in range(n)]


def reclaimable(pool: Pool, blocks: list[bytes]) -> list[bool | None]:
    l1 = pool.l1
    return [None if (b := l1.index.get(l1.ns[NS], h)) is None else b.reclaimable for h in blocks]


def test_three_holders_make_a_block_reclaimable_on_each_and_a_leaver_restores_it() -> None:
    c = NodeCluster(3, (8, True), (0, True), {NS: 1}, owner_threshold=3)
    x = hs("x", 4)
    c.serve(0, NS, x)  # computed on node 0: retained
    assert c.serve(1, NS, x) == (0, 0, 4, 0)  # node 1's pulled copies: reclaimable already
    assert reclaimable(c.pools[0], x) == [False] * 4 and reclaimable(c.pools[1], x) == [True] * 4
    c.serve(2, NS, x)  # a third holder: every copy is reclaimable
    assert [reclaimable(p, x) for p in c.pools] == [[True] * 4] * 3
    assert c.owners is not None and c.owners.demoted == 4  # node 0's; the pulled ones were already
    c.serve(2, NS, hs("f", 8))  # node 2's L1 turns over: x goes (first, being reclaimable)
    assert reclaimable(c.pools[2], x) == [None] * 4
    assert reclaimable(c.pools[0], x) == reclaimable(c.pools[1], x) == [False] * 4  # retained again
    assert c.owners.restored == 8


def test_a_threshold_above_the_nodes_is_no_owner_classes() -> None:
    c = NodeCluster(3, (8, True), (0, True), {NS: 1}, owner_threshold=4)
    assert c.owners is None
    x = hs("x", 4)
    for k in range(3):
        c.serve(k, NS, x)
    assert reclaimable(c.pools[0], x) == [False] * 4


def test_the_cli_prints_what_the_owner_classes_change(capsys) -> None:
    from pathlib import Path

    trace = Path(__file__).resolve().parents[1] / "data" / "mooncake_slice.jsonl"
    assert main([str(trace), "--nodes", "3", "--l1", "300blocks", "--ssd", "1000blocks",
                 "--min-reclaimable-owner-count", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("owner classes (--min-reclaimable-owner-count 2)") == 2 and "without them" in out
    with pytest.raises(SystemExit):
        main([str(trace), "--nodes", "3", "--l1", "300blocks", "--min-reclaimable-owner-count", "1"])
    assert "at least 2" in capsys.readouterr().err


# ---- the model's notices are the metaserver's ----------------------------------------------


class SsdOf:
    """A pool's SSD index as the ``(namespace id, hash)`` mapping HolderTiers reads (the
    node's SSD records), namespace ids being the L1's."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        assert pool.ssd is not None
        self.ssd = pool.ssd
        self.by_id = {ns.id: name for name, ns in pool.l1.ns.items()}

    def __contains__(self, key: object) -> bool:
        ns_id, h = key  # type: ignore[misc]
        return self.ssd.index.contains(self.ssd.ns[self.by_id[ns_id]], h)

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, key: tuple[int, bytes]) -> object:
        return key

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return iter(())

    def __len__(self) -> int:
        return 0


class Published:
    """A publisher that keeps what HolderTiers tells it, for every node, in one order."""

    def __init__(self, into: list[Update], nid: int) -> None:
        self.into, self.nid = into, nid

    def on_tier(self, namespace: str, hashes: Sequence[bytes], tier: Tier) -> None:
        self.into.append(Update(Op.INSERT, namespace, self.nid, b"".join(hashes), tier))

    def on_evict(self, namespace: str, hashes: Sequence[bytes]) -> None:
        self.into.append(Update(Op.EVICT, namespace, self.nid, b"".join(hashes)))


@pytest.mark.parametrize(("threshold", "writes"), [(2, "commits"), (3, "commits"), (3, "evictions")])
def test_the_models_notices_are_the_metaservers(threshold: int, writes: str) -> None:
    pytest.importorskip("lupa", reason="fakeredis runs Lua scripts only with lupa (pip install 'fakeredis[lua]')")
    r = fakeredis.FakeRedis()
    r.set(keys.OWNER_COUNT, threshold)
    c = NodeCluster(3, (10, True), (24, True), {NS: 1}, owner_threshold=threshold, ssd_writes=writes)
    assert c.owners is not None
    updates: list[Update] = []
    for k, pool in enumerate(c.pools):  # after the model's own listeners, as the node adds HolderTiers
        tiers = HolderTiers(Published(updates, k + 1), pool.l1.index, SsdOf(pool))  # type: ignore[arg-type]
        pool.l1.index.add_listener(tiers.on_index_event)
        ssd_ns = {ns.id: pool.l1.ns[name] for name, ns in pool.ssd.ns.items()}  # type: ignore[union-attr]

        def on_ssd(op: IndexEvent, ns: Namespace, hashes: list[bytes], tiers=tiers, ssd_ns=ssd_ns) -> None:  # noqa: ANN001
            (tiers.ssd_stored if op is IndexEvent.INSERT else tiers.ssd_removed)(ssd_ns[ns.id], hashes)

        pool.ssd.index.add_listener(on_ssd)  # type: ignore[union-attr]
    model: dict[int, list[tuple[bool, bytes]]] = {}
    settle = c.owners.settle

    def recording_settle() -> None:
        for k, _, h, rec in c.owners._queued:  # noqa: SLF001 - what the model applies, in order
            model.setdefault(k + 1, []).append((rec, h))
        settle()

    c.owners.settle = recording_settle  # type: ignore[method-assign]
    rng = random.Random(threshold)
    convs = [hs(f"c{i}", 3) for i in range(6)]
    idx = Index(r)
    for _ in range(150):
        i = rng.randrange(len(convs))
        convs[i] = convs[i] + hs(f"c{i}:{len(convs[i])}", rng.randint(1, 2))
        c.serve(rng.randrange(3), NS, convs[i])
        for u in updates:
            idx.apply_many([u], native=False)
        updates.clear()
    tag = keys.ns_tag(NS)
    scripts: dict[int, list[tuple[bool, bytes]]] = {}
    for nid in (1, 2, 3):
        for el in notices.pop(r, nid, [tag]).get(tag, []):
            n = notices.decode(el)
            scripts.setdefault(nid, []).extend((n.reclaimable, h) for h in n.hashes)
    assert scripts == model
    assert sum(1 for seq in model.values() for rec, _ in seq if rec) > 20  # demotions ...
    assert sum(1 for seq in model.values() for rec, _ in seq if not rec) > 10  # ... and restores happened
    assert c.owners.demoted > 0
