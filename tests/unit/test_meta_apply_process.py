"""The parent's metrics follow what the consumer child counts (apply_process.snapshot/fold)."""

from __future__ import annotations

from pegaflow.meta.apply_child import snapshot
from pegaflow.meta.apply_process import fold
from pegaflow.meta.events.consumer import ConsumerMetrics
from pegaflow.meta.metrics import MetaMetrics


def value(m: MetaMetrics, name: str, **labels: str) -> float:
    got = m.registry.get_sample_value(name, labels)
    assert got is not None, name
    return got


def test_fold_adds_the_childs_increments_and_sets_gauges() -> None:
    child, parent = ConsumerMetrics(), MetaMetrics()
    parent.consumer.blocks_applied.inc(7)  # counted by an earlier child
    before = snapshot(child)
    child.blocks_applied.inc(100)
    child.events_applied.labels("insert").inc(3)
    child.streams_owned.set(4)
    now = snapshot(child)
    fold(parent.consumer, now, before)
    child.blocks_applied.inc(5)
    fold(parent.consumer, snapshot(child), now)
    fold(parent.consumer, snapshot(child), snapshot(child))  # nothing new: nothing added
    assert value(parent, "pegaflow_meta_blocks_applied_total") == 112
    assert value(parent, "pegaflow_meta_events_applied_total", op="insert") == 3
    assert value(parent, "pegaflow_meta_streams_owned") == 4


def test_a_restarted_childs_counts_are_added_from_zero() -> None:
    parent = MetaMetrics()
    first = ConsumerMetrics()
    first.blocks_applied.inc(10)
    fold(parent.consumer, snapshot(first), {})
    second = ConsumerMetrics()  # a new child starts its counters at zero
    second.blocks_applied.inc(4)
    fold(parent.consumer, snapshot(second), {})
    assert value(parent, "pegaflow_meta_blocks_applied_total") == 14
