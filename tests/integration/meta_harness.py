"""Helpers for metaserver integration tests: the metaserver they run, node-like publisher
processes, and the index checked against the publishers' ground truth."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pegaflow.cluster import keys, registry
from pegaflow.cluster.redis_conn import Client, connect
from pegaflow.meta.index import Index
from tests.harness import forked
from tests.harness.meta import MetaServer
from tests.harness.procs import REPO, python_env
from tests.waiting import wait_until

# The index tests' metaserver: a short stream lease (a dead consumer's streams are claimed
# within seconds) and no sweeper unless a test asks for one.
LEASE_TTL_S = 2.0
SWEEP_S = 0.0


# A node silent this long is reaped by a sweeping metaserver (--ttl-minutes 0.05: 3 s; its
# --node-stale-secs must fit in it), instead of the product's two hours.
SHORT_TTL = ("--ttl-minutes", "0.05", "--node-stale-secs", "2")


def start_meta(url: str, cluster: bool, name: str, log: Path, lease_ttl: float = LEASE_TTL_S,
               sweep: float = SWEEP_S, extra: Sequence[str] = ()) -> MetaServer:
    """A metaserver (tests/harness/meta.py) consuming as ``name``, with the index tests' lease
    and sweep (``extra`` after them)."""
    return MetaServer(url, log, cluster=cluster, extra=["--consumer-name", name, "--stream-lease-ttl", str(lease_ttl),
                                                        "--sweep-interval", str(sweep), *extra]).start()


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
    out = subprocess.run(args, env=python_env(), capture_output=True, text=True, timeout=300)
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
        # Its one JSON line (stdout) once the workload is published; a file of this process's own
        # (a restarted node's publisher shares the log).
        self.out = log.parent / f"{log.stem}-{time.monotonic_ns()}.out"
        self.proc = forked.start(args, python_env(), REPO, log, out_path=self.out)
        self.result: dict | None = None

    def wait_done(self, timeout: float = 60) -> dict:
        """Wait until the workload is published (the process prints one JSON line)."""

        def line() -> str | None:
            text = self.out.read_text() if self.out.exists() else ""
            if "\n" in text:
                return text.split("\n", 1)[0]
            if self.proc.poll() is not None:
                raise AssertionError(f"publisher {self.node} exited with status {self.proc.returncode} and wrote no line")
            return None

        try:
            got = wait_until(line, timeout, f"publisher {self.node} to finish", every=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log.read_text()[-3000:]}") from None
        self.result = json.loads(got)
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
