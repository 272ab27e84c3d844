"""The router's kv-aware hints carry the holder's tier: a real metaserver (on a real
redis-server) answers QueryPrefix with ssd_blocks, MetaHints passes them on, and the
policy weighs an SSD-held prefix by --ssd-hit-cost."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from pegaflow.common.security import Security
from pegaflow.core.tiers import Tier
from pegaflow.node.publishing import EventPublisher
from pegaflow.policy.routing import TierCosts
from pegaflow.router.hints import MetaHints
from pegaflow.router.routing import KV_AWARE, Candidate, Policy
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures
from tests.integration.meta_harness import start_meta
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server

NS = "router-tiers|fp16|bs16|tp1"
H = [random.Random(100 + i).randbytes(16) for i in range(8)]
BS = 16


def test_meta_hints_carry_ssd_blocks_and_the_policy_weighs_them(redis_server: RedisServer, tmp_path: Path) -> None:
    from pegaflow.cluster.redis_conn import connect

    r = connect(redis_server.url)
    # n1 holds the first 4 blocks in DRAM; n2 all 8, only on its SSD.
    p1 = EventPublisher(r, "n1", "h:1", lambda: [(NS, H[:4])], flush_interval=0.01)
    p2 = EventPublisher(r, "n2", "h:2", lambda: [(NS, H, Tier.SSD)], flush_interval=0.01)
    meta = start_meta(redis_server.url, False, "m", tmp_path / "meta.log")
    p1.start(wait=5)
    p2.start(wait=5)
    try:
        wait_until(lambda: meta.query(NS, H) == {"n1": 4, "n2": 8}, 20, "both holders indexed")

        async def ask() -> dict[str, tuple[int, int]]:
            hints = MetaHints(f"127.0.0.1:{meta.port}", Security(), 5.0)
            try:
                return await hints.prefixes([NS], H)
            finally:
                await hints.close()

        held = asyncio.run(ask())
        assert held == {"n1": (4, 0), "n2": (8, 8)}
        anywhere = max(n for n, _ in held.values())

        def cand(url: str, node: str) -> Candidate:
            n, ssd = held[node]
            return Candidate(url, prefix_tokens=n * BS, ssd_tokens=ssd * BS, remote_tokens=(anywhere - n) * BS)

        cands = [cand("http://e1", "n1"), cand("http://e2", "n2")]
        # SSD reads at half a recompute: e1 saves 4 + 4 * 0.5 (pulled) = 6 blocks, e2 8 * 0.5 = 4.
        slow_ssd = Policy(KV_AWARE, load_window=0, costs=TierCosts(ssd=0.5, remote=0.5))
        assert slow_ssd.choose(cands, 8 * BS, now=0.0).url == "http://e1"
        # Fast SSD reads: e2 saves 8 * 0.9 = 7.2 blocks.
        fast_ssd = Policy(KV_AWARE, load_window=0, costs=TierCosts(ssd=0.1, remote=0.5))
        assert fast_ssd.choose(cands, 8 * BS, now=0.0).url == "http://e2"
    finally:
        p1.stop()
        p2.stop()
        meta.stop()
