"""Several hosts on one machine: Linux network namespaces joined by veth pairs and a bridge.

    hub namespace:   bridge br0 (10.X.Y.1/24)  -- redis-server, pegaflow-meta
    host namespaces: eth0 (10.X.Y.11, .12, ...) -- one pegaflow-node each, its clients

Every name carries a unique suffix and the private subnet exists only inside namespaces
created here, so parallel runs and the root namespace are untouched. :meth:`Cluster.close`
deletes the namespaces (their veths and the bridge go with them).

When namespaces cannot be created (not root, no ``ip``), :func:`make_cluster` falls back
to loopback: each host gets its own 127.0.0.x address in the root namespace, and
``fallback_reason`` says why (tests print it). Link shaping (``tc``) is unavailable then.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.waiting import next_line

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# One Python process per host runs the snippets of ``Host.py``, one at a time, each as
# ``python -c CODE ARGS...`` would (``sys.argv``, ``__main__``, its output and exit status).
# A process per snippet cost ~0.1-0.2 s of CPU in imports (urllib, grpc): tests poll metrics
# and the index with snippets every 0.1 s for tens of seconds.
AGENT = r"""
import contextlib, io, json, sys, traceback
reply = sys.stdout
for line in sys.stdin:
    req = json.loads(line)
    out, err, rc = io.StringIO(), io.StringIO(), 0
    sys.argv = ["-c", *req["args"]]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            rc = 1
    reply.write(json.dumps({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
    reply.flush()
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@dataclass
class Host:
    name: str
    ns: str | None  # None: loopback fallback, root namespace
    ip: str
    dev: str = "eth0"
    _agent: subprocess.Popen | None = field(default=None, init=False, repr=False, compare=False)
    _agent_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def argv(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args] if self.ns else list(args)

    def popen(self, args: list[str], log: Path, **kw: object) -> subprocess.Popen:
        f = open(log, "ab")
        return subprocess.Popen(self.argv(args), stdout=kw.pop("stdout", f), stderr=f, env=ENV, **kw)  # type: ignore[call-overload]

    def run(self, args: list[str], timeout: float = 120, **kw: object) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(args), capture_output=True, text=True, timeout=timeout, env=ENV, **kw)  # type: ignore[call-overload]

    def py(self, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``code`` as ``python -c code *args`` on this host would, in its one agent process
        (``AGENT``, started on first use). Past ``timeout`` the agent is killed (the next call
        starts another) and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` would."""
        argv = [sys.executable, "-c", code, *args]
        with self._agent_lock:
            agent = self._agent
            if agent is None or agent.poll() is not None:
                agent = self._agent = subprocess.Popen(self.argv([sys.executable, "-c", AGENT]), stdin=subprocess.PIPE,
                                                       stdout=subprocess.PIPE, text=True, env=ENV)
            assert agent.stdin is not None and agent.stdout is not None
            agent.stdin.write(json.dumps({"code": code, "args": list(args)}) + "\n")
            agent.stdin.flush()
            try:
                got = json.loads(next_line(agent.stdout, agent, timeout, f"a snippet on {self.name}"))
            except AssertionError:
                self.close()
                raise subprocess.TimeoutExpired(argv, timeout) from None
        return subprocess.CompletedProcess(argv, got["rc"], got["stdout"], got["stderr"])

    def close(self) -> None:
        """Stop this host's agent process, if one runs."""
        agent, self._agent = self._agent, None
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait(10)

    def tx_bytes(self) -> int:
        """Bytes this host has sent on its link so far (the kernel's interface counter)."""
        out = self.run(["cat", f"/sys/class/net/{self.dev}/statistics/tx_bytes"], timeout=10)
        return int(out.stdout)

    def shape(self, rate: str) -> None:
        """Cap this host's egress (tc tbf), e.g. ``"50mbit"``; ``""`` removes the cap."""
        if not self.ns:
            raise RuntimeError("link shaping needs network namespaces")
        subprocess.run(self.argv(["tc", "qdisc", "del", "dev", self.dev, "root"]), capture_output=True)
        if rate:
            subprocess.run(self.argv(["tc", "qdisc", "add", "dev", self.dev, "root", "tbf", "rate", rate,
                                      "burst", "256kb", "latency", "400ms"]), check=True, capture_output=True)


@dataclass
class Cluster:
    hub: Host
    hosts: list[Host]
    namespaces: list[str] = field(default_factory=list)
    fallback_reason: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    loopback_base: int | None = None  # the fallback's 127.0.BASE.x, held until close()

    def spawn(self, host: Host, args: list[str], log: Path, **kw: object) -> subprocess.Popen:
        p = host.popen(args, log, **kw)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for h in (self.hub, *self.hosts):
            h.close()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.loopback_base is not None:
            _LOOPBACK_BASES.discard(self.loopback_base)


_LOOPBACK_BASES: set[int] = set()  # the fallback's bases of this process's open clusters


def make_cluster(n: int) -> Cluster:
    """A hub and ``n`` hosts in fresh namespaces, or the loopback fallback (see module doc)."""
    reason = ""
    if os.geteuid() != 0:
        reason = "not root"
    elif not shutil.which("ip"):
        reason = "no ip(8)"
    if not reason:
        try:
            return _netns_cluster(n)
        except (subprocess.CalledProcessError, OSError) as exc:
            err = getattr(exc, "stderr", "") or str(exc)
            reason = f"ip netns failed: {err.strip()}"
    # A base no cluster of this process holds (two at once, as bench/backup.py runs, would
    # otherwise share addresses, hence ports, once in ~200 picks).
    base = random.choice([b for b in range(2, 200) if b not in _LOOPBACK_BASES])
    _LOOPBACK_BASES.add(base)
    hub = Host("hub", None, f"127.0.{base}.1")
    hosts = [Host(f"h{i}", None, f"127.0.{base}.{11 + i}") for i in range(n)]
    return Cluster(hub, hosts, fallback_reason=reason, loopback_base=base)


def _netns_cluster(n: int) -> Cluster:
    tag = f"{os.getpid() % 100000:05d}{random.randrange(1000):03d}"
    sub = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
    hub_ns = f"pfhub{tag}"
    c = Cluster(Host("hub", hub_ns, f"{sub}.1", dev="br0"), [])
    try:
        _ip("netns", "add", hub_ns)
        c.namespaces.append(hub_ns)
        _ip("-n", hub_ns, "link", "set", "lo", "up")
        _ip("-n", hub_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub_ns, "addr", "add", f"{sub}.1/24", "dev", "br0")
        _ip("-n", hub_ns, "link", "set", "br0", "up")
        for i in range(n):
            ns = f"pfh{i}{tag}"
            _ip("netns", "add", ns)
            c.namespaces.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # created in the root namespace with a unique name, then both ends moved away
            hv, nv = f"pfv{i}h{tag}"[:15], f"pfv{i}n{tag}"[:15]
            _ip("link", "add", hv, "type", "veth", "peer", "name", nv)
            _ip("link", "set", hv, "netns", hub_ns)
            _ip("link", "set", nv, "netns", ns)
            _ip("-n", ns, "link", "set", nv, "name", "eth0")
            _ip("-n", hub_ns, "link", "set", hv, "master", "br0")
            _ip("-n", hub_ns, "link", "set", hv, "up")
            _ip("-n", ns, "addr", "add", f"{sub}.{11 + i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            c.hosts.append(Host(f"h{i}", ns, f"{sub}.{11 + i}"))
    except BaseException:
        c.close()
        raise
    return c
