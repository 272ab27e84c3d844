"""NUMA placement of the L1 pool: one part per NUMA node, each bound to its node's memory.

What the original does (``pegaflow-core``: ``NumaTopology``, ``PinnedAllocator::Numa``),
and what is kept here: unless ``--disable-numa-affinity``, a host with several NUMA nodes
gets one pool part per node, ``pool size / nodes`` each, its memory on that node, and an
engine's pages come from the part of its own node (a GPU's DMA to far memory crosses the
socket interconnect). The original takes the nodes that have a GPU attached (nvidia-smi),
or every CPU node when none is known; here the node holds no GPU (docs/architecture.md),
so the parts are the nodes with memory, and an engine's node is read from what the host
says about it: its GPU's PCI device (``/sys/bus/pci/devices/<bdf>/numa_node``) when known,
else the CPUs it may run on (``/proc/<pid>/status`` ``Cpus_allowed_list``, the node
holding most of them). Differences, on purpose: when an engine's part is full the page
comes from the nearest other part (``distance`` in sysfs) instead of failing, so a busy
socket borrows before it evicts; an engine whose node is unknown takes any part.

Mechanics:

- Topology from ``/sys/devices/system/node`` (:func:`read_topology`); a :class:`Topology`
  can be built by hand, which is how the placement is tested for hosts this one is not.
- :func:`plan_parts` splits ``[0, size)`` into aligned parts, one per node.
- :func:`mbind` binds each part (``MPOL_BIND``, ``MPOL_MF_MOVE``) before the pool is
  pre-faulted, so the first touch already allocates on the right node. It is the raw
  ``mbind(2)`` system call through ``ctypes`` on libc's ``syscall``: libnuma is not
  installed on every host (it is a separate package, with no binding in the standard
  library), the call is a stable kernel ABI, and the pool needs nothing else of libnuma.
  On a shared memfd the policy belongs to the file's range, so every mapping of it (the
  engines' too) gets pages of that node; a hugetlb memfd has no shared policy, so only the
  node's own mapping is bound, which is enough: the node pre-faults every page it hands
  out. :func:`get_mempolicy` reads it back. The parts are planned over the nodes this
  process may allocate on (``Mems_allowed_list``: a cgroup's cpuset), each checked against
  what its node has free (:func:`node_free`: ``MPOL_BIND`` on a node that runs out calls
  the OOM killer, or fails the pre-fault of huge pages) before anything is bound, and a
  bind that fails part-way is undone (``MPOL_DEFAULT`` over the pool).
- :class:`NumaAllocator` is the block index's page allocator over the parts (one
  :class:`~pegaflow.core.allocator.ExtentAllocator` each); :meth:`NumaAllocator.prefer`
  names the node whose part serves the next allocations.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
import platform
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog

from pegaflow.common.memory import meminfo
from pegaflow.core.allocator import ExtentAllocator, OutOfSpace

log = structlog.get_logger("pegaflow.numa")

HUGE_PAGE = 2 << 20  # parts start on huge-page boundaries at least (mbind splits a hugetlb range only there)
SYSFS_NODES = "/sys/devices/system/node"
SYSFS_PCI = "/sys/bus/pci/devices"
MPOL_DEFAULT = 0
MPOL_BIND = 2
MPOL_MF_MOVE = 1 << 1
MPOL_F_ADDR = 1 << 1
# (mbind, get_mempolicy) system call numbers.
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}
_ULONG_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)


class NumaError(OSError):
    """A NUMA system call failed (errno and a one-line reason)."""


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` (sysfs and ``Cpus_allowed_list``) as a set of CPU numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


@dataclass(frozen=True)
class Topology:
    """NUMA nodes with memory, their CPUs and their distances (``distance[a][b]``)."""

    nodes: tuple[int, ...]
    cpus: dict[int, frozenset[int]] = field(default_factory=dict)
    distance: dict[int, dict[int, int]] = field(default_factory=dict)

    @property
    def multi(self) -> bool:
        return len(self.nodes) > 1

    def node_of_cpus(self, cpus: Sequence[int] | frozenset[int]) -> int | None:
        """The node holding most of ``cpus`` (an engine's affinity); None on a tie or none."""
        counts = sorted(((len(self.cpus.get(n, frozenset()) & set(cpus)), n) for n in self.nodes), reverse=True)
        if not counts or counts[0][0] == 0 or (len(counts) > 1 and counts[1][0] == counts[0][0]):
            return None
        return counts[0][1]

    def nearest(self, node: int) -> list[int]:
        """Every node, ``node`` first, then by distance from it (ties by number)."""
        d = self.distance.get(node, {})
        return sorted(self.nodes, key=lambda n: (n != node, d.get(n, 1 << 30), n))


def read_topology(root: str = SYSFS_NODES) -> Topology:
    """The host's nodes that have memory (``has_memory``, else ``online``) and CPUs
    (``has_cpu``: not a memory-only node, CXL memory or a Grace host's GPU memory), with
    their CPUs and distances. A host without the directory is one node, 0."""
    base = Path(root)
    try:
        listed = (base / "has_memory").read_text() if (base / "has_memory").exists() else (base / "online").read_text()
    except OSError:
        return Topology((0,))
    found = parse_cpulist(listed)
    with contextlib.suppress(OSError):
        found &= parse_cpulist((base / "has_cpu").read_text()) or found
    nodes = tuple(sorted(found)) or (0,)
    cpus: dict[int, frozenset[int]] = {}
    distance: dict[int, dict[int, int]] = {}
    # A distance row has a column per online node (the kernel's node_read_distance).
    every = sorted(parse_cpulist((base / "online").read_text())) if (base / "online").exists() else list(nodes)
    for n in nodes:
        d = base / f"node{n}"
        with contextlib.suppress(OSError):
            cpus[n] = parse_cpulist((d / "cpulist").read_text())
        with contextlib.suppress(OSError, ValueError):
            row = [int(x) for x in (d / "distance").read_text().split()]
            distance[n] = dict(zip(every, row, strict=False))
    return Topology(nodes, cpus, distance)


_BDF = re.compile(r"([0-9a-f]{1,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")


def node_of_pci(bdf: str, root: str = SYSFS_PCI) -> int | None:
    """The NUMA node of PCI device ``bdf`` (CUDA's ``0000:3b:00.0``, nvidia-smi's
    ``00000000:3B:00.0``: sysfs names it with a 4-digit domain, lower case); None when the
    firmware does not say (-1), there is none, or ``bdf`` is not a PCI address."""
    m = _BDF.fullmatch(bdf.strip().lower())
    if m is None:
        return None
    domain, bus, slot, fn = m.groups()
    try:
        v = int((Path(root) / f"{int(domain, 16):04x}:{bus}:{slot}.{fn}" / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return v if v >= 0 else None


def mems_allowed(proc: str = "/proc") -> frozenset[int]:
    """The NUMA nodes this process may allocate on (``Mems_allowed_list``: its cgroup's
    cpuset, e.g. a Kubernetes topology manager's or systemd's ``AllowedMemoryNodes``);
    empty when unknown."""
    return _status_list(f"{proc}/self/status", "Mems_allowed_list")


def _status_list(path: str, key: str) -> frozenset[int]:
    """A list field (``0-3,8``) of a ``/proc/<pid>/status`` file; empty when there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return parse_cpulist(line.split(":", 1)[1])
    except OSError:
        pass
    return frozenset()


def node_free(node: int, huge_page: int = 0, root: str = SYSFS_NODES) -> int | None:
    """Bytes node ``node`` can still give the pool: its free huge pages of ``huge_page``
    bytes, or (``huge_page`` 0) its free memory and page cache (``nodeN/meminfo`` MemFree +
    FilePages, generous: what the kernel could reclaim); None when sysfs does not say."""
    d = Path(root) / f"node{node}"
    try:
        if huge_page:
            return int((d / "hugepages" / f"hugepages-{huge_page >> 10}kB" / "free_hugepages").read_text()) * huge_page
        fields = meminfo(str(d / "meminfo"))
        return fields["MemFree"] + fields.get("FilePages", 0)
    except (OSError, ValueError, KeyError):
        return None


def cpus_allowed(pid: int, proc: str = "/proc") -> frozenset[int]:
    """The CPUs ``pid`` may run on (empty when it is gone)."""
    return _status_list(f"{proc}/{pid}/status", "Cpus_allowed_list")


def node_of_pid(topo: Topology, pid: int, proc: str = "/proc") -> int | None:
    """An engine process's node from its CPU affinity (None when it spans nodes evenly)."""
    return topo.node_of_cpus(cpus_allowed(pid, proc))


@dataclass(frozen=True)
class Part:
    node: int
    start: int
    size: int


def plan_parts(size: int, nodes: Sequence[int], align: int) -> list[Part]:
    """``[0, size)`` split into one part per node, each a multiple of ``align`` (the last
    takes the remainder). Nodes whose share would be empty get no part."""
    if not nodes:
        raise ValueError("no NUMA node to place the pool on")
    share = size // len(nodes) // align * align
    if share == 0:
        return [Part(nodes[0], 0, size)]
    parts = [Part(n, i * share, share) for i, n in enumerate(nodes)]
    last = parts[-1]
    parts[-1] = Part(last.node, last.start, size - last.start)
    return parts


# ---- system calls -----------------------------------------------------------------------

def _syscalls() -> tuple[int, int]:
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        raise NumaError(0, f"mbind: no system call number known for {platform.machine()}")
    return nums


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _mask(nodes: Sequence[int]) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    words = max(nodes) // _ULONG_BITS + 1
    arr = (ctypes.c_ulong * words)()
    for n in nodes:
        arr[n // _ULONG_BITS] |= 1 << (n % _ULONG_BITS)
    return arr, words * _ULONG_BITS + 1  # maxnode: the kernel counts one bit less


def mbind(addr: int, length: int, node: int | None) -> None:
    """Bind ``[addr, addr + length)`` (page-aligned) to ``node`` (MPOL_BIND, moving pages
    already faulted elsewhere); ``node`` None: back to the default policy (MPOL_DEFAULT).
    Raises :class:`NumaError`."""
    nr_mbind, _ = _syscalls()
    if node is None:
        mode, mask, maxnode, flags = MPOL_DEFAULT, None, 0, 0
    else:
        (mask, maxnode), mode, flags = _mask([node]), MPOL_BIND, MPOL_MF_MOVE
    r = _libc.syscall(ctypes.c_long(nr_mbind), ctypes.c_void_p(addr), ctypes.c_ulong(length),
                      ctypes.c_int(mode), mask, ctypes.c_ulong(maxnode), ctypes.c_uint(flags))
    if r != 0:
        err = ctypes.get_errno()
        where = "the default policy" if node is None else f"NUMA node {node}"
        raise NumaError(err, f"mbind of {length} bytes to {where}: {os.strerror(err)}")


def get_mempolicy(addr: int, max_nodes: int = 1024) -> tuple[int, list[int]]:
    """(mode, nodes) of the policy covering ``addr``."""
    _, nr_get = _syscalls()
    mode = ctypes.c_int(-1)
    mask, maxnode = _mask([max_nodes - 1])
    for i in range(len(mask)):
        mask[i] = 0
    r = _libc.syscall(ctypes.c_long(nr_get), ctypes.byref(mode), mask, ctypes.c_ulong(maxnode),
                      ctypes.c_void_p(addr), ctypes.c_ulong(MPOL_F_ADDR))
    if r != 0:
        err = ctypes.get_errno()
        raise NumaError(err, f"get_mempolicy: {os.strerror(err)}")
    nodes = [w * _ULONG_BITS + b for w in range(len(mask)) for b in range(_ULONG_BITS) if mask[w] >> b & 1]
    return mode.value, nodes


# ---- the allocator over the parts -------------------------------------------------------

class NumaAllocator:
    """The block index's page allocator (``PageAllocator``) over one extent allocator per
    part. Offsets are the pool's; :meth:`prefer` chooses whose part serves allocations,
    the nearest others taking over when it is full (:attr:`spilled` counts those pages).

    Event loop only, like the index that calls it."""

    def __init__(self, parts: Sequence[Part], topo: Topology, align: int = 4096, usable: int | None = None) -> None:
        if not parts:
            raise ValueError("no parts")
        self.parts = list(parts)
        self.topo = topo
        self.align = align
        self._starts = [p.start for p in self.parts]
        self._allocs = [ExtentAllocator(p.size, align, usable=0) for p in self.parts]
        self.capacity = sum(a.capacity for a in self._allocs)
        self._by_node = {p.node: i for i, p in enumerate(self.parts)}
        self._orders: dict[int | None, list[int]] = {None: list(range(len(self.parts)))}
        for n in {*topo.nodes, *self._by_node}:  # a node without a part (not allowed) takes the nearest
            self._orders[n] = [self._by_node[m] for m in topo.nearest(n) if m in self._by_node]
        self._order = self._orders[None]
        self.preferred: int | None = None
        self.spilled = 0
        self.extend(self.capacity if usable is None else usable)

    @property
    def free_bytes(self) -> int:
        return sum(a.free_bytes for a in self._allocs)

    @property
    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self._allocs)

    def part_used(self) -> list[tuple[int, int, int]]:
        """(node, used bytes, capacity) per part."""
        return [(p.node, a.used_bytes, a.capacity) for p, a in zip(self.parts, self._allocs, strict=True)]

    def round(self, size: int) -> int:
        return self._allocs[0].round(size)

    @contextlib.contextmanager
    def prefer(self, node: int | None) -> Iterator[None]:
        """Allocate from ``node``'s part (then the nearest) within the block; None: any."""
        saved = self.preferred, self._order
        self.preferred, self._order = node, self._orders.get(node, self._orders[None])
        try:
            yield
        finally:
            self.preferred, self._order = saved

    def alloc(self, size: int) -> int:
        need = self.round(size)
        for k, i in enumerate(self._order):
            a = self._allocs[i]
            if a.free_bytes < need:
                continue
            try:
                off = a.alloc(size)
            except OutOfSpace:
                continue
            if k and self.preferred is not None:
                self.spilled += 1
            return self._starts[i] + off
        raise OutOfSpace(need)

    def free(self, offset: int, size: int) -> None:
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            raise ValueError(f"bad extent to free: offset={offset} size={size}")
        self._allocs[i].free(offset - self._starts[i], size)

    def part_of(self, offset: int) -> Part:
        return self.parts[bisect.bisect_right(self._starts, offset) - 1]

    def extend(self, usable: int) -> int:
        """Make ``[0, usable)`` of the pool allocatable (pre-faulted front to back)."""
        return sum(a.extend(max(0, min(p.size, usable - p.start)))
                   for p, a in zip(self.parts, self._allocs, strict=True))

    def largest_free(self) -> int:
        return max(a.largest_free() for a in self._allocs)


# ---- the node's pool ---------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """How the node's pool was placed: the topology read and the parts bound (none: the
    kernel's default policy, with ``--disable-numa-affinity`` or when binding failed)."""

    topo: Topology
    parts: tuple[Part, ...]

    def allocator(self, size: int, align: int, usable: int = 0) -> NumaAllocator | ExtentAllocator:
        """The index's allocator: per part with several parts, else one extent allocator."""
        if len(self.parts) > 1:
            return NumaAllocator(self.parts, self.topo, align, usable=usable)
        return ExtentAllocator(size, align, usable=usable)


class _Bindable(Protocol):
    size: int
    page_size: int  # the pool's pages (a huge page with --use-hugepages)

    def bind_numa(self, parts: Sequence[Part]) -> None: ...


def place_pool(pool: _Bindable, disabled: bool, align: int, topo: Topology | None = None,
               allowed: frozenset[int] | None = None) -> Placement:
    """Split ``pool`` over the host's NUMA nodes this process may use (``allowed``, read
    from ``Mems_allowed_list`` when None) and bind each part (the node's start-up, before
    the pre-fault). On a one-node host the one part is bound to that node. A failed bind (a
    container without CAP_SYS_NICE under Docker's seccomp profile, a kernel without NUMA)
    is logged and leaves the kernel's default policy: the node still starts. A node without
    the memory for its part is the pool's to refuse (``bind_numa``)."""
    topo = topo if topo is not None else read_topology()
    if disabled:
        log.info("pool_numa_affinity_off", nodes=list(topo.nodes))
        return Placement(topo, ())
    allowed = mems_allowed() if allowed is None else allowed
    nodes = [n for n in topo.nodes if n in allowed] if allowed else list(topo.nodes)
    if not nodes:
        log.warning("pool_numa_no_allowed_node", nodes=list(topo.nodes), allowed=sorted(allowed),
                    fallback="the kernel's default memory policy")
        return Placement(topo, ())
    parts = plan_parts(pool.size, nodes, max(align, HUGE_PAGE, pool.page_size))
    try:
        pool.bind_numa(parts)
    except NumaError as exc:
        log.warning("pool_numa_bind_failed", error=str(exc), fallback="the kernel's default memory policy")
        return Placement(topo, ())
    log.info("pool_numa_parts", parts=[{"node": p.node, "start": p.start, "bytes": p.size} for p in parts])
    return Placement(topo, tuple(parts))


def engine_node(alloc: object, pci_bus_id: str, cpus: Sequence[int]) -> int | None:
    """An engine's NUMA node from what it sent at Register (``pci_bus_id``, ``cpu_affinity``):
    its GPU's node when the PCI device says, else the node of its CPUs; None when the pool
    is not split (nothing to choose) or neither tells."""
    if not isinstance(alloc, NumaAllocator):
        return None
    node = node_of_pci(pci_bus_id) if pci_bus_id else None
    if node is None and cpus:
        node = alloc.topo.node_of_cpus(cpus)
    return node if node in alloc.topo.nodes else None


def prefer_node(alloc: object, node: int | None) -> contextlib.AbstractContextManager[None]:
    """``alloc.prefer(node)`` for a split pool; nothing otherwise."""
    if node is None or not isinstance(alloc, NumaAllocator):
        return contextlib.nullcontext()
    return alloc.prefer(node)
