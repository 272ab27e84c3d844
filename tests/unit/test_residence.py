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


def test_evictions_are_queued_on_the_loop_and_counted_by_fold_or_a_scrape() -> None:
    reg, clock = CollectorRegistry(), Clock()
    r = Residence(reg, clock)
    ns = Namespace(1, "a", 4096, 0)
    r.on_index_event(IndexEvent.INSERT, ns, [b"x", b"y"])
    clock.t += 20
    r.on_index_event(IndexEvent.EVICT, ns, [b"x"])
    r.on_index_event(IndexEvent.REMOVE, ns, [b"y"])
    assert r.queued == 2 and r.resident == 0  # the listener only queued the stamps
    r.fold()  # housekeeping's worker thread
    assert r.queued == 0
    r.on_index_event(IndexEvent.INSERT, ns, [b"z"])
    clock.t += 2
    r.on_index_event(IndexEvent.EVICT, ns, [b"z"])
    assert r.queued == 1
    buckets, count, total = _hist(reg, "pressure")  # a scrape counts what was queued before it
    assert r.queued == 0
    assert count == 2 and total == 22.0 and buckets["5"] == 1 and buckets["30"] == 2
    assert _hist(reg, "cleanup")[1:] == (1.0, 20.0)


def test_fold_in_another_thread_loses_and_doubles_nothing() -> None:
    import threading

    reg, clock = CollectorRegistry(), Clock()
    r = Residence(reg, clock)
    ns = Namespace(1, "a", 4096, 0)
    batches, per = 3000, 16
    stop = threading.Event()

    def folder() -> None:
        while not stop.is_set():
            r.fold()

    t = threading.Thread(target=folder)
    t.start()
    try:
        for i in range(batches):
            hs = [f"{i}:{k}".encode() for k in range(per)]
            r.on_index_event(IndexEvent.INSERT, ns, hs)
            r.on_index_event(IndexEvent.EVICT, ns, hs)
    finally:
        stop.set()
        t.join()
    assert _hist(reg, "pressure")[1] == batches * per


def test_an_unscraped_node_counts_its_queued_evictions_in_housekeeping(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from pegaflow.config.commands import node_config
    from pegaflow.node import daemon
    from pegaflow.node.daemon import Node

    monkeypatch.setattr(daemon, "EXPIRY_INTERVAL", 0.05)
    node = Node(node_config(pool_size=4 << 20, http_addr="", local_socket=""))
    try:
        r = node.residence
        ns = Namespace(1, "a", 4096, 0)
        r.on_index_event(IndexEvent.INSERT, ns, [b"x", b"y"])
        r.on_index_event(IndexEvent.EVICT, ns, [b"x", b"y"])
        assert r.queued == 1

        async def run() -> None:
            task = asyncio.create_task(node.housekeeping())
            try:
                for _ in range(200):  # bounded: 10 s
                    if not r.queued:
                        return
                    await asyncio.sleep(0.05)
            finally:
                task.cancel()

        asyncio.run(run())
        assert r.queued == 0
        assert node.metrics.registry.get_sample_value(f"{NAME}_count", {"reason": "pressure"}) == 2
    finally:
        node.pool.close()
