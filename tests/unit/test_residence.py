"""L1 residence times: first insertion to removal, per reason, in the original's buckets."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pegaflow.core.block_index import IndexEvent, Namespace
from pegaflow.node.residence import BOUNDS, NAME, Residence


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _hist(reg: CollectorRegistry, reason: str) -> tuple[dict[str, float], float, float]:
    buckets = {}
    for m in reg.collect():
        for s in m.samples:
            if s.labels.get("reason") != reason:
                continue
            if s.name == f"{NAME}_bucket":
                buckets[s.labels["le"]] = s.value
    return buckets, reg.get_sample_value(f"{NAME}_count", {"reason": reason}), \
        reg.get_sample_value(f"{NAME}_sum", {"reason": reason})


def test_residence_runs_from_first_insert_to_eviction_or_removal() -> None:
    reg, clock = CollectorRegistry(), Clock()
    r = Residence(reg, clock)
    ns, other = Namespace(1, "a", 4096, 0), Namespace(2, "b", 4096, 0)
    r.on_index_event(IndexEvent.INSERT, ns, [b"x", b"y", b"z"])
    r.on_index_event(IndexEvent.INSERT, other, [b"x"])  # same hash, another namespace
    clock.t += 3
    r.on_index_event(IndexEvent.INSERT, ns, [b"x"])  # a duplicate insert keeps the first stamp
    clock.t += 4  # x, y, z: 7 s
    r.on_index_event(IndexEvent.EVICT, ns, [b"x", b"y"])
    clock.t += 100  # z: 107 s; other's x: 107 s
    r.on_index_event(IndexEvent.REMOVE, ns, [b"z"])
    assert r.resident == 1
    buckets, count, total = _hist(reg, "pressure")
    assert count == 2 and total == 14.0
    assert buckets["5"] == 0 and buckets["10"] == 2 and buckets["+Inf"] == 2
    buckets, count, total = _hist(reg, "cleanup")
    assert count == 1 and total == 107.0
    assert buckets["60"] == 0 and buckets["120"] == 1 and buckets["+Inf"] == 1
    assert list(buckets) == [f"{b:g}" for b in BOUNDS] + ["+Inf"]


def test_a_block_inserted_again_starts_a_new_residence() -> None:
    reg, clock = CollectorRegistry(), Clock()
    r = Residence(reg, clock)
    ns = Namespace(1, "a", 4096, 0)
    r.on_index_event(IndexEvent.INSERT, ns, [b"x"])
    clock.t += 50
    r.on_index_event(IndexEvent.EVICT, ns, [b"x"])
    r.on_index_event(IndexEvent.INSERT, ns, [b"x"])
    clock.t += 1  # exactly on a bound: le is inclusive
    r.on_index_event(IndexEvent.EVICT, ns, [b"x"])
    buckets, count, total = _hist(reg, "pressure")
    assert count == 2 and total == 51.0
    assert buckets["1"] == 1 and buckets["30"] == 1 and buckets["60"] == 2
    assert r.resident == 0
