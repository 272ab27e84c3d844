"""The original's flags that are implemented here reach the component they configure.

The flags themselves (syntax, defaults, rejection) are tests/unit/test_options.py's; both
daemons started with the original's complete lists are tests/integration/test_original_flags.py's.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

from pegaflow.common import otel
from pegaflow.config.commands import node_config
from pegaflow.meta import sweeper
from pegaflow.node.query_trace import QueryTrace


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_query_trace_records_the_sampled_fraction_of_requests(tmp_path: Path):
    random.seed(7)
    for rate, lo, hi in ((0.0, 0, 0), (1.0, 1000, 1000), (0.25, 200, 300)):
        path = tmp_path / f"{rate}.jsonl"
        t = QueryTrace(str(path), rate)
        for i in range(1000):
            t.record("ns", [i.to_bytes(16, "little")], 4096, "e0")
        t.close()
        assert lo <= _lines(path) <= hi, (rate, _lines(path))


def test_node_options_reach_their_components(tmp_path: Path):
    from pegaflow.node.daemon import Node

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = node_config(pool_size=64 << 20, http_addr="", local_socket="", query_trace=str(tmp_path / "q.jsonl"),
                      trace_sample_rate=0.25, enable_lfu_admission=True, hint_value_size=1 << 20,
                      ssd_cache_path=(str(ssd),), ssd_cache_capacity=64 << 20, ssd_cache_shards=3,
                      max_prefetch_blocks=7)
    node = Node(cfg)
    try:
        assert node.query_trace is not None and node.query_trace.sample_rate == 0.25  # --trace-sample-rate
        assert node.index.admission.capacity == 64  # --hint-value-size: pool / 1 MiB pages
        assert node.ssd is not None and node.ssd.promoter.max_blocks == 7  # --max-prefetch-blocks
        # --ssd-cache-shards: three files in the one path, the capacity split across them
        assert sorted(Path(f.path).name for f in node.ssd.files) == [f"pegaflow-ssd.cache.{i}" for i in range(3)]
    finally:
        node.query_trace.close()
        asyncio.run(node.ssd.close())
        node.pool.close()


def test_otlp_exports_come_every_configured_period():
    from prometheus_client import CollectorRegistry, Counter

    from tests.integration.test_metrics_export import GrpcReceiver  # skips without the otel extra

    reg = CollectorRegistry()
    Counter("pf_test", "a metric to export", registry=reg).inc()
    c = GrpcReceiver()
    export = otel.start_otel_export(f"http://127.0.0.1:{c.port}", reg, "t", 1)  # the SDK's own period: 60 s
    try:
        deadline = time.monotonic() + 10
        while len(c.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(c.requests) >= 2
    finally:
        export.provider.shutdown(timeout_millis=1000)
        c.close()


def test_sweeper_reaps_after_the_configured_ttl_minutes(monkeypatch):
    seen: list[int] = []
    stop = threading.Event()

    def once(r, owner, metrics=None, idle_ms=0):
        seen.append(idle_ms)
        stop.set()

    monkeypatch.setattr(sweeper, "sweep_once", once)
    sweeper.run(None, stop, 0.01, "me", None, 60 * 60_000)  # type: ignore[arg-type]
    assert seen == [3_600_000]


def test_max_prefetch_blocks_promotes_the_front_and_answers_with_what_is_on_its_way(
    tmp_path: Path, monkeypatch
):
    from pegaflow.node.tiers.ssd import promote
    from tests.unit.test_ssd_store import WAIT_S, _Node
    from tests.waiting import wait_until_async

    monkeypatch.setattr(promote, "HOLD_SECONDS", 0.0)

    async def run() -> None:
        n = _Node(tmp_path, "threads")
        n.tier.promoter.max_blocks = 2  # --max-prefetch-blocks 2 (its wiring: test_node_options_reach...)
        hs = [i.to_bytes(16, "little") for i in range(1, 6)]
        n.save(hs)
        await n.written()
        n.index.remove(n.index.resident())
        assert n.tier.promote([n.ns], hs, 0) == 2, "two reads at most: LOADING for the first two"
        assert len(n.tier.promoter.inflight) == 2
        await wait_until_async(lambda: not n.tier.promoter.inflight, WAIT_S, "the promotions to end")
        assert len(n.index.prefix(n.ns, hs, touch=False)) == 2
        assert n.tier.promote([n.ns], hs, 2) == 4, "the next Query promotes the next two"
        await wait_until_async(lambda: not n.tier.promoter.inflight, WAIT_S, "the promotions to end")
        assert len(n.index.prefix(n.ns, hs, touch=False)) == 4
        await n.close()

    asyncio.run(run())
