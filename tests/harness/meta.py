"""A real ``pegaflow-meta`` metaserver, the one way tests and benchmarks start one."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from tests.harness import forked
from tests.harness.node import FAST_RECONNECT
from tests.harness.ports import free_port
from tests.harness.procs import REPO, python_env
from tests.waiting import wait_until

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


class MetaServer:
    """A ``pegaflow-meta`` subprocess on a free loopback port, against ``redis_url``.

    Constructing one picks its ports and starts nothing; ``start()`` runs it and waits until
    ListNodes answers (and, with ``http``, /metrics does). Its flags are the product's
    defaults but for the harness's: ``--addr``, ``--http-addr`` (a free port, or off),
    ``--redis-cluster`` with ``cluster``; ``extra`` come after them (a later flag wins), ``env``
    on top of this process's environment (in the tests, forked from the fork server of
    ``forked.py``). Logs (stdout and stderr; the default level, info:
    tests read the consumer's events there) are appended to ``log_path``.
    """

    def __init__(self, redis_url: str, log_path: Path, *, cluster: bool = False, http: bool = False,
                 extra: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.redis_url = redis_url
        self.log_path = log_path
        self.cluster = cluster
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.http_port: int | None = free_port() if http else None
        self.extra = list(extra)
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | forked.Forked | None = None
        self._channel: grpc.Channel | None = None

    def argv(self) -> list[str]:
        http = "off" if self.http_port is None else f"127.0.0.1:{self.http_port}"
        return [sys.executable, "-m", "pegaflow.meta.cli", "--redis-url", self.redis_url, "--addr", self.addr,
                "--http-addr", http, *(["--redis-cluster"] if self.cluster else []),
                *self.extra]

    def start(self, timeout: float = READY_TIMEOUT_S) -> MetaServer:
        self.proc = forked.start(self.argv(), python_env(**self.env), REPO, self.log_path)

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"pegaflow-meta exited {self.proc.returncode}: {self.log()[-2000:]}")
            self.stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=1)
            if self.http_port is not None:
                urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=2).read()
            return True

        try:
            wait_until(up, timeout, lambda: f"pegaflow-meta to serve: {self.log()[-3000:]}",
                       ignore=(grpc.RpcError, OSError))
        except AssertionError:
            self.kill()
            raise
        return self

    @property
    def stub(self) -> meta_pb2_grpc.MetaServiceStub:
        """A stub on one channel kept for this server's life (closed by stop/kill)."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.addr, options=FAST_RECONNECT)  # a start waits less
        return meta_pb2_grpc.MetaServiceStub(self._channel)

    def query(self, namespace: str, hashes: list[bytes]) -> dict[str, int]:
        """QueryPrefix: node name -> prefix length."""
        res = self.stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace=namespace, hashes=hashes), timeout=10)
        return {n.node: n.prefix_len for n in res.nodes}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL what still runs after STOP_TIMEOUT_S."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._close()

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
