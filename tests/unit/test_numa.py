"""NUMA placement (pegaflow/node/numa.py) against FAKE multi-node topologies: sysfs trees
written under tmp_path, and Topology objects built by hand. The real mbind on this host is
tested in tests/integration/test_numa_pool.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pegaflow.core.allocator import ExtentAllocator, OutOfSpace
from pegaflow.node import numa
from pegaflow.node.numa import NumaAllocator, Part, Topology, parse_cpulist, plan_parts

MB = 1 << 20


def fake_sysfs(root: Path, nodes: dict[int, str], distance: dict[int, str], possible: str = "") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    ids = ",".join(str(n) for n in nodes)
    (root / "has_memory").write_text(ids + "\n")
    (root / "online").write_text(ids + "\n")
    (root / "possible").write_text((possible or ids) + "\n")
    for n, cpus in nodes.items():
        d = root / f"node{n}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
        (d / "distance").write_text(distance[n] + "\n")
    return root


# A 4-socket host: nodes 0-3, 0<->1 and 2<->3 close (21), across 31.
FOUR = {0: "0-7,32-39", 1: "8-15,40-47", 2: "16-23,48-55", 3: "24-31,56-63"}
FOUR_DIST = {0: "10 21 31 31", 1: "21 10 31 31", 2: "31 31 10 21", 3: "31 31 21 10"}


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == frozenset()


def test_read_topology_of_a_fake_four_node_host(tmp_path: Path) -> None:
    t = numa.read_topology(str(fake_sysfs(tmp_path / "node", FOUR, FOUR_DIST)))
    assert t.nodes == (0, 1, 2, 3) and t.multi
    assert t.cpus[2] == set(range(16, 24)) | set(range(48, 56))
    assert t.distance[0] == {0: 10, 1: 21, 2: 31, 3: 31}
    assert t.nearest(2) == [2, 3, 0, 1]
    assert t.nearest(1) == [1, 0, 2, 3]


def test_memoryless_nodes_get_no_part(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path / "node", {0: "0-3", 1: "4-7"}, {0: "10 20", 1: "20 10"})
    (root / "has_memory").write_text("0\n")  # node 1: CPUs only (e.g. a CXL or HBM layout)
    assert numa.read_topology(str(root)).nodes == (0,)


def test_memory_only_nodes_get_no_part(tmp_path: Path) -> None:
    """A node with memory and no CPUs is CXL memory or, on a Grace host, a GPU's memory."""
    root = fake_sysfs(tmp_path / "node", {0: "0-3", 1: "4-7", 2: ""}, {0: "10 20 40", 1: "20 10 40", 2: "40 40 10"})
    assert numa.read_topology(str(root)).nodes == (0, 1, 2)  # no has_cpu: an older kernel says nothing
    (root / "has_cpu").write_text("0-1\n")
    assert numa.read_topology(str(root)).nodes == (0, 1)


def test_a_host_without_sysfs_nodes_is_one_node(tmp_path: Path) -> None:
    t = numa.read_topology(str(tmp_path / "absent"))
    assert t.nodes == (0,) and not t.multi


def test_this_hosts_topology_reads() -> None:
    t = numa.read_topology()
    assert t.nodes and all(n >= 0 for n in t.nodes)


def test_split_sizes_are_aligned_and_cover_the_pool() -> None:
    parts = plan_parts(1000 * MB + 3 * 4096, [0, 1, 2], 2 * MB)
    assert [p.node for p in parts] == [0, 1, 2]
    assert all(p.start % (2 * MB) == 0 for p in parts)
    assert parts[0].size == parts[1].size == 332 * MB  # floor(1000/3) rounded down to 2 MiB
    assert parts[2].start + parts[2].size == 1000 * MB + 3 * 4096  # the last takes the remainder
    assert [p.start for p in parts] == [0, 332 * MB, 664 * MB]
    # A pool too small to split: one part on the first node.
    assert plan_parts(MB, [0, 1], 2 * MB) == [Part(0, 0, MB)]
    with pytest.raises(ValueError):
        plan_parts(MB, [], 4096)


def test_engine_node_from_cpu_affinity_and_pci(tmp_path: Path) -> None:
    t = numa.read_topology(str(fake_sysfs(tmp_path / "node", FOUR, FOUR_DIST)))
    assert t.node_of_cpus(range(8, 16)) == 1  # taskset -c 8-15
    assert t.node_of_cpus([16, 17, 18, 24]) == 2  # mostly node 2
    assert t.node_of_cpus(range(64)) is None  # every CPU: no node of its own
    assert t.node_of_cpus([0, 8]) is None  # a tie
    # /proc/<pid>/status of a pinned engine
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "status").write_text("Name:\tpython\nCpus_allowed_list:\t48-55\n")
    assert numa.node_of_pid(t, 4242, str(proc)) == 2
    assert numa.node_of_pid(t, 1, str(proc)) is None  # gone
    # the GPU's PCI device
    pci = tmp_path / "pci"
    (pci / "0000:3b:00.0").mkdir(parents=True)
    (pci / "0000:3b:00.0" / "numa_node").write_text("3\n")
    (pci / "0000:af:00.0").mkdir()
    (pci / "0000:af:00.0" / "numa_node").write_text("-1\n")  # the firmware does not say
    assert numa.node_of_pci("0000:3B:00.0", str(pci)) == 3
    assert numa.node_of_pci("0000:af:00.0", str(pci)) is None
    assert numa.node_of_pci("0000:00:00.0", str(pci)) is None


def four_node_allocator(part: int = 8 * MB) -> NumaAllocator:
    t = Topology((0, 1, 2, 3), distance={n: dict(zip(range(4), map(int, d.split()), strict=True))
                                         for n, d in FOUR_DIST.items()})
    return NumaAllocator(plan_parts(4 * part, t.nodes, 2 * MB), t, 4096)


def test_an_engines_pages_come_from_its_own_nodes_part() -> None:
    a = four_node_allocator()
    assert a.capacity == 32 * MB and a.free_bytes == 32 * MB
    for node in (2, 0, 3, 1):
        with a.prefer(node):
            offs = [a.alloc(64 << 10) for _ in range(10)]
        assert {a.part_of(o).node for o in offs} == {node}
    assert a.spilled == 0
    assert [u for _, u, _ in a.part_used()] == [640 << 10] * 4
    assert a.used_bytes == 4 * (640 << 10)
    # Outside prefer(): no preference.
    assert a.preferred is None


def test_a_full_part_spills_to_the_nearest_part_then_the_rest() -> None:
    a = four_node_allocator(part=2 * MB)
    with a.prefer(2):
        own = [a.alloc(MB) for _ in range(2)]
        near = [a.alloc(MB) for _ in range(2)]  # node 2 is full: node 3 (distance 21)
        far = a.alloc(MB)  # then 0 and 1 (31), by number
    assert {a.part_of(o).node for o in own} == {2}
    assert {a.part_of(o).node for o in near} == {3}
    assert a.part_of(far).node == 0
    assert a.spilled == 3
    a.free(own[0], MB)  # freed pages go back to their own part
    with a.prefer(2):
        assert a.part_of(a.alloc(MB)).node == 2
    with a.prefer(1):
        a.alloc(MB), a.alloc(MB), a.alloc(MB)  # its own two, then what node 0 has left
    with pytest.raises(OutOfSpace), a.prefer(0):
        a.alloc(MB)


def test_the_allocator_grows_with_the_prefault_front_to_back() -> None:
    t = Topology((0, 1))
    a = NumaAllocator(plan_parts(8 * MB, t.nodes, 2 * MB), t, 4096, usable=0)
    assert a.free_bytes == 0
    a.extend(6 * MB)  # part 0 whole, part 1 half
    assert [(n, c) for n, _, c in a.part_used()] == [(0, 4 * MB), (1, 4 * MB)]
    assert a.free_bytes == 6 * MB
    with a.prefer(1):
        o = a.alloc(2 * MB)
        assert a.part_of(o).node == 1 and o == 4 * MB
        with pytest.raises(OutOfSpace):
            a.alloc(6 * MB)
    a.extend(8 * MB)
    assert a.free_bytes == 6 * MB and a.largest_free() == 4 * MB


def test_placement_binds_each_part_and_falls_back_when_binding_fails() -> None:
    class Pool:
        size = 64 * MB
        page_size = 4096

        def __init__(self, fail: bool = False) -> None:
            self.bound: list[Part] = []
            self.fail = fail

        def bind_numa(self, parts: list[Part]) -> None:
            if self.fail:
                raise numa.NumaError(1, "mbind: Operation not permitted")
            self.bound = list(parts)

    two = Topology((0, 1))
    both = frozenset({0, 1})  # the process may use both (Mems_allowed_list)
    p = Pool()
    pl = numa.place_pool(p, False, 4096, two, both)
    assert [(x.node, x.size) for x in p.bound] == [(0, 32 * MB), (1, 32 * MB)]
    assert isinstance(pl.allocator(p.size, 4096), NumaAllocator)
    # --disable-numa-affinity: nothing bound, one extent allocator as before.
    p = Pool()
    pl = numa.place_pool(p, True, 4096, two, both)
    assert p.bound == [] and pl.parts == ()
    assert isinstance(pl.allocator(p.size, 4096), ExtentAllocator)
    # A host that refuses mbind: the node still starts, unbound.
    pl = numa.place_pool(Pool(fail=True), False, 4096, two, both)
    assert pl.parts == () and isinstance(pl.allocator(64 * MB, 4096), ExtentAllocator)
    # One node: the one part is bound to it, and the allocator is the plain one.
    p = Pool()
    pl = numa.place_pool(p, False, 4096, Topology((0,)))
    assert p.bound == [Part(0, 0, 64 * MB)] and isinstance(pl.allocator(p.size, 4096), ExtentAllocator)


def test_sessions_reserve_an_engines_pages_on_the_node_it_registered_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pegaflow.core.block_index import BlockIndex
    from pegaflow.node.sessions import Sessions

    topo = numa.read_topology(str(fake_sysfs(tmp_path / "node", FOUR, FOUR_DIST)))
    pci = tmp_path / "pci"
    (pci / "0000:3b:00.0").mkdir(parents=True)
    (pci / "0000:3b:00.0" / "numa_node").write_text("3\n")
    alloc = NumaAllocator(plan_parts(32 * MB, topo.nodes, 2 * MB), topo, 4096)
    index = BlockIndex(alloc.capacity, allocator=alloc)
    sessions = Sessions(index, 30.0, 30.0)
    # What Register carries: the CPUs (taskset -c 16-23: node 2), or the GPU's PCI address.
    assert numa.engine_node(alloc, "", list(range(16, 24))) == 2
    assert numa.engine_node(alloc, "", list(range(64))) is None  # every CPU: no node
    assert numa.engine_node(ExtentAllocator(MB), "", [0]) is None  # an unsplit pool: nothing to choose
    orig = numa.node_of_pci
    monkeypatch.setattr(numa, "node_of_pci", lambda bdf, root=str(pci): orig(bdf, root))
    assert numa.engine_node(alloc, "0000:3b:00.0", list(range(16, 24))) == 3  # the GPU wins
    for node in (2, 3, None):
        s = sessions.open(f"engine-{node}", [("m", 64 << 10)])
        s.numa_node = node
        ns = s.namespaces["m"]
        res = sessions.reserve(s, ns, [bytes([node or 0, i]) * 8 for i in range(8)])
        got = {alloc.part_of(b.offset).node for b in res.blocks if b is not None}
        assert got == ({node} if node is not None else {0}), (node, got)
    assert alloc.preferred is None  # the preference ends with the reservation


def test_a_shards_pages_go_to_the_node_of_the_gpu_that_copies_them(tmp_path: Path) -> None:
    """The scheduler side reserves every shard's pages from a process with no GPU; each TP
    rank's worker copies its own shard: its pages belong on that worker's GPU's node."""
    from pegaflow.core.block_index import BlockIndex
    from pegaflow.node.sessions import Sessions

    topo = numa.read_topology(str(fake_sysfs(tmp_path / "node", FOUR, FOUR_DIST)))
    alloc = NumaAllocator(plan_parts(32 * MB, topo.nodes, 2 * MB), topo, 4096)
    sessions = Sessions(BlockIndex(alloc.capacity, allocator=alloc), 30.0, 30.0)
    page = 64 << 10
    for rank, gpu_node in ((0, 1), (1, 3)):  # each rank's worker registers its shard from its GPU
        w = sessions.open(f"engine-rank{rank}", [(f"m|shard={rank}/2", page)])
        w.numa_node = gpu_node
        sessions.writer_node(w)
    sched = sessions.open("engine", [("m|shard=0/2", page), ("m|shard=1/2", page), ("other", page)])
    sched.numa_node = 2  # the engine core's CPUs
    for name, want in (("m|shard=0/2", 1), ("m|shard=1/2", 3), ("other", 2)):
        res = sessions.reserve(sched, sched.namespaces[name], [bytes([want, i]) * 8 for i in range(8)])
        assert {alloc.part_of(b.offset).node for b in res.blocks if b is not None} == {want}, name


def test_distance_rows_have_a_column_per_online_node(tmp_path: Path) -> None:
    """The kernel writes a column per online node, not per possible one."""
    root = fake_sysfs(tmp_path / "node", {0: "0-3", 2: "4-7"}, {0: "10 21", 2: "21 10"}, possible="0-3")
    t = numa.read_topology(str(root))
    assert t.distance[0] == {0: 10, 2: 21} and t.nearest(0) == [0, 2]


def test_a_gpu_address_as_nvidia_smi_writes_it_finds_its_node(tmp_path: Path) -> None:
    pci = tmp_path / "pci"
    (pci / "0000:3b:00.0").mkdir(parents=True)
    (pci / "0000:3b:00.0" / "numa_node").write_text("1\n")
    for bdf in ("0000:3b:00.0", "00000000:3B:00.0", " 0000:3B:00.0\n"):
        assert numa.node_of_pci(bdf, str(pci)) == 1, bdf
    for bdf in ("../3b:00.0", "3b:00.0", "0000:3b:00.0/../../x", ""):
        assert numa.node_of_pci(bdf, str(pci)) is None, bdf


def test_parts_go_to_the_nodes_the_process_may_use_on_huge_page_boundaries() -> None:
    class Pool:
        size = 3 << 30
        page_size = 1 << 30  # --use-hugepages with 1 GiB pages: mbind splits a hugetlb range only there

        def __init__(self) -> None:
            self.bound: list[Part] = []

        def bind_numa(self, parts: list[Part]) -> None:
            self.bound = list(parts)

    two = Topology((0, 1), distance={0: {0: 10, 1: 21}, 1: {0: 21, 1: 10}})
    p = Pool()
    numa.place_pool(p, False, 4096, two, allowed=frozenset({0, 1}))
    assert [(x.node, x.start, x.size) for x in p.bound] == [(0, 0, 1 << 30), (1, 1 << 30, 2 << 30)]
    # A cpuset that allows node 1 only (Mems_allowed_list): the pool is placed there alone.
    p = Pool()
    pl = numa.place_pool(p, False, 4096, two, allowed=frozenset({1}))
    assert p.bound == [Part(1, 0, 3 << 30)] and pl.parts == (Part(1, 0, 3 << 30),)
    # None of the nodes allowed: the kernel's default policy.
    p = Pool()
    assert numa.place_pool(p, False, 4096, two, allowed=frozenset({7})).parts == () and p.bound == []
    assert numa.mems_allowed()  # this process's, read from /proc/self/status


def test_an_engine_on_a_node_without_a_part_takes_the_nearest() -> None:
    t = Topology((0, 1, 2), distance={2: {0: 31, 1: 21, 2: 10}})
    a = NumaAllocator(plan_parts(8 * MB, (0, 1), 2 * MB), t, 4096)  # node 2 not allowed: no part
    with a.prefer(2):
        assert a.part_of(a.alloc(4096)).node == 1
