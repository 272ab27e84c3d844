"""SSD holders in the cluster, with real processes: redis-server + pegaflow-meta + two real
nodes in network namespaces (loopback addresses when namespaces cannot be made), node-0
with a small DRAM pool and an SSD tier.

- A prefix that left node-0's DRAM but is on its SSD stays in the index, with tier SSD
  (a tier change, not a removal), and node-1 pulls it: node-0 promotes it from its SSD
  and serves it; the bytes node-1's client loads equal the saved ones.
- node-0's SSD eviction of a block only on SSD removes node-0 from its holders.
- node-0 restarted with its SSD intact: the index converges to its SSD blocks, tier SSD.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest

from tests.harness.node import EVERY_SCRAPE
from tests.harness.p2p import P2PCluster
from tests.harness.p2p_client import namespace
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PAGES = ("--heads", "8", "--dim", "128")  # 128 KiB pages
NSB = namespace(8, 128)
N = 16  # blocks per prefix: half of node-0's 32-page pool
SSD_WAIT = 60

TIERS = """
import sys, json, grpc, xxhash
from pegaflow._proto import meta_pb2, meta_pb2_grpc
addr, ns, tag, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
hs = [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]
stub = meta_pb2_grpc.MetaServiceStub(grpc.insecure_channel(addr))
res = stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace=ns, hashes=hs), timeout=5)
print(json.dumps({x.node: [x.prefix_len, meta_pb2.Tier.Name(x.tier), x.ssd_blocks] for x in res.nodes}))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[P2PCluster]:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    tmp = tmp_path_factory.mktemp("p2pssd")
    ssd = tmp / "ssd0"
    ssd.mkdir()
    c = P2PCluster(tmp, 2, node_args=("--peer-backoff", "1"), render_interval=EVERY_SCRAPE, per_node_args={0: (
        "--pool-size", "4mb", "--ssd-cache-path", str(ssd), "--ssd-cache-capacity", "12mb", "--ssd-queue-depth", "8")})
    if c.fallback_reason:
        print(f"network namespaces unavailable ({c.fallback_reason}): loopback addresses instead")
    yield c
    c.close()


def tiers(c: P2PCluster, tag: str, n: int = N) -> dict[str, list]:
    r = c.c.hub.py(TIERS, c.meta_addr, NSB, tag, str(n))
    return json.loads(r.stdout.strip()) if r.returncode == 0 else {}


def save0(c: P2PCluster, tag: str) -> None:
    """Save a prefix through node-0 and wait until its SSD wrote it (queued writes pin their
    DRAM pages, so the next save finds the pool's room only after that)."""
    written = c.metric(0, "pegaflow_node_ssd_written_blocks_total")
    assert c.client(0, "save", tag, str(N), *PAGES)["committed"] == N
    wait_until(lambda: c.metric(0, "pegaflow_node_ssd_written_blocks_total") >= written + N
               and c.metric(0, "pegaflow_node_ssd_write_queue_blocks") == 0, SSD_WAIT, f"{tag} on node-0's SSD")


def test_ssd_only_prefix_is_indexed_pulled_evicted_and_resynced(cluster: P2PCluster) -> None:
    c = cluster
    save0(c, "cold")
    wait_until(lambda: tiers(c, "cold").get("node-0") == [N, "TIER_L1", 0], 20, "cold in DRAM, tier L1")
    save0(c, "f1")
    save0(c, "f2")  # the pool holds 32 pages: cold leaves node-0's DRAM
    assert c.metric(0, "pegaflow_node_evictions_total", 'tier="l1"') >= N
    wait_until(lambda: tiers(c, "cold").get("node-0") == [N, "TIER_SSD", N], 20, "cold listed with tier SSD")

    # node-1 misses, finds node-0 as an SSD holder, pulls: node-0 reads its SSD straight
    # into the transfer (no promotion into its DRAM), node-1 verifies every page.
    promoted, read = (c.metric(0, f"pegaflow_node_ssd_{m}_total") for m in ("promoted_blocks", "read_bytes"))
    out = c.client(1, "load", "cold", str(N), *PAGES, "--until-hit")
    assert out["hit"] == N and out["identical"], out
    assert c.metric(1, "pegaflow_node_p2p_pulled_blocks_total", 'holder_tier="ssd"') == N
    assert c.metric(0, "pegaflow_node_p2p_ssd_served_blocks_total") == N
    pulled = c.metric(1, "pegaflow_node_p2p_pull_bytes_total")
    assert pulled > 0 and c.metric(0, "pegaflow_node_ssd_read_bytes_total") - read == pulled
    assert c.metric(0, "pegaflow_node_ssd_promoted_blocks_total") == promoted
    assert tiers(c, "cold").get("node-0") == [N, "TIER_SSD", N]  # still only on its SSD
    wait_until(lambda: tiers(c, "cold").get("node-1") == [N, "TIER_L1", 0], 20, "node-1's pulled copy indexed")

    # SSD eviction: 12 MiB of SSD hold ~90 records; three more prefixes push f1 (out of
    # DRAM since f3, the oldest record never promoted) off the SSD.
    save0(c, "f3")
    wait_until(lambda: tiers(c, "f1").get("node-0") == [N, "TIER_SSD", N], 20,
               lambda: f"f1 listed with tier SSD: {tiers(c, 'f1')}")
    for tag in ("f4", "f5", "f6"):
        save0(c, tag)
    assert c.metric(0, "pegaflow_node_ssd_evicted_blocks_total") >= N
    wait_until(lambda: "node-0" not in tiers(c, "f1"), 20,
               lambda: f"f1 gone from the index with node-0's SSD copy: {tiers(c, 'f1')}")

    # Restart with the SSD intact: DRAM is empty, the SSD's blocks are published as SSD.
    assert tiers(c, "f6").get("node-0") == [N, "TIER_L1", 0]
    c.kill_node(0)
    c.start_node(0)
    wait_until(lambda: tiers(c, "f6").get("node-0") == [N, "TIER_SSD", N], 30, "f6 re-published with tier SSD")
    assert "node-0" not in tiers(c, "f1")
    # and it is still served from there, byte-identical
    out = c.client(1, "load", "f6", str(N), *PAGES, "--until-hit")
    assert out["hit"] == N and out["identical"], out
