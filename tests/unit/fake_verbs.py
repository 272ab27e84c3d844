"""A fake verbs layer at the hardware edge, for pegaflow/node/tiers/remote/rdma.py.

Implements only the pyverbs classes and calls rdma.py uses, with the same names and
signatures, over an in-process :class:`Fabric`: devices, memory regions with real
addresses and keys, RC queue pairs with the RESET->INIT->RTR->RTS state machine. A posted
RDMA READ is checked like a NIC would (QP in RTS, connected to a live remote QP, rkey
valid on the remote side with REMOTE_READ, range inside the MR, local lkey and range
valid) and then performed with ``ctypes.memmove``; its completion lands on the send CQ.
Any check that fails completes with an error status, as real hardware does.

Failure injection: ``Fabric.kill_qp(qp_num)`` (the remote side died: its QPs stop
answering, READs against them complete with IBV_WC_RETRY_EXC_ERR), ``Fabric.drop_device``.
A device's ports (state, link layer, LID, GID table with types, MTU) and its READ limits
are ``Fabric.ports`` and ``Fabric.rd_atom``; by default one active InfiniBand port. The
QPs record the attributes they were connected with (``QP.rtr``, ``QP.rts``), and a READ
limit above the device's is refused, as ``ibv_modify_qp`` does (EINVAL). Work requests and
SGEs count their ``close()`` calls (``closed``): pyverbs frees them only there.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class enums:  # noqa: N801 - mirrors the pyverbs.enums module
    IBV_ACCESS_LOCAL_WRITE = 1
    IBV_ACCESS_REMOTE_WRITE = 2
    IBV_ACCESS_REMOTE_READ = 4
    IBV_QPT_RC = 2
    IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_ERR = 0, 1, 2, 3, 6
    IBV_MTU_1024 = 3
    IBV_MTU_4096 = 5
    IBV_WR_RDMA_READ = 4
    IBV_SEND_SIGNALED = 2
    IBV_WC_SUCCESS = 0
    IBV_WC_LOC_PROT_ERR = 4
    IBV_WC_REM_ACCESS_ERR = 10
    IBV_WC_RETRY_EXC_ERR = 12
    IBV_WC_WR_FLUSH_ERR = 5
    IBV_PORT_DOWN, IBV_PORT_ACTIVE = 1, 4
    IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET = 1, 2
    IBV_GID_TYPE_SYSFS_IB_ROCE_V1, IBV_GID_TYPE_SYSFS_ROCE_V2 = 0, 1


@dataclass
class Port:
    """One port of a fake device: ``gids`` is its GID table, (GID, sysfs type) per index
    (an empty GID: an unused slot); ``lid`` None: one derived from the device's name."""

    state: int = enums.IBV_PORT_ACTIVE
    link_layer: int = enums.IBV_LINK_LAYER_INFINIBAND
    lid: int | None = None
    gids: list[tuple[str, int]] = field(default_factory=list)
    active_mtu: int = enums.IBV_MTU_4096


class Fabric:
    """Everything the fake NICs see: devices by name, MRs by key, QPs by number."""

    def __init__(self, devices: list[str]) -> None:
        self.devices = set(devices)
        self.mrs: dict[int, MR] = {}
        self.qps: dict[int, QP] = {}
        self._keys = itertools.count(0x1000)
        self._qpns = itertools.count(0x10)
        self.reads = 0
        self.read_bytes = 0
        self.ports: dict[str, list[Port]] = {}  # by device; absent: one active InfiniBand port
        self.rd_atom: dict[str, int] = {}  # by device: max_qp_rd_atom = max_qp_init_rd_atom (16)

    def kill_qp(self, qp_num: int) -> None:
        self.qps[qp_num].dead = True

    def drop_device(self, name: str) -> None:
        self.devices.discard(name)

    def verbs(self) -> SimpleNamespace:
        """The namespace rdma.py takes instead of load_pyverbs()."""
        fab = self

        class _Context(Context):
            fabric = fab

        return SimpleNamespace(Context=_Context, PD=PD, MR=MR, CQ=CQ, QP=QP, QPCap=QPCap, QPInitAttr=QPInitAttr,
                               QPAttr=QPAttr, AHAttr=AHAttr, GlobalRoute=GlobalRoute, GID=GID, SGE=SGE,
                               SendWR=SendWR, e=enums)


class Context:
    fabric: Fabric

    def __init__(self, name: str = "") -> None:
        if name not in self.fabric.devices:
            raise RuntimeError(f"Failed to open device {name}")
        self.name = name
        self.closed = False

    def _ports(self) -> list[Port]:
        return self.fabric.ports.get(self.name) or [Port()]

    def _port(self, port: int) -> Port:
        ports = self._ports()
        if not 1 <= port <= len(ports):
            raise RuntimeError(f"Failed to query port {port}")
        p = ports[port - 1]
        if not p.gids:  # the default: one InfiniBand GID derived from the device's name
            raw = bytes(8) + (abs(hash(self.name)) % (1 << 64)).to_bytes(8, "big")
            p.gids = [(":".join(raw.hex()[i:i + 4] for i in range(0, 32, 4)), enums.IBV_GID_TYPE_SYSFS_IB_ROCE_V1)]
        return p

    def query_device(self) -> Any:
        limit = self.fabric.rd_atom.get(self.name, 16)
        return SimpleNamespace(phys_port_cnt=len(self._ports()), max_qp_rd_atom=limit, max_qp_init_rd_atom=limit)

    def query_port(self, port: int) -> Any:
        p = self._port(port)
        lid = p.lid if p.lid is not None else (hash(self.name) & 0xFFFF) or 1
        return SimpleNamespace(state=p.state, link_layer=p.link_layer, lid=lid, active_mtu=p.active_mtu,
                               gid_tbl_len=len(p.gids))

    def query_gid(self, port: int, index: int) -> Any:
        return GID(self._port(port).gids[index][0] or "0000:0000:0000:0000:0000:0000:0000:0000")

    def query_gid_type(self, port: int, index: int) -> int:
        return self._port(port).gids[index][1]

    def close(self) -> None:
        self.closed = True


class PD:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def close(self) -> None:
        pass


class MR:
    def __init__(self, pd: PD, length: int, access: int, address: int | None = None) -> None:
        if address is None:
            raise ValueError("the fake only registers caller memory")
        fab = pd.ctx.fabric
        self.pd, self.length, self.access, self.buf = pd, length, access, address
        self.lkey = next(fab._keys)
        self.rkey = next(fab._keys)
        self.fabric = fab
        fab.mrs[self.lkey] = self
        fab.mrs[self.rkey] = self

    def close(self) -> None:
        self.fabric.mrs.pop(self.lkey, None)
        self.fabric.mrs.pop(self.rkey, None)


class CQ:
    def __init__(self, ctx: Context, cqe: int) -> None:
        self.cqe = cqe
        self.entries: list[Any] = []

    def poll(self, num_entries: int = 1) -> tuple[int, list[Any]]:
        out, self.entries = self.entries[:num_entries], self.entries[num_entries:]
        return len(out), out

    def close(self) -> None:
        pass


class QPCap:
    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 1, max_send_sge: int = 1, max_recv_sge: int = 1,
                 max_inline_data: int = 0) -> None:
        self.max_send_wr = max_send_wr


class QPInitAttr:
    def __init__(self, qp_type: int = enums.IBV_QPT_RC, scq: CQ | None = None, rcq: CQ | None = None,
                 cap: QPCap | None = None, sq_sig_all: int = 0) -> None:
        self.qp_type, self.scq, self.rcq, self.cap = qp_type, scq, rcq, cap or QPCap()


class QPAttr:
    def __init__(self) -> None:
        self.qp_access_flags = 0
        self.port_num = 1
        self.dest_qp_num = 0
        self.ah_attr: AHAttr | None = None
        self.path_mtu = 0
        self.max_dest_rd_atomic = 0
        self.max_rd_atomic = 0


class GID:
    def __init__(self, val: str = "") -> None:
        self.gid = val


class GlobalRoute:
    def __init__(self, dgid: GID | None = None, sgid_index: int = 0) -> None:
        self.dgid, self.sgid_index = dgid, sgid_index


class AHAttr:
    def __init__(self, gr: GlobalRoute | None = None, is_global: int = 0, port_num: int = 1, dlid: int = 0) -> None:
        self.gr, self.is_global, self.port_num, self.dlid = gr, is_global, port_num, dlid


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class SendWR:
    def __init__(self, wr_id: int = 0, opcode: int = 0, num_sge: int = 1, sg: list[SGE] | None = None,
                 send_flags: int = 0) -> None:
        self.wr_id, self.opcode, self.num_sge, self.sg, self.send_flags = wr_id, opcode, num_sge, sg or [], send_flags
        self.rkey = 0
        self.remote_addr = 0
        self.closed = 0

    def close(self) -> None:
        self.closed += 1

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


class QP:
    def __init__(self, pd: PD, init_attr: QPInitAttr) -> None:
        fab = pd.ctx.fabric
        self.fabric, self.pd = fab, pd
        self.qp_num = next(fab._qpns)
        self.scq = init_attr.scq
        self.max_send_wr = init_attr.cap.max_send_wr
        self.qp_state = enums.IBV_QPS_RESET
        self.dest = 0
        self.access = 0
        self.dead = False
        self.outstanding = 0
        self.rd_atom = fab.rd_atom.get(pd.ctx.name, 16)
        self.rtr: dict[str, Any] = {}
        self.rts: dict[str, Any] = {}
        fab.qps[self.qp_num] = self

    def to_init(self, attr: QPAttr) -> None:
        assert self.qp_state == enums.IBV_QPS_RESET, "to_init from a non-RESET state"
        self.access = attr.qp_access_flags
        self.qp_state = enums.IBV_QPS_INIT

    def to_rtr(self, attr: QPAttr) -> None:
        assert self.qp_state == enums.IBV_QPS_INIT, "to_rtr needs INIT"
        assert attr.ah_attr is not None and attr.dest_qp_num, "RTR needs a path and a remote QP"
        if attr.max_dest_rd_atomic > self.rd_atom:
            raise RuntimeError("Failed to modify QP state to RTR: EINVAL (max_dest_rd_atomic)")
        self.dest = attr.dest_qp_num
        self.rtr = {"path_mtu": attr.path_mtu, "max_dest_rd_atomic": attr.max_dest_rd_atomic,
                    "port_num": attr.port_num, "sgid_index": attr.ah_attr.gr.sgid_index,
                    "ah_port_num": attr.ah_attr.port_num}
        self.qp_state = enums.IBV_QPS_RTR

    def to_rts(self, attr: QPAttr) -> None:
        assert self.qp_state == enums.IBV_QPS_RTR, "to_rts needs RTR"
        if attr.max_rd_atomic > self.rd_atom:
            raise RuntimeError("Failed to modify QP state to RTS: EINVAL (max_rd_atomic)")
        self.rts = {"max_rd_atomic": attr.max_rd_atomic}
        self.qp_state = enums.IBV_QPS_RTS

    def post_send(self, wr: SendWR) -> None:
        if self.qp_state != enums.IBV_QPS_RTS:
            raise RuntimeError(f"post_send on QP {self.qp_num} in state {self.qp_state}")
        if self.outstanding >= self.max_send_wr:
            raise RuntimeError("send queue full")
        assert wr.opcode == enums.IBV_WR_RDMA_READ, "the fake implements RDMA READ only"
        status = self._read(wr)
        if status != enums.IBV_WC_SUCCESS:
            self.qp_state = enums.IBV_QPS_ERR
        self.scq.entries.append(SimpleNamespace(wr_id=wr.wr_id, status=status, byte_len=wr.sg[0].length))
        # the fake completes at once; the transport still sees a bounded queue
        self.outstanding = 0

    def _read(self, wr: SendWR) -> int:
        fab = self.fabric
        remote = fab.qps.get(self.dest)
        if remote is None or remote.dead or remote.qp_state != enums.IBV_QPS_RTS or remote.dest != self.qp_num:
            return enums.IBV_WC_RETRY_EXC_ERR
        rmr = fab.mrs.get(wr.rkey)
        sge = wr.sg[0]
        if (rmr is None or rmr.rkey != wr.rkey or not rmr.access & enums.IBV_ACCESS_REMOTE_READ
                or not rmr.buf <= wr.remote_addr <= rmr.buf + rmr.length - sge.length):
            return enums.IBV_WC_REM_ACCESS_ERR
        lmr = fab.mrs.get(sge.lkey)
        if lmr is None or lmr.lkey != sge.lkey or not lmr.buf <= sge.addr <= lmr.buf + lmr.length - sge.length:
            return enums.IBV_WC_LOC_PROT_ERR
        ctypes.memmove(sge.addr, wr.remote_addr, sge.length)
        fab.reads += 1
        fab.read_bytes += sge.length
        return enums.IBV_WC_SUCCESS

    def close(self) -> None:
        self.fabric.qps.pop(self.qp_num, None)
