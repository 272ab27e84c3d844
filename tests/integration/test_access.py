"""Access rules against real daemons: an attacker process tries each door of a node and a
metaserver that have a token (and TLS), and the owners still work.

Each attack is one that succeeded before the token existed (issue: register in another
engine's namespace, release its lease or abort its reservation by guessing ids, commit
pages it never wrote, read its pages through PinForTransfer + the data port, list the
metaserver's nodes).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from pegaflow._proto import meta_pb2, meta_pb2_grpc, node_pb2, node_pb2_grpc, peer_pb2, peer_pb2_grpc
from pegaflow.client import NodeError, PegaClient
from pegaflow.common.local_wire import HELLO, METHOD_IDS, REPLY_HEADER, REQUEST_HEADER
from pegaflow.common.security import Security
from pegaflow.node.tiers.remote.tcp import REQ, REQ_MAGIC, RESP, UNKNOWN_PIN
from tests.harness.ports import free_port
from tests.harness.procs import REPO
from tests.integration.redis_fixtures import redis_server  # noqa: F401
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-of-the-cluster"
PAGE = 8192
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def token_file(tmp: Path, text: str = TOKEN, mode: int = 0o600) -> Path:
    p = tmp / f"token-{mode:o}"
    p.write_text(text + "\n")
    p.chmod(mode)
    return p


def hashes(tag: str, n: int) -> list[bytes]:
    import xxhash

    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def code_of(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined]
    return grpc.StatusCode.OK


@pytest.fixture
def guarded(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    """A node with a token, serving peers (so the data port is on), and its owner's client."""
    node = node_factory(extra=["--auth-token-file", str(token_file(tmp_path)), "--redis-url",
                               "redis://127.0.0.1:1/0"])  # publishing fails quietly; P2P serving is on
    owner = PegaClient(node.addr, security=Security(token=TOKEN))
    owner.register({"victim": PAGE})
    r = owner.reserve("victim", hashes("v", 4))
    for off in r.offsets:
        owner.pool[off:off + PAGE] = 7
    assert owner.commit(r.reservation_id) == 4
    yield node, owner
    owner.close()


def test_grpc_without_or_with_a_wrong_token_is_unauthenticated(guarded):  # type: ignore[no-untyped-def]
    node, _ = guarded
    with grpc.insecure_channel(node.addr) as ch:
        stub = node_pb2_grpc.PegaNodeStub(ch)
        reg = node_pb2.RegisterRequest(instance_id="x", namespaces=[node_pb2.NamespaceSpec(name="victim",
                                                                                           page_bytes=PAGE)])
        assert code_of(lambda: stub.Register(reg, timeout=5)) == UNAUTH
        assert code_of(lambda: stub.Register(reg, timeout=5, metadata=(("authorization", "Bearer nope"),))) == UNAUTH
        assert code_of(lambda: stub.Register(reg, timeout=5, metadata=(("authorization", TOKEN),))) == UNAUTH
        assert code_of(lambda: stub.Stats(node_pb2.StatsRequest(), timeout=5)) == UNAUTH
        q = node_pb2.QueryRequest(session_id=1, namespaces=["victim"], hashes=hashes("v", 4))
        assert code_of(lambda: stub.Query(q, timeout=5)) == UNAUTH
        peer = peer_pb2_grpc.PegaPeerStub(ch)
        pin = peer_pb2.PinRequest(namespace="victim", hashes=hashes("v", 4), transport="tcp")
        assert code_of(lambda: peer.PinForTransfer(pin, timeout=5)) == UNAUTH
        # Probes stay open.
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
    # The client library says so too.
    with pytest.raises(NodeError) as err:
        PegaClient(node.addr, security=Security(token="wrong")).register({"victim": PAGE})
    assert err.value.code == UNAUTH


def test_local_socket_needs_the_token_in_its_first_frame(guarded):  # type: ignore[no-untyped-def]
    node, owner = guarded
    path = node.local_socket
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    q = node_pb2.QueryRequest(session_id=owner.session_id, namespaces=["victim"], hashes=hashes("v", 4)).SerializeToString()
    for opening in (b"", b"wrong-token"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(path)
        if opening:
            s.sendall(REQUEST_HEADER.pack(len(opening), HELLO, 0) + opening)
        else:
            s.sendall(REQUEST_HEADER.pack(len(q), METHOD_IDS["Query"], 0) + q)
        n, status = REPLY_HEADER.unpack(s.recv(REPLY_HEADER.size, socket.MSG_WAITALL))
        assert status == UNAUTH.value[0], status
        s.recv(n, socket.MSG_WAITALL)
        assert s.recv(1) == b"", "the node closes a refused connection"
        s.close()
    assert owner.transport == "local"  # and the owner, with the token, uses the socket


def test_one_session_cannot_touch_anothers_leases_and_reservations(guarded):  # type: ignore[no-untyped-def]
    node, owner = guarded
    q = owner.query(["victim"], hashes("v", 4))
    r = owner.reserve("victim", hashes("w", 2))
    attacker = PegaClient(node.addr, security=Security(token=TOKEN))  # a token holder, another session
    attacker.register({"victim": PAGE})
    try:
        for guess in (q.lease_id, q.lease_id + 1, 1, 2, 3):
            with pytest.raises(NodeError, match="unknown lease"):
                attacker.release(guess)
        for guess in (r.reservation_id, 1, 2, 3):
            with pytest.raises(NodeError, match="unknown reservation"):
                attacker.abort(guess)
            with pytest.raises(NodeError, match="unknown reservation"):
                attacker.commit(guess)
        assert q.lease_id > 1 << 20 and r.reservation_id > 1 << 20, "ids are not a counter"
    finally:
        attacker.close()
    assert owner.commit(r.reservation_id) == 2  # the owner's reservation is intact
    owner.release(q.lease_id)


def test_the_data_port_serves_no_guessed_pin(guarded):  # type: ignore[no-untyped-def]
    node, owner = guarded
    # The data port's address comes from a real pin, obtained with the token.
    with grpc.insecure_channel(node.addr) as ch:
        peer = peer_pb2_grpc.PegaPeerStub(ch)
        md = (("authorization", f"Bearer {TOKEN}"),)
        pin = peer.PinForTransfer(peer_pb2.PinRequest(namespace="victim", hashes=hashes("v", 4), transport="tcp"),
                                  timeout=5, metadata=md)
        assert pin.count == 4 and pin.pin_id > 1 << 20
        host, _, port = pin.data_addr.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            for guess in range(1, 200):
                s.sendall(REQ.pack(REQ_MAGIC, guess, 0, 1))
                magic, status, total = RESP.unpack(s.recv(RESP.size, socket.MSG_WAITALL))
                assert (status, total) == (UNKNOWN_PIN, 0), guess
        peer.Unpin(peer_pb2.UnpinRequest(pin_id=pin.pin_id), timeout=5, metadata=md)


def test_a_node_refuses_a_token_file_others_can_read_and_warns_when_exposed(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    n = node_factory(extra=["--auth-token-file", str(token_file(tmp_path, mode=0o644))], start=False)
    p = subprocess.run(n.argv(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "chmod 600" in p.stderr, p.stderr
    port = free_port()
    exposed = node_factory(extra=["--local-socket", "off"], start=False)
    exposed.addr = f"0.0.0.0:{port}"
    exposed.port = port
    exposed.start()
    wait_until(lambda: "node_exposed_without_token" in exposed.log(), 10, "the exposure warning")


def test_query_trace_is_private(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    trace = tmp_path / "q.jsonl"
    trace.write_text("")
    trace.chmod(0o644)
    node_factory(extra=["--query-trace", str(trace)])
    assert stat.S_IMODE(trace.stat().st_mode) == 0o600


CLUSTER_CLIENT = textwrap.dedent('''
    import sys, torch
    from pegaflow.client import PegaClient
    addr, cmd = sys.argv[1], sys.argv[2]
    c = PegaClient(addr, timeout=10)  # token from PEGAFLOW_AUTH_TOKEN, as an engine's connector reads it
    c.register({"ns": 8192})
    hs = [bytes([i]) * 16 for i in range(6)]
    if cmd == "save":
        r = c.reserve("ns", hs)
        for i, off in enumerate(r.offsets):
            c.pool[off:off + 8192] = i + 1
        print(c.commit(r.reservation_id))
    else:
        from tests.waiting import wait_until

        def pulled():
            q = c.query(["ns"], hs, req_id="pull")
            if q.status == "READY" and q.hit_blocks == 6:
                return q
            if q.lease_id:
                c.release(q.lease_id)
            return None

        q = wait_until(pulled, 60, "all 6 blocks pulled from the other node", every=0.02)
        ok = all(int(q.pool[off:off + 8192].float().mean()) == i + 1 for i, off in enumerate(q.offsets["ns"]))
        print("identical" if ok else "different")
''')


def test_a_cluster_with_a_token_and_tls_works_and_refuses_strangers(tmp_path, node_factory, redis_server):  # type: ignore[no-untyped-def]  # noqa: F811
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pegaflow",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    tok = token_file(tmp_path)
    env = {"PEGAFLOW_AUTH_TOKEN_FILE": str(tok), "PEGAFLOW_TLS_CA": str(cert)}
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    meta_port = free_port()
    meta = subprocess.Popen([sys.executable, "-m", "pegaflow.meta.cli", "--addr", f"127.0.0.1:{meta_port}",
                             "--redis-url", redis_server.url, "--http-addr", "off", *tls],
                            env={**os.environ, **env}, stdout=open(tmp_path / "meta.log", "ab"), stderr=subprocess.STDOUT)
    try:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{meta_port}", creds) as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)

            def up() -> bool:
                assert meta.poll() is None, (tmp_path / "meta.log").read_text()[-2000:]
                return code_of(lambda: stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=1)) == UNAUTH

            wait_until(up, 30, "the metaserver, refusing calls without the token")
        with grpc.insecure_channel(f"127.0.0.1:{meta_port}") as ch:  # plaintext to a TLS port: no answer
            code = code_of(lambda: meta_pb2_grpc.MetaServiceStub(ch).ListNodes(meta_pb2.ListNodesRequest(), timeout=2))
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), code
        nodes = [node_factory(extra=[*tls, "--metaserver-addr", f"127.0.0.1:{meta_port}", "--node-id", name],
                              env=env) for name in ("a", "b")]
        run = lambda addr, cmd: subprocess.run(  # noqa: E731
            [sys.executable, "-c", CLUSTER_CLIENT, addr, cmd], capture_output=True, text=True, timeout=120, cwd=REPO,
            env={**os.environ, "PEGAFLOW_AUTH_TOKEN": TOKEN, "PEGAFLOW_TLS_CA": str(cert)})
        saved = run(nodes[0].addr, "save")
        assert saved.returncode == 0 and saved.stdout.strip() == "6", saved.stderr[-2000:]
        pulled = run(nodes[1].addr, "load")  # b misses, asks the metaserver, pulls from a: all over TLS + token
        assert pulled.returncode == 0 and pulled.stdout.strip() == "identical", pulled.stderr[-2000:]
        assert nodes[1].metric("pegaflow_node_hit_blocks_total", 'tier="remote"') == 6
        # A client without the CA cannot even register.
        stranger = subprocess.run([sys.executable, "-c", CLUSTER_CLIENT, nodes[0].addr, "save"], capture_output=True,
                                  text=True, timeout=120, env={**os.environ, "PEGAFLOW_AUTH_TOKEN": TOKEN})
        assert stranger.returncode != 0
    finally:
        meta.terminate()
        meta.wait(15)


def _cert(tmp: Path, name: str) -> tuple[Path, Path]:
    cert, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def test_unusable_tls_files_are_named_in_one_line_at_start(tmp_path, node_factory):  # type: ignore[no-untyped-def]
    """A file that is not PEM, or a key of another certificate, was reported as 'cannot listen
    on HOST:PORT' after three lines of gRPC's C core."""
    cert, key = _cert(tmp_path, "a")
    _, other_key = _cert(tmp_path, "b")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [((garbage, key), "--tls-cert", "holds no PEM certificate"),
             ((cert, garbage), "--tls-key", "holds no PEM private key"),
             ((cert, other_key), "--tls-key", "is not the private key of --tls-cert")]
    for (c, k), flag, says in cases:
        tls = ["--tls-cert", str(c), "--tls-key", str(k)]
        node = subprocess.run(node_factory(extra=tls, start=False).argv(), capture_output=True, text=True, timeout=60)
        meta = subprocess.run([sys.executable, "-m", "pegaflow.meta.cli", "--addr", f"127.0.0.1:{free_port()}",
                               "--http-addr", "off", "--redis-url", "redis://127.0.0.1:1/0", *tls],
                              capture_output=True, text=True, timeout=60)
        for p, rc in ((node, 1), (meta, 2)):
            lines = p.stderr.strip().splitlines()
            assert p.returncode == rc and len(lines) == 1, p.stderr[-2000:]
            assert f"{flag} {k if flag == '--tls-key' else c} {says}" in lines[0], lines[0]
    status = subprocess.run([sys.executable, "-m", "pegaflow.cli", "status", "--addr", f"127.0.0.1:{free_port()}",
                             "--tls-ca", str(garbage)], capture_output=True, text=True, timeout=60)
    lines = status.stderr.strip().splitlines()
    assert status.returncode != 0 and len(lines) == 1 and "the TLS CA file" in lines[0], status.stderr[-2000:]
