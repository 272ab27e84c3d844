"""pytest fixtures over the harness's Redis (tests/harness/redis.py): a real redis-server or
a 6-process Redis Cluster on free loopback ports. Use them from a test module with::

    from tests.integration.redis_fixtures import redis_cluster, redis_server  # noqa: F401

When ``redis-server`` is not installed the tests are skipped with the reason printed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.redis import RedisClusterProc, RedisServer, start_cluster, start_server


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
    c = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield c
    finally:
        c.stop()
