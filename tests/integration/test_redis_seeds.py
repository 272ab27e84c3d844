"""A fleet survives its Redis: ``--redis-url`` names several seeds, and both daemons connect
through any live one (real redis-servers, a real 6-process Redis Cluster, real daemons).

- ``pegaflow-meta --redis-cluster`` and ``pegaflow-node --redis-cluster`` started with their
  first seed dead start and work: the node's blocks reach the metaserver's lookups.
- Every seed dead: ``pegaflow-meta`` exits 1 with one line naming each seed (no traceback,
  where ``--redis-cluster`` used to end in a ``RedisClusterException`` traceback); a node
  starts and serves its engines anyway (Redis down is not the node's failure: it keeps
  serving local hits and retries), logging the seeds it could not reach.
- Standalone seeds are tried in order when a connection is made and again when it broke.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis
import xxhash

from pegaflow.client import PegaClient
from pegaflow.cluster.redis_conn import connect
from tests.harness.meta import MetaServer
from tests.harness.ports import free_port
from tests.harness.procs import REPO, python_env
from tests.harness.redis import RedisClusterProc, RedisServer, start_server
from tests.integration import redis_fixtures
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server
redis_cluster = redis_fixtures.redis_cluster

PAGE = 64 << 10


def dead_seed() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


def meta_exit(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pegaflow.meta.cli", "--addr", f"127.0.0.1:{free_port()}",
                           "--http-addr", "off", *argv], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=python_env())


def test_cluster_daemons_started_with_their_first_seed_dead_start_and_work(
    redis_cluster: RedisClusterProc, node_factory, tmp_path: Path
) -> None:
    redis_cluster.flush()
    seeds = f"{dead_seed()},{redis_cluster.url}"
    meta = MetaServer(seeds, tmp_path / "meta.log", cluster=True).start()
    try:
        node = node_factory(extra=["--redis-url", seeds, "--redis-cluster", "--node-id", "seeded"])
        c = PegaClient(node.addr)
        c.register({"m": PAGE})
        hs = [xxhash.xxh3_128_digest(f"seed:{i}".encode()) for i in range(6)]
        assert c.commit(c.reserve("m", hs).reservation_id) == 6
        wait_until(lambda: meta.query("m", hs) == {"seeded": 6}, 30, "the node's blocks in the metaserver's lookups")
        assert "Traceback" not in meta.log() and "Traceback" not in node.log()
        assert node.log().count("redis_reached") == 1
        c.close()
    finally:
        meta.stop()


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "standalone"])
def test_metaserver_with_every_seed_dead_exits_with_one_line_naming_them(tmp_path: Path, cluster: bool) -> None:
    a, b = dead_seed(), dead_seed()
    p = meta_exit(tmp_path, "--redis-url", a, "--redis-url", b, *(["--redis-cluster"] if cluster else []))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "cannot reach Redis" in lines[0] and a in lines[0] and b in lines[0], lines[0]


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "standalone"])
def test_a_node_whose_seeds_are_all_dead_serves_and_names_them(node_factory, cluster: bool) -> None:
    a, b = dead_seed(), dead_seed()
    node = node_factory(extra=["--redis-url", f"{a},{b}", *(["--redis-cluster"] if cluster else []),
                               "--node-id", "alone"])
    c = PegaClient(node.addr)
    c.register({"m": PAGE})
    hs = [xxhash.xxh3_128_digest(f"alone:{i}".encode()) for i in range(3)]
    assert c.commit(c.reserve("m", hs).reservation_id) == 3
    assert c.query(["m"], hs).hit_blocks == 3  # local hits go on

    def named() -> bool:
        return any("publish failed" in line and a.split("//")[1].split("/")[0] in line
                   and b.split("//")[1].split("/")[0] in line for line in node.log().splitlines())

    wait_until(named, 30, "the publisher's warning naming both seeds")
    assert "Traceback" not in node.log()
    assert "redis_reached" not in node.log()  # a standalone client was reported reached as it was made
    c.close()


def test_standalone_seeds_are_tried_in_order_at_connect_and_at_reconnect(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    second = start_server(tmp_path / "second")
    try:
        r = connect([redis_server.url, second.url])
        r.set("which", "first")
        assert r.get("which") == b"first"  # the first seed answers: it serves
        redis_server.stop()
        second.client().set("which", "second")

        # The broken connection is made again: the first seed is dead, the second answers.
        wait_until(lambda: r.get("which") == b"second", 30, "the client to reconnect through the second seed",
                   ignore=(redis.ConnectionError, redis.TimeoutError))
        r.close()
    finally:
        second.stop()
