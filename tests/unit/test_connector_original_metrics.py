"""The original connector's twelve ``vllm:pega_*`` series (pegaflow-llm 0.25.1's
connector_metrics.py) on vLLM's /metrics: each load and save batch a worker copies (seconds,
blocks, success or failure), the saves on the copy stream, and the requests the node
answered LOADING (prefetches), through PegaConnectorStats and PegaPromMetrics as vLLM feeds
them. Its docs/deployment.md has operators watch vllm:pega_load_failure_total and
vllm:pega_save_failure_total; only vllm:pegaflow_* series were served."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pegaflow.connector import scheduler as scheduler_mod
from pegaflow.connector.connector import PegaConnectorStats, PegaPromMetrics
from tests.unit.connector_fakes import Engine, FakeNode, identity
from tests.unit.test_connector_sides import BS, idle_step, prompt, run_step

ORIGINAL = {
    "vllm:pega_pending_prefetches": "gauge", "vllm:pega_pending_save_requests": "gauge",
    "vllm:pega_prefetch_duration_seconds": "histogram", "vllm:pega_prefetch_blocks": "histogram",
    "vllm:pega_load_duration_seconds": "histogram", "vllm:pega_load_blocks": "histogram",
    "vllm:pega_load_success": "counter", "vllm:pega_load_failure": "counter",
    "vllm:pega_save_duration_seconds": "histogram", "vllm:pega_save_blocks": "histogram",
    "vllm:pega_save_success": "counter", "vllm:pega_save_failure": "counter",
}


def prom() -> tuple[PegaPromMetrics, CollectorRegistry]:
    """The connector's metrics as vLLM builds them (its metric classes), on a registry of their own."""
    reg = CollectorRegistry()
    types: Any = {cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    return PegaPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]}), reg  # type: ignore[arg-type]


def scrape(reg: CollectorRegistry) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def sample(fams: dict[str, Any], family: str, suffix: str = "", **labels: str) -> float:
    return sum(s.value for s in fams[family].samples if s.name == family + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))


def feed(m: PegaPromMetrics, *stats: dict[str, Any]) -> None:
    """As vLLM does: the step's stats aggregated (workers, then the scheduler's), then observed."""
    agg = PegaConnectorStats(data={})
    for data in stats:
        if data:
            agg.aggregate(PegaConnectorStats(data=dict(data)))
    agg.reduce()  # vLLM's log line reads it too
    m.observe(agg.data, 0)


def test_every_original_series_is_there_from_the_start_with_its_type() -> None:
    _, reg = prom()
    fams = scrape(reg)
    assert {n: fams[n].type for n in ORIGINAL} == ORIGINAL
    assert sample(fams, "vllm:pega_load_failure", "_total", engine="0") == 0  # 0, not absent
    buckets = [s.labels["le"] for s in fams["vllm:pega_load_duration_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets[:5] == ["0.01", "0.02", "0.04", "0.08", "0.1"] and buckets[-2:] == ["100.0", "+Inf"]


def test_loads_and_saves_are_observed_per_batch() -> None:
    node = FakeNode()
    m, reg = prom()
    a = Engine(node, identity(tp=2))
    a.run(prompt(1))  # saves 5 blocks, a batch on each rank
    feed(m, *(w.take_stats() for w in a.workers))
    b = Engine(node, identity(tp=2))
    assert b.run(prompt(1))["external"] == 5 * BS  # loads them, a batch on each rank
    feed(m, *(w.take_stats() for w in b.workers), b.sched.take_stats())
    fams = scrape(reg)
    assert sample(fams, "vllm:pega_save_success", "_total") == 2
    assert sample(fams, "vllm:pega_save_blocks", "_count") == 2
    assert sample(fams, "vllm:pega_save_blocks", "_sum") == 2 * 5
    assert sample(fams, "vllm:pega_save_duration_seconds", "_count") == 2
    assert sample(fams, "vllm:pega_load_success", "_total") == 2
    assert sample(fams, "vllm:pega_load_blocks", "_sum") == 2 * 5
    assert sample(fams, "vllm:pega_load_duration_seconds", "_count") == 2
    assert sample(fams, "vllm:pega_load_failure", "_total") == sample(fams, "vllm:pega_save_failure", "_total") == 0
    assert sample(fams, "vllm:pega_pending_save_requests") == 0  # copies on the CPU are synchronous


def test_a_batch_with_no_pool_to_copy_with_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    node = FakeNode()
    m, reg = prom()
    Engine(node, identity()).run(prompt(2))
    b = Engine(node, identity())
    monkeypatch.setattr(b.workers[0], "_pool_for", lambda epoch: None)  # e.g. the node restarted meanwhile
    b.run(prompt(2))  # a hit: its load batch fails
    b.run(prompt(4))  # new blocks: their save batch fails
    feed(m, b.workers[0].take_stats())
    fams = scrape(reg)
    assert sample(fams, "vllm:pega_load_failure", "_total") == 1
    assert sample(fams, "vllm:pega_load_success", "_total") == 0
    assert sample(fams, "vllm:pega_save_failure", "_total") == 1
    assert sample(fams, "vllm:pega_save_success", "_total") == 0


def test_a_request_waiting_for_a_promotion_is_a_pending_prefetch_until_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    node = FakeNode()
    m, reg = prom()
    p = prompt(3, 13 * BS // 2)
    Engine(node, identity()).run(p)
    b = Engine(node, identity())
    node.loading, node.loading_dram, node.loading_from, node.loading_expected = 2, 1, "ssd", 5
    req = b.request(p)
    block_ids = [b.free.pop() for _ in range(6)]
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 5 * BS)
    feed(m, b.sched.take_stats())
    assert sample(scrape(reg), "vllm:pega_pending_prefetches") == 1
    for _ in range(2):  # the node still loads, then has them in DRAM: the copy goes out
        clock[0] += scheduler_mod.LOADING_POLL_S
        meta = b.sched.build_connector_meta(idle_step())
        run_step(b, meta)
    assert len(meta.loads) == 1
    feed(m, b.workers[0].take_stats(), b.sched.take_stats())
    fams = scrape(reg)
    assert sample(fams, "vllm:pega_pending_prefetches") == 0
    assert sample(fams, "vllm:pega_prefetch_blocks", "_sum") == 5
    assert sample(fams, "vllm:pega_prefetch_duration_seconds", "_sum") == pytest.approx(
        2 * scheduler_mod.LOADING_POLL_S)
    assert sample(fams, "vllm:pega_load_success", "_total") == 1
