"""Shared fixtures: free ports and real `pegaflow-node` daemon processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.e2e.harness import VLLM_RPC, temp_dir_removed_at_exit, vllm_rpc_dir
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Sockets a killed process cannot remove go to directories of this run, removed when it
    exits, so the suite leaves nothing in the system temporary directory:

    - vLLM names its ZeroMQ IPC sockets ``$VLLM_RPC_BASE_PATH/<uuid4>`` (default: the system
      temporary directory): about 85 per run (``tests.e2e.harness.vllm_rpc_dir``);
    - a node puts its local socket and its own token in ``$XDG_RUNTIME_DIR`` (else ``/tmp``,
      ``pegaflow.common.security.default_socket_path``): about 11 per run from the tests
      that kill nodes. Clients look for the token there too, and every process a test starts
      inherits the variable. A node with ``--access-group`` still uses ``/tmp``."""
    os.environ[VLLM_RPC] = vllm_rpc_dir()
    os.environ["XDG_RUNTIME_DIR"] = temp_dir_removed_at_exit("pf-test-run-")  # 0700, as a user's is


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeProcess:
    """A real `pegaflow-node` subprocess; restartable on the same port."""

    def __init__(self, tmp: Path, pool_size: str = "64mb", extra: list[str] | None = None,
                 env: dict[str, str] | None = None, render_interval: float | None = 0.0) -> None:
        self.port = free_port()
        self.http_port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.pool_size = pool_size
        # /metrics renders on every scrape here: the default rate limit (one render per
        # --metrics-render-interval, never a stale answer) would only make tests that read
        # metrics back to back wait; tests/unit/test_http_renders.py covers it. None: the
        # node's default (what the benchmarks measure).
        self.extra = ([] if render_interval is None else ["--metrics-render-interval", str(render_interval)]) + list(
            extra or [])
        self.env = env or {}
        self.log_path = tmp / f"node-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "pegaflow.node.cli", "--addr", self.addr, "--pool-size", self.pool_size,
                "--http-addr", f"127.0.0.1:{self.http_port}", "--log-format", "json", *self.extra]

    def start(self, timeout: float = 30.0, wait_pool: bool = True) -> NodeProcess:
        """Start and wait until the node answers Health and (``wait_pool``) its pool is
        fully pre-faulted, so a test sees the whole capacity."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, env={**os.environ, **self.env})
        self.wait_ready(timeout, wait_pool)
        return self

    def wait_ready(self, timeout: float, wait_pool: bool = True) -> None:
        from pegaflow._proto import node_pb2, node_pb2_grpc
        from pegaflow.common.security import Security, sync_channel

        # Reconnect fast: gRPC's default first backoff (~1 s) made every start wait ~0.5 s
        # after the node was already listening.
        fast = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
                ("grpc.max_reconnect_backoff_ms", 100)]
        with sync_channel(self.addr, Security.load(env={**os.environ, **self.env}), fast) as ch:
            stub = node_pb2_grpc.PegaNodeStub(ch)

            def ready() -> bool:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"node exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
                h = stub.Health(node_pb2.HealthRequest(), timeout=1)
                return not wait_pool or h.pool_prefaulted_bytes >= h.pool_bytes

            wait_until(ready, timeout, lambda: f"node {self.addr} to be ready: {self.log_path.read_text()[-2000:]}",
                       every=0.05, ignore=grpc.RpcError)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def log(self) -> str:
        return self.log_path.read_text()

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of the node's Prometheus series ``name`` whose labels contain ``labels``."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5).read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
            if m and labels in (m.group(1) or ""):
                total += float(m.group(2))
        return total

    @property
    def local_socket(self) -> str:
        """The node's default local-socket path (``--local-socket auto``)."""
        from pegaflow.node.transports.unix_socket import default_socket_path

        return default_socket_path("127.0.0.1", self.port, {**os.environ, **self.env})

    def remove_local_socket(self) -> None:
        """A SIGKILLed node leaves its socket file and its own token beside it behind (the next
        node on the port would replace the socket and remove the token): at the default path,
        or with ``--access-group`` at the shared one in ``/tmp``."""
        from pegaflow.common.security import default_socket_path, token_path

        shared = default_socket_path("127.0.0.1", self.port, shared=True)
        for path in (self.local_socket, token_path(self.local_socket), shared, token_path(shared)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator:
    nodes: list[NodeProcess] = []

    def make(pool_size: str = "64mb", extra: list[str] | None = None, start: bool = True,
             env: dict[str, str] | None = None) -> NodeProcess:
        n = NodeProcess(tmp_path, pool_size, extra, env)
        nodes.append(n)
        return n.start() if start else n

    yield make
    for n in nodes:
        n.kill()
        n.remove_local_socket()


@pytest.fixture
def node(node_factory) -> NodeProcess:
    return node_factory()
