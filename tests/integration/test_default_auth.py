"""Safe by default on a shared host: a node started with no token refuses other users.

A default node (no token, every listener on loopback) writes its own token beside its local
socket, readable by its user only; its user's clients find it with no setting. The attacker
is a real process of another uid (``nobody``) using the real client and gRPC stubs: it
imports everything as root, then drops to uid 65534 (so it needs no readable Python
install), and tries each attack of the threat model (docs/security.md): register in the
victim's namespace, query its blocks, commit hashes it never wrote (poisoning), and read
its pages through PinForTransfer + the TCP data port. Against a ``--no-auth`` node the same
attacker succeeds at each, so these tests can fail.
"""

from __future__ import annotations

import gc
import grp
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pegaflow.client import NodeError, PegaClient
from pegaflow.common.security import Security, default_socket_path, node_token_paths, token_path
from tests.harness.procs import REPO

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="runs the attacker as another uid: needs root"),
]

PAGE = 8192
N = 8
NOBODY = 65534
# Publishing to a Redis that is not there fails quietly; the node serves peers (data port on).
CLUSTER = ["--redis-url", "redis://127.0.0.1:1/0"]

# Runs as root until drop(): every module the attacks use is imported first.
ATTACKER = r'''
import json, os, socket, sys
import grpc
import xxhash
from pegaflow._proto import node_pb2, node_pb2_grpc, peer_pb2, peer_pb2_grpc
from pegaflow.client import NodeError, PegaClient
from pegaflow.node.tiers.remote.tcp import REQ, REQ_MAGIC, RESP

addr, uid, groups, victim_session = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
PAGE, N = 8192, 8

def exactly(s, n):  # a socket with a timeout may return short reads, even with MSG_WAITALL
    data = bytearray()
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)

def hashes(tag):
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(N)]

# grpc imports its channel modules lazily: load them (and every stub's path) while root.
import encodings.idna, grpc._channel, grpc._interceptor  # noqa: E401
with grpc.insecure_channel(addr) as warm:
    node_pb2_grpc.PegaNodeStub(grpc.intercept_channel(warm)).Health(node_pb2.HealthRequest(), timeout=10)
os.setgroups([int(g) for g in groups.split(",") if g])
os.setgid(uid)
os.setuid(uid)
assert os.getuid() == uid and os.geteuid() == uid
out = {}

def code(exc):
    return exc.code.name if isinstance(exc, NodeError) else exc.code().name

# 1. Register in the victim's namespace (the real client: it looks for the node's token itself).
c = PegaClient(addr, map_pool=False, timeout=5)
try:
    c.register({"victim": PAGE})
    out["register"] = "OK"
    out["transport"] = c.transport  # "local": it could open the socket and present the token
except (NodeError, grpc.RpcError) as exc:
    out["register"] = code(exc)
# 2. Query the victim's blocks: hits = what this process learns of them.
try:
    out["query_hits"] = c.query(["victim"], hashes("v")).hit_blocks if out["register"] == "OK" else 0
except (NodeError, grpc.RpcError) as exc:
    out["query"] = code(exc)
ch = grpc.insecure_channel(addr)
stub, peer = node_pb2_grpc.PegaNodeStub(ch), peer_pb2_grpc.PegaPeerStub(ch)
try:  # the raw RPC, even knowing the victim's session id
    stub.Query(node_pb2.QueryRequest(session_id=victim_session, namespaces=["victim"], hashes=hashes("v")), timeout=5)
    out["raw_query"] = "OK"
except grpc.RpcError as exc:
    out["raw_query"] = exc.code().name
# 3. Poison: commit hashes it never wrote (the victim would load them as its own).
try:
    r = c.reserve("victim", hashes("poison"))
    out["poisoned"] = c.commit(r.reservation_id)
except (NodeError, grpc.RpcError) as exc:
    out["poison"] = code(exc)
    out["poisoned"] = 0
# 4. Read the victim's pages: PinForTransfer, then the TCP data port.
out["pages_read"] = 0
try:
    pin = peer.PinForTransfer(peer_pb2.PinRequest(namespace="victim", hashes=hashes("v"), transport="tcp"),
                              timeout=5)
    out["pin"] = "OK"
    host, _, port = pin.data_addr.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as s:
        s.sendall(REQ.pack(REQ_MAGIC, pin.pin_id, 0, N))
        _magic, status, total = RESP.unpack(exactly(s, RESP.size))
        data = exactly(s, total) if status == 0 else b""
    out["pages_read"] = sum(1 for i in range(len(data) // PAGE) if data[i * PAGE:(i + 1) * PAGE] == bytes([7]) * PAGE)
except grpc.RpcError as exc:
    out["pin"] = exc.code().name
try:
    c.close()
except Exception:
    pass
# 5. An engine that maps the pool: save pages of its own through the mapping, load them back.
try:
    m = PegaClient(addr, timeout=5)
    m.register({"mine": PAGE})
    r = m.reserve("mine", hashes("m"))
    for i, off in enumerate(r.offsets):
        r.pool[off:off + PAGE] = 40 + i
    assert m.commit(r.reservation_id) == N
    q = m.query(["mine"], hashes("m"))
    got = [bytes(q.pool[off:off + PAGE].numpy()) for off in q.offsets["mine"]]
    m.release(q.lease_id)
    out["pool_pages"] = sum(1 for i, b in enumerate(got) if b == bytes([40 + i]) * PAGE)
    out["pool_transport"] = m.transport
    m.close()
except (NodeError, grpc.RpcError) as exc:
    out["pool_pages"] = code(exc)
except OSError as exc:
    out["pool_pages"] = type(exc).__name__
print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.fixture(autouse=True)
def _unmap_pools():  # type: ignore[no-untyped-def]
    """Closed clients' pool mappings go before the next test (test_numa_pool counts this
    process's pool mappings)."""
    yield
    gc.collect()


def hashes(tag: str) -> list[bytes]:
    import xxhash

    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(N)]


def attack(tmp: Path, addr: str, session: int, groups: tuple[int, ...] = ()) -> dict:
    """Run the attacker as uid ``nobody`` (with supplementary ``groups``); its findings."""
    script = tmp / "attacker.py"
    script.write_text(ATTACKER)
    proc = subprocess.run([sys.executable, str(script), addr, str(NOBODY), ",".join(map(str, groups)), str(session)],
                          cwd="/", env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"attacker failed ({proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def victim(addr: str, **kw) -> PegaClient:
    """The node's own user, with no setting at all: registers and stores N pages of 7s."""
    c = PegaClient(addr, **kw)
    c.register({"victim": PAGE})
    r = c.reserve("victim", hashes("v"))
    for off in r.offsets:
        c.pool[off:off + PAGE] = 7
    assert c.commit(r.reservation_id) == N
    return c


def poisoned_hits(c: PegaClient) -> int:
    q = c.query(["victim"], hashes("poison"))
    if q.lease_id:
        c.release(q.lease_id)
    return q.hit_blocks


def test_a_default_node_refuses_another_user_and_serves_its_own(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    node = node_factory(extra=CLUSTER)
    tok = token_path(node.local_socket)
    st = os.stat(tok)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert tok in node_token_paths(node.addr)  # the one rule clients follow
    assert "node_own_token" in node.log()
    owner = victim(node.addr)  # no token configured anywhere: found beside the socket
    assert owner.transport == "local"
    q = owner.query(["victim"], hashes("v"))
    assert q.hit_blocks == N
    assert all(bool((owner.pool[off:off + PAGE] == 7).all()) for off in q.offsets["victim"]), "the pages load back"
    owner.release(q.lease_id)

    got = attack(tmp_path, node.addr, owner.session_id)
    assert got["register"] == "UNAUTHENTICATED", got
    assert got["raw_query"] == "UNAUTHENTICATED", got
    assert got.get("query_hits", 0) == 0, got
    assert got["poisoned"] == 0 and got["poison"] == "UNAUTHENTICATED", got
    assert got["pin"] == "UNAUTHENTICATED" and got["pages_read"] == 0, got
    assert poisoned_hits(owner) == 0
    owner.close()
    node.stop()
    assert not os.path.exists(tok), "the token file goes with a clean exit"


def test_the_same_attacker_succeeds_against_a_no_auth_node(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    node = node_factory(extra=[*CLUSTER, "--no-auth"])
    assert not os.path.exists(token_path(node.local_socket))
    owner = victim(node.addr)
    got = attack(tmp_path, node.addr, owner.session_id)
    assert got["register"] == "OK" and got["transport"] == "grpc", got  # the socket stays 0600 to it
    assert got["query_hits"] == N, got
    assert got["raw_query"] == "OK", got
    assert got["poisoned"] == N and poisoned_hits(owner) == N, got
    assert got["pin"] == "OK" and got["pages_read"] == N, got
    owner.close()


def _some_group() -> grp.struct_group:
    """A group ``nobody`` is not in (``users`` on Debian and Ubuntu)."""
    for g in sorted(grp.getgrall(), key=lambda g: (g.gr_name != "users", g.gr_gid)):
        if g.gr_gid not in (0, NOBODY) and "nobody" not in g.gr_mem:
            return g
    pytest.skip("no group to lend")


def test_access_group_lets_its_members_in_and_nobody_else(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    g = _some_group()
    node = node_factory(extra=["--access-group", g.gr_name])
    shared = default_socket_path("127.0.0.1", node.port, shared=True)
    tok = token_path(shared)
    for path, mode in ((shared, 0o660), (tok, 0o640)):
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, g.gr_gid), path
    owner = victim(node.addr)
    assert owner.transport == "local"
    member = attack(tmp_path, node.addr, owner.session_id, groups=(g.gr_gid,))
    assert member["register"] == "OK" and member["query_hits"] == N and member["transport"] == "local", member
    # It maps the pool from the descriptor the local socket passes (/proc/<node>/fd is the
    # node's user's only): pages saved through the mapping load back byte for byte.
    assert member["pool_pages"] == N and member["pool_transport"] == "local", member
    stranger = attack(tmp_path, node.addr, owner.session_id)
    assert stranger["register"] == "UNAUTHENTICATED" and stranger.get("query_hits", 0) == 0, stranger
    assert stranger["pool_pages"] == "UNAUTHENTICATED", stranger
    owner.close()


def test_access_group_must_exist(tmp_path):  # type: ignore[no-untyped-def]
    out = subprocess.run([sys.executable, "-m", "pegaflow.node.cli", "--access-group", "no-such-group-pf",
                          "--pool-size", "8mb"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()
    assert err and "no such group 'no-such-group-pf'" in err[-1], out.stderr


def test_no_auth_and_a_token_exclude_each_other(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    tok = tmp_path / "t"
    tok.write_text("x")
    tok.chmod(0o600)
    node = node_factory(extra=["--no-auth", "--auth-token-file", str(tok)], start=False)
    proc = subprocess.run(node.argv(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "exclude each other" in proc.stderr + proc.stdout


def test_a_node_beyond_loopback_keeps_no_token_and_warns(node_factory):  # type: ignore[no-untyped-def]
    node = node_factory(start=False)
    node.addr = f"0.0.0.0:{node.port}"
    node.start()
    sock = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"pegaflow-node-0.0.0.0-{node.port}.sock")
    assert not os.path.exists(token_path(sock))
    assert "node_exposed_without_token" in node.log()
    c = PegaClient(f"127.0.0.1:{node.port}", security=Security())  # the quick start: no token needed
    c.register({"victim": PAGE})
    c.close()


def test_a_configured_token_writes_no_file_and_is_required(node_factory, tmp_path):  # type: ignore[no-untyped-def]
    tok = tmp_path / "t"
    tok.write_text("configured-token")
    tok.chmod(0o600)
    node = node_factory(extra=["--auth-token-file", str(tok)], env={"PEGAFLOW_AUTH_TOKEN_FILE": str(tok)},
                        start=False)
    # A killed node's own token left beside the socket: the node that takes the socket removes it.
    stale = token_path(node.local_socket)
    fd = os.open(stale, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"a-killed-node-token\n")
    os.close(fd)
    node.start()
    assert not os.path.exists(stale)
    with pytest.raises(NodeError):
        PegaClient(node.addr, security=Security()).register({"victim": PAGE})
    c = PegaClient(node.addr, security=Security(token="configured-token"))
    c.register({"victim": PAGE})
    c.close()
