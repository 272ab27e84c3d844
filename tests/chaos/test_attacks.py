"""An attacker process against each door of a node and metaserver that have a token.

Random tokens, headers and ids, many times over: every attempt must be refused, none may
reach another engine's blocks (``tests/integration/test_access.py`` states each rule once;
this hammers them).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

import grpc

from pegaflow._proto import meta_pb2, meta_pb2_grpc, node_pb2, node_pb2_grpc, peer_pb2, peer_pb2_grpc
from pegaflow.client import NodeError, PegaClient
from pegaflow.common.local_wire import HELLO, METHOD_IDS, REPLY_HEADER, REQUEST_HEADER
from pegaflow.common.security import Security
from pegaflow.node.tiers.remote.tcp import REQ, REQ_MAGIC, RESP, UNKNOWN_PIN
from tests.chaos.common import NS, PAGE, Report, block_hash, pick, read_back, store, tracebacks_in
from tests.harness.ports import free_port
from tests.waiting import wait_until

TOKEN = "chaos-cluster-token-7f3a"


def test_an_attacker_gets_nothing_through_any_door(node_factory, tmp_path, redis_server):  # type: ignore[no-untyped-def]
    rep = Report("attacker against every door (token set)", expected_failures=True)
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    tok.chmod(0o600)
    node = node_factory(extra=["--auth-token-file", str(tok), "--redis-url", redis_server.url])
    owner = PegaClient(node.addr, security=Security(token=TOKEN))
    owner.register({NS: PAGE})
    hs = [block_hash(i) for i in range(8)]
    store(owner, hs)
    lease = owner.query([NS], hs)
    meta_port = free_port()
    meta = subprocess.Popen([sys.executable, "-m", "pegaflow.meta.cli", "--addr", f"127.0.0.1:{meta_port}",
                             "--redis-url", redis_server.url, "--http-addr", "off", "--auth-token-file", str(tok)],
                            env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rng = random.Random(5)
    n = int(pick(200, 3000))
    tried = got_through = 0

    def forged() -> tuple[tuple[str, str], ...]:
        return rng.choice([(), (("authorization", "Bearer " + TOKEN[:-1] + "x"),),
                           (("authorization", TOKEN),), (("authorization", "Bearer " + os.urandom(8).hex()),),
                           (("authorization", "bearer " + TOKEN),)])

    try:
        with grpc.insecure_channel(node.addr) as ch, grpc.insecure_channel(f"127.0.0.1:{meta_port}") as mch:
            stub, peer, mstub = node_pb2_grpc.PegaNodeStub(ch), peer_pb2_grpc.PegaPeerStub(ch), meta_pb2_grpc.MetaServiceStub(mch)
            wait_until(lambda: meta.poll() is None and _code(lambda: mstub.ListNodes(
                meta_pb2.ListNodesRequest(), timeout=1)) == grpc.StatusCode.UNAUTHENTICATED, 30, "metaserver up")
            calls = [
                lambda md: stub.Register(node_pb2.RegisterRequest(instance_id="evil", namespaces=[
                    node_pb2.NamespaceSpec(name=NS, page_bytes=PAGE)]), timeout=5, metadata=md),
                lambda md: stub.Query(node_pb2.QueryRequest(session_id=owner.session_id, namespaces=[NS], hashes=hs),
                                      timeout=5, metadata=md),
                lambda md: stub.Release(node_pb2.ReleaseRequest(session_id=owner.session_id, lease_id=lease.lease_id),
                                        timeout=5, metadata=md),
                lambda md: peer.PinForTransfer(peer_pb2.PinRequest(namespace=NS, hashes=hs, transport="tcp"),
                                               timeout=5, metadata=md),
                lambda md: mstub.ListNodes(meta_pb2.ListNodesRequest(), timeout=5, metadata=md),
                lambda md: mstub.GetClusterConfig(meta_pb2.ClusterConfigRequest(), timeout=5, metadata=md),
            ]
            for _ in range(n):
                tried += 1
                if _code(lambda: rng.choice(calls)(forged())) != grpc.StatusCode.UNAUTHENTICATED:
                    got_through += 1
            # Local socket: frames without, or with a forged, HELLO.
            q = node_pb2.QueryRequest(session_id=owner.session_id, namespaces=[NS], hashes=hs).SerializeToString()
            for _ in range(n // 10):
                tried += 1
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(10)
                    s.connect(node.local_socket)
                    frames = b""
                    if rng.random() < 0.5:
                        bad = os.urandom(rng.randrange(1, 40))
                        frames += REQUEST_HEADER.pack(len(bad), HELLO, 0) + bad
                    frames += REQUEST_HEADER.pack(len(q), METHOD_IDS["Query"], 0) + q
                    try:
                        s.sendall(frames)
                        head = s.recv(REPLY_HEADER.size, socket.MSG_WAITALL)
                    except (BrokenPipeError, ConnectionResetError):
                        continue  # refused and closed before the Query even arrived
                    if len(head) == REPLY_HEADER.size and REPLY_HEADER.unpack(head)[1] == 0:
                        got_through += 1
            # A token holder with its own session: another session's ids; guessed pins on the data port.
            with PegaClient(node.addr, security=Security(token=TOKEN)) as mallory:
                mallory.register({NS: PAGE})
                for _ in range(n // 10):
                    tried += 1
                    try:
                        mallory.release(rng.choice([lease.lease_id, rng.getrandbits(63)]))
                        got_through += 1
                    except NodeError:
                        pass
                md = (("authorization", f"Bearer {TOKEN}"),)
                pin = peer.PinForTransfer(peer_pb2.PinRequest(namespace=NS, hashes=hs[:1], transport="tcp"),
                                          timeout=5, metadata=md)
                host, _, port = pin.data_addr.rpartition(":")
                with socket.create_connection((host, int(port)), timeout=10) as s:
                    for _ in range(n):
                        tried += 1
                        guess = rng.getrandbits(63)
                        s.sendall(REQ.pack(REQ_MAGIC, guess, 0, 1))
                        _magic, status, total = RESP.unpack(s.recv(RESP.size, socket.MSG_WAITALL))
                        if status != UNKNOWN_PIN or total:
                            got_through += 1
                peer.Unpin(peer_pb2.UnpinRequest(pin_id=pin.pin_id), timeout=5, metadata=md)
    finally:
        meta.terminate()
        meta.wait(15)
    missing, garbled = read_back(owner, hs)  # the owner's blocks and lease are untouched
    owner.release(lease.lease_id)  # still the owner's to release
    owner.close()
    f = rep.fig
    f.tried, f.failed = tried, tried - got_through
    f.lost = missing
    f.wrong = got_through + garbled
    f.tracebacks = tracebacks_in(node.log())
    f.notes.update(got_through=got_through)
    rep.done()
    assert not f.bad(), f


def _code(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined]
