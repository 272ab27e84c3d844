"""``POST /admin/cleanup-expired-blocks`` on a real ``pegaflow-meta`` and a real redis-server.

The original's manual cleanup removes every owner registration older than an hour and answers
``{"removed_owners": N, "removed_keys": M}``. Registrations an hour old are written straight
into the node streams with entry ids of two hours ago (a stream entry's id is its time), then
the real metaserver consumes them; the cleanup must remove exactly those not registered again
since, from the index and from lookups (the in-memory view), durably (a rebuild from the
streams agrees), and leave a block re-registered afterwards discoverable again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import Client, connect
from pegaflow.meta.events.codec import FIELD, encode
from pegaflow.meta.events.schema import FLAG_LAST, Event, Op
from pegaflow.meta.index import Index
from tests.harness.meta import MetaServer
from tests.harness.ports import free_port
from tests.harness.procs import REPO
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures
from tests.integration.meta_harness import run_rebuild
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server

NS = "cleanup-ns"
HOUR_MS = 3_600_000
A = [bytes([1, i]) * 8 for i in range(10)]  # n1 (and A[5:] n2)
B = [bytes([2, i]) * 8 for i in range(5)]  # n1 only
TOKEN = "cleanup-test-token"


def post(port: int, token: str = "", method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/cleanup-expired-blocks", method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.status, json.loads(res.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code, json.loads(body) if body.startswith(b"{") else {}


class Node:
    """A node's registration and stream, written as its publisher would, at chosen times."""

    def __init__(self, r: Client, name: str) -> None:
        self.r, self.name = r, name
        self.nid, self.epoch = registry.register(r, name, f"127.0.0.1:{free_port()}", 600_000, switch=True)
        self.seq = 0

    def write(self, op: Op, hashes: Sequence[bytes] = (), flags: int = 0, at_ms: int | None = None) -> None:
        ev = Event.make(self.name, self.nid, self.epoch, self.seq, op, "" if op == Op.RESET else NS, hashes, flags)
        self.seq += 1
        eid = "*" if at_ms is None else f"{at_ms}-{self.seq}"
        self.r.xadd(stream_key(self.name), {FIELD: encode(ev)}, id=eid)


def holders(r: Client, hs: list[bytes]) -> list[frozenset[int]]:
    return Index(r).holders(NS, hs)


def test_cleanup_removes_the_registrations_older_than_an_hour_from_index_and_lookups(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    r = connect(redis_server.url)
    old = registry.redis_ms(r.time()) - 2 * HOUR_MS
    n1, n2 = Node(r, "n1"), Node(r, "n2")
    n1.write(Op.RESET, at_ms=old)
    n1.write(Op.SNAPSHOT, A, FLAG_LAST, at_ms=old)
    n1.write(Op.INSERT, B, at_ms=old)
    n1.write(Op.INSERT, A[:3])  # registered again just now: stays
    n1.write(Op.EVICT, B[:2])  # already gone
    n2.write(Op.RESET)
    n2.write(Op.SNAPSHOT, A[5:], FLAG_LAST)
    meta = MetaServer(redis_server.url, tmp_path / "meta.log", http=True,
                      extra=["--node-stale-secs", "3600", "--sweep-interval", "0"]).start()
    try:
        before = [frozenset({n1.nid})] * 5 + [frozenset({n1.nid, n2.nid})] * 5
        wait_until(lambda: holders(r, A) == before and holders(r, B) == [frozenset()] * 2 + [frozenset({n1.nid})] * 3,
                   30, "the metaserver to apply both streams")
        wait_until(lambda: meta.query(NS, A) == {"n1": 10}, 30, "lookups to see n1's ten blocks")
        assert meta.http_port is not None

        # Old: A[3:10] and B[2:5] of n1 (10 owners); A[3:5] and B[2:5] had no other owner (5 keys).
        assert post(meta.http_port) == (200, {"removed_owners": 10, "removed_keys": 5})
        after = [frozenset({n1.nid})] * 3 + [frozenset()] * 2 + [frozenset({n2.nid})] * 5
        assert holders(r, A) == after and holders(r, B) == [frozenset()] * 5
        wait_until(lambda: meta.query(NS, A) == {"n1": 3}, 30, "lookups (the view) to drop the old registrations")
        assert post(meta.http_port) == (200, {"removed_owners": 0, "removed_keys": 0})  # nothing old is left

        # Durable: the index recomputed from the streams agrees.
        run_rebuild(redis_server.url, False)
        assert holders(r, A) == after and holders(r, B) == [frozenset()] * 5

        # A removed owner is discoverable again once its node registers the block again.
        n1.write(Op.INSERT, A[3:5])
        wait_until(lambda: meta.query(NS, A) == {"n1": 5}, 30, "n1's re-registered blocks in lookups")
        assert post(meta.http_port, method="GET")[0] == 405
        assert "cleanup_expired_blocks" in meta.log()
    finally:
        meta.stop()


def test_cleanup_needs_the_token_when_one_is_configured(redis_server: RedisServer, tmp_path: Path) -> None:
    r = connect(redis_server.url)
    n1 = Node(r, "n1")
    old = registry.redis_ms(r.time()) - 2 * HOUR_MS
    n1.write(Op.RESET, at_ms=old)
    n1.write(Op.SNAPSHOT, A, FLAG_LAST, at_ms=old)
    http = free_port()
    log = tmp_path / "meta.log"
    with open(log, "ab") as out:
        p = subprocess.Popen([sys.executable, "-m", "pegaflow.meta.cli", "--redis-url", redis_server.url,
                              "--addr", f"127.0.0.1:{free_port()}", "--http-addr", f"127.0.0.1:{http}"],
                             stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                             env={**os.environ, "PEGAFLOW_AUTH_TOKEN": TOKEN})
    try:
        def served() -> bool:
            assert p.poll() is None, log.read_text()[-2000:]
            urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=2).read()  # /metrics stays open
            return True

        wait_until(served, 30, "pegaflow-meta's /metrics", ignore=(OSError,))
        wait_until(lambda: holders(r, A) == [frozenset({n1.nid})] * 10, 30, "the metaserver to apply n1's stream")
        status, body = post(http)
        assert status == 401 and "token" in body["error"]
        assert post(http, token="wrong")[0] == 401
        assert holders(r, A) == [frozenset({n1.nid})] * 10  # refused: nothing removed
        assert post(http, token=TOKEN) == (200, {"removed_owners": 10, "removed_keys": 10})
        assert holders(r, A) == [frozenset()] * 10
        assert r.get(keys.CLEANUP_LOCK) is None  # given back
    finally:
        p.terminate()
        p.wait(15)
