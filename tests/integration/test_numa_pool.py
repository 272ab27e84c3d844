"""The real mbind(2) on this host (one NUMA node): a node binds its pool's one part to
node 0 before the pre-fault, which the kernel then reports in /proc/<pid>/numa_maps
(``bind:0``, the pages on N0); with --disable-numa-affinity it binds nothing. The placement
logic for several nodes is tested against fake topologies in tests/unit/test_numa.py."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from pegaflow.node import numa
from pegaflow.node.pool import SharedPool
from tests.harness.procs import log_events

pytestmark = pytest.mark.integration

MB = 1 << 20


def pool_mapping(pid: int) -> str:
    """The numa_maps line of the node's pool (its memfd ``pegaflow-pool``)."""
    if pid == os.getpid():  # earlier tests' closed clients may still map their nodes' pools
        gc.collect()
    lines = [ln for ln in Path(f"/proc/{pid}/numa_maps").read_text().splitlines() if "memfd:pegaflow-pool" in ln]
    assert len(lines) == 1, lines
    return lines[0]


def events(log: Path, name: str) -> list[dict]:
    return log_events(log.read_text(), name)


def test_a_pool_part_bound_in_process_reads_back_through_get_mempolicy() -> None:
    topo = numa.read_topology()
    node = topo.nodes[0]
    pool = SharedPool(8 * MB)
    try:
        pl = numa.place_pool(pool, False, 4096, topo)
        if not pl.parts:
            pytest.fail("mbind failed on this host (see the pool_numa_bind_failed log line)")
        assert pool.numa_parts == [numa.Part(node, 0, 8 * MB)] == list(pl.parts)
        mode, nodes = numa.get_mempolicy(pool.base + 4 * MB)
        assert (mode, nodes) == (numa.MPOL_BIND, [node])
        pool.prefault()
        assert f"bind:{node}" in pool_mapping_of_self()
    finally:
        pool.close()
    # Unbound: the default policy.
    pool = SharedPool(8 * MB)
    try:
        assert numa.get_mempolicy(pool.base)[0] == 0  # MPOL_DEFAULT
    finally:
        pool.close()


def pool_mapping_of_self() -> str:
    return pool_mapping(os.getpid())


def test_a_bind_that_fails_part_way_leaves_no_part_bound(tmp_path: Path) -> None:
    """A later part's node refused (outside the process's cpuset, or absent): the parts
    bound before it go back to the default policy, so the pool is not half bound."""
    node = numa.read_topology().nodes[0]
    pool = SharedPool(8 * MB)
    try:
        parts = [numa.Part(node, 0, 4 * MB), numa.Part(63, 4 * MB, 4 * MB)]  # no node 63 here
        with pytest.raises(numa.NumaError, match="node 63"):
            pool.bind_numa(parts, nodes_root=str(tmp_path))  # a sysfs that says nothing of free memory
        assert numa.get_mempolicy(pool.base)[0] == numa.MPOL_DEFAULT and pool.numa_parts == []
    finally:
        pool.close()


@pytest.mark.parametrize("huge", [False, True])
def test_a_node_without_the_memory_for_its_part_refuses_the_pool(tmp_path: Path, huge: bool) -> None:
    """Bound to a node that runs out, the pre-fault would fail there (huge pages) or the OOM
    killer end a process: the pool is refused at start, naming the node, before any bind."""
    from pegaflow.node.pool import PoolError

    pool = SharedPool(8 * MB)
    try:
        hp = 2 * MB
        if huge:  # as a --use-hugepages pool (none may be reserved here): what bind_numa reads of it
            pool.use_hugepages, pool.page_size = True, hp
        for n, free in ((0, 64 * MB), (1, 3 * MB)):
            d = tmp_path / f"node{n}"
            (d / "hugepages" / "hugepages-2048kB").mkdir(parents=True)
            (d / "hugepages" / "hugepages-2048kB" / "free_hugepages").write_text(f"{free // hp}\n")
            (d / "meminfo").write_text(f"Node {n} MemTotal: 99999999 kB\nNode {n} MemFree: {free >> 11} kB\n"
                                       f"Node {n} FilePages: {free >> 11} kB\n")
        with pytest.raises(PoolError, match="NUMA node 1 has") as exc:
            pool.bind_numa([numa.Part(0, 0, 4 * MB), numa.Part(1, 4 * MB, 4 * MB)], nodes_root=str(tmp_path))
        assert ("nr_hugepages" in str(exc.value)) == huge and "\n" not in str(exc.value)
        assert numa.get_mempolicy(pool.base)[0] == numa.MPOL_DEFAULT and pool.numa_parts == []
    finally:
        pool.close()


def test_node_binds_its_pool_to_its_numa_node_unless_disabled(node_factory) -> None:
    node = numa.read_topology().nodes[0]
    n = node_factory(pool_size="64mb")
    line = pool_mapping(n.proc.pid)
    assert f"bind:{node}" in line, line
    # Every pre-faulted page is on that node (N<node>=<pages>, nothing elsewhere).
    counts = {f: int(v) for f, v in (x.split("=") for x in line.split() if x[:1] == "N" and "=" in x)}
    assert set(counts) == {f"N{node}"} and counts[f"N{node}"] * 4096 >= 64 * MB, line
    (ev,) = events(n.log_path, "pool_numa_parts")
    assert ev["parts"] == [{"node": node, "start": 0, "bytes": 64 * MB}]

    off = node_factory(pool_size="64mb", extra=["--disable-numa-affinity"])
    line = pool_mapping(off.proc.pid)
    assert "bind:" not in line and "default" in line, line
    assert events(off.log_path, "pool_numa_affinity_off") and not events(off.log_path, "pool_numa_parts")
