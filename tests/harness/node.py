"""A real ``pegaflow-node`` daemon, the one way tests and benchmarks start one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from tests.harness import forked
from tests.harness.ports import free_port
from tests.harness.procs import REPO
from tests.waiting import wait_until

READY_TIMEOUT_S = 30.0  # start-up to Health answering with the pool pre-faulted
STOP_TIMEOUT_S = 30.0  # SIGTERM to exit: a node that takes longer is a bug (stop() says so)
# --metrics-render-interval 0: /metrics renders on every scrape. The node's default (one
# render per interval, never a stale answer) would only make tests that read metrics back to
# back wait; tests/unit/test_http_renders.py covers it. Benchmarks keep the default (None).
EVERY_SCRAPE = 0.0
# Reconnect fast while waiting for a start: gRPC's default first backoff (~1 s) made every
# start wait ~0.5 s after the node was already listening.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
                  ("grpc.max_reconnect_backoff_ms", 100)]


class Node:
    """A ``pegaflow-node`` subprocess on free loopback ports, restartable on the same ports.

    Constructing one picks its ports and log file and starts nothing: ``start()`` runs it and
    waits until it is ready; ``kill()`` (a crash) or ``stop()`` (SIGTERM) end it, and
    ``start()`` again restarts it on the same address. ``pool_size``, ``extra``, ``env`` and
    ``render_interval`` are read at each start, so a test may change them in between.

    What callers choose, each with the one default of every caller that does not say:

    - ``pool_size``: always given (tests use a few MiB, engines 256 MiB to 2 GiB);
    - ``http``: /metrics and /health on a free port (``http_port``; ``metric()`` reads it), or
      ``--http-addr off``;
    - ``render_interval``: ``--metrics-render-interval``; None keeps the node's default (what
      users and the benchmarks run), tests pass ``EVERY_SCRAPE``;
    - ``extra``: more flags, after the harness's (a later flag wins); ``env``: more environment;
    - ``port``, ``host``: a given address (``host`` "0.0.0.0" or a 127.0.0.x of its own).

    The node runs ``python -m pegaflow.node.cli`` with this interpreter (in the tests, forked
    from a fork server that has its imports done: ``forked.py``), in the repository, with JSON logs (stdout and stderr) appended to ``log_dir/node-<host>-<port>-<ms>.log``:
    one file per Node, across its restarts.
    """

    def __init__(self, log_dir: Path, pool_size: str, *, http: bool = True, render_interval: float | None = None,
                 extra: Sequence[str] = (), env: Mapping[str, str] | None = None, port: int | None = None,
                 host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port()
        self.addr = f"{host}:{self.port}"
        self.http_port: int | None = free_port() if http else None
        self.pool_size = pool_size
        self.render_interval = render_interval
        self.extra = list(extra)
        self.env = dict(env or {})
        self.log_path = log_dir / f"node-{host}-{self.port}-{int(time.time() * 1000)}.log"
        self.proc: subprocess.Popen[bytes] | forked.Forked | None = None

    def argv(self) -> list[str]:
        http = "off" if self.http_port is None else f"{self.host}:{self.http_port}"
        render = [] if self.render_interval is None else ["--metrics-render-interval", str(self.render_interval)]
        return [sys.executable, "-m", "pegaflow.node.cli", "--addr", self.addr, "--pool-size", self.pool_size,
                "--http-addr", http, "--log-format", "json", *render, *self.extra]

    def start(self, timeout: float = READY_TIMEOUT_S, wait_pool: bool = True) -> Node:
        """Start and wait until the node answers Health and (``wait_pool``) its pool is fully
        pre-faulted: it serves while the pool pre-faults, handing out only faulted pages, so a
        caller that saved at once could find no pages free (a 64 MiB pool is one pre-fault
        chunk: nothing is allocatable until it is done) and a test would see less than the
        whole capacity."""
        self.proc = forked.start(self.argv(), {**os.environ, **self.env}, REPO, self.log_path)
        self.wait_ready(timeout, wait_pool)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S, wait_pool: bool = True) -> None:
        from pegaflow._proto import node_pb2, node_pb2_grpc
        from pegaflow.common.security import Security, sync_channel

        with sync_channel(self.addr, Security.load(env={**os.environ, **self.env}), FAST_RECONNECT) as ch:
            stub = node_pb2_grpc.PegaNodeStub(ch)

            def ready() -> bool:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"node exited {self.proc.returncode}: {self.log()[-2000:]}")
                h = stub.Health(node_pb2.HealthRequest(), timeout=1)
                return not wait_pool or h.pool_prefaulted_bytes >= h.pool_bytes

            wait_until(ready, timeout, lambda: f"node {self.addr} to be ready: {self.log()[-2000:]}",
                       every=0.05, ignore=grpc.RpcError)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL, as a crash would) and wait for the exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM and wait; a node still running after ``timeout`` is SIGKILLed and reported
        (AssertionError): a clean stop is part of what the node promises."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"node {self.addr} still ran {timeout}s after SIGTERM: {self.log()[-2000:]}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stats(self) -> Any:
        """The node's Stats answer (``node_pb2.StatsResponse``)."""
        from pegaflow.client import PegaClient

        c = PegaClient(self.addr, timeout=5.0)
        try:
            return c.stats()
        finally:
            c.close()

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of the node's Prometheus series ``name`` whose labels contain ``labels``."""
        assert self.http_port is not None, "this node runs with --http-addr off"
        url = f"http://{self.host}:{self.http_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
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

        return default_socket_path(self.host, self.port, {**os.environ, **self.env})

    def remove_local_socket(self) -> None:
        """A SIGKILLed node leaves its socket file and its own token beside it behind (the next
        node on the port would replace the socket and remove the token): at the default path,
        or with ``--access-group`` at the shared one in ``/tmp``."""
        from pegaflow.common.security import default_socket_path, token_path

        shared = default_socket_path(self.host, self.port, shared=True)
        for path in (self.local_socket, token_path(self.local_socket), shared, token_path(shared)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
