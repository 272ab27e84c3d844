"""--ssd-{write,prefetch}-{inflight,queue-depth}: the per-direction bounds in front of the
SSD I/O engine (pegaflow/node/tiers/ssd/gate.py), alone and in a real tier on both engines.

The in-flight count is measured independently of the gate: every op the engine receives
is counted from its submission to its completion (engine threads), and the maximum is
compared with the limit and with the tier's own peak gauge."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from pegaflow.config.commands import node_config
from pegaflow.config.tiers import SsdConfig
from pegaflow.core.block_index import BlockIndex
from pegaflow.node.metrics import NodeMetrics
from pegaflow.node.pool import SharedPool
from pegaflow.node.tiers.ssd import promote
from pegaflow.node.tiers.ssd.gate import IoGate
from pegaflow.node.tiers.ssd.parts import KnownChecksums
from pegaflow.node.tiers.ssd.tier import SsdTier, open_cache
from pegaflow.node.tiers.ssd.uring import IoOp
from tests.unit.test_ssd_store import ENGINES, PAGE, WAIT_S, _engine_or_skip, _page
from tests.waiting import wait_until_async


class FakeEngine:
    name, depth = "fake", 64

    def __init__(self) -> None:
        self.ops: list[IoOp] = []

    def submit(self, ops: Sequence[IoOp]) -> None:
        self.ops.extend(ops)

    def inflight(self) -> int:
        return len(self.ops)

    def close(self) -> None:
        pass


def _op(tag: list[int], i: int) -> IoOp:
    return IoOp(False, 0, i, [bytearray(1)], lambda res: tag.append(i))


def test_gate_bounds_in_flight_ops_and_waiting_batches() -> None:
    eng = FakeEngine()
    posted: list[Callable[[], None]] = []
    gate = IoGate(eng, lambda fn, *a: posted.append(lambda: fn(*a)), inflight=2, queue_depth=2)
    done: list[int] = []
    assert gate.offer([_op(done, i) for i in (0, 1, 2)])  # 2 submitted, 1 waits
    assert [o.offset for o in eng.ops] == [0, 1] and gate.waiting() == 1
    assert gate.offer([_op(done, i) for i in (3, 4)])  # waits whole
    assert gate.waiting() == 2 and gate.full()
    assert not gate.offer([_op(done, 5)]), "a third waiting batch is refused, not queued"
    assert gate.waiting() == 2
    # Completion (engine thread) runs the op's own completion, then hands the slot back on the loop.
    eng.ops.pop(0).complete(1)
    assert done == [0] and gate.inflight == 2 and len(posted) == 1
    posted.pop()()
    assert [o.offset for o in eng.ops] == [1, 2] and gate.inflight == 2 and gate.waiting() == 1
    while eng.ops or posted:
        if eng.ops:
            eng.ops.pop(0).complete(1)
        while posted:
            posted.pop(0)()
        assert gate.inflight <= 2
    assert done == [0, 1, 2, 3, 4] and gate.inflight == 0 and gate.peak == 2 and gate.waiting() == 0
    with pytest.raises(ValueError):
        IoGate(eng, print, 0, 1)


class _Tier:
    """Pool + index + tier as the daemon assembles them, with the engine's ops counted per direction."""

    def __init__(self, path: Path, engine: str, checksums: KnownChecksums | None = None, **opts: int) -> None:
        cfg = node_config(ssd_cache_path=[str(path)], ssd_cache_capacity=8 << 20, ssd_queue_depth=16,
                          ssd_write_queue_size=2 << 20, ssd_io_engine=engine, **opts)
        files = open_cache(SsdConfig.from_node(cfg))
        assert files is not None
        self.pool = SharedPool(4 << 20)
        self.index = BlockIndex(self.pool.size)
        self.metrics = NodeMetrics()
        self.tier = tier = SsdTier(files, self.index, self.pool.view, self.metrics, checksums=checksums)
        tier.start(asyncio.get_running_loop())
        self.ns = self.index.namespace("m", PAGE)
        self.lock = threading.Lock()
        self.now = {True: 0, False: 0}
        self.most = {True: 0, False: 0}
        submit = tier.engine.submit

        def counted(ops: Sequence[IoOp]) -> None:
            for op in ops:
                with self.lock:
                    self.now[op.write] += 1
                    self.most[op.write] = max(self.most[op.write], self.now[op.write])
                op.complete = self._end(op.write, op.complete)
            submit(ops)

        tier.engine.submit = counted  # type: ignore[method-assign]

    def _end(self, write: bool, complete: Callable[[int], None]) -> Callable[[int], None]:
        def end(res: int) -> None:
            with self.lock:
                self.now[write] -= 1
            complete(res)

        return end

    def save(self, hashes: list[bytes]) -> None:
        blocks = [b for b in self.index.reserve(self.ns, hashes) if b is not None]
        for b in blocks:
            self.pool.view[b.offset:b.offset + PAGE] = _page(b.hash)
        self.index.commit(blocks)

    def scrape(self) -> dict[str, float]:
        text = generate_latest(self.metrics.registry).decode()
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln[:1] != "#"}

    async def close(self) -> None:
        await self.tier.close()
        self.pool.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_writes_keep_to_the_write_limits_and_drop_batches_beyond_the_queue(tmp_path: Path, engine: str) -> None:
    _engine_or_skip(engine)

    async def run() -> None:
        t = _Tier(tmp_path, engine, ssd_write_inflight=1, ssd_write_queue_depth=2)
        # 12 commits in one loop tick: 2 batches may wait, the other 10 are dropped whole.
        for c in range(12):
            t.save([(c * 100 + i).to_bytes(16, "little") for i in range(4)])
        await wait_until_async(t.tier.writer.idle, WAIT_S, "the write-behind to drain")
        m = t.scrape()
        assert m['pegaflow_node_ssd_skipped_writes_total{reason="queue_full"}'] == 40
        assert m["pegaflow_node_ssd_written_blocks_total"] == 8 == len(t.tier.store.entries)
        # Then a steady load, one commit per tick: each waits its turn, none is dropped.
        for c in range(12, 40):
            t.save([(c * 100 + i).to_bytes(16, "little") for i in range(4)])
            m = t.scrape()
            assert m['pegaflow_node_ssd_direction_inflight_ios{direction="write"}'] <= 1
            assert m['pegaflow_node_ssd_direction_waiting_batches{direction="write"}'] <= 2
            await wait_until_async(lambda: t.tier.writer._scheduled == 0 and t.tier.writes.waiting() < 2,
                                   WAIT_S, "room in the write queue")
        await wait_until_async(t.tier.writer.idle, WAIT_S, "the write-behind to drain")
        m = t.scrape()
        assert m["pegaflow_node_ssd_written_blocks_total"] == 8 + 28 * 4
        assert t.most[True] == 1, t.most  # measured at the engine: never two writes at once
        assert m['pegaflow_node_ssd_direction_inflight_ios_peak{direction="write"}'] == 1
        await t.close()

    asyncio.run(run())


@pytest.mark.parametrize("engine", ENGINES)
def test_promotions_keep_to_the_prefetch_limits_and_drop_a_query_beyond_the_queue(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _engine_or_skip(engine)
    monkeypatch.setattr(promote, "HOLD_SECONDS", 0.0)

    async def run() -> None:
        t = _Tier(tmp_path, engine, ssd_prefetch_inflight=2, ssd_prefetch_queue_depth=1)
        hs = [i.to_bytes(16, "little") for i in range(1, 81)]
        t.save(hs)
        await wait_until_async(t.tier.writer.idle, WAIT_S, "the write-behind to drain")
        t.index.remove(t.index.resident())
        # Every other block: records apart on disk, one read I/O each (no coalescing).
        even, odd = hs[0::2], hs[1::2]
        assert t.tier.promote([t.ns], even, 0) == 40  # LOADING: 2 reads in flight, the rest waits
        assert t.tier.reads.inflight == 2 and t.tier.reads.waiting() == 1
        # The prefetch queue holds one batch: this Query's promotion is dropped, nothing reserved.
        assert t.tier.promote([t.ns], odd, 0) == 0
        assert t.scrape()["pegaflow_node_ssd_prefetch_dropped_blocks_total"] == 40
        assert all(t.index.get(t.ns, h) is None for h in odd)
        # The gate takes a read's slot back in a call posted after the promoter's own (gate.py).
        await wait_until_async(lambda: not t.tier.promoter.inflight and not t.tier.reads.inflight, WAIT_S,
                               "the promotions to end and their slots to come back")
        assert len(t.index.prefix(t.ns, even, touch=False)) == 40
        assert t.most[False] == 2, t.most  # measured at the engine
        m = t.scrape()
        assert m['pegaflow_node_ssd_direction_inflight_ios_peak{direction="prefetch"}'] == 2
        assert m['pegaflow_node_ssd_direction_inflight_ios{direction="prefetch"}'] == 0
        # Room again: the odd blocks promote now.
        assert t.tier.promote([t.ns], odd, 0) == 40
        await wait_until_async(lambda: not t.tier.promoter.inflight, WAIT_S, "the promotions to end")
        assert len(t.index.prefix(t.ns, odd, touch=False)) == 40
        assert t.most[False] == 2
        await t.close()

    asyncio.run(run())
