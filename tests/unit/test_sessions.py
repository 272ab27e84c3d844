import pytest

from pegaflow.common.errors import FailedPrecondition, InvalidArgument
from pegaflow.core.block_index import PENDING, BlockIndex
from pegaflow.node.sessions import Expiry, Sessions


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env():
    clock = Clock()
    idx = BlockIndex(16 * 4096)
    return idx, Sessions(idx, reservation_ttl=10, lease_ttl=60, clock=clock, session_open_timeout=30), clock


def live(ss: Sessions, name: str, namespaces):  # type: ignore[no-untyped-def]
    """A session whose engine holds its Session stream open (what the node's service does)."""
    s = ss.open(name, namespaces)
    s.streams, s.streamed = 1, True
    return s


def test_a_live_writer_past_its_ttl_keeps_its_pages_and_commits_them(env):
    idx, ss, clock = env
    s = live(ss, "e1", [("a", 4096)])
    r = ss.reserve(s, s.namespaces["a"], [h(1), h(2)])
    clock.t = 9.9
    assert ss.expire() == Expiry()
    clock.t = 1000.0
    assert ss.expire() == Expiry(reservations_overdue=1)
    assert ss.expire() == Expiry(), "reported once"
    # Nothing was freed: a full pool gives another engine no page of the late writer's.
    other = live(ss, "e2", [("a", 4096)])
    got = ss.reserve(other, other.namespaces["a"], [h(100 + i) for i in range(16)])
    mine = {b.offset for b in r.blocks if b is not None}
    assert not mine & {b.offset for b in got.blocks if b is not None}
    assert all(b is not None and b.state == PENDING for b in r.blocks)
    assert ss.commit(s, r.id) == 2
    assert [b.offset for b in idx.prefix(s.namespaces["a"], [h(1), h(2)])] == [b.offset for b in r.blocks]


def test_a_live_reader_past_its_ttl_keeps_its_pages_pinned(env):
    idx, ss, clock = env
    s = live(ss, "e1", [("a", 4096)])
    ns = s.namespaces["a"]
    ss.commit(s, ss.reserve(s, ns, [h(1)]).id)
    lease = ss.lease(s, idx.prefix(ns, [h(1)]))
    clock.t = 61
    assert ss.expire() == Expiry(leases_overdue=1)
    assert idx.lru_order() == [], "still pinned: not evictable, its page cannot be reused"
    ss.release(s, lease.id)
    assert len(idx.lru_order()) == 1


def test_a_session_that_never_opens_its_stream_is_ended_with_what_it_holds(env):
    idx, ss, clock = env
    s = ss.open("e1", [("a", 4096)])
    ss.reserve(s, s.namespaces["a"], [h(1), h(2)])
    kept = live(ss, "e2", [("a", 4096)])
    clock.t = 29.9
    assert ss.expire().sessions_closed == 0
    clock.t = 30.0
    e = ss.expire()
    assert (e.sessions_closed, e.reservations_freed) == (1, 1)
    assert s.id not in ss.sessions and kept.id in ss.sessions
    assert idx.alloc.free_bytes == idx.alloc.capacity
    with pytest.raises(FailedPrecondition):
        ss.get(s.id)


def test_a_session_whose_stream_ended_is_not_swept_twice(env):
    _, ss, clock = env
    s = live(ss, "e1", [("a", 4096)])
    s.streams = 0  # the service closes it when the last stream ends; expire leaves it to that
    clock.t = 100
    assert ss.expire().sessions_closed == 0


def test_duplicate_commit_is_invalid_and_harmless(env):
    idx, ss, _ = env
    s = live(ss, "e1", [("a", 4096)])
    r = ss.reserve(s, s.namespaces["a"], [h(1)])
    assert ss.commit(s, r.id) == 1
    with pytest.raises(InvalidArgument, match="already committed"):
        ss.commit(s, r.id)
    assert idx.resident_blocks == 1


def test_partial_commit_frees_the_rest(env):
    idx, ss, _ = env
    s = live(ss, "e1", [("a", 4096)])
    r = ss.reserve(s, s.namespaces["a"], [h(1), h(2), h(3)])
    assert ss.commit(s, r.id, [0, 2]) == 2
    assert idx.resident_blocks == 2
    assert idx.alloc.free_bytes == idx.alloc.capacity - 2 * 4096


def test_commit_indices_out_of_range_are_rejected_without_change(env):
    idx, ss, _ = env
    s = live(ss, "e1", [("a", 4096)])
    r = ss.reserve(s, s.namespaces["a"], [h(1)])
    with pytest.raises(InvalidArgument, match="out of range"):
        ss.commit(s, r.id, [5])
    assert ss.commit(s, r.id) == 1


def test_lease_pins_until_release_and_session_end_frees_everything(env):
    idx, ss, _ = env
    s = live(ss, "e1", [("a", 4096)])
    ns = s.namespaces["a"]
    ss.commit(s, ss.reserve(s, ns, [h(1), h(2)]).id)
    lease = ss.lease(s, idx.prefix(ns, [h(1), h(2)]))
    assert idx.lru_order() == []
    ss.reserve(s, ns, [h(3)])
    assert ss.close(s.id) == (1, 1)
    assert len(idx.lru_order()) == 2
    assert idx.resident_blocks == 2
    assert lease.id not in ss.leases


def test_unknown_session_and_foreign_namespace(env):
    _, ss, _ = env
    with pytest.raises(FailedPrecondition):
        ss.get(999)
    s = ss.open("e1", [("a", 4096)])
    ss.open("e2", [("b", 4096)])
    with pytest.raises(InvalidArgument, match="not registered"):
        ss.namespace(s, "b")


def test_ids_are_unguessable_and_scoped_to_their_session(env):
    idx, ss, _ = env
    a, b = live(ss, "a", [("n", 4096)]), live(ss, "b", [("n", 4096)])
    ns = a.namespaces["n"]
    ra = ss.reserve(a, ns, [h(1)])
    ss.commit(a, ss.reserve(a, ns, [h(2)]).id)
    la = ss.lease(a, idx.prefix(ns, [h(2)]))
    ids = [a.id, b.id, ra.id, la.id]
    assert len(set(ids)) == 4 and all(i >= 1 << 20 for i in ids), "random 63-bit ids, not a counter"
    assert all(i < 1 << 63 for i in ids)
    with pytest.raises(InvalidArgument, match="unknown"):
        ss.commit(b, ra.id, abort=True)  # b cannot abort a's reservation
    with pytest.raises(InvalidArgument, match="unknown lease"):
        ss.release(b, la.id)  # nor release a's lease
    assert ra.id in ss.reservations and la.id in ss.leases


def test_a_register_that_fails_creates_no_namespace(env):
    idx, ss, _ = env
    ss.open("e1", [("taken", 4096)])
    with pytest.raises(InvalidArgument, match="page_bytes"):
        ss.open("e2", [("fresh", 4096), ("taken", 8192)])
    assert idx.get_namespace("fresh") is None
    assert len(ss.sessions) == 1


def test_one_name_twice_with_two_page_sizes_is_refused_whole(env):
    # Found by the chaos fuzzer: the second spec raised out of the index (INTERNAL) after
    # the first had been created.
    idx, ss, _ = env
    with pytest.raises(InvalidArgument, match="twice"):
        ss.open("e", [("fresh", 4096), ("other", 4096), ("fresh", 8192)])
    assert idx.get_namespace("fresh") is None and idx.get_namespace("other") is None
    s = ss.open("e", [("same", 4096), ("same", 4096)])  # a harmless repeat
    assert list(s.namespaces) == ["same"]


def test_namespaces_in_use_are_known_until_their_last_session_ends(env):
    idx, ss, _ = env
    a, b = live(ss, "a", [("m", 4096)]), live(ss, "b", [("m", 4096), ("n", 4096)])
    assert ss.uses("m") and ss.uses("n")
    ss.close(b.id)
    assert ss.uses("m") and not ss.uses("n")
    ss.close(a.id)
    assert not ss.uses("m")
    assert idx.drop_namespace("n") and idx.get_namespace("n") is None
    ns = idx.namespace("m", 4096)
    s = live(ss, "c", [("m", 4096)])
    ss.commit(s, ss.reserve(s, ns, [h(1)]).id)
    ss.close(s.id)
    assert not idx.drop_namespace("m"), "a namespace that holds a block is kept"
    again = idx.namespace("n", 8192)  # a dropped name comes back with a fresh id and page size
    assert again.id not in {x.id for x in idx.namespaces() if x.name != "n"}
