"""The node's local fast path (Unix socket beside gRPC) against real `pegaflow-node` processes."""

from __future__ import annotations

import gc
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from pegaflow._proto import node_pb2, node_pb2_grpc
from pegaflow.client import NodeError, NodeUnavailable, PegaClient
from pegaflow.common.local_wire import HELLO, METHOD_IDS, NO_REPLY, REPLY_HEADER, REQUEST_HEADER
from pegaflow.common.security import Security, sync_channel, token_for_socket
from tests.harness.procs import python_env
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PAGE = 8192


def hashes(tag: str, n: int) -> list[bytes]:
    import xxhash

    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def rpc_counts(node, transport: str) -> dict[tuple[str, str], float]:
    """``(method, status) -> calls`` of the node's RPC histogram for one transport."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/metrics", timeout=5).read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in body.splitlines():
        if line.startswith("pegaflow_node_rpc_duration_seconds_count{") and f'transport="{transport}"' in line:
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["method"].strip('"'), labels["status"].strip('"'))] = float(line.split(" ")[1])
    return out


class RawLocal:
    """A hand-framed connection to the node's socket, to send what a client would not."""

    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        self.s.connect(path)
        token = token_for_socket(path).encode()  # the node's own token: the first frame
        if token:
            self.send(HELLO, token)
            assert self.reply()[0] == grpc.StatusCode.OK

    def send(self, method: str | int, payload: bytes, flags: int = 0, length: int | None = None) -> None:
        mid = METHOD_IDS[method] if isinstance(method, str) else method
        self.s.sendall(REQUEST_HEADER.pack(len(payload) if length is None else length, mid, flags) + payload)

    def reply(self) -> tuple[grpc.StatusCode, bytes]:
        head = self._exactly(REPLY_HEADER.size)
        n, status = REPLY_HEADER.unpack(head)
        return {c.value[0]: c for c in grpc.StatusCode}[status], self._exactly(n)

    def call(self, method: str, request) -> tuple[grpc.StatusCode, bytes]:  # type: ignore[no-untyped-def]
        self.send(method, request.SerializeToString())
        return self.reply()

    def closed_by_node(self) -> bool:
        return self.s.recv(1) == b""

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            assert chunk, "node closed the connection"
            buf += chunk
        return buf

    def close(self) -> None:
        self.s.close()


@pytest.fixture(scope="module")
def raw_node(module_node_factory):
    """One node (--max-batch 64) and a gRPC session holding two committed blocks, shared by
    the tests below: each sends what a client would not over a connection of its own, then
    checks the answer and that nothing changed; counts are read as differences."""
    n = module_node_factory(extra=["--max-batch", "64"])
    ch = sync_channel(n.addr, Security())
    stub = node_pb2_grpc.PegaNodeStub(ch)
    reg = stub.Register(node_pb2.RegisterRequest(
        instance_id="raw", namespaces=[node_pb2.NamespaceSpec(name="ns", page_bytes=PAGE)]))
    sid = reg.session_id
    r = stub.Reserve(node_pb2.ReserveRequest(session_id=sid, namespace="ns", hashes=hashes("keep", 2)))
    stub.Commit(node_pb2.CommitRequest(session_id=sid, reservation_id=r.reservation_id))
    assert reg.local_socket == n.local_socket
    yield n, stub, sid
    ch.close()


@pytest.fixture
def raw(raw_node):
    """The shared node, its session, and a raw socket of this test's own."""
    n, stub, sid = raw_node
    link = RawLocal(n.local_socket)
    yield n, stub, sid, link
    link.close()


def assert_unchanged(stub, sid: int) -> None:  # type: ignore[no-untyped-def]
    q = stub.Query(node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("keep", 2)))
    assert q.hit_blocks == 2
    st = stub.Stats(node_pb2.StatsRequest())
    assert st.resident_blocks == 2 and st.active_reservations == 0 and st.active_leases == 0


def test_client_uses_the_local_socket_and_the_node_counts_it_by_transport(node):
    with PegaClient(node.addr) as c:
        c.register({"m": PAGE})
        assert c.transport == "local"
        hs = hashes("fast", 8)
        r = c.reserve("m", hs)
        assert c.commit(r.reservation_id) == 8
        q = c.query(["m"], hs)
        assert (q.status, q.hit_blocks, q.epoch) == ("READY", 8, c.epoch) and q.pool is not None
        c.release(q.lease_id)
        assert c.stats().active_leases == 0
    local, grpc_ = rpc_counts(node, "local"), rpc_counts(node, "grpc")
    for method in ("Reserve", "Commit", "Query", "Release"):
        assert local[(method, "OK")] >= 1, local
        assert (method, "OK") not in grpc_, grpc_
    assert grpc_[("Register", "OK")] == 1 and grpc_[("Stats", "OK")] == 1


def test_socket_is_private_replaces_a_stale_file_and_is_removed_on_shutdown(node_factory):
    n = node_factory(start=False)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a killed node's leftover
    stale.bind(n.local_socket)
    stale.close()
    n.start()
    assert stat.S_IMODE(os.stat(n.local_socket).st_mode) == 0o600
    with PegaClient(n.addr) as c:
        c.register({"m": PAGE})
        assert c.transport == "local" and c.query(["m"], hashes("x", 1)).hit_blocks == 0
    n.stop()
    assert n.proc.returncode == 0
    assert not os.path.exists(n.local_socket)


def test_a_path_served_by_a_live_process_is_a_one_line_startup_error(node, node_factory):
    other = node_factory(start=False, extra=["--local-socket", node.local_socket])
    p = subprocess.run(other.argv(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert "served by another process" in p.stderr.strip().splitlines()[-1] and "Traceback" not in p.stderr
    with PegaClient(node.addr) as c:  # the first node's socket is untouched
        c.register({"m": PAGE})
        assert c.transport == "local" and c.query(["m"], hashes("x", 1)).hit_blocks == 0


@pytest.mark.parametrize("name, method, make, needle", [
    ("unknown namespace", "Query",
     lambda sid: node_pb2.QueryRequest(session_id=sid, namespaces=["nope"], hashes=hashes("x", 1)), "not registered"),
    ("wrong hash length", "Reserve",
     lambda sid: node_pb2.ReserveRequest(session_id=sid, namespace="ns", hashes=[b"short"]), "expected 16"),
    ("oversized batch", "Query",
     lambda sid: node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("b", 65)), "--max-batch"),
    ("unknown reservation", "Commit",
     lambda sid: node_pb2.CommitRequest(session_id=sid, reservation_id=424242), "unknown"),
    ("unknown lease", "Release", lambda sid: node_pb2.ReleaseRequest(session_id=sid, lease_id=99), "unknown lease"),
    ("reset of no namespace", "Reset", lambda sid: node_pb2.ResetRequest(session_id=sid), "at least one namespace"),
    ("reset of another's namespace", "Reset",
     lambda sid: node_pb2.ResetRequest(session_id=sid, namespaces=["nope"]), "not registered"),
])
def test_invalid_requests_over_the_socket_answer_invalid_argument_and_change_nothing(raw, name, method, make, needle):
    n, stub, sid, link = raw
    before = rpc_counts(n, "local").get((method, "INVALID_ARGUMENT"), 0)
    code, body = link.call(method, make(sid))
    assert code is grpc.StatusCode.INVALID_ARGUMENT, name
    assert needle in body.decode()
    code, _ = link.call("Query", node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("keep", 2)))
    assert code is grpc.StatusCode.OK  # the connection stays usable after a rejected request
    assert_unchanged(stub, sid)
    assert rpc_counts(n, "local")[(method, "INVALID_ARGUMENT")] == before + 1


def test_unknown_session_over_the_socket_is_failed_precondition(raw):
    _, _, _, link = raw
    code, body = link.call("Query", node_pb2.QueryRequest(session_id=777, namespaces=["ns"], hashes=hashes("x", 1)))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and body


def test_client_gets_the_same_errors_over_both_transports(node_factory):
    fast = node_factory()
    slow = node_factory(extra=["--local-socket", "off"])
    for n, transport in ((fast, "local"), (slow, "grpc")):
        with PegaClient(n.addr) as c:
            c.register({"m": PAGE})
            assert c.transport == transport
            with pytest.raises(NodeError, match="INVALID_ARGUMENT: .*not registered") as err:
                c.query(["other"], hashes("x", 1))
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(NodeError, match="INVALID_ARGUMENT: .*expected 16"):
                c.reserve("m", [b"short"])
            with pytest.raises(NodeError, match="INVALID_ARGUMENT: .*not registered"):
                c.reset(["other"])
            r = c.reserve("m", hashes("kept-then-reset", 2))
            c.commit(r.reservation_id)
            assert c.reset(["m"]).dropped_blocks == 2
            assert c.query(["m"], hashes("kept-then-reset", 2)).hit_blocks == 0


@pytest.mark.parametrize("name, frame", [
    ("unknown method", lambda link: link.send(99, b"")),
    ("frame too long", lambda link: link.send("Query", b"", length=(64 << 20) + 1)),
    ("undecodable payload", lambda link: link.send("Query", b"\xff\xff\xff\xff garbage")),
    ("truncated frame", lambda link: (link.send("Query", b"\x08", length=100), link.s.shutdown(socket.SHUT_WR))),
])
def test_a_malformed_frame_closes_that_connection_and_the_node_keeps_serving(raw, name, frame):
    n, stub, sid, link = raw
    rejected = n.log().count("local_frame_rejected")
    other = RawLocal(n.local_socket)  # a second engine's connection is not affected
    frame(link)
    assert link.closed_by_node(), name
    code, _ = other.call("Query", node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("keep", 2)))
    assert code is grpc.StatusCode.OK
    other.close()
    assert_unchanged(stub, sid)
    assert n.proc.poll() is None
    assert n.log().count("local_frame_rejected") == rejected + 1


def test_errors_of_no_reply_calls_are_logged_by_the_node(raw):
    n, stub, sid, link = raw
    link.send("Release", node_pb2.ReleaseRequest(session_id=sid, lease_id=4242).SerializeToString(), flags=NO_REPLY)
    code, _ = link.call("Query", node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("keep", 2),
                                                       lease=False))
    assert code is grpc.StatusCode.OK  # no reply was sent for the failed Release: frames stay in step
    assert "local_no_reply_call_failed" in n.log() and "4242" in n.log()


def test_async_commit_and_release_go_over_the_socket_in_order(node):
    with PegaClient(node.addr) as c:
        c.register({"m": PAGE})
        hs = hashes("async", 4)
        r = c.reserve("m", hs)
        assert c.commit(r.reservation_id, wait=False) == -1
        q = c.query(["m"], hs)  # same thread, same socket: served after the commit
        assert q.hit_blocks == 4
        c.release(q.lease_id, wait=False)
        assert c.query(["m"], hs, lease=False).hit_blocks == 4
        assert c.stats().active_leases == 0
    assert rpc_counts(node, "local")[("Release", "OK")] == 1


@pytest.mark.parametrize("socket_on", [True, False], ids=["local", "grpc"])
def test_commits_sent_without_waiting_are_delivered_before_close_ends_the_session(node_factory, socket_on):
    """close() ends the session, and the node drops a session's open reservations: a
    Commit sent with wait=False right before close() must land first (the connector's
    last step before an engine shuts down)."""
    n = node_factory(extra=[] if socket_on else ["--local-socket", "off"])
    pages_per_round = 64
    for rnd in range(20):
        c = PegaClient(n.addr)
        c.register({"m": PAGE})
        assert c.transport == ("local" if socket_on else "grpc")
        hs = hashes(f"close-{rnd}", pages_per_round)
        r = c.reserve("m", hs)
        c.commit(r.reservation_id, wait=False)
        c.close()
        with PegaClient(n.addr) as check:
            check.register({"m": PAGE})
            assert check.query(["m"], hs, lease=False).hit_blocks == pages_per_round, f"round {rnd}"


def test_clients_reconnect_over_the_socket_after_a_node_sigkill_and_restart(node):
    c = PegaClient(node.addr, timeout=2)
    c.register({"m": PAGE})
    hs = hashes("restart", 4)
    r = c.reserve("m", hs)
    c.commit(r.reservation_id)
    epoch = c.epoch
    assert c.transport == "local"
    node.kill(signal.SIGKILL)
    with pytest.raises(NodeUnavailable):
        c.query(["m"], hs)
    node.start()  # replaces the killed node's socket file
    q = c.query(["m"], hs)  # registers again transparently, maps the new pool, reconnects the socket
    assert q.hit_blocks == 0 and q.epoch == c.epoch != epoch and c.transport == "local"
    r = c.reserve("m", hs)
    assert c.commit(r.reservation_id) == 4
    assert c.query(["m"], hs).hit_blocks == 4
    assert rpc_counts(node, "local")[("Commit", "OK")] == 1
    c.close()


def test_client_falls_back_to_grpc_when_the_socket_is_off_or_gone(node):
    c = PegaClient(node.addr, timeout=2)
    c.register({"m": PAGE})
    assert c.transport == "local"
    node.stop()
    node.extra = ["--local-socket", "off"]
    node.start()
    hs = hashes("fallback", 3)
    try:  # the session stream usually tells the client first; else the dead socket does
        r = c.reserve("m", hs)
    except NodeUnavailable:
        r = c.reserve("m", hs)
    assert c.transport == "grpc"
    assert c.commit(r.reservation_id) == 3
    q = c.query(["m"], hs)
    assert q.hit_blocks == 3
    c.release(q.lease_id)
    c.close()
    grpc_ = rpc_counts(node, "grpc")
    assert grpc_[("Reserve", "OK")] == 1 and grpc_[("Query", "OK")] == 1 and rpc_counts(node, "local") == {}


def test_announced_socket_that_cannot_be_connected_means_grpc(node):
    os.unlink(node.local_socket)  # e.g. an engine on another host, or a path it cannot reach
    with PegaClient(node.addr) as c:
        c.register({"m": PAGE})
        assert c.transport == "grpc"
        assert c.query(["m"], hashes("x", 2)).hit_blocks == 0


def test_several_threads_have_calls_in_flight_on_their_own_sockets(node):
    threads, rounds = 4, 100
    with PegaClient(node.addr) as c:
        c.register({"m": PAGE})
        errors: list[BaseException] = []
        barrier, done = threading.Barrier(threads), threading.Barrier(threads)
        fds: set[int] = set()

        def work(t: int) -> None:
            try:
                barrier.wait()
                for i in range(rounds):
                    hs = hashes(f"t{t}:{i}", 3)
                    r = c.reserve("m", hs)
                    assert all(o >= 0 for o in r.offsets)
                    assert c.commit(r.reservation_id) == 3
                    q = c.query(["m"], hs)
                    assert q.hit_blocks == 3 and q.offsets["m"] == r.offsets
                    c.release(q.lease_id)
                fds.add(c._bound.local._tls.sock.fileno())  # type: ignore[union-attr]
                done.wait()  # all threads alive at once: their sockets are too
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        t0 = time.monotonic()
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errors, errors
        assert time.monotonic() - t0 < 120
        assert len(fds) == threads  # one socket per calling thread
        gc.collect()
        assert c._bound is not None and c._bound.local is not None
        assert len(c._bound.local._socks) == 1  # finished threads' sockets are closed; the registering one stays
        st = c.stats()
        assert st.resident_blocks == threads * rounds * 3 and st.active_leases == 0
    assert rpc_counts(node, "local")[("Query", "OK")] == threads * rounds


def test_a_timed_out_call_drops_its_socket_so_a_late_reply_is_never_read_as_the_next(node):
    c = PegaClient(node.addr, timeout=0.5)
    c.register({"m": PAGE})
    hs = hashes("late", 2)
    r = c.reserve("m", hs)
    c.commit(r.reservation_id)
    node.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(NodeUnavailable):
            c.query(["m"], hs, lease=False)  # its reply comes only after SIGCONT
    finally:
        node.proc.send_signal(signal.SIGCONT)
    other = hashes("other", 3)
    q = c.query(["m"], other, lease=False)  # a fresh socket: this reply, not the late one
    assert (q.hit_blocks, q.offsets["m"]) == (0, [])
    assert c.query(["m"], hs, lease=False).hit_blocks == 2 and c.transport == "local"
    c.close()


def test_close_waits_its_drain_in_all_not_per_thread_for_a_stalled_node(node):
    """close() drained each thread's socket for up to its timeout in turn, holding the lock
    every other thread's call wanted: 14 s for 6 threads' sockets at timeout=2."""
    c = PegaClient(node.addr, timeout=1)
    c.register({"m": PAGE})
    done, queried = threading.Event(), threading.Barrier(7)

    def one() -> None:  # a thread that called once and lives on: its socket stays open
        c.query(["m"], hashes("drain", 1), lease=False)
        queried.wait(10)
        done.wait(30)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    queried.wait(10)
    node.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        c.close()
        took = time.monotonic() - t0
    finally:
        node.proc.send_signal(signal.SIGCONT)
        done.set()
        for t in threads:
            t.join(10)
    assert took < 2.5, f"close() took {took:.1f} s with a 1 s timeout"


def test_frames_sent_back_to_back_in_one_write_are_answered_in_order(raw):
    """A client may pipeline: several frames arrive in one read and each gets its answer,
    in order (a Query that hits, a bad one, a Query that misses)."""
    n, stub, sid, link = raw
    frames = [
        node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("keep", 2), lease=False),
        node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=[b"short"], lease=False),
        node_pb2.QueryRequest(session_id=sid, namespaces=["ns"], hashes=hashes("absent", 3), lease=False),
    ]
    link.s.sendall(b"".join(REQUEST_HEADER.pack(len(p), METHOD_IDS["Query"], 0) + p
                            for p in (f.SerializeToString() for f in frames)))
    replies = [link.reply() for _ in frames]
    assert [code for code, _ in replies] == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK]
    assert [node_pb2.QueryResponse.FromString(replies[i][1]).hit_blocks for i in (0, 2)] == [2, 0]
    assert_unchanged(stub, sid)


REPLACED_AND_CLOSED = r"""
import sys
from pegaflow._proto import node_pb2
from pegaflow.client import ClientClosed, NodeUnavailable, PegaClient
c = PegaClient(sys.argv[1], timeout=5)
c.register({"m": 4096})
b = c._ensure_session()  # one thread's registration, taken just before...
c._lost(b, unreachable=True)  # ...another thread found the node unreachable
c._ensure_session()  # and connected again: the channel b's stub is on is replaced
query = node_pb2.QueryRequest(session_id=b.session_id, namespaces=["m"], hashes=[bytes(16)])
try:
    c._call("Query", query, node_pb2.QueryResponse, b)
except NodeUnavailable as exc:
    print("replaced:", type(exc).__name__, flush=True)
c.close()
c.close()
for name, call in (("stats", c.stats), ("health", c.health), ("query", lambda: c.query(["m"], [bytes(16)]))):
    try:
        call()
    except ClientClosed:
        print("closed:", name, flush=True)
"""


def test_a_call_on_a_replaced_or_closed_connection_is_a_typed_error_not_a_crash(node_factory):
    """grpcio crashes the process (SIGSEGV) on a call on a closed channel with interceptors:
    a thread whose registration was taken before another thread reconnected did that, and so
    did any call after close(); a closed client also came back to life at its next call."""
    node = node_factory(extra=["--local-socket", "off"])
    r = subprocess.run([sys.executable, "-c", REPLACED_AND_CLOSED, node.addr], capture_output=True, text=True,
                       timeout=60, env=python_env())
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.splitlines() == ["replaced: NodeUnavailable", "closed: stats", "closed: health", "closed: query"]
    wait_until(lambda: node.stats().sessions == 0, 10, "the closed client's session gone")
