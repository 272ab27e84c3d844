"""The original's quick-start command lines, run as its users paste them.

Sources: novitalabs/pegaflow README.md ("Start PegaFlow Server") and docs/p2p.md ("Quick
Start"). Each command line is kept flag for flag; only what a test host must change is
changed: addresses become loopback ports, sizes become small, and what the original's
command leaves at a default this host cannot give (a 512 GB SSD tier, the one Redis port,
the metrics port, and the node's name, which defaults to the hostname: two nodes on one
host need two) is set through the ``PEGAFLOW_*`` environment. The
RDMA devices of ``--nics`` are the fake verbs layer at the hardware edge
(``tests/fakes/pyverbs``); everything above it is the node's real code.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from pegaflow._proto import meta_pb2, meta_pb2_grpc, node_pb2, node_pb2_grpc
from tests.harness.ports import free_port
from tests.integration.redis_fixtures import redis_server  # noqa: F401
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FAKES = ROOT / "tests" / "fakes"


def console(name: str) -> str:
    exe = shutil.which(name)
    assert exe, f"console script {name} is not installed (pip install -e .)"
    return exe


class Proc:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.log_path = log
        self.argv = argv
        with open(log, "ab") as f:
            self.p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=ROOT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        assert self.p.poll() is None, f"{' '.join(self.argv)} exited {self.p.returncode}:\n{self.log()[-3000:]}"
        return True

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def node_serves(addr: str, proc: Proc) -> bool:
    proc.alive()
    with grpc.insecure_channel(addr) as ch:
        try:
            return node_pb2_grpc.PegaNodeStub(ch).Health(node_pb2.HealthRequest(), timeout=1).ok
        except grpc.RpcError:
            return False


def metaserver_serves(addr: str, proc: Proc) -> bool:
    proc.alive()
    with grpc.insecure_channel(addr) as ch:
        try:
            meta_pb2_grpc.MetaServiceStub(ch).ListNodes(meta_pb2.ListNodesRequest(), timeout=1)
            return True
        except grpc.RpcError:
            return False


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def client(cmd: str, addr: str, tag: str, n: int, *extra: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "tests.harness.p2p_client", cmd, addr, tag, str(n), *extra],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_bare_pegaflow_server_serves_on_the_originals_defaults(tmp_path: Path, procs: list[Proc]):
    # README "2. Start PegaFlow Server": `pegaflow-server`. Default gRPC 127.0.0.1:50055 and
    # metrics 127.0.0.1:9091; only the 30 GB default pool is made small.
    assert port_is_free(50055) and port_is_free(9091), "the original's default ports are taken on this host"
    node = Proc([console("pegaflow-server")], tmp_path / "node.log", {"PEGAFLOW_POOL_SIZE": "64mb"})
    procs.append(node)
    wait_until(lambda: node_serves("127.0.0.1:50055", node), 30, "pegaflow-server on 127.0.0.1:50055")
    with urllib.request.urlopen("http://127.0.0.1:9091/health", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["ok"] is True
    saved = client("save", "127.0.0.1:50055", "bare", 4)
    assert saved["committed"] == 4
    loaded = client("load", "127.0.0.1:50055", "bare", 4)
    assert loaded["hit"] == 4 and loaded["identical"]


def test_the_originals_p2p_quick_start_builds_a_cluster(tmp_path: Path, procs: list[Proc], redis_server):  # noqa: F811
    meta_port, a_port, b_port = free_port(), free_port(), free_port()
    meta = f"http://127.0.0.1:{meta_port}"
    redis_env = {"PEGAFLOW_REDIS_URL": redis_server.url}  # the default, 127.0.0.1:6379, is not ours to take
    # "1. Start MetaServer": pegaflow-metaserver --addr 0.0.0.0:50056
    # Its metrics port (127.0.0.1:9092, the original's) is not the node's (9091): both run on one host.
    assert port_is_free(9092), "the metaserver's default metrics port is taken on this host"
    m = Proc([console("pegaflow-metaserver"), "--addr", f"127.0.0.1:{meta_port}"], tmp_path / "meta.log", redis_env)
    procs.append(m)
    wait_until(lambda: metaserver_serves(f"127.0.0.1:{meta_port}", m), 30, "pegaflow-metaserver")
    channel = grpc.insecure_channel(f"127.0.0.1:{meta_port}")
    stub = meta_pb2_grpc.MetaServiceStub(channel)
    # "2. Start PegaFlow nodes", node A as the issue quotes it:
    #   pegaflow-server --addr 10.0.0.11:50055 --pool-size 30gb --ssd-cache-path P --nics mlx5_0 mlx5_1
    #                   --metaserver-addr http://metaserver-host:50056
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    a_argv = [console("pegaflow-server"), "--addr", f"127.0.0.1:{a_port}", "--pool-size", "64mb",
              "--ssd-cache-path", str(ssd), "--nics", "mlx5_0", "mlx5_1", "--metaserver-addr", meta]
    a_env = {
        "PEGAFLOW_NODE_ID": "node-a",
        "PEGAFLOW_SSD_CACHE_CAPACITY": "256mb",
        "PEGAFLOW_HTTP_ADDR": f"127.0.0.1:{free_port()}",
        "PYTHONPATH": os.pathsep.join([str(FAKES), str(ROOT)]),
        "PEGAFLOW_FAKE_RDMA_DEVICES": "mlx5_0,mlx5_1",
    }
    a = Proc(a_argv, tmp_path / "node-a.log", a_env)
    procs.append(a)
    wait_until(lambda: node_serves(f"127.0.0.1:{a_port}", a), 60, "node A")
    assert '"transport": "rdma"' in a.log() or "transport=rdma" in a.log(), a.log()[-2000:]
    assert "ssd_tier_ready" in a.log()

    # Given only --metaserver-addr, A found the metaserver's Redis and is published.
    def a_listed() -> bool:
        nodes = stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=2).nodes
        return any(n.address == f"127.0.0.1:{a_port}" and n.alive for n in nodes)

    wait_until(a_listed, 30, "node A in the metaserver's ListNodes")
    assert client("save", f"127.0.0.1:{a_port}", "qs", 8)["committed"] == 8

    # Node B, the original's form without RDMA devices (TCP data plane):
    #   pegaflow-server --addr 10.0.0.2:50055 --pool-size 30gb --metaserver-addr http://10.0.0.100:50056
    b = Proc([console("pegaflow-server"), "--addr", f"127.0.0.1:{b_port}", "--pool-size", "64mb",
              "--metaserver-addr", meta], tmp_path / "node-b.log",
             {"PEGAFLOW_NODE_ID": "node-b", "PEGAFLOW_HTTP_ADDR": f"127.0.0.1:{free_port()}"})
    procs.append(b)
    wait_until(lambda: node_serves(f"127.0.0.1:{b_port}", b), 60, "node B")
    # B misses locally and pulls A's blocks: LOADING, then READY with every block, bytes equal.
    got = client("load", f"127.0.0.1:{b_port}", "qs", 8, "--until-hit", "--timeout", "60")
    assert got["hit"] == 8 and got["identical"], got
    assert any(s.startswith("LOADING") for s in got["statuses"]), got
    channel.close()


def test_metaserver_without_a_reachable_redis_says_how_to_start_one(tmp_path: Path):
    dead = free_port()
    p = subprocess.run([console("pegaflow-metaserver"), "--addr", f"127.0.0.1:{free_port()}"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PEGAFLOW_REDIS_URL": f"redis://127.0.0.1:{dead}/0"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert f"127.0.0.1:{dead}" in lines[0] and "infra/redis/" in lines[0] and "Traceback" not in p.stderr


def test_metaserver_metrics_port_in_use_is_a_one_line_error(redis_server):  # noqa: F811
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([console("pegaflow-metaserver"), "--addr", f"127.0.0.1:{free_port()}",
                            "--http-addr", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PEGAFLOW_REDIS_URL": redis_server.url})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and f"--http-addr 127.0.0.1:{port}" in lines[0], p.stderr
    assert "Traceback" not in p.stderr
