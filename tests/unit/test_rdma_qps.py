"""--qps-per-peer: an RDMA pull opens that many RC queue pairs per (our NIC, peer NIC) pair,
deals each NIC's pages over them, reuses them on the next pull, and drops them all when the
peer fails. Over the fake verbs layer (tests/unit/fake_verbs.py, the one tests/fakes/pyverbs
gives node processes): everything above the hardware edge is the code that runs on NICs."""

from __future__ import annotations

import asyncio
import collections

import pytest

from pegaflow.node.tiers.remote.rdma import RdmaTransport
from tests.unit import fake_verbs
from tests.unit.test_p2p import Holder, RdmaPair, hashes, pulls, settle


def test_transport_refuses_zero_qps() -> None:
    with pytest.raises(ValueError):
        RdmaTransport(None, lambda p, r: None, "x", qps_per_peer=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("qps", [1, 3])
def test_a_pull_spreads_each_nics_pages_over_qps_per_peer_queue_pairs(qps: int, monkeypatch) -> None:
    per_qp: collections.Counter[int] = collections.Counter()
    post = fake_verbs.QP.post_send

    def counted(self: fake_verbs.QP, wr: object) -> None:
        per_qp[self.qp_num] += 1
        post(self, wr)

    monkeypatch.setattr(fake_verbs.QP, "post_send", counted)
    r = RdmaPair()
    r.transport.qps_per_peer = qps  # as RdmaTransport(..., qps_per_peer) from --qps-per-peer (wiring.py)
    try:
        hs = hashes("qp", 60)
        want = r.a.store(hs)
        r.meta.holders = [Holder("ra", r.a.address, 60)]

        async def pull() -> None:
            r.a.table.loop = asyncio.get_running_loop()
            assert await r.puller.query([r.b.ns], hs, 0)
            await settle(r.puller)

        asyncio.run(pull())
        assert all(r.b.page(h) == want[h] for h in hs)
        assert r.handshakes == 2 * qps  # 2 NICs x qps queue pairs, each with its handshake
        assert r.transport.qps() == r.transport.qps(r.a.address) == 2 * qps
        assert len(r.responder.qps) == 2 * qps  # the peer answered each with a QP of its own
        assert len(per_qp) == 2 * qps and sum(per_qp.values()) == 60
        assert set(per_qp.values()) == {60 // (2 * qps)}  # dealt evenly
        # The next pull reuses them.
        r.b.index.remove(r.b.index.resident(r.b.ns))
        asyncio.run(pull())
        assert r.handshakes == 2 * qps and r.transport.qps() == 2 * qps
        assert pulls(r.b, "ok") == 2
        # The peer dies (its QPs stop answering): the pull fails and every QP to it is dropped.
        for n in list(r.fabric.qps):
            if r.fabric.qps[n] in [q for q, _ in r.responder.qps.values()]:
                r.fabric.kill_qp(n)
        r.b.index.remove(r.b.index.resident(r.b.ns))
        asyncio.run(pull())
        assert r.transport.qps() == 0
        assert pulls(r.b, "ok") == 2
        # The peer is back: the next pull (past the backoff) handshakes again for the same QPs,
        # and the peer closes the QPs that answered the dropped ones instead of keeping them.
        r.puller.backoff.ok(r.a.address)
        asyncio.run(pull())
        assert pulls(r.b, "ok") == 3 and r.handshakes == 4 * qps
        assert len(r.responder.qps) == r.transport.qps() == 2 * qps
        assert len(r.fabric.qps) == 4 * qps, "a QP of a dropped one is still open"
    finally:
        r.close()


def test_open_queue_pairs_are_a_gauge_under_ours_and_the_originals_name() -> None:
    # As wiring.P2P binds them: the puller's transport, the responder's accepted QPs.
    from pegaflow.node.metrics import NodeMetrics

    r = RdmaPair()
    NodeMetrics(r.b.registry)  # the node's registry: ours, and the original's names from them
    NodeMetrics(r.a.registry)
    r.b.metrics.bind_rdma(r.transport.qps, None)
    r.a.metrics.bind_rdma(None, lambda: len(r.responder.qps))
    r.transport.qps_per_peer = 2
    try:
        def qps(side: Holder | object, role: str = "") -> float | None:
            reg = side.registry  # type: ignore[attr-defined]
            if role:
                return reg.get_sample_value("pegaflow_node_p2p_rdma_queue_pairs", {"role": role})
            return reg.get_sample_value("pegaflow_rdma_qps")

        assert qps(r.b) == qps(r.a) == 0 and qps(r.b, "pull") == qps(r.b, "serve") == 0
        hs = hashes("gauge", 8)
        r.a.store(hs)
        r.meta.holders = [Holder("ra", r.a.address, 8)]

        async def pull() -> None:
            r.a.table.loop = asyncio.get_running_loop()
            assert await r.puller.query([r.b.ns], hs, 0)
            await settle(r.puller)

        asyncio.run(pull())
        assert qps(r.b, "pull") == qps(r.b) == r.transport.qps() == 4  # 2 NICs x 2
        assert qps(r.a, "serve") == qps(r.a) == 4 and qps(r.a, "pull") == 0
    finally:
        r.close()


def test_idle_queue_pairs_are_closed_on_both_sides_and_never_under_a_live_puller() -> None:
    """A holder kept the QPs of every puller that ever connected (a pod's node id changes at
    each restart): a puller closes its QPs after QP_IDLE_S without a pull; a holder closes a
    puller's after twice that without a pin from it, never those of a puller that pins."""
    from pegaflow.node.tiers.remote import rdma

    now = [1000.0]
    r = RdmaPair(clock=lambda: now[0])
    try:
        hs = hashes("idle", 8)
        want = r.a.store(hs)
        r.meta.holders = [Holder("ra", r.a.address, 8)]

        def pull() -> None:
            async def run() -> None:
                r.a.table.loop = asyncio.get_running_loop()
                assert await r.puller.query([r.b.ns], hs, 0)
                await settle(r.puller)

            r.b.index.remove(r.b.index.resident(r.b.ns))
            asyncio.run(run())
            assert all(r.b.page(h) == want[h] for h in hs)

        pull()
        assert r.handshakes == 2 and len(r.responder.qps) == 2 and len(r.fabric.qps) == 4
        for _ in range(6):  # a pull every 0.6 x QP_IDLE_S: 3.6 x in all, the same QPs throughout
            now[0] += 0.6 * rdma.QP_IDLE_S
            r.responder.seen("rc")  # another puller pins here meanwhile (the holder looks for silent ones)
            pull()
        assert r.handshakes == 2 and len(r.responder.qps) == 2 and len(r.fabric.qps) == 4
        # Idle past QP_IDLE_S: the puller closes its QPs and sets them up again for the next pull.
        now[0] += rdma.QP_IDLE_S + 1
        pull()
        assert r.handshakes == 4 and r.transport.qps() == 2
        assert len(r.responder.qps) == 2 and len(r.fabric.qps) == 4  # the holder replaced its two
        # The puller goes away for good; another pins twice QP_IDLE_S later: its QPs are closed.
        now[0] += 2 * rdma.QP_IDLE_S + 1
        r.transport.close()
        assert len(r.fabric.qps) == 2
        r.responder.seen("rc")
        assert r.responder.qps == {} and r.fabric.qps == {}
        assert pulls(r.b, "ok") == 8
    finally:
        r.close()
