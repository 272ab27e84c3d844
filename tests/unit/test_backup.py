"""The decode backup's parts without processes (docs/architecture.md, "Decode backup"): the
wire codec, the busy node's candidates, the target's rate limiter, the planner's pairing, and
the backup notice the source demotes by."""

import pytest

from pegaflow.cluster import backup, notices
from pegaflow.core.block_index import BlockIndex
from pegaflow.meta.backup import MAX_QUEUED, Source, Target, pair
from pegaflow.node.backup import TokenBucket, pick_candidates
from pegaflow.node.classes import Classes
from tests.unit.test_block_index import fill, h

PAGE = 4096


# ---- wire ----------------------------------------------------------------------------------


def test_offers_and_plans_round_trip():
    groups = [backup.Candidates("ns-a", PAGE, [h(1), h(2)]), backup.Candidates("ns-b", 8192, [h(3)])]
    assert backup.decode_offer(backup.encode_offer(groups)) == groups
    plan = backup.Plan("prefill-0", "10.0.0.1:50055", 7, backup.Candidates("ns-a", PAGE, [h(1), h(2)]))
    assert backup.decode_plan(backup.encode_plan(plan)) == plan
    assert plan.nbytes == 2 * PAGE


@pytest.mark.parametrize("blob", [b"", b"XX", backup.OFFER + b"\x00\x05ab", backup.PLAN + b"\x00"])
def test_a_malformed_value_is_refused_in_one_line(blob):
    with pytest.raises(backup.MalformedBackup):
        (backup.decode_plan if blob.startswith(backup.PLAN) else backup.decode_offer)(blob)


def test_reports_parse_and_refuse_garbage():
    assert backup.parse_report(b"0:1700000000000:268435456") == backup.Report(False, 1700000000000, 268435456)
    with pytest.raises(backup.MalformedBackup):
        backup.parse_report(b"nonsense")


def test_a_backup_notice_demotes_with_the_backup_reason():
    idx = BlockIndex(4 * PAGE)
    ns = idx.namespace("a", PAGE)
    fill(idx, ns, [1, 2, 3])
    classes = Classes(idx)
    element = notices.encode(notices.Notice(True, [h(1), h(2)], backup=True))
    assert element[:1] == notices.BACKUP and notices.decode(element) == notices.Notice(True, [h(1), h(2)], True)
    classes.apply(ns, [element, notices.encode(notices.Notice(True, [h(3)]))])
    assert classes.demoted == {"backup_hint": 2, "reclaim_hint": 1}


# ---- the busy node's candidates --------------------------------------------------------------


def test_a_pool_that_is_not_full_offers_nothing():
    idx = BlockIndex(20 * PAGE)
    ns = idx.namespace("a", PAGE)
    fill(idx, ns, range(18))  # 2 of 20 pages free: 10% > FULL_FREE_SHARE
    assert pick_candidates(idx, 50, 100) == []


def test_a_full_pool_offers_its_oldest_retained_blocks_up_to_the_percent():
    idx = BlockIndex(20 * PAGE)
    ns = idx.namespace("a", PAGE)
    fill(idx, ns, range(20))  # 0 the oldest
    idx.reclassify(ns, [h(0)], True)  # reclaimable already: counts toward the percent, never offered
    (got,) = pick_candidates(idx, 25, 100)  # 25% of 20 pages = 5 pages, 1 reclaimable: 4 more
    assert (got.namespace, got.block_bytes, got.hashes) == ("a", PAGE, [h(1), h(2), h(3), h(4)])
    assert pick_candidates(idx, 25, 2)[0].hashes == [h(1), h(2)]  # --backup-max-candidates
    assert pick_candidates(idx, 5, 100) == []  # the reclaimable class reaches 5% already


def test_pinned_blocks_are_not_offered():
    idx = BlockIndex(10 * PAGE)
    ns = idx.namespace("a", PAGE)
    blocks = fill(idx, ns, range(10))
    idx.pin(blocks[:2])
    assert pick_candidates(idx, 30, 100)[0].hashes == [h(2), h(3), h(4)]


# ---- the target's rate limit -----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_bucket_holds_the_rate_over_time():
    clock = Clock()
    b = TokenBucket(rate=1000, burst=500, clock=clock)
    assert b.take(500) == 0.0  # the burst is there at once
    assert b.take(1000) == pytest.approx(1.0)  # then bytes wait for their share of the rate
    clock.t = 1.0
    assert b.take(250) == pytest.approx(0.25)
    sent, t = 0, 1.25
    for _ in range(100):  # a sender that always waits as told moves rate bytes per second
        clock.t = t
        t += b.take(100)
        sent += 100
    assert sent / (t - 1.25) == pytest.approx(1000, rel=0.01)


def test_a_zero_rate_is_unlimited():
    assert TokenBucket(0, 1).take(1 << 40) == 0.0


# ---- the planner's pairing -------------------------------------------------------------------


def src(name: str, nid: int, *groups: backup.Candidates) -> Source:
    return Source(name, nid, f"{name}:50055", list(groups))


def nobody(ns: str, hashes: list[bytes]) -> list[frozenset[int]]:
    return [frozenset()] * len(hashes)


def never(*_: object) -> bool:
    return False


def test_plans_go_round_robin_in_chunks_of_the_targets_max_bytes():
    t1, t2 = Target("d1", 11, 2 * PAGE), Target("d2", 12, 3 * PAGE)
    s = src("p1", 1, backup.Candidates("a", PAGE, [h(i) for i in range(5)]))
    out = pair([s], [t1, t2], nobody, never)
    assert [(t.name, p.blocks.hashes) for t, p in out.plans] == [("d1", [h(0), h(1)]), ("d2", [h(2), h(3), h(4)])]
    assert all((p.source, p.address, p.nid, p.blocks.namespace) == ("p1", "p1:50055", 1, "a") for _, p in out.plans)
    # the next pass goes on where this one stopped
    again = pair([s], [t1, t2], nobody, never, out.next_rr)
    assert again.plans[0][0].name == "d1" and out.next_rr == 0
    third = pair([src("p1", 1, backup.Candidates("a", PAGE, [h(9)]))], [t1, t2], nobody, never, 1)
    assert [t.name for t, _ in third.plans] == ["d2"]


def test_blocks_a_target_holds_are_backed_up_without_a_plan():
    t = Target("d1", 11, 64 * PAGE)
    s = src("p1", 1, backup.Candidates("a", PAGE, [h(1), h(2), h(3)]))

    def held(ns, hashes):
        return [frozenset({11}) if x == h(2) else frozenset({5}) for x in hashes]  # nid 5: another busy node

    out = pair([s], [t], held, never)
    assert out.backed == [(s, "a", [h(2)])] and out.has_backup == 1
    assert [p.blocks.hashes for _, p in out.plans] == [[h(1), h(3)]]


def test_blocks_in_flight_are_not_planned_again():
    t = Target("d1", 11, 64 * PAGE)
    s = src("p1", 1, backup.Candidates("a", PAGE, [h(1), h(2)]))
    out = pair([s], [t], nobody, lambda source, ns, x: (source, ns, x) == ("p1", "a", h(1)))
    assert [p.blocks.hashes for _, p in out.plans] == [[h(2)]] and out.offered == 2


def test_a_target_with_plans_queued_gets_no_more_and_no_target_no_plans():
    busy = Target("d1", 11, PAGE, queued=MAX_QUEUED)
    free = Target("d2", 12, PAGE, queued=MAX_QUEUED - 1)
    s = src("p1", 1, backup.Candidates("a", PAGE, [h(1), h(2), h(3)]))
    out = pair([s], [busy, free], nobody, never)
    assert [(t.name, p.blocks.hashes) for t, p in out.plans] == [("d2", [h(1)])]
    assert pair([s], [], nobody, never).plans == []


def test_sources_are_served_in_name_order_across_targets():
    t1, t2 = Target("d1", 11, 8 * PAGE), Target("d2", 12, 8 * PAGE)
    out = pair([src("p2", 2, backup.Candidates("a", PAGE, [h(2)])), src("p1", 1, backup.Candidates("a", PAGE, [h(1)]))],
               [t1, t2], nobody, never)
    assert [(p.source, t.name) for t, p in out.plans] == [("p1", "d1"), ("p2", "d2")]
