"""pegaflow_node_gc_pause_seconds' collector (pegaflow/common/heap.py GcPauses): each
collection of the process counted under its generation while installed, none after."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def test_gc_pauses_counts_each_collection_by_generation_and_stops_when_removed() -> None:
    import gc

    from prometheus_client import generate_latest

    from pegaflow.common.heap import GcPauses

    reg = CollectorRegistry()
    g = GcPauses("probe_gc_pause_seconds", "collections")
    reg.register(g)

    def count(gen: int) -> float:
        line = f'probe_gc_pause_seconds_count{{generation="{gen}"}} '
        return float(next(x for x in generate_latest(reg).decode().splitlines() if x.startswith(line)).split()[1])

    assert count(2) == 0  # not installed: nothing timed
    g.install()
    try:
        before0, before2 = count(0), count(2)
        gc.collect(0)
        gc.collect()
        assert count(0) >= before0 + 1 and count(2) == before2 + 1
        text = generate_latest(reg).decode()
        assert 'probe_gc_pause_seconds_bucket{generation="2",le="+Inf"} ' in text
    finally:
        g.remove()
    after = count(2)
    gc.collect()
    assert count(2) == after  # removed: no longer timed
