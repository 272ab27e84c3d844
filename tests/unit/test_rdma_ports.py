"""What rdma.py takes from the device before its first READ: the port, the GID, the READ
limits, pyverbs' constants, and what it frees. Over the fake verbs layer
(tests/unit/fake_verbs.py): only the hardware edge is fake.

- The port is the first ACTIVE one; the GID on Ethernet (RoCE) the first RoCE v2 one that
  is not link-local: index 0 there is RoCE v1, which is not routed between subnets (as the
  original's pegaflow-transfer chooses).
- The READs in flight each way are held to the device's limits (``ibv_modify_qp`` refuses more).
- pyverbs from rdma-core 59 has no ``pyverbs.enums``: its constants are enum members.
- Every READ's work request and SGE is closed once (pyverbs 44-63 never free them otherwise).
"""

from __future__ import annotations

import enum
import mmap
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest

from pegaflow.node.tiers.remote import RemotePages, TransferError, page_checksum
from pegaflow.node.tiers.remote.rdma import (
    RdmaEngine,
    RdmaResponder,
    RdmaTransport,
    RdmaUnavailable,
    flat_enums,
    gid_str,
    load_pyverbs,
)
from tests.unit import fake_verbs
from tests.unit.fake_verbs import Port, enums

PAGE = 4096
PAGES = 8
V1, V2 = enums.IBV_GID_TYPE_SYSFS_IB_ROCE_V1, enums.IBV_GID_TYPE_SYSFS_ROCE_V2
ETH = enums.IBV_LINK_LAYER_ETHERNET
ROCE_TABLE = [("fe80:0000:0000:0000:0a00:00ff:fe00:0001", V1), ("fe80:0000:0000:0000:0a00:00ff:fe00:0001", V2),
              ("febf:0000:0000:0000:0a00:00ff:fe00:0001", V2),  # link-local too (fe80::/10)
              ("0000:0000:0000:0000:0000:ffff:0a00:0001", V1), ("0000:0000:0000:0000:0000:ffff:0a00:0001", V2)]


class Pair:
    """Two engines on one fake fabric: node a serves (responder), node b pulls (transport);
    ``nics`` devices each (a_0.., b_0..); ``handshake`` wraps the responder's answer."""

    def __init__(self, fabric: fake_verbs.Fabric, nics: int = 1,
                 handshake: Callable[[Callable[[], Any]], Any] = lambda answer: answer()) -> None:
        self.fabric = fabric
        self.mm = [mmap.mmap(-1, PAGES * PAGE) for _ in range(2)]
        for i in range(PAGES):
            self.mm[0][i * PAGE:(i + 1) * PAGE] = bytes([i + 1]) * PAGE
        v = fabric.verbs()
        self.a = RdmaEngine([f"a_{i}" for i in range(nics)], self.mm[0], v)
        self.b = RdmaEngine([f"b_{i}" for i in range(nics)], self.mm[1], v)
        self.responder = RdmaResponder(self.a)
        self.handshakes = 0

        def answer(peer: str, req: Any) -> Any:
            self.handshakes += 1
            return handshake(lambda: self.responder.accept(req))

        self.transport = RdmaTransport(self.b, answer, "b")

    def pull(self, pages: int = PAGES) -> list[int | None]:
        offsets = tuple(i * PAGE for i in range(pages))
        sums = tuple(page_checksum(self.a.view[o:o + PAGE]) for o in offsets)
        remote = RemotePages("a", 1, PAGE, offsets, sums, rdma_base=self.a.base, rkeys=tuple(self.a.rkeys))
        return self.transport.read(remote, list(offsets))

    def qps(self) -> list[fake_verbs.QP]:
        return list(self.fabric.qps.values())

    def close(self) -> None:
        self.transport.close()
        self.responder.close()
        self.a.close()
        self.b.close()
        for m in self.mm:
            m.close()


def pair(**ports: list[Port]) -> Pair:
    fabric = fake_verbs.Fabric(["a_0", "b_0"])
    fabric.ports.update(ports)
    return Pair(fabric)


def test_roce_uses_the_first_routable_roce_v2_gid_not_index_0() -> None:
    p = pair(a_0=[Port(link_layer=ETH, lid=0, gids=ROCE_TABLE)], b_0=[Port(link_layer=ETH, lid=0, gids=ROCE_TABLE)])
    try:
        for nic in (p.a.nics[0], p.b.nics[0]):
            assert nic.gid_index == 4 and gid_str(nic.gid) == ROCE_TABLE[4][0] and nic.link_layer == "ethernet"
        assert all(s is not None for s in p.pull())
        assert p.mm[1][:] == p.mm[0][:]
        assert {qp.rtr["sgid_index"] for qp in p.qps()} == {4}  # both sides' QPs
    finally:
        p.close()


def test_roce_without_a_v2_gid_takes_a_routable_one_and_infiniband_its_first() -> None:
    p = pair(a_0=[Port(link_layer=ETH, lid=0, gids=[ROCE_TABLE[0], ROCE_TABLE[3]])],
             b_0=[Port(gids=[("", V1), ("fe80:0000:0000:0000:0002:c903:0001:0002", V1)])])
    try:
        assert p.a.nics[0].gid_index == 1  # no RoCE v2: the first that is not link-local
        assert p.b.nics[0].gid_index == 1  # InfiniBand: the first GID (an empty slot skipped)
    finally:
        p.close()


def test_the_first_active_port_is_used_and_none_is_one_line() -> None:
    p = pair(a_0=[Port(state=enums.IBV_PORT_DOWN), Port()], b_0=[Port(state=enums.IBV_PORT_DOWN), Port()])
    try:
        assert p.a.nics[0].port == 2
        assert all(s is not None for s in p.pull())
        assert {(qp.rtr["port_num"], qp.rtr["ah_port_num"]) for qp in p.qps()} == {(2, 2)}
    finally:
        p.close()
    for ports, match in (([Port(state=enums.IBV_PORT_DOWN)], "no active port"), ([Port(lid=0)], "LID 0")):
        fabric = fake_verbs.Fabric(["x_0"])
        fabric.ports["x_0"] = ports
        m = mmap.mmap(-1, PAGE)
        with pytest.raises(RdmaUnavailable, match=match) as exc:
            RdmaEngine(["x_0"], m, fabric.verbs())
        assert "\n" not in str(exc.value) and "x_0" in str(exc.value)
        m.close()  # the engine let go of the pool


def test_reads_in_flight_are_held_to_the_devices_limits() -> None:
    fabric = fake_verbs.Fabric(["a_0", "b_0"])
    fabric.rd_atom.update(a_0=4, b_0=8)
    p = Pair(fabric)
    try:
        assert all(s is not None for s in p.pull())
        by_device = {qp.pd.ctx.name: qp for qp in p.qps()}
        assert by_device["a_0"].rtr["max_dest_rd_atomic"] == 4 and by_device["a_0"].rts["max_rd_atomic"] == 4
        assert by_device["b_0"].rtr["max_dest_rd_atomic"] == 8 and by_device["b_0"].rts["max_rd_atomic"] == 8
    finally:
        p.close()


def test_every_work_request_and_sge_is_closed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    for cls in (fake_verbs.SGE, fake_verbs.SendWR):
        init = cls.__init__

        def tracked(self: Any, *a: Any, _init: Any = init, **k: Any) -> None:
            _init(self, *a, **k)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", tracked)
    p = pair()
    try:
        p.pull()
        assert len(made) == 2 * PAGES and [o.closed for o in made] == [1] * len(made)
    finally:
        p.close()


def test_a_queue_pair_the_device_cannot_create_fails_the_pull_not_the_puller(monkeypatch: pytest.MonkeyPatch) -> None:
    p = pair()
    try:
        def refused(self: Any, pd: Any, init_attr: Any) -> None:
            raise RuntimeError("Failed to create QP: ENOMEM")

        monkeypatch.setattr(fake_verbs.QP, "__init__", refused)
        with pytest.raises(TransferError, match="ENOMEM"):
            p.pull()
    finally:
        p.close()


def test_pyverbs_without_its_enums_module_uses_the_enum_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """rdma-core >= 59 (Cython 3): ``pyverbs.libibverbs_enums`` holds enum classes, no flat names."""
    access = enum.IntFlag("ibv_access_flags", {"IBV_ACCESS_LOCAL_WRITE": 1, "IBV_ACCESS_REMOTE_READ": 4})
    port_state = enum.IntEnum("ibv_port_state", {"IBV_PORT_DOWN": 1, "IBV_PORT_ACTIVE": 4})
    fake = fake_verbs.Fabric([]).verbs()
    modules = {
        "addr": {"AHAttr": fake.AHAttr, "GlobalRoute": fake.GlobalRoute, "GID": fake.GID},
        "cq": {"CQ": fake.CQ}, "device": {"Context": fake.Context}, "mr": {"MR": fake.MR}, "pd": {"PD": fake.PD},
        "qp": {"QP": fake.QP, "QPCap": fake.QPCap, "QPInitAttr": fake.QPInitAttr, "QPAttr": fake.QPAttr},
        "wr": {"SGE": fake.SGE, "SendWR": fake.SendWR},
        "libibverbs_enums": {"ibv_access_flags": access, "ibv_port_state": port_state, "IBV_OTHER": 7},
    }
    package = types.ModuleType("pyverbs")
    monkeypatch.setitem(sys.modules, "pyverbs", package)
    for name, attrs in modules.items():
        m = types.ModuleType(f"pyverbs.{name}")
        m.__dict__.update(attrs)
        setattr(package, name, m)
        monkeypatch.setitem(sys.modules, m.__name__, m)
    v = load_pyverbs()
    assert v.e.IBV_ACCESS_LOCAL_WRITE | v.e.IBV_ACCESS_REMOTE_READ == 5
    assert v.e.IBV_PORT_ACTIVE == 4 and v.e.IBV_OTHER == 7
    assert flat_enums(types.SimpleNamespace()).__dict__ == {}


def test_every_nic_gets_its_reads_before_any_completion_is_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several NICs transfer at once: no NIC's READs wait for another's completions."""
    events: list[tuple[str, str]] = []
    post, poll = fake_verbs.QP.post_send, fake_verbs.CQ.poll

    def posted(self: fake_verbs.QP, wr: Any) -> None:
        events.append(("post", self.pd.ctx.name))
        post(self, wr)

    def polled(self: fake_verbs.CQ, n: int = 1) -> tuple[int, list[Any]]:
        events.append(("poll", ""))
        return poll(self, n)

    monkeypatch.setattr(fake_verbs.QP, "post_send", posted)
    monkeypatch.setattr(fake_verbs.CQ, "poll", polled)
    p = Pair(fake_verbs.Fabric(["a_0", "a_1", "b_0", "b_1"]), nics=2)
    try:
        assert all(s is not None for s in p.pull())
        first_poll = events.index(("poll", ""))
        assert {dev for kind, dev in events[:first_poll]} == {"b_0", "b_1"}
        assert sum(kind == "post" for kind, _ in events) == PAGES
    finally:
        p.close()


def test_two_pulls_setting_up_the_same_queue_pair_make_one() -> None:
    """The peer keeps one QP per puller QP: a second handshake for it would replace the
    first one's while that one is in use. Both pulls wait (bounded) for each other inside
    the handshake: if both were let in, both would get there."""
    both = threading.Barrier(2, timeout=1.0)

    def meet(answer: Callable[[], Any]) -> Any:
        try:
            both.wait()
        except threading.BrokenBarrierError:
            pass  # the other pull waits for this setup instead
        return answer()

    p = Pair(fake_verbs.Fabric(["a_0", "b_0"]), handshake=meet)
    try:
        got: list[Any] = []
        threads = [threading.Thread(target=lambda: got.append(p.transport._conn("a", 0, 0, 1))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(got) == 2 and got[0] is got[1]
        assert p.handshakes == 1 and len(p.responder.qps) == 1
    finally:
        p.close()


def test_both_sides_use_the_smaller_path_mtu() -> None:
    p = pair(a_0=[Port(active_mtu=enums.IBV_MTU_4096)], b_0=[Port(active_mtu=enums.IBV_MTU_1024)])
    try:
        assert all(s is not None for s in p.pull())
        assert {qp.rtr["path_mtu"] for qp in p.qps()} == {enums.IBV_MTU_1024}
    finally:
        p.close()


def test_a_pull_waiting_on_a_silent_peer_yields_then_sleeps_and_still_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spin would hold the interpreter lock against the node's event loop (every engine's
    call) and burn a core for the whole timeout on a dead peer: empty sweeps yield, then
    sleep longer and longer, and the pull still fails at POLL_TIMEOUT."""
    from pegaflow.node.tiers.remote import TransferError, rdma

    clock = [1000.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += max(s, 1e-6)

    def monotonic() -> float:
        clock[0] += 1e-4  # a sweep's own time: a spinning poll reaches the timeout too
        return clock[0]

    monkeypatch.setattr(rdma, "time", types.SimpleNamespace(monotonic=monotonic, sleep=sleep))
    p = Pair(fake_verbs.Fabric(["a_0", "b_0"]))
    try:
        assert all(s is not None for s in p.pull()) and slept == [], "completions at once: no wait"
        monkeypatch.setattr(fake_verbs.CQ, "poll", lambda self, n=1: (0, []))  # the peer died
        with pytest.raises(TransferError, match="no RDMA completion"):
            p.pull()
        assert slept[:rdma.SPIN_SWEEPS] == [0.0] * rdma.SPIN_SWEEPS, "first only yield the lock"
        waits = slept[rdma.SPIN_SWEEPS:]
        assert waits == sorted(waits) and waits[0] == rdma.IDLE_SLEEP_S and max(waits) == rdma.IDLE_SLEEP_MAX_S
        assert len(slept) < rdma.POLL_TIMEOUT / rdma.IDLE_SLEEP_MAX_S + 64, "a sweep per ms, not a spin"
    finally:
        p.close()
