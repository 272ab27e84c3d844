"""RDMA data plane: one-sided RDMA READ of pinned peer pages into our pool, over pyverbs.

Shape (as the Rust original): every node opens the devices named by ``--nics`` and
registers its whole pool as one memory region per device (remote read + local write),
so a pin only needs to return offsets, the pool's base virtual address and the MR's
rkey per NIC. The puller keeps ``--qps-per-peer`` RC queue pairs per (peer, NIC) (the
original's "RC QPs per (local NIC, remote NIC) pair", default 2), each set up lazily with
a gRPC handshake (``PegaPeer.RdmaConnect``: QP number, LID, GID, PSN each way; the
responder opens one QP per puller QP, so the two sides need not agree on the number); a
pull posts one signaled READ work request per page, striped over the NICs and, within a
NIC, over its QPs, at most ``MAX_OUTSTANDING`` in flight per QP, every QP's before it polls
any CQ (all NICs transfer at once), and polls the QPs' CQs until every page completed. The
peer's CPU takes no part in the copy.

A failed completion (peer died, keys revoked) or a poll timeout raises
:class:`TransferError`; the QP is then in the error state and is dropped, so the next
pull reconnects. Checksums are verified by the puller, as for TCP.

All verbs calls go through a ``verbs`` namespace (:func:`load_pyverbs` for Debian's
``python3-pyverbs``); unit tests pass a fake with the same classes that copies memory on
READ, so everything above the hardware edge is the code that runs on real NICs.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import mmap
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import structlog

from pegaflow._proto import peer_pb2
from pegaflow.node.tiers.remote import RDMA, RemotePages, TransferError, page_checksum

log = structlog.get_logger("pegaflow.p2p")

MAX_OUTSTANDING = 64  # READs in flight per QP (max_send_wr); enough to fill a 200 Gbit/s link
MAX_RD_ATOMIC = 16  # outstanding RDMA READs per QP, each way (ConnectX's limit; less where the device says)
POLL_TIMEOUT = 10.0  # seconds without any completion before the pull is failed
CQ_BATCH = 32  # completions taken per poll call
# A sweep over the CQs that found nothing yields the interpreter lock (a spin holds it, and the
# node's event loop, which answers every engine, would get it only at the switch interval, 5 ms);
# after SPIN_SWEEPS of them the poll sleeps, from IDLE_SLEEP_S doubling up to IDLE_SLEEP_MAX_S,
# instead of burning a core for POLL_TIMEOUT on a peer that died.
SPIN_SWEEPS = 8
IDLE_SLEEP_S = 20e-6
IDLE_SLEEP_MAX_S = 1e-3
# Queue pairs idle this long are closed on both sides, so a holder does not keep for good the
# QPs of pullers that went away (a pod's node id changes at each restart; the device's QPs
# and pinned memory are finite). The puller closes its own after QP_IDLE_S without a READ on
# it; the responder closes a puller's after twice that without a pin from it (every READ
# follows its pin), so it never closes one a live puller may still use.
QP_IDLE_S = 300.0


def idle_sleep(idle: int) -> float:
    """Seconds to sleep after the ``idle``-th sweep in a row that found no completion (0:
    only yield the interpreter lock)."""
    if idle <= SPIN_SWEEPS:
        return 0.0
    return min(IDLE_SLEEP_MAX_S, IDLE_SLEEP_S * 2.0 ** min(idle - SPIN_SWEEPS - 1, 16))


DIST_PACKAGES = "/usr/lib/python3/dist-packages"  # Debian's python3-pyverbs lives here

Qp = Any  # pyverbs.qp.QP: Debian's python3-pyverbs has no stubs and is absent where mypy runs
Cq = Any  # pyverbs.cq.CQ: likewise


class RdmaUnavailable(Exception):
    """``--nics`` was given but the devices cannot be used (one line for the operator)."""


def load_pyverbs() -> SimpleNamespace:
    """The verbs classes this module uses, from Debian's ``python3-pyverbs``."""
    if DIST_PACKAGES not in sys.path:
        sys.path.append(DIST_PACKAGES)
    try:
        from pyverbs import addr, cq, device, mr, pd, qp, wr
        e = pyverbs_enums()
    except ImportError as exc:
        raise RdmaUnavailable(f"pyverbs is not importable ({exc}); apt install python3-pyverbs") from None
    return SimpleNamespace(
        Context=device.Context, PD=pd.PD, MR=mr.MR, CQ=cq.CQ, QP=qp.QP, QPCap=qp.QPCap,
        QPInitAttr=qp.QPInitAttr, QPAttr=qp.QPAttr, AHAttr=addr.AHAttr, GlobalRoute=addr.GlobalRoute,
        GID=addr.GID, SGE=wr.SGE, SendWR=wr.SendWR, e=e,
    )  # fmt: skip


def pyverbs_enums() -> object:
    """pyverbs' constants by their C names (``e.IBV_ACCESS_LOCAL_WRITE``): the module
    ``pyverbs.enums`` up to rdma-core 58; from 59 (built with Cython 3) it is gone and the
    constants are members of enum classes in ``pyverbs.libibverbs_enums``, flattened here."""
    try:
        from pyverbs import enums

        return enums
    except ImportError:
        from pyverbs import libibverbs_enums

        return flat_enums(libibverbs_enums)


def flat_enums(module: object) -> SimpleNamespace:
    """The members of every enum class in ``module``, and its own ``IBV_*`` names, by name."""
    names: dict[str, object] = {}
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, enum.Enum):
            names.update(value.__members__)
    names.update({k: v for k, v in vars(module).items() if k.startswith("IBV_")})
    return SimpleNamespace(**names)


def buffer_address(mm: mmap.mmap) -> tuple[int, ctypes.c_char]:
    """(virtual address of the mapping, the ctypes export keeping it valid; drop before closing)."""
    c = ctypes.c_char.from_buffer(mm)
    return ctypes.addressof(c), c


def gid_bytes(gid: str) -> bytes:
    return bytes.fromhex(gid.replace(":", ""))


def gid_str(raw: bytes) -> str:
    h = raw.hex().rjust(32, "0")
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def link_local(gid: str) -> bool:
    """fe80::/10, the address every port has; RoCE v2 routes only the others."""
    return ipaddress.IPv6Address(gid_bytes(gid)).is_link_local


class Nic:
    """One opened device with the pool registered on it, on its first active port."""

    def __init__(self, verbs: SimpleNamespace, name: str, base: int, size: int) -> None:
        e = verbs.e
        self.v = verbs
        self.name = name
        try:
            self.ctx = verbs.Context(name=name)
        except Exception as exc:
            raise RdmaUnavailable(f"cannot open RDMA device {name!r}: {exc}") from None
        self.pd = verbs.PD(self.ctx)
        try:
            self._choose_port()
        except RdmaUnavailable:
            raise
        except Exception as exc:  # a verbs query error (PyverbsRDMAError)
            raise RdmaUnavailable(f"cannot query RDMA device {name!r}: {exc}") from None
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        try:
            self.mr = verbs.MR(self.pd, size, access, address=base)
        except Exception as exc:
            raise RdmaUnavailable(f"cannot register the pool on {name!r}: {exc} (ulimit -l?)") from None
        log.info("rdma_nic_ready", nic=name, port=self.port, link_layer=self.link_layer, lid=self.lid,
                 gid_index=self.gid_index, gid=gid_str(self.gid), mtu=int(self.mtu), rd_atomic=self.rd_atomic,
                 dest_rd_atomic=self.dest_rd_atomic)

    def _choose_port(self) -> None:
        """As the original (pegaflow-transfer's ``choose_port_and_gid``): the first ACTIVE
        port; its LID (InfiniBand: never 0); the first RoCE v2 GID that is not link-local
        (RoCE v1, GID index 0 on Ethernet, is not routed across subnets), else the first
        non-link-local one, else index 0; its active MTU. The READs in flight each way are
        held to what the device accepts."""
        e = self.v.e
        dev = self.ctx.query_device()
        self.rd_atomic = max(1, min(MAX_RD_ATOMIC, int(dev.max_qp_init_rd_atom)))  # as initiator
        self.dest_rd_atomic = max(1, min(MAX_RD_ATOMIC, int(dev.max_qp_rd_atom)))  # as responder
        for port_num in range(1, int(dev.phys_port_cnt) + 1):
            port = self.ctx.query_port(port_num)
            if port.state != e.IBV_PORT_ACTIVE:
                continue
            self.port = port_num
            self.mtu = port.active_mtu
            ethernet = port.link_layer == e.IBV_LINK_LAYER_ETHERNET
            self.link_layer = "ethernet" if ethernet else "infiniband"
            self.lid = int(port.lid)
            if not ethernet and self.lid == 0:
                raise RdmaUnavailable(f"RDMA device {self.name!r} port {port_num}: InfiniBand with LID 0 "
                                      "(no subnet manager?)")
            self.gid_index, gid = self._choose_gid(port_num, int(port.gid_tbl_len), ethernet)
            self.gid = gid_bytes(gid)
            return
        raise RdmaUnavailable(f"RDMA device {self.name!r} has no active port")

    def _choose_gid(self, port_num: int, entries: int, ethernet: bool) -> tuple[int, str]:
        e = self.v.e
        table: list[tuple[int, str, object]] = []
        for i in range(entries):
            try:
                gid = str(self.ctx.query_gid(port_num, i).gid)
                kind = self.ctx.query_gid_type(port_num, i) if ethernet else None
            except Exception:  # noqa: BLE001 - an empty slot of the table
                continue
            if any(gid_bytes(gid)):
                table.append((i, gid, kind))
        picked = ([t for t in table if ethernet and t[2] == e.IBV_GID_TYPE_SYSFS_ROCE_V2 and not link_local(t[1])]
                  or [t for t in table if not ethernet]
                  or [t for t in table if not link_local(t[1])])
        if picked:
            return picked[0][0], picked[0][1]
        return 0, str(self.ctx.query_gid(port_num, 0).gid)

    def new_qp(self) -> tuple[Qp, Cq]:
        v = self.v
        cq = v.CQ(self.ctx, MAX_OUTSTANDING * 2)
        cap = v.QPCap(max_send_wr=MAX_OUTSTANDING, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        qp = v.QP(self.pd, v.QPInitAttr(qp_type=v.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
        return qp, cq

    def endpoint(self, qp: Qp, psn: int) -> peer_pb2.QpEndpoint:
        return peer_pb2.QpEndpoint(qp_num=qp.qp_num, lid=self.lid, gid=self.gid, psn=psn, port=self.port,
                                   mtu=int(self.mtu))

    def connect(self, qp: Qp, psn: int, remote: peer_pb2.QpEndpoint) -> None:
        """RESET -> INIT -> RTR -> RTS against the remote endpoint."""
        v, e = self.v, self.v.e
        attr = v.QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        attr.port_num = self.port
        attr.pkey_index = 0
        qp.to_init(attr)
        # A READ's responses are cut to the responder's path MTU: a peer with jumbo frames must
        # not send this side more than its port takes (nor this side it).
        attr.path_mtu = min(int(self.mtu), remote.mtu or int(self.mtu))
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = self.dest_rd_atomic
        attr.min_rnr_timer = 12
        gr = v.GlobalRoute(dgid=v.GID(gid_str(remote.gid)), sgid_index=self.gid_index)
        attr.ah_attr = v.AHAttr(gr=gr, is_global=1, port_num=self.port, dlid=remote.lid)
        qp.to_rtr(attr)
        attr.sq_psn = psn
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.max_rd_atomic = self.rd_atomic
        qp.to_rts(attr)

    def close(self) -> None:
        _close(self.mr, self.pd, self.ctx)


class RdmaEngine:
    """The node's devices and pool registration, shared by the responder and the transport."""

    def __init__(self, nics: Sequence[str], mm: mmap.mmap, verbs: SimpleNamespace | None = None) -> None:
        self.verbs = verbs or load_pyverbs()
        if not nics:
            raise RdmaUnavailable("--nics names no device")
        self._export: ctypes.c_char | None
        self.base, self._export = buffer_address(mm)
        self.size = len(mm)
        self.view = memoryview(mm)
        self.nics: list[Nic] = []
        try:
            for name in nics:
                self.nics.append(Nic(self.verbs, name, self.base, self.size))
        except BaseException:
            self.close()  # the pool must stay closable after a failed start
            raise

    @property
    def rkeys(self) -> list[int]:
        return [n.mr.rkey for n in self.nics]

    def close(self) -> None:
        for n in self.nics:
            n.close()
        self.view.release()
        self._export = None  # lets the pool's mmap close


class RdmaResponder:
    """Serving side of the handshake: a QP per puller QP, connected back to it.

    Responder QPs never post work: the NIC serves the puller's READs from the registered
    pool by itself. Each is kept for its puller's QP, (puller, NIC, the puller's QP index):
    a puller that dropped its QP (a failed pull, a restart) handshakes again for the same
    one, and the QP that answered the old one is closed. A puller's QPs are closed once it
    has neither pinned nor handshaken for twice ``QP_IDLE_S`` (:meth:`seen`).
    """

    def __init__(self, engine: RdmaEngine, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.qps: dict[tuple[str, int, int], tuple[Qp, Cq]] = {}
        self.clock = clock
        self._seen: dict[str, float] = {}  # puller -> its last pin or handshake (clock)
        self._swept = clock()
        self._lock = threading.Lock()

    @property
    def base_addr(self) -> int:
        return self.engine.base

    @property
    def rkeys(self) -> list[int]:
        return self.engine.rkeys

    def accept(self, req: peer_pb2.RdmaConnectRequest) -> peer_pb2.RdmaConnectResponse:
        nics = self.engine.nics
        if not 0 <= req.nic_index < len(nics):
            raise ValueError(f"nic_index {req.nic_index} out of range (this node has {len(nics)} NICs)")
        nic = nics[req.nic_index]
        qp, cq = nic.new_qp()
        psn = random.randrange(1 << 24)
        try:
            nic.connect(qp, psn, req.endpoint)
        except BaseException:
            _close(qp, cq)
            raise
        key = (req.puller, req.nic_index, req.qp_index)
        self.seen(req.puller)
        with self._lock:
            old = self.qps.get(key)
            self.qps[key] = (qp, cq)
        if old is not None:
            _close(*old)
        log.info("rdma_qp_accepted", puller=req.puller, nic=nic.name, qp=qp.qp_num, replaced=old is not None)
        return peer_pb2.RdmaConnectResponse(endpoint=nic.endpoint(qp, psn), rkey=nic.mr.rkey,
                                            rdma_base=self.engine.base)

    def seen(self, puller: str) -> None:
        """``puller`` pinned pages here or handshakes: its QPs stay; those of pullers silent
        for twice ``QP_IDLE_S`` are closed (looked for every ``QP_IDLE_S`` / 4 at most)."""
        now = self.clock()
        gone: list[tuple[Qp, Cq]] = []
        with self._lock:
            self._seen[puller] = now
            if now - self._swept < QP_IDLE_S / 4:
                return
            self._swept = now
            silent = {p for p, t in self._seen.items() if now - t > 2 * QP_IDLE_S}
            for p in silent:
                del self._seen[p]
            for key in [k for k in self.qps if k[0] in silent]:
                gone.append(self.qps.pop(key))
        for qp, cq in gone:
            _close(qp, cq)
        if gone:
            log.info("rdma_qps_reclaimed", pullers=sorted(silent), qps=len(gone))

    def close(self) -> None:
        """Close every QP (before the engine's devices)."""
        with self._lock:
            qps, self.qps = list(self.qps.values()), {}
        for qp, cq in qps:
            _close(qp, cq)


def _close(*objects: Any) -> None:
    """Close verbs objects, best effort (a QP whose peer died may refuse)."""
    for o in objects:
        try:
            o.close()
        except Exception:  # noqa: BLE001
            pass


# (peer gRPC address, RdmaConnectRequest) -> RdmaConnectResponse; blocking (worker thread)
Handshake = Callable[[str, peer_pb2.RdmaConnectRequest], peer_pb2.RdmaConnectResponse]


class _Conn:
    def __init__(self, qp: Qp, cq: Cq, nic: Nic, peer_nic: int, now: float) -> None:
        self.qp, self.cq, self.nic, self.peer_nic = qp, cq, nic, peer_nic
        self.lock = threading.Lock()
        self.used = now  # when a pull last took it (the transport's clock)


class RdmaTransport:
    """Puller side: READ work requests striped over our NICs; see the module docstring."""

    name = RDMA

    def __init__(self, engine: RdmaEngine, handshake: Handshake, node_id: str = "", qps_per_peer: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if qps_per_peer < 1:
            raise ValueError(f"qps_per_peer must be > 0, got {qps_per_peer}")
        self.engine = engine
        self.clock = clock
        self._swept = clock()
        self.handshake = handshake
        self.node_id = node_id
        self.qps_per_peer = qps_per_peer
        self._conns: dict[tuple[str, int, int], _Conn] = {}  # (peer, our NIC, QP index)
        self._lock = threading.Lock()
        # One handshake at a time: two pulls setting up the same QP would each make one, and
        # the peer keeps one per QP index.
        self._setup = threading.Lock()

    def qps(self, peer: str | None = None) -> int:
        """Queue pairs open (to ``peer``, or to every peer)."""
        with self._lock:
            return sum(1 for k in self._conns if peer is None or k[0] == peer)

    def _conn(self, peer: str, i: int, j: int, peer_nics: int) -> _Conn:
        key = (peer, i, j)
        with self._lock:
            c = self._conns.get(key)
            if c is not None:
                c.used = self.clock()
                return c
        with self._setup:
            with self._lock:
                c = self._conns.get(key)
                if c is not None:
                    c.used = self.clock()
            return c if c is not None else self._connect(key, peer_nics)

    def _connect(self, key: tuple[str, int, int], peer_nics: int) -> _Conn:
        peer, i, j = key
        nic = self.engine.nics[i]
        peer_nic = i % peer_nics
        try:
            qp, cq = nic.new_qp()
        except Exception as exc:  # a verbs error (ENOMEM once locked memory is used up, ...)
            raise TransferError(f"cannot create an RDMA queue pair on {nic.name}: {exc}") from exc
        psn = random.randrange(1 << 24)
        try:
            resp = self.handshake(peer, peer_pb2.RdmaConnectRequest(
                puller=self.node_id, nic_index=peer_nic, endpoint=nic.endpoint(qp, psn), qp_index=j))
            nic.connect(qp, psn, resp.endpoint)
        except Exception as exc:
            _close(qp, cq)
            raise TransferError(f"RDMA handshake with {peer} failed: {exc}") from exc
        c = _Conn(qp, cq, nic, peer_nic, self.clock())
        with self._lock:
            self._conns[key] = c
        return c

    def read(self, remote: RemotePages, dests: Sequence[int]) -> list[int | None]:
        """One READ per page into ``dests`` (all complete or TransferError); then, per page,
        the pin's checksum if the page matches it, else None."""
        n = len(dests)
        if n != remote.count:
            raise ValueError(f"{n} destinations for {remote.count} pages")
        if n == 0:
            return []
        if not remote.rkeys or len(remote.checksums) != n:
            raise TransferError("peer returned no RDMA keys or no checksums")
        k = len(self.engine.nics)
        self._close_idle()
        try:
            self._read_pages(remote, dests, [list(range(i, n, k)) for i in range(k)])
        except TransferError:
            self.forget(remote.peer)  # the peer likely died: every QP to it is suspect
            raise
        view, size = self.engine.view, remote.page_bytes
        return [c if page_checksum(view[o:o + size]) == c else None
                for o, c in zip(dests, remote.checksums, strict=True)]

    def _read_pages(self, remote: RemotePages, dests: Sequence[int], stripes: list[list[int]]) -> None:
        """Each NIC's pages (``stripes``, by NIC), dealt round-robin over its QPs to the peer:
        every QP gets its READs (up to ``MAX_OUTSTANDING`` in flight) before any CQ is
        polled, so all NICs transfer at once."""
        jobs: list[tuple[_Conn, list[int]]] = []
        for i, pages in enumerate(stripes):
            q = min(self.qps_per_peer, len(pages))
            jobs += [(self._conn(remote.peer, i, j, len(remote.rkeys)), pages[j::q]) for j in range(q)]
        v, e = self.engine.verbs, self.engine.verbs.e
        base, size = self.engine.base, remote.page_bytes
        for c, _ in jobs:  # always in (NIC, QP) order: two pulls cannot deadlock
            c.lock.acquire()
        try:
            posted = [0] * len(jobs)
            done = [0] * len(jobs)
            last = time.monotonic()
            idle = 0  # sweeps in a row that found no completion
            while any(done[j] < len(part) for j, (_, part) in enumerate(jobs)):
                for j, (c, part) in enumerate(jobs):
                    rkey, lkey = remote.rkeys[c.peer_nic], c.nic.mr.lkey
                    while posted[j] < len(part) and posted[j] - done[j] < MAX_OUTSTANDING:
                        i = part[posted[j]]
                        sge = v.SGE(base + dests[i], size, lkey)
                        wr = v.SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge],
                                      send_flags=e.IBV_SEND_SIGNALED)
                        wr.set_wr_rdma(rkey, remote.rdma_base + remote.offsets[i])
                        try:
                            c.qp.post_send(wr)  # the NIC's queue holds a copy from here on
                        finally:
                            # pyverbs 44-63 never free these (their destructor is misspelt
                            # __dealloc): 61 MiB per million READs unless closed, once each.
                            wr.close()
                            sge.close()
                        posted[j] += 1
                progress = False
                for j, (c, part) in enumerate(jobs):
                    if done[j] == len(part):
                        continue
                    npolled, wcs = c.cq.poll(CQ_BATCH)
                    if npolled:
                        for wc in wcs[:npolled]:
                            if wc.status != e.IBV_WC_SUCCESS:
                                raise TransferError(f"RDMA READ of page {wc.wr_id} failed: status {wc.status}")
                        done[j] += npolled
                        progress = True
                if progress:
                    last = time.monotonic()
                    idle = 0
                elif time.monotonic() - last > POLL_TIMEOUT:
                    raise TransferError(f"no RDMA completion for {POLL_TIMEOUT}s ({sum(done)}/{sum(posted)})")
                else:
                    idle += 1
                    time.sleep(idle_sleep(idle))
        except TransferError:
            raise
        except Exception as exc:  # a verbs error (QP in error state, ...)
            raise TransferError(f"RDMA READ from {remote.peer}: {exc}") from exc
        finally:
            now = self.clock()
            for c, _ in jobs:
                c.used = now
                c.lock.release()

    def _close_idle(self) -> None:
        """Close the QPs no pull took for ``QP_IDLE_S`` (looked for every ``QP_IDLE_S`` / 4
        at most); one a pull holds now is kept."""
        now = self.clock()
        with self._lock:
            if now - self._swept < QP_IDLE_S / 4:
                return
            self._swept = now
            idle = [(k, c) for k, c in self._conns.items() if now - c.used > QP_IDLE_S and c.lock.acquire(blocking=False)]
            for k, _ in idle:
                del self._conns[k]
        for _, c in idle:
            c.lock.release()
            _close(c.qp, c.cq)
        if idle:
            log.info("rdma_idle_qps_closed", qps=len(idle), peers=sorted({k[0] for k, _ in idle}))

    def _drop(self, peer: str, i: int, j: int) -> None:
        with self._lock:
            c = self._conns.pop((peer, i, j), None)
        if c is not None:
            _close(c.qp, c.cq)

    def forget(self, addr: str) -> None:
        """Drop every QP to a peer (it failed); the next pull handshakes again."""
        with self._lock:
            keys = [k for k in self._conns if k[0] == addr]
        for k in keys:
            self._drop(*k)

    def close(self) -> None:
        with self._lock:
            keys = list(self._conns)
        for k in keys:
            self._drop(*k)
