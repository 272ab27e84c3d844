"""The parent's metrics follow what the consumer child counts (apply_process.snapshot/fold)."""

from __future__ import annotations

from pegaflow.meta.apply_process import fold, snapshot
from pegaflow.meta.metrics import MetaMetrics


def value(m: MetaMetrics, name: str, **labels: str) -> float:
    return next(s.value for f in m.registry.collect() for s in f.samples
                if s.name == name and s.labels == labels)


def test_fold_adds_the_childs_increments_and_sets_gauges() -> None:
    child, parent = MetaMetrics(), MetaMetrics()
    parent.blocks_applied.inc(7)  # counted by an earlier child
    before = snapshot(child)
    child.blocks_applied.inc(100)
    child.events_applied.labels("insert").inc(3)
    child.streams_owned.set(4)
    now = snapshot(child)
    fold(parent, now, before)
    child.blocks_applied.inc(5)
    fold(parent, snapshot(child), now)
    fold(parent, snapshot(child), snapshot(child))  # nothing new: nothing added
    assert value(parent, "pegaflow_meta_blocks_applied_total") == 112
    assert value(parent, "pegaflow_meta_events_applied_total", op="insert") == 3
    assert value(parent, "pegaflow_meta_streams_owned") == 4


def test_a_restarted_childs_counts_are_added_from_zero() -> None:
    parent = MetaMetrics()
    first = MetaMetrics()
    first.blocks_applied.inc(10)
    fold(parent, snapshot(first), {})
    second = MetaMetrics()  # a new child starts its counters at zero
    second.blocks_applied.inc(4)
    fold(parent, snapshot(second), {})
    assert value(parent, "pegaflow_meta_blocks_applied_total") == 14
