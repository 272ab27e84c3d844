"""Helpers for metaserver integration tests: real `pegaflow-meta` and node-like processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.cluster import keys, registry
from pegaflow.cluster.redis_conn import Client, connect
from pegaflow.meta.index import Index
from tests.integration.redis_fixtures import free_port_range
from tests.waiting import next_line, wait_until

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


class MetaProc:
    """A `pegaflow-meta` process (python -m pegaflow.meta.cli) with its own gRPC port."""

    def __init__(
        self, url: str, cluster: bool, name: str, log: Path, lease_ttl: float = 2.0, sweep: float = 0.0
    ):
        self.port = free_port_range(1, lo=30000, hi=40000)
        self.name = name
        args = [
            sys.executable, "-m", "pegaflow.meta.cli", "--redis-url", url, "--addr", f"127.0.0.1:{self.port}",
            "--http-addr", "off", "--consumer-name", name, "--stream-lease-ttl", str(lease_ttl),
            "--sweep-interval", str(sweep), "--log-level", "info",
        ]  # fmt: skip
        if cluster:
            args.append("--redis-cluster")
        self.log = log
        self.proc = subprocess.Popen(args, env=ENV, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = meta_pb2_grpc.MetaServiceStub(self.channel)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=30)
        except grpc.FutureTimeoutError:
            self.kill()
            raise AssertionError(f"metaserver did not start:\n{log.read_text()[-3000:]}") from None

    def query(self, namespace: str, hashes: list[bytes]) -> dict[str, int]:
        res = self.stub.QueryPrefix(
            meta_pb2.QueryPrefixRequest(namespace=namespace, hashes=hashes), timeout=10
        )
        return {n.node: n.prefix_len for n in res.nodes}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.channel.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.channel.close()


def run_rebuild(url: str, cluster: bool) -> dict:
    args = [
        sys.executable,
        "-m",
        "pegaflow.meta.cli",
        "rebuild",
        "--redis-url",
        url,
        "--log-level",
        "warning",
    ]
    if cluster:
        args.append("--redis-cluster")
    out = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


class PublisherProc:
    """A node-like publisher process (tests/integration/meta_nodeproc.py): a node's
    ``EventPublisher`` driven by a random workload, with its ground truth in a state file."""

    def __init__(self, url: str, cluster: bool, node: str, state: Path, log: Path, *extra: str) -> None:
        self.node = node
        self.state = state
        args = [sys.executable, "-m", "tests.integration.meta_nodeproc", "--redis-url", url, "--node", node,
                "--state", str(state), *extra]  # fmt: skip
        if cluster:
            args.append("--cluster")
        self.log = log
        self.proc = subprocess.Popen(args, env=ENV, stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True)
        self.result: dict | None = None

    def wait_done(self, timeout: float = 60) -> dict:
        """Wait until the workload is published (the process prints one JSON line)."""
        assert self.proc.stdout is not None
        line = next_line(self.proc.stdout, self.proc, timeout, f"publisher {self.node} to finish",
                         tail=lambda: self.log.read_text()[-3000:])
        self.result = json.loads(line)
        return self.result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def load_truth(states: dict[str, Path]) -> dict[tuple[str, bytes], frozenset[str]]:
    """(namespace tag, hash) -> names of the nodes holding it, from the nodes' final states."""
    out: dict[tuple[str, bytes], set[str]] = {}
    for node, path in states.items():
        for ns, hs in json.loads(path.read_text()).items():
            for h in hs:
                out.setdefault((keys.ns_tag(ns), bytes.fromhex(h)), set()).add(node)
    return {k: frozenset(v) for k, v in out.items()}


def index_view(r: Client) -> dict[tuple[str, bytes], frozenset[str]]:
    """What readers see: (namespace tag, hash) -> live node names, from the whole index."""
    names = sorted(registry.nodes(r))
    vis = registry.visible(r, names)
    tags = sorted(t.decode() for t in r.hkeys(keys.NAMESPACES))
    out = {}
    for k, nids in Index(r).dump(tags, set(vis)).items():
        out[k] = frozenset(vis[n] for n in nids)
    return out


def client(url: str, cluster: bool) -> Client:
    return connect(url, cluster)


def wait_converged(r: Client, states: dict[str, Path], timeout: float = 60) -> None:
    """Wait until the visible index equals the nodes' ground truth (diff in the failure message)."""
    last: list = []

    def same() -> bool:
        truth, view = load_truth(states), index_view(r)
        last[:] = [truth, view]
        return truth == view

    try:
        wait_until(same, timeout, "index == ground truth", every=0.3)
    except AssertionError:
        truth, view = last
        missing = len(set(truth) - set(view))
        extra = len(set(view) - set(truth))
        wrong = sum(1 for k in set(truth) & set(view) if truth[k] != view[k])
        raise AssertionError(
            f"index != truth: {len(truth)} true blocks, {len(view)} indexed, "
            f"{missing} missing, {extra} extra, {wrong} with wrong holders"
        ) from None
