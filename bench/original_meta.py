"""The Rust original's metaserver as bench/meta.py's same-run peer.

PegaFlow's original (github.com/novitalabs/pegaflow) ships its metaserver, a tonic gRPC
server over an in-memory map, as ``pegaflow/pegaflow-metaserver-py`` in the
``pegaflow-llm`` wheel; it runs on a CPU-only host. This module:

- fetches that wheel once (``pip download``) and keeps only the binary, in
  ``$XDG_CACHE_HOME/pegaflow-bench/original/<VERSION>/`` (``~/.cache`` by default); where
  that fails (no package index, no wheel for this platform) :class:`Unavailable` carries
  the one-line reason and bench/meta.py runs without the peer;
- generates the Python stubs of ``bench/original/engine.proto`` (its MetaServer service) into
  the same cache with ``grpc_tools.protoc``: nothing generated is committed;
- starts the server (:class:`OriginalMetaServer`) and drives it the way its nodes do
  (``pegaflow-core/src/internode/metaserver_client.rs``): ``HeartbeatNode`` registers a node
  (address + a session UUID), ``InsertBlockHashes`` / ``RemoveBlockHashes`` carry at most
  ``MAX_HASHES_PER_RPC`` hashes, ``QueryPrefixBlocks`` answers a lookup;
- ingests in a process of its own (bench/sender.py's ``original`` kind, :func:`ingest`): one
  thread and one channel per node, as that many nodes would, sending requests serialized
  beforehand, so the rate is the server's and the querying process shares no interpreter
  lock with the load (our nodes' events are sent the same way: bench/meta.py).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from bench.sender import Sender

ROOT = Path(__file__).resolve().parents[1]

PACKAGE = "pegaflow-llm"
VERSION = "0.25.1"  # its QueryPrefixBlocks reply: one longest holder, field 2 (bench/original/engine.proto)
BINARY = "pegaflow-metaserver-py"
PROTO = Path(__file__).resolve().parent / "original" / "engine.proto"
MAX_HASHES_PER_RPC = 16_384  # the original node's chunk (metaserver_client.rs)
FETCH_TIMEOUT_S = 240  # one 8 MB wheel; pip itself gives up on an unreachable index well before
READY_TIMEOUT_S = 30.0
SERVICE = "/pegaflow.MetaServer/"
UNREACHABLE = re.compile(r"Failed to establish a new connection: [^')\"]*|Temporary failure in name resolution|"
                         r"Name or service not known|ProxyError\([^,]*|certificate verify failed|timed out")
# The bench's nodes register once and never heartbeat again: no node goes stale, and the
# lifecycle sweep (off in our server too: --sweep-interval 0) never runs during a run.
SERVER_FLAGS = ("--log-level", "warn", "--node-stale-secs", "3600", "--ttl-minutes", "1440",
                "--sweep-interval-secs", "86400")


class Unavailable(Exception):
    """The peer cannot run here; the message is the one-line reason."""


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pegaflow-bench" / "original" / VERSION


def binary() -> Path:
    """The metaserver binary, fetched into the cache on first use."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise Unavailable(f"{PACKAGE} ships its metaserver for Linux x86_64 only (this is "
                          f"{platform.system()} {platform.machine()})")
    path = cache_dir() / BINARY
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
                "--timeout", "15", "--disable-pip-version-check", "-q", f"{PACKAGE}=={VERSION}", "-d", tmp]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip download {PACKAGE}=={VERSION} took over {FETCH_TIMEOUT_S} s") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if out.returncode != 0 or not wheels:
            raise Unavailable(f"pip download {PACKAGE}=={VERSION} failed: {pip_reason(out.stderr + out.stdout)}")
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                data = z.read(f"pegaflow/{BINARY}")
            except KeyError:
                raise Unavailable(f"{wheels[0].name} has no pegaflow/{BINARY}") from None
        part = Path(tmp) / BINARY
        part.write_bytes(data)
        part.chmod(0o755)
        os.replace(part, path)  # atomic: a concurrent run sees the whole binary or none
    return path


def pip_reason(output: str) -> str:
    """One line of pip's output that says why: where the index could not be reached, that
    (pip's last line would only say that no version was found), else its last line."""
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    for line in lines:
        m = UNREACHABLE.search(line)
        if m:
            return f"the package index is unreachable ({m.group(0)[:120]})"
    return lines[-1][:200] if lines else "no output"


def stubs() -> tuple[ModuleType, ModuleType]:
    """``engine_pb2`` and ``engine_pb2_grpc`` of bench/original/engine.proto, generated into the
    cache (a directory per version of the proto) on first use."""
    digest = hashlib.sha256(PROTO.read_bytes()).hexdigest()[:12]
    out = cache_dir() / f"stubs-{digest}"
    if not (out / "engine_pb2_grpc.py").exists():
        from grpc_tools import protoc  # grpcio-tools: requirements/runtime.txt

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent))
        rc = protoc.main(["protoc", f"-I{PROTO.parent}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                          str(PROTO)])
        if rc != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise Unavailable(f"grpc_tools.protoc failed on {PROTO} (exit {rc})")
        try:
            os.replace(tmp, out)
        except OSError:  # another run put them there first
            shutil.rmtree(tmp, ignore_errors=True)
    if str(out) not in sys.path:
        sys.path.insert(0, str(out))  # engine_pb2_grpc imports engine_pb2 by its bare name
    return importlib.import_module("engine_pb2"), importlib.import_module("engine_pb2_grpc")


def process_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class Session:
    """A registered node: its address (the original names nodes by it) and session id."""

    node: str
    node_id: str


class OriginalMetaServer:
    """``pegaflow-metaserver-py`` on free loopback ports (gRPC and its HTTP metrics), with
    ``SERVER_FLAGS``; ``start()`` returns once it answers a HeartbeatNode."""

    def __init__(self, log_path: Path) -> None:
        from tests.harness.ports import free_port

        self.binary = binary()
        self.pb, self.pb_grpc = stubs()
        self.log_path = log_path
        self.addr = f"127.0.0.1:{free_port()}"
        self.http_addr = f"127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.stub: Any = None  # engine_pb2_grpc.MetaServerStub, generated at run time: untyped

    def start(self) -> OriginalMetaServer:
        from tests.harness import wait_until

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(self.binary), "--addr", self.addr, "--http-addr", self.http_addr,
                                          *SERVER_FLAGS], stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = self.pb_grpc.MetaServerStub(self.channel)
        probe = Session("127.0.0.1:1", str(uuid.uuid4()))

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"{BINARY} exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            self.heartbeat(probe)
            return True

        try:
            wait_until(up, READY_TIMEOUT_S, f"{BINARY} to serve on {self.addr}", ignore=(grpc.RpcError,))
        except AssertionError:
            self.stop()
            raise
        self.stub.UnregisterNode(self.pb.UnregisterNodeRequest(node=probe.node, node_id=probe.node_id), timeout=5)
        return self

    def heartbeat(self, s: Session) -> None:
        res = self.stub.HeartbeatNode(self.pb.HeartbeatNodeRequest(node=s.node, node_id=s.node_id), timeout=5)
        assert res.stale_after_secs > 0, res

    def register(self, addresses: Iterable[str]) -> list[Session]:
        sessions = [Session(a, str(uuid.uuid4())) for a in addresses]
        for s in sessions:
            self.heartbeat(s)
        return sessions

    def longest(self, namespace: str, hashes: list[bytes]) -> tuple[str, int]:
        """QueryPrefixBlocks: (node, prefix length) of the longest holder; ("", 0): none."""
        return longest_holder(self.stub.QueryPrefixBlocks(
            self.pb.QueryPrefixBlocksRequest(namespace=namespace, block_hashes=hashes), timeout=5))

    def rss(self) -> int:
        assert self.proc is not None
        return process_rss(self.proc.pid)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def longest_holder(res: Any) -> tuple[str, int]:
    """The longest holder of a QueryPrefixBlocksResponse: 0.25.1's field 2, or the longest of
    v0.23.12's list (field 1) when an older server answers."""
    if res.HasField("longest"):
        return res.longest.node, res.longest.prefix_len
    if res.nodes:
        best = max(res.nodes, key=lambda n: n.prefix_len)
        return best.node, best.prefix_len
    return "", 0


# --- ingest -----------------------------------------------------------------------------------

Call = tuple[str, bytes, int]  # method, serialized request, hashes in it


def plan(pb: ModuleType, sessions: list[Session], events: Iterable[tuple[int, str, bool, list[bytes]]]
         ) -> list[list[Call]]:
    """Each node's calls for ``events`` (node index, namespace, insert or evict, hashes), in
    the node's order: consecutive events of one kind and namespace merged, then cut into calls
    of at most ``MAX_HASHES_PER_RPC`` hashes, as the original node batches its queue."""
    runs: list[list[tuple[str, bool, list[bytes]]]] = [[] for _ in sessions]
    for node, ns, insert, hashes in events:
        run = runs[node]
        if run and run[-1][0] == ns and run[-1][1] == insert:
            run[-1][2].extend(hashes)
        else:
            run.append((ns, insert, list(hashes)))
    out: list[list[Call]] = []
    for s, run in zip(sessions, runs, strict=True):
        calls: list[Call] = []
        for ns, insert, hashes in run:
            for j in range(0, len(hashes), MAX_HASHES_PER_RPC):
                chunk = hashes[j : j + MAX_HASHES_PER_RPC]
                kind = pb.InsertBlockHashesRequest if insert else pb.RemoveBlockHashesRequest
                req = kind(namespace=ns, block_hashes=chunk, node=s.node, node_id=s.node_id)
                calls.append(("InsertBlockHashes" if insert else "RemoveBlockHashes", req.SerializeToString(),
                              len(chunk)))
        out.append(calls)
    return out


class OriginalCalls:
    """bench/sender.py's ``original`` kind: each node's calls (``plan``) on a channel of its own,
    sent serialized; replies parsed after the first pass's timing."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.pb, _ = stubs()
        self.addr: str = data["addr"]
        self.items: list[list[tuple[tuple[str, bytes], int]]] = [
            [((method, req), n) for method, req, n in calls] for calls in data["calls"]]

    def connect(self, k: int) -> Callable[[tuple[str, bytes]], bytes]:
        ch = grpc.insecure_channel(self.addr)
        grpc.channel_ready_future(ch).result(timeout=READY_TIMEOUT_S)
        ident = lambda b: b  # noqa: E731 (requests are serialized beforehand)
        methods = {m: ch.unary_unary(SERVICE + m, request_serializer=ident, response_deserializer=ident)
                   for m in ("InsertBlockHashes", "RemoveBlockHashes")}
        return lambda call: methods[call[0]](call[1], timeout=120)

    def check_first(self, replies: list[list[bytes]]) -> None:
        for node_calls, got in zip(self.items, replies, strict=True):
            for ((method, _req), n), raw in zip(node_calls, got, strict=True):
                ok, count = _reply_ok(self.pb, method, raw)
                if not ok or count != n:
                    raise SystemExit(f"original ingest: {method} of {n} hashes answered ok={ok} count={count}")

    def check_later(self, call: tuple[str, bytes], raw: bytes) -> None:
        ok, _count = _reply_ok(self.pb, call[0], raw)
        if not ok:  # counts differ on later passes (what was removed is gone): only ok is checked
            raise RuntimeError(f"{call[0]} answered not ok")


def ingest(addr: str, calls: list[list[Call]], scratch: Path) -> Sender:
    """``calls`` sent to the original's metaserver at ``addr`` by a process of its own, ready to go."""
    return Sender("original", {"addr": addr, "calls": calls}, scratch)


def _reply_ok(pb: ModuleType, method: str, raw: bytes) -> tuple[bool, int]:
    if method == "InsertBlockHashes":
        r = pb.InsertBlockHashesResponse.FromString(raw)
        return r.status.ok, r.inserted_count
    r = pb.RemoveBlockHashesResponse.FromString(raw)
    return r.status.ok, r.removed_count
