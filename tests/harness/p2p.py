"""A P2P cluster on one machine: redis + pegaflow-meta in the hub namespace, one real
pegaflow-node per host namespace (tests/harness/netns.py), for tests and the benchmarks
(bench/p2p.py, p2p_ssd.py, cluster_model.py).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.harness.netns import Cluster, Host, make_cluster
from tests.harness.node import FAST_RECONNECT
from tests.waiting import next_line, wait_until

NODE_PORT, HTTP_PORT, META_PORT, REDIS_PORT = 50055, 9091, 50056, 6379

HEALTH = """
import sys, grpc
from pegaflow._proto import node_pb2, node_pb2_grpc
ch = grpc.insecure_channel(sys.argv[1])
node_pb2_grpc.PegaNodeStub(ch).Health(node_pb2.HealthRequest(), timeout=1)
"""

# A refused first connection waits out gRPC's reconnect backoff (~1 s by default): the node
# harness's short one.
META_READY = f"""
import sys, grpc
grpc.channel_ready_future(grpc.insecure_channel(sys.argv[1], options={FAST_RECONNECT!r})).result(timeout=1)
"""

HOLDERS = """
import sys, json, grpc, xxhash
from pegaflow._proto import meta_pb2, meta_pb2_grpc
addr, ns, tag, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
hs = [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]
stub = meta_pb2_grpc.MetaServiceStub(grpc.insecure_channel(addr))
res = stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace=ns, hashes=hs), timeout=5)
print(json.dumps({x.node: x.prefix_len for x in res.nodes}))
"""

FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
RUN_CLIENT = "from tests.harness.p2p_client import main; main()"


@dataclass
class NodeInfo:
    host: Host
    name: str
    proc: subprocess.Popen | None
    log: Path

    @property
    def addr(self) -> str:
        return f"{self.host.ip}:{NODE_PORT}"


class P2PCluster:
    """Redis + metaserver on the hub, ``n`` nodes on hosts; every process killed by close()."""

    def __init__(self, tmp: Path, n: int = 3, pool: str = "256mb", node_args: tuple[str, ...] = (),
                 per_node_args: dict[int, tuple[str, ...]] | None = None, meta_args: tuple[str, ...] = (),
                 render_interval: float | None = None) -> None:
        """``render_interval``: the nodes' ``--metrics-render-interval``, as ``Node`` takes it
        (tests/harness/node.py): None keeps the node's default (benchmarks), tests pass
        ``EVERY_SCRAPE`` (at the default, every metric read waited up to a second)."""
        self.tmp = tmp
        self.c: Cluster = make_cluster(n)
        self.pool = pool
        render = () if render_interval is None else ("--metrics-render-interval", str(render_interval))
        self.node_args = (*render, *node_args)
        self.per_node_args = per_node_args or {}  # node i's own flags, after node_args (later flags win)
        hub = self.c.hub
        self.redis_url = f"redis://{hub.ip}:{REDIS_PORT}/0"
        self.meta_addr = f"{hub.ip}:{META_PORT}"
        self.nodes: list[NodeInfo] = []
        try:
            self.c.spawn(hub, ["redis-server", "--bind", hub.ip, "--port", str(REDIS_PORT), "--save", "",
                               "--appendonly", "no", "--protected-mode", "no", "--dir", str(tmp)], tmp / "redis.log")
            wait_until(lambda: hub.run(["redis-cli", "-h", hub.ip, "-p", str(REDIS_PORT), "ping"]).stdout.strip()
                       == "PONG", 20, "redis")
            self.c.spawn(hub, [sys.executable, "-m", "pegaflow.meta.cli", "--redis-url", self.redis_url, "--addr",
                               self.meta_addr, "--http-addr", "off", "--log-format", "json", *meta_args],
                         tmp / "meta.log")
            wait_until(lambda: hub.py(META_READY, self.meta_addr).returncode == 0, 30, "metaserver")
            for i, h in enumerate(self.c.hosts):
                self.nodes.append(NodeInfo(h, f"node-{i}", None, tmp / f"node-{i}.log"))
                self._spawn_node(i)
            for i in range(n):  # all start at once; each is then waited for
                self._wait_node(i)
        except BaseException:
            self.close()
            raise

    @property
    def fallback_reason(self) -> str:
        return self.c.fallback_reason

    def start_node(self, i: int) -> None:
        """Start node ``i`` (again) and wait until it answers Health."""
        self._spawn_node(i)
        self._wait_node(i)

    def _spawn_node(self, i: int) -> None:
        n = self.nodes[i]
        h = n.host
        args = [sys.executable, "-m", "pegaflow.node.cli", "--addr", n.addr, "--pool-size", self.pool,
                "--http-addr", f"{h.ip}:{HTTP_PORT}", "--redis-url", self.redis_url, "--meta-addr", self.meta_addr,
                "--node-id", n.name, "--log-format", "json", "--liveness-ttl", "5", *self.node_args,
                *self.per_node_args.get(i, ())]
        n.proc = self.c.spawn(h, args, n.log)

    def _wait_node(self, i: int) -> None:
        n, h = self.nodes[i], self.nodes[i].host
        try:
            wait_until(lambda: n.proc.poll() is None and h.py(HEALTH, n.addr).returncode == 0, 60, f"{n.name}")
        except AssertionError:
            raise AssertionError(f"{n.name} did not start:\n{n.log.read_text()[-3000:]}") from None

    def kill_node(self, i: int) -> None:
        p = self.nodes[i].proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)

    def client(self, i: int, *args: str, timeout: float = 120) -> dict:
        """Run tests/harness/p2p_client.py on host i; its last JSON line. It runs in the host's
        agent process (``Host.py``), as ``python -m tests.harness.p2p_client`` would: a process
        per call spent ~1.8 s of CPU importing torch, and the P2P tests make ~30 calls."""
        h = self.nodes[i].host
        r = h.py(RUN_CLIENT, args[0], self.nodes[i].addr, *args[1:], timeout=timeout)
        if r.returncode != 0:
            raise AssertionError(f"client on node-{i} failed ({r.returncode}): {r.stdout}\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def client_proc(self, i: int, *args: str) -> subprocess.Popen:
        h = self.nodes[i].host
        return self.c.spawn(h, [sys.executable, "-m", "tests.harness.p2p_client", args[0], self.nodes[i].addr,
                                *args[1:]], self.tmp / f"client-{i}.log", stdout=subprocess.PIPE, text=True)

    def holders(self, ns: str, tag: str, n: int) -> dict[str, int]:
        r = self.c.hub.py(HOLDERS, self.meta_addr, ns, tag, str(n))
        if r.returncode != 0:
            return {}
        return json.loads(r.stdout.strip())

    def wait_indexed(self, ns: str, tag: str, n: int, node: str, timeout: float = 20) -> None:
        wait_until(lambda: self.holders(ns, tag, n).get(node) == n, timeout, f"{node} holding {tag} in the index",
                   every=0.2)

    def metrics(self, i: int) -> str:
        h = self.nodes[i].host
        r = h.py(FETCH, f"http://{h.ip}:{HTTP_PORT}/metrics")
        assert r.returncode == 0, r.stderr
        return r.stdout

    def metric(self, i: int, name: str, labels: str = "") -> float:
        pat = re.compile(rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} ([0-9.e+-]+)$", re.M)
        m = pat.search(self.metrics(i))
        return float(m.group(1)) if m else float("nan")

    def close(self) -> None:
        for h in self.c.hosts:
            if h.ns:
                try:
                    h.shape("")
                except Exception:  # noqa: BLE001
                    pass
        self.c.close()
        # The nodes were SIGKILLed: their local sockets and own tokens are left at the default
        # path (the namespaces share the file system; in /tmp outside the test run).
        from pegaflow.common.security import default_socket_path, token_path

        for n in self.nodes:
            sock = default_socket_path(n.host.ip, NODE_PORT)
            for path in (sock, token_path(sock)):
                Path(path).unlink(missing_ok=True)


def wait_line(proc: subprocess.Popen, timeout: float) -> dict:
    """Next JSON line of a client_proc (blocking up to ``timeout``)."""
    assert proc.stdout is not None
    return json.loads(next_line(proc.stdout, proc, timeout, "a line from the client"))
