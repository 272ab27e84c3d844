"""A real ``redis-server`` or a 6-process Redis Cluster, started by infra/redis/'s scripts on
free loopback ports (so runs share the machine with other users of it).

The pytest fixtures over these are in tests/integration/redis_fixtures.py.
"""

from __future__ import annotations

import shutil
import subprocess
import unittest
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from tests.harness.ports import free_port_range
from tests.harness.procs import REPO

INFRA = REPO / "infra" / "redis"
START_TRIES = 5  # a port found free may be taken before redis binds it: try another


def need_redis() -> None:
    """``unittest.SkipTest`` (pytest skips the test; elsewhere an error that says why) when
    ``redis-server`` is not installed."""
    if not shutil.which("redis-server"):
        raise unittest.SkipTest("redis-server is not installed (Debian package redis-server)")


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
        subprocess.run([str(INFRA / "redis-standalone.sh"), "stop", str(self.dir), str(self.port)],
                       check=True, capture_output=True, timeout=30)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@dataclass
class RedisClusterProc:
    """Three masters and three replicas under ``dir`` on ports ``base``..``base+5`` (bus ports +10000)."""

    dir: Path
    base: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.base}/0"

    def start(self) -> None:
        subprocess.run([str(INFRA / "redis-cluster.sh"), "start", str(self.dir), str(self.base)],
                       check=True, capture_output=True, timeout=120)

    def stop(self) -> None:
        subprocess.run([str(INFRA / "redis-cluster.sh"), "stop", str(self.dir), str(self.base)],
                       check=True, capture_output=True, timeout=60)

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.base)

    def flush(self) -> None:
        """Empty every master (tests that share one cluster start clean)."""
        rc = self.client()
        rc.flushall(target_nodes=RedisCluster.PRIMARIES)
        rc.close()


def start_server(dir: Path, aof: bool = False) -> RedisServer:  # noqa: A002
    """A fresh standalone Redis under ``dir`` on a free port (``aof``: the append-only file on)."""
    need_redis()
    for _ in range(START_TRIES):
        srv = RedisServer(dir, free_port_range(1), aof)
        try:
            srv.start()
            return srv
        except subprocess.CalledProcessError:  # lost a port race with another process
            srv.stop()
    raise RuntimeError("could not start redis-server")


def start_cluster(dir: Path) -> RedisClusterProc:  # noqa: A002
    """A fresh 6-process Redis Cluster under ``dir`` on free ports."""
    need_redis()
    for _ in range(START_TRIES):
        c = RedisClusterProc(dir, free_port_range(6, bus_offset=10000))
        try:
            c.start()
            return c
        except subprocess.CalledProcessError:
            c.stop()
    raise RuntimeError("could not start a redis cluster")
