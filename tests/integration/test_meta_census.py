"""The index's census (``Index.census``, ``--index-census-interval``), counted in Redis: its
figures equal a count of the holder lists read back, on a real redis-server and on a real
Redis Cluster, with holders in both tiers, dead and live, one to five of them per block, in
two namespaces."""

from __future__ import annotations

import random

import pytest

from pegaflow.cluster import keys
from pegaflow.core.tiers import Tier
from pegaflow.meta.events.schema import Op
from pegaflow.meta.index import Census, Index
from tests.harness.redis import RedisClusterProc, RedisServer
from tests.integration.redis_fixtures import redis_cluster, redis_server  # noqa: F401

pytestmark = pytest.mark.integration

NAMESPACES = ("census-a|fp16", "census-b|bf16")
TAGS = [keys.ns_tag(ns) for ns in NAMESPACES]  # what the census is given: the namespaces' tags
NIDS = (3, 5, 8, 13, 21)
LIVE = {3, 8, 13, 21}


def fill(index: Index) -> dict[tuple[str, bytes], dict[int, Tier]]:
    """Blocks with 1-5 holders each, some on SSD only; returns what was written."""
    rng = random.Random(7)
    truth: dict[tuple[str, bytes], dict[int, Tier]] = {}
    for ns in NAMESPACES:
        blocks = [rng.randbytes(16) for _ in range(3000)]
        for nid in NIDS:
            held = [b for b in blocks if rng.random() < 0.45]
            for tier in (Tier.L1, Tier.SSD):
                part = [b for b in held if (rng.random() < 0.3) == (tier == Tier.SSD)]
                if part:
                    index.apply(Op.INSERT, ns, nid, part, tier)
                    for b in part:
                        truth.setdefault((ns, b), {})[nid] = tier
    return truth


def expected(truth: dict[tuple[str, bytes], dict[int, Tier]]) -> Census:
    red = [0, 0, 0, 0]
    copies = 0
    for holders in truth.values():
        n = sum(1 for nid in holders if nid in LIVE)
        if n:
            copies += n
            red[min(n, 4) - 1] += 1
    r1, r2, r3, r4 = red
    return Census(len(truth), sum(map(len, truth.values())), (r1, r2, r3, r4), copies)


def test_the_census_counts_every_holder_list_on_redis(redis_server: RedisServer) -> None:  # noqa: F811
    index = Index(redis_server.client())
    want = expected(fill(index))
    assert want.redundancy[3] > 0 and want.owners > want.entries  # every case is there
    assert index.census(TAGS, LIVE) == want
    assert index.census(TAGS, set()) == Census(want.entries, want.owners, (0, 0, 0, 0), 0)


def test_the_census_counts_every_holder_list_on_a_redis_cluster(redis_cluster: RedisClusterProc) -> None:  # noqa: F811
    redis_cluster.flush()
    index = Index(redis_cluster.client())
    want = expected(fill(index))
    assert index.census(TAGS, LIVE) == want
