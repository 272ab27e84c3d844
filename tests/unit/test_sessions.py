import pytest

from pegaflow.common.errors import FailedPrecondition, InvalidArgument
from pegaflow.node.block_index import BlockIndex
from pegaflow.node.sessions import Sessions


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
    return idx, Sessions(idx, reservation_ttl=10, lease_ttl=60, clock=clock), clock


def test_uncommitted_reservation_expires_and_frees_pages(env):
    idx, ss, clock = env
    s = ss.open("e1", [("a", 4096)])
    ss.reserve(s, s.namespaces["a"], [h(1), h(2)])
    assert idx.alloc.free_bytes == idx.alloc.capacity - 2 * 4096
    clock.t = 9.9
    assert ss.expire() == (0, 0)
    clock.t = 10.0
    assert ss.expire() == (1, 0)
    assert idx.alloc.free_bytes == idx.alloc.capacity
    assert idx.prefix(s.namespaces["a"], [h(1)]) == []


def test_commit_after_expiry_is_rejected(env):
    _, ss, clock = env
    s = ss.open("e1", [("a", 4096)])
    r = ss.reserve(s, s.namespaces["a"], [h(1)])
    clock.t = 11
    ss.expire()
    with pytest.raises(InvalidArgument, match="expired"):
        ss.commit(s, r.id)


def test_duplicate_commit_is_invalid_and_harmless(env):
    idx, ss, _ = env
    s = ss.open("e1", [("a", 4096)])
    r = ss.reserve(s, s.namespaces["a"], [h(1)])
    assert ss.commit(s, r.id) == 1
    with pytest.raises(InvalidArgument, match="already committed"):
        ss.commit(s, r.id)
    assert idx.resident_blocks == 1


def test_partial_commit_frees_the_rest(env):
    idx, ss, _ = env
    s = ss.open("e1", [("a", 4096)])
    r = ss.reserve(s, s.namespaces["a"], [h(1), h(2), h(3)])
    assert ss.commit(s, r.id, [0, 2]) == 2
    assert idx.resident_blocks == 2
    assert idx.alloc.free_bytes == idx.alloc.capacity - 2 * 4096


def test_commit_indices_out_of_range_are_rejected_without_change(env):
    idx, ss, _ = env
    s = ss.open("e1", [("a", 4096)])
    r = ss.reserve(s, s.namespaces["a"], [h(1)])
    with pytest.raises(InvalidArgument, match="out of range"):
        ss.commit(s, r.id, [5])
    assert ss.commit(s, r.id) == 1


def test_lease_pins_until_release_and_session_end_frees_everything(env):
    idx, ss, _ = env
    s = ss.open("e1", [("a", 4096)])
    ns = s.namespaces["a"]
    ss.commit(s, ss.reserve(s, ns, [h(1), h(2)]).id)
    lease = ss.lease(s, idx.prefix(ns, [h(1), h(2)]))
    assert idx.lru_order() == []
    ss.reserve(s, ns, [h(3)])
    assert ss.close(s.id) == (1, 1)
    assert len(idx.lru_order()) == 2
    assert idx.resident_blocks == 2
    assert lease.id not in ss.leases


def test_lease_ttl_is_a_safety_net(env):
    idx, ss, clock = env
    s = ss.open("e1", [("a", 4096)])
    ns = s.namespaces["a"]
    ss.commit(s, ss.reserve(s, ns, [h(1)]).id)
    ss.lease(s, idx.prefix(ns, [h(1)]))
    clock.t = 61
    assert ss.expire() == (0, 1)
    assert len(idx.lru_order()) == 1


def test_unknown_session_and_foreign_namespace(env):
    _, ss, _ = env
    with pytest.raises(FailedPrecondition):
        ss.get(999)
    s = ss.open("e1", [("a", 4096)])
    ss.open("e2", [("b", 4096)])
    with pytest.raises(InvalidArgument, match="not registered"):
        ss.namespace(s, "b")
