"""The node's operator surface against real `pegaflow-node` processes: the original's HTTP
endpoints (/instances, /instances/cleanup, /cache/memory/cleanup) and `pegaflow cache`
(run as a process of its own, as an operator runs it: forked from the tests' fork server,
tests/harness/forked.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest
import xxhash

from pegaflow._proto import node_pb2, node_pb2_grpc
from pegaflow.client import PegaClient
from pegaflow.common.security import Security, sync_channel
from pegaflow.core.identity import KVIdentity, block_hashes
from tests.harness import forked
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TOKEN = "admin-test-token-0123456789"
ENV = {"PEGAFLOW_AUTH_TOKEN": TOKEN}
PAGE = 64 << 10
POOL = "4mb"  # 64 pages of PAGE
# A namespace as the connector names it (pegaflow.core.identity), so token ids hash like the connector's.
IDENTITY = KVIdentity(model="tiny", config_hash="0", model_dtype="float16", kv_dtype="float16", block_size=4,
                      num_layers=2, num_kv_heads=1, head_size=8, tp_size=1, num_shards=1, mla=False,
                      page_bytes=PAGE, platform="cpu")
NS = IDENTITY.namespace(0)
OTHER = "other-model"


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def client(node: Any, instance: str, namespaces: dict[str, int] | None = None) -> PegaClient:
    c = PegaClient(node.addr, instance_id=instance, map_pool=False, security=Security(token=TOKEN))
    c.register(namespaces or {NS: PAGE})
    return c


def store(c: PegaClient, ns: str, hs: list[bytes]) -> int:
    """Reserve and commit ``hs`` (the bytes do not matter here); returns how many were stored."""
    r = c.reserve(ns, hs)
    return c.commit(r.reservation_id) if r.reservation_id else 0


def http(node: Any, method: str, path: str, token: str | None = TOKEN) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{node.http_port}{path}", method=method,
                                 data=b"" if method == "POST" else None)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read().decode()
            status = r.status
            ctype = r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        body, status, ctype = e.read().decode(), e.code, e.headers.get("content-type", "")
    return status, json.loads(body) if "json" in ctype else body


def cache(node: Any, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-m", "pegaflow.cli", "cache", *args, "--addr", node.addr],
                      env={**os.environ, **(ENV if env is None else env)})


def cache_json(node: Any, *args: str) -> Any:
    p = cache(node, *args, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def one_line(p: subprocess.CompletedProcess, out: str = "stdout") -> str:
    text = getattr(p, out)
    assert text.endswith("\n") and text.count("\n") == 1, f"not one line: {text!r} (stderr {p.stderr!r})"
    return text.strip()


def stub(node: Any, token: str = TOKEN) -> Any:
    return node_pb2_grpc.PegaNodeStub(sync_channel(node.addr, Security(token=token)))


def stats(node: Any) -> Any:
    return stub(node).Stats(node_pb2.StatsRequest(), timeout=5)


@pytest.fixture
def node(node_factory):  # type: ignore[no-untyped-def]
    return node_factory(POOL, env=ENV)


# ---- HTTP ---------------------------------------------------------------------------------
def test_instances_lists_engines_with_their_namespaces_sessions_and_holdings(node):
    a = client(node, "engine-a")
    b = client(node, "engine-b", {OTHER: PAGE})
    try:
        assert store(a, NS, hashes("a", 6)) == 6
        q = a.query([NS], hashes("a", 6), lease=True)
        assert q.hit_blocks == 6
        a.reserve(NS, hashes("pending", 2))  # never committed: held by engine-a's session
        status, body = http(node, "GET", "/instances")
        assert status == 200
        assert body["instances"] == ["engine-a", "engine-b"]
        da, db = body["details"]["engine-a"], body["details"]["engine-b"]
        assert da["namespaces"] == [NS] and da["namespace_blocks"] == {NS: 6}
        assert (da["leased_blocks"], da["reserved_blocks"]) == (6, 2)
        assert len(da["sessions"]) == 1 and da["sessions"][0]["leases"] == 1
        assert db["namespaces"] == [OTHER] and db["leased_blocks"] == 0
    finally:
        a.close()
        b.close()


def test_endpoints_need_the_token_and_metrics_and_health_stay_open(node):
    for method, path in (("GET", "/instances"), ("POST", "/instances/cleanup"), ("POST", "/cache/memory/cleanup")):
        for token in (None, "wrong"):
            status, body = http(node, method, path, token)
            assert status == 401, (method, path, token, body)
    c = client(node, "engine-a")
    try:  # nothing was removed by the refused calls
        assert http(node, "GET", "/instances")[1]["instances"] == ["engine-a"]
    finally:
        c.close()
    for path in ("/metrics", "/health"):
        with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}{path}", timeout=5) as r:
            assert r.status == 200


def test_a_default_nodes_401_names_its_own_token_file_and_the_header_that_gets_in(node_factory):
    """A node started as the original's (no token, loopback) makes its own token: the original's
    cleanup scripts get 401, whose answer says where the token is and how to send it."""
    n = node_factory(POOL)
    status, body = http(n, "POST", "/cache/memory/cleanup", None)
    assert status == 401
    path = n.local_socket + ".token"
    assert path in body["error"] and "Authorization: Bearer" in body["error"], body
    with open(path) as f:
        assert http(n, "POST", "/cache/memory/cleanup", f.read().strip())[0] == 200
    status, body = http(node_factory(POOL, env=ENV), "GET", "/instances", "wrong")  # a configured token
    assert status == 401 and "--auth-token-file" in body["error"] and ".token" not in body["error"], body


def test_instances_cleanup_ends_one_engines_sessions_then_all(node):
    a = client(node, "engine-a")
    b = client(node, "engine-b")
    try:
        store(a, NS, hashes("a", 4))
        assert a.query([NS], hashes("a", 4), lease=True).hit_blocks == 4
        a.reserve(NS, hashes("pending", 3))
        assert stats(node).active_leases == 1 and stats(node).active_reservations == 1

        assert http(node, "POST", "/instances/cleanup?id=nope") == (404, "instance nope not found")
        status, body = http(node, "POST", "/instances/cleanup?id=engine-a")
        assert (status, body) == (200, {"removed_instances": ["engine-a"], "removed_tensors": 0})
        s = stats(node)
        assert (s.active_leases, s.active_reservations, s.sessions) == (0, 0, 1)
        assert http(node, "GET", "/instances")[1]["instances"] == ["engine-b"]

        status, body = http(node, "POST", "/instances/cleanup")
        assert (status, body) == (200, {"removed_instances": ["engine-b"], "removed_tensors": 0})
        assert http(node, "GET", "/instances")[1]["instances"] == []
        assert http(node, "POST", "/instances/cleanup")[1] == {"removed_instances": [], "removed_tensors": 0}
        # An engine whose session was ended registers again on its next call and goes on.
        assert a.query([NS], hashes("a", 4), lease=False).hit_blocks == 4
        wait_until(lambda: http(node, "GET", "/instances")[1]["instances"] == ["engine-a"], 10,
                   "engine-a to be registered again")
    finally:
        a.close()
        b.close()


def test_memory_cleanup_evicts_every_block_nothing_holds(node):
    c = client(node, "engine-a")
    try:
        assert store(c, NS, hashes("a", 10)) == 10
        q = c.query([NS], hashes("a", 2), lease=True)  # two blocks held by a lease
        used = stats(node).used_bytes
        status, body = http(node, "POST", "/cache/memory/cleanup")
        assert status == 200
        assert body == {"evicted_blocks": 8, "evicted_bytes": 8 * PAGE, "reclaimed_bytes": 8 * PAGE,
                        "still_referenced_blocks": 2}
        s = stats(node)
        assert (s.resident_blocks, used - s.used_bytes) == (2, 8 * PAGE)
        assert c.query([NS], hashes("a", 10), lease=False).hit_blocks == 2
        c.release(q.lease_id)
        assert http(node, "POST", "/cache/memory/cleanup")[1]["evicted_blocks"] == 2
        assert stats(node).resident_blocks == 0
    finally:
        c.close()


# ---- pegaflow cache --------------------------------------------------------------------------
def test_inspect_hashes_a_prompts_tokens_like_the_connector_and_reports_l1(node):
    tokens = list(range(100, 122))  # 5 full blocks of 4 and 2 tokens that make none
    hs = block_hashes(IDENTITY.seed, tokens, IDENTITY.block_size)
    assert len(hs) == 5
    c = client(node, "engine-a")
    try:
        assert store(c, NS, hs[:3]) == 3
        p = cache(node, "inspect", "--namespace", NS, "--tokens", ",".join(map(str, tokens)))
        assert p.returncode == 0, p.stderr
        line = one_line(p)
        assert "5 blocks: 3 in L1 (leading 3, 0 pinned), 0 on SSD, 2 on neither" in line, line
        doc = cache_json(node, "inspect", "-n", NS, "--hashes", *(h.hex() for h in hs))
        assert [b["l1"] for b in doc["blocks"]] == [True, True, True, False, False]
        assert [b["hash"] for b in doc["blocks"]] == [h.hex() for h in hs]
        assert doc["node"] and doc["namespace_known"] and doc["l1_prefix"] == 3
        # Another LoRA adapter is another chain: none of these blocks.
        doc = cache_json(node, "inspect", "-n", NS, "--tokens", " ".join(map(str, tokens)), "--lora-name", "x")
        assert doc["l1"] == 0
    finally:
        c.close()


def test_inspect_tells_the_ssd_tier_from_l1(node_factory, tmp_path):
    node = node_factory(POOL, ["--ssd-cache-path", str(tmp_path), "--ssd-cache-capacity", "16mb"], env=ENV)
    hs = hashes("s", 6)
    c = client(node, "engine-a")
    try:
        assert store(c, NS, hs) == 6
        wait_until(lambda: cache_json(node, "inspect", "-n", NS, "--hashes", *(h.hex() for h in hs))["ssd"] == 6,
                   30, "6 blocks written to SSD")
        assert http(node, "POST", "/cache/memory/cleanup")[1]["evicted_blocks"] == 6
        doc = cache_json(node, "inspect", "-n", NS, "--hashes", *(h.hex() for h in hs))
        assert (doc["l1"], doc["ssd"], doc["nowhere"]) == (0, 6, 0)
        assert all(b["ssd"] and not b["l1"] for b in doc["blocks"])
    finally:
        c.close()


def test_clear_empties_a_namespace_an_instances_namespaces_or_everything(node):
    a = client(node, "engine-a")
    b = client(node, "engine-b", {OTHER: PAGE, "third": PAGE})
    try:
        store(a, NS, hashes("a", 5))
        store(b, OTHER, hashes("b", 4))
        store(b, "third", hashes("c", 3))
        p = cache(node, "clear", "--namespace", NS)
        assert p.returncode == 0, p.stderr
        assert one_line(p) == "cleared 1 namespace(s): 5 blocks dropped (0 in use, freed when released), 0 SSD records"
        assert dict(stats(node).blocks_by_namespace) == {NS: 0, OTHER: 4, "third": 3}
        doc = cache_json(node, "clear", "--instance", "engine-b")
        assert sorted(doc["namespaces"]) == [OTHER, "third"] and doc["dropped_blocks"] == 7
        assert stats(node).resident_blocks == 0
        store(a, NS, hashes("a", 5))
        store(b, OTHER, hashes("b", 4))
        assert cache_json(node, "clear", "--all")["dropped_blocks"] == 9
        assert stats(node).resident_blocks == 0 and stats(node).used_bytes == 0
    finally:
        a.close()
        b.close()


def fill(c: PegaClient, tag: str, n: int) -> None:
    """Store ``n`` fresh blocks in rounds, evicting what the pool must."""
    for i in range(0, n, 16):
        store(c, NS, hashes(f"{tag}{i}", 16))


def test_a_pinned_prefix_survives_filling_the_pool_past_capacity_until_unpinned(node):
    system = hashes("system-prompt", 8)
    plain = hashes("plain", 8)
    c = client(node, "engine-a")
    try:
        store(c, NS, system + plain)
        p = cache(node, "pin", "-n", NS, "--hashes", *(h.hex() for h in system), "--name", "sys")
        assert p.returncode == 0, p.stderr
        assert one_line(p).startswith("pinned sys: 8 blocks (8 resident now"), p.stdout
        fill(c, "fill", 256)  # 4x the pool
        assert stats(node).evictions >= 200
        assert c.query([NS], system, lease=False).hit_blocks == 8
        assert c.query([NS], plain, lease=False).hit_blocks == 0
        line = one_line(cache(node, "pins"))
        assert line.startswith("1 pin(s), 512.0 KiB of 1.0 MiB pinnable: sys 8/8 resident"), line
        assert cache_json(node, "inspect", "-n", NS, "--hashes", *(h.hex() for h in system))["pinned"] == 8
        assert (node.metric("pegaflow_node_pinned_bytes"), node.metric("pegaflow_node_pins")) == (8 * PAGE, 1)
        p = cache(node, "unpin", "sys")
        assert one_line(p) == "unpinned sys: 8 blocks evictable again"
        assert cache_json(node, "pins")["pins"] == []
        assert (node.metric("pegaflow_node_pinned_bytes"), node.metric("pegaflow_node_pins")) == (0, 0)
        fill(c, "again", 128)
        assert c.query([NS], system, lease=False).hit_blocks == 0
    finally:
        c.close()


def test_a_pin_of_blocks_not_stored_yet_holds_them_once_they_are(node):
    tokens = list(range(32))
    hs = block_hashes(IDENTITY.seed, tokens, IDENTITY.block_size)
    c = client(node, "engine-a")
    try:
        line = one_line(cache(node, "pin", "-n", NS, "--tokens", ",".join(map(str, tokens))))
        assert line.startswith("pinned pin-1: 8 blocks (0 resident now"), line
        store(c, NS, hs)
        wait_until(lambda: cache_json(node, "pins")["pins"][0]["resident"] == 8, 10, "the pin to hold its blocks")
        fill(c, "fill", 256)
        assert c.query([NS], hs, lease=False).hit_blocks == 8
        # A clear drops them (and frees their pages); the pin stays and holds them when stored again.
        assert cache_json(node, "clear", "-n", NS)["dropped_blocks"] >= 8
        assert cache_json(node, "pins")["pins"][0]["resident"] == 0
        store(c, NS, hs)
        wait_until(lambda: cache_json(node, "pins")["pins"][0]["resident"] == 8, 10, "the pin to hold them again")
    finally:
        c.close()


def test_pins_stay_within_the_pinned_share(node_factory):
    node = node_factory(POOL, ["--max-pinned-share", "0.1"], env=ENV)  # 409.6 KiB: 6 pages
    c = client(node, "engine-a")
    try:
        assert cache(node, "pin", "-n", NS, "--hashes", *(h.hex() for h in hashes("a", 6))).returncode == 0
        p = cache(node, "pin", "-n", NS, "--hashes", hashes("b", 1)[0].hex())
        assert p.returncode == 1
        line = one_line(p, "stderr")
        assert "RESOURCE_EXHAUSTED" in line and "--max-pinned-share 0.1" in line, line
        assert len(cache_json(node, "pins")["pins"]) == 1
    finally:
        c.close()


def test_bad_input_is_one_line_and_invalid_argument(node, tmp_path):
    c = client(node, "engine-a")
    binary = tmp_path / "tokens.bin"
    binary.write_bytes(bytes(range(256)))  # not UTF-8: was a UnicodeDecodeError traceback
    try:
        for args, want in ((("inspect", "-n", NS, "--hashes", "zz"), "not hex"),
                           (("inspect", "-n", NS, "--hashes", "abcd"), "expected 16"),
                           (("inspect", "-n", "plain-name", "--tokens", "1,2,3,4"), "give --hashes"),
                           (("inspect", "-n", NS, "--tokens", "1,2"), "no full block"),
                           (("inspect", "-n", NS, "--tokens", "1,x"), "integers"),
                           (("inspect", "-n", NS, "--tokens-file", str(binary)), "is not text"),
                           # An OverflowError traceback; a float or a string was cut to an int silently.
                           (("inspect", "-n", NS, "--tokens", "[1e400,2,3,4]"), "integers"),
                           (("inspect", "-n", NS, "--tokens", "[1.9,2,3,4]"), "integers"),
                           (("inspect", "-n", NS, "--tokens", '["5",2,3,4]'), "integers"),
                           # Alone, the path was ignored: the answer was the base model's blocks.
                           (("inspect", "-n", NS, "--tokens", "1,2,3,4", "--lora-path", "/p/ad"), "--lora-name"),
                           (("pin", "-n", NS, "--tokens", "1,2,3,4", "--block-size", "8"), "contradicts"),
                           (("clear",), "required")):
            p = cache(node, *args)
            assert p.returncode == 2, (args, p.stdout, p.stderr)
            assert want in one_line(p, "stderr"), (args, p.stderr)
        p = cache(node, "unpin", "nope")
        assert p.returncode == 1 and "INVALID_ARGUMENT: no pin 'nope'" in one_line(p, "stderr")
        p = cache(node, "pin", "-n", "never-registered", "--hashes", hashes("a", 1)[0].hex())
        assert p.returncode == 1 and "INVALID_ARGUMENT" in one_line(p, "stderr")
        p = cache(node, "pins", env={})  # no token
        assert p.returncode == 1 and "UNAUTHENTICATED" in one_line(p, "stderr")

        s = stub(node)
        bad = [lambda: s.CacheInspect(node_pb2.CacheInspectRequest(namespace=NS, hashes=[b"short"]), timeout=5),
               lambda: s.CacheInspect(node_pb2.CacheInspectRequest(hashes=hashes("a", 1)), timeout=5),
               lambda: s.CacheClear(node_pb2.CacheClearRequest(), timeout=5),
               lambda: s.CacheClear(node_pb2.CacheClearRequest(namespace=NS, all=True), timeout=5),
               lambda: s.CacheClear(node_pb2.CacheClearRequest(instance_id="nobody"), timeout=5),
               lambda: s.CachePin(node_pb2.CachePinRequest(namespace=NS), timeout=5),
               lambda: s.CachePin(node_pb2.CachePinRequest(namespace=NS, hashes=hashes("a", 1) * 2), timeout=5),
               lambda: s.CachePin(node_pb2.CachePinRequest(namespace=NS, hashes=hashes("a", 1), name="a b"),
                                  timeout=5)]
        for call in bad:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert cache_json(node, "pins")["pins"] == []
    finally:
        c.close()


def test_inspect_with_the_metaserver_names_every_node_holding_each_block(node_factory, tmp_path):
    from tests.harness.redis import start_server
    from tests.integration.meta_harness import start_meta

    redis = start_server(tmp_path)
    meta = None
    try:
        meta = start_meta(redis.url, False, "m1", tmp_path / "meta.log")
        nodes = [node_factory(POOL, ["--redis-url", redis.url, "--node-id", name], env=ENV)
                 for name in ("host-a", "host-b")]
        hs = hashes("shared", 5)
        for n, held in zip(nodes, (5, 3), strict=True):
            c = client(n, f"engine-{n.port}")
            try:
                assert store(c, NS, hs[:held]) == held
            finally:
                c.close()
        args = ("inspect", "-n", NS, "--hashes", *(h.hex() for h in hs), "--metaserver", f"127.0.0.1:{meta.port}")

        def answered() -> str | None:
            p = cache(nodes[1], *args)
            assert p.returncode == 0, p.stderr
            line = one_line(p)
            return line if "host-a 5 leading, host-b 3 leading" in line else None

        line = wait_until(answered, 30, "the metaserver to know both nodes' blocks")
        assert line.startswith("node host-b: 5 blocks: 3 in L1"), line
        doc = cache_json(nodes[1], *args)
        assert [b["nodes"] for b in doc["blocks"]] == [["host-a", "host-b"]] * 3 + [["host-a"]] * 2
        assert {x["node"]: x["prefix_blocks"] for x in doc["cluster"]} == {"host-a": 5, "host-b": 3}
    finally:
        if meta is not None:
            meta.stop()
        redis.stop()


def test_an_engines_reset_frees_pinned_pages_and_the_pin_holds_them_again_when_stored(node):
    hs = hashes("sys", 4)
    c = client(node, "engine-a")
    try:
        store(c, NS, hs)
        assert cache_json(node, "pin", "-n", NS, "--hashes", *(h.hex() for h in hs))["pin"]["resident"] == 4
        r = c.reset([NS])
        assert (r.dropped_blocks, r.busy_blocks) == (4, 4)  # pinned: out of the index, pages held
        # Left DRAM while still referenced, memory freed later: the original's counter of that.
        assert node.metric("pegaflow_node_removed_held_blocks_total") == 4
        assert node.metric("pegaflow_cache_block_evictions_still_referenced_total") == 4
        wait_until(lambda: stats(node).used_bytes == 0, 10, "the pin to let go of the dropped pages")
        assert cache_json(node, "pins")["pins"][0]["resident"] == 0
        store(c, NS, hs)
        wait_until(lambda: cache_json(node, "pins")["pins"][0]["resident"] == 4, 10, "the pin to hold them again")
    finally:
        c.close()
