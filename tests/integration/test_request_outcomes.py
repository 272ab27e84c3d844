"""Per-request block outcomes on a real node with an SSD tier: blocks a request found only
on SSD count as `ssd` once (not again as `l1` when the engine's follow-up Query leases
them), blocks already in L1 as `l1`, the rest as `miss`; the ceiling sees each request once."""

from __future__ import annotations

import pytest

from pegaflow.client import PegaClient
from tests.integration.test_ssd_tier import NS, PAGE, POOL, SSD_WAIT_S, hashes, save, ssd_args
from tests.integration.test_ssd_tier import ask_until_ready as ask_ssd_until_ready
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def ask_until_ready(c: PegaClient, hs: list[bytes], req_id: str) -> tuple[int, int]:
    """Query as the connector does (same req_id until READY); returns (hit blocks, LOADING answers)."""
    q, loading = ask_ssd_until_ready(c, hs, req_id=req_id, lease=False)
    return q.hit_blocks, loading


def test_each_block_of_a_request_has_one_outcome(node_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = node_factory(POOL, ssd_args(tmp_path))
    hs = hashes("o", 48)
    with PegaClient(node.addr) as c:
        c.register({NS: PAGE})
        save(c, hs, node=node)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= 48, SSD_WAIT_S, "48 blocks on SSD")
        before = {o: node.metric("pegaflow_node_request_blocks_total", f'outcome="{o}"')
                  for o in ("l1", "ssd", "remote", "miss")}
        hit, loading = ask_until_ready(c, hs[:12], "r1")  # only on SSD: LOADING, then READY
        assert (hit, loading >= 1) == (12, True)
        # Promoted blocks stay pinned a moment: the next request finds them in L1.
        hit, loading = ask_until_ready(c, hs[:12] + hashes("never-saved", 4), "r2")
        assert (hit, loading) == (12, 0)
        ask_until_ready(c, hs[:12], "r1")  # the engine asking again for r1: not a new request
        after = {o: node.metric("pegaflow_node_request_blocks_total", f'outcome="{o}"')
                 for o in ("l1", "ssd", "remote", "miss")}
        got = {o: after[o] - before[o] for o in after}
        assert got == {"l1": 12, "ssd": 12, "remote": 0, "miss": 4}
        # The older per-answer counter counts r1's blocks under ssd and again under l1.
        assert node.metric("pegaflow_node_hit_blocks_total", 'tier="ssd"') >= 12


def test_two_engines_with_the_same_request_id_are_two_requests(node_factory) -> None:  # type: ignore[no-untyped-def]
    node = node_factory("4mb")
    hs = hashes("same-id", 4)
    with PegaClient(node.addr) as a, PegaClient(node.addr) as b:
        a.register({NS: PAGE})
        b.register({NS: PAGE})
        for c in (a, b, a, b):  # vLLM's offline engines both number their first request "0"
            assert c.query([NS], hs, req_id="0", lease=False).hit_blocks == 0
    assert node.metric("pegaflow_node_request_blocks_total", 'outcome="miss"') == 8
