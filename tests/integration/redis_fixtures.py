"""pytest fixtures that start a real redis-server / 6-process Redis Cluster via infra/redis/.

Each fixture picks random free loopback ports and a temp dir, so test sessions run in
parallel with other users of the machine. Use them from a test module with::

    from tests.integration.redis_fixtures import redis_cluster, redis_server  # noqa: F401

When ``redis-server`` is not installed the tests are skipped with the reason printed.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

INFRA = Path(__file__).resolve().parents[2] / "infra" / "redis"


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(n: int, bus_offset: int = 0, lo: int = 20000, hi: int = 30000) -> int:
    """A base port such that base..base+n-1 (and the cluster bus ports +10000) are free."""
    for _ in range(200):
        base = random.randrange(lo, hi - n)
        ports = list(range(base, base + n))
        if bus_offset:
            ports += [p + bus_offset for p in ports]
        if all(_free(p) for p in ports):
            return base
    raise RuntimeError("no free port range")


def _need_redis() -> None:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (Debian package redis-server)")


@dataclass
class RedisServer:
    """A standalone redis-server under ``dir`` on ``port``; restartable (optionally with AOF)."""

    dir: Path
    port: int
    aof: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [str(INFRA / "redis-standalone.sh"), "start", str(self.dir), str(self.port)]
        if self.aof:
            args.append("--aof")
        subprocess.run(args, check=True, capture_output=True, timeout=30)

    def stop(self) -> None:
        subprocess.run(
            [str(INFRA / "redis-standalone.sh"), "stop", str(self.dir), str(self.port)],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@dataclass
class RedisClusterProc:
    dir: Path
    base: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.base}/0"

    def start(self) -> None:
        subprocess.run(
            [str(INFRA / "redis-cluster.sh"), "start", str(self.dir), str(self.base)],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def stop(self) -> None:
        subprocess.run(
            [str(INFRA / "redis-cluster.sh"), "stop", str(self.dir), str(self.base)],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.base)


def start_server(tmp: Path, aof: bool = False) -> RedisServer:
    _need_redis()
    for _ in range(5):
        srv = RedisServer(tmp, free_port_range(1), aof)
        try:
            srv.start()
            return srv
        except subprocess.CalledProcessError:  # lost a port race with another process
            srv.stop()
    raise RuntimeError("could not start redis-server")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh empty standalone Redis for one test (no persistence)."""
    srv = start_server(tmp_path / "redis")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def redis_server_aof(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh standalone Redis with the append-only file on (survives restarts)."""
    srv = start_server(tmp_path / "redis-aof", aof=True)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProc]:
    """A 6-process cluster (3 masters, 3 replicas) shared by one test module; flush between tests."""
    _need_redis()
    tmp = tmp_path_factory.mktemp("redis-cluster")
    for _ in range(5):
        c = RedisClusterProc(tmp, free_port_range(6, bus_offset=10000))
        try:
            c.start()
            break
        except subprocess.CalledProcessError:
            c.stop()
    else:
        raise RuntimeError("could not start a redis cluster")
    try:
        yield c
    finally:
        c.stop()


def flush_cluster(c: RedisClusterProc) -> None:
    rc = c.client()
    rc.flushall(target_nodes=RedisCluster.PRIMARIES)
    rc.close()
