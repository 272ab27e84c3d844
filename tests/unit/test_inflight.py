"""Copies beside the forward (pegaflow/connector/inflight.py): the commit-after-event protocol.

The workers run with a copy stream whose events complete only when the test says so (the
hardware edge: on a GPU, CUDA events), on the CPU tensors of the fake engine. The copies
themselves are the real batched ones (``issue_pages``); what is proved is the ordering:

* a save is never committed before its copy's event completed, and is committed after;
* a leased page is not released while a load that reads it is in flight;
* the compute stream waits for the gather of a save, and for each layer's load;
* over TP ranks the engine's progress is the slowest rank's; a step a rank never saw is
  aborted, never committed.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest

from pegaflow.connector.intents import PegaWorkerReport
from pegaflow.connector.scheduler import _StepWork
from tests.fakes.device import HostDma
from tests.unit.connector_fakes import Engine, FakeNode, identity
from tests.unit.test_connector_sides import prompt


class ManualEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True  # the host waited for it

    def __repr__(self) -> str:
        return f"<{self.name} {'done' if self.done else 'pending'}>"


class ManualStream(HostDma):
    """A copy stream whose events complete by hand; logs what the compute stream waits for.
    Its DMAs run on the host at once (``HostDma``): the bytes are checked elsewhere, the
    ordering here."""

    asynchronous = True

    def __init__(self) -> None:
        super().__init__()
        self.events: list[ManualEvent] = []
        self.log: list[Any] = []

    def after_compute(self) -> None:
        self.log.append("after_compute")

    def issuing(self) -> Any:
        return nullcontext()

    def record(self) -> ManualEvent:
        ev = ManualEvent(f"e{len(self.events)}")
        self.events.append(ev)
        self.log.append(("record", ev))
        return ev

    def compute_waits(self, event: ManualEvent) -> None:
        self.log.append(("waits", event))

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        super().copy(dst, src, nbytes)
        self.log.append(("copy", dst, nbytes))

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        super().copy2d(dst, dpitch, src, spitch, width, height)
        self.log.append(("copy2d", dst, width * height))

    def complete(self) -> None:
        for e in self.events:
            e.done = True


def empty_step(eng: Engine) -> PegaWorkerReport:
    """A step with nothing scheduled (vLLM still runs the connector: kv_connector_no_forward)."""
    so = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                         scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                               resumed_req_ids=set()))
    meta = eng.sched.build_connector_meta(so)
    report = None
    for w in eng.workers:
        w.before_step(meta)
        w.start_load(meta)
        w.save(meta)
        r = w.report(meta)
        report = r if report is None else report.aggregate(r)
    eng.sched.update_connector_output(report)
    return report


def test_a_save_is_committed_only_after_its_copy_completed() -> None:
    node = FakeNode()
    streams: list[ManualStream] = []
    eng = Engine(node, identity(), stream=lambda: streams.append(ManualStream()) or streams[-1])
    tokens = prompt(1)
    bs = identity().block_size
    saved = eng.run(tokens, generate=[7])  # the prefill, then a decode step while its save is in flight
    computed = [eng.block_content(0, b) for b in saved["block_ids"][: (len(tokens) - 1) // bs]]
    assert node.calls["reserve"] >= 1
    assert saved["meta"].flush is False
    assert node.calls["commit"] == 0, "committed while the copy into the pool was still in flight"
    assert eng.sched.pending_steps(), "the step waits for its copy"
    streams[0].complete()
    empty_step(eng)
    assert node.calls["commit"] >= 1 and not eng.sched.pending_steps()
    # The bytes the batched copy wrote are the page: a second engine (synchronous) loads them.
    out = Engine(node, identity()).run(tokens)
    assert out["external"] == (len(tokens) - 1) // bs * bs
    assert out["loaded"][0] == computed


def test_a_step_with_nothing_scheduled_waits_for_the_copies_so_an_idle_engine_commits_them() -> None:
    # vLLM runs one step with nothing scheduled after the last request, then none until the
    # next: without the wait the save would stay uncommitted, and the next request (asking
    # the node before any step) would miss it.
    node = FakeNode()
    streams: list[ManualStream] = []
    eng = Engine(node, identity(), stream=lambda: streams.append(ManualStream()) or streams[-1])
    tokens = prompt(1)
    eng.run(tokens)
    assert node.calls["commit"] == 0 and eng.sched.pending_steps()
    report = empty_step(eng)
    assert report.done_through == eng.sched._step, "the idle step's report did not wait for the copies"  # noqa: SLF001
    assert node.calls["commit"] == 1 and not eng.sched.pending_steps()
    assert Engine(node, identity()).run(tokens)["external"] > 0, "the same prompt again misses"
    empty_step(eng)
    assert node.calls["commit"] == 1  # nothing in flight: a plain idle step


def test_a_step_is_not_reported_done_before_its_saves_are_issued() -> None:
    # With speculative decoding vLLM builds the step's report before wait_for_save.
    node = FakeNode()
    eng = Engine(node, identity(), stream=ManualStream)
    out = eng.run(prompt(1), finalize_late=True)
    step = out["meta"].step
    assert out["meta"].saves
    assert node.calls["reserve"] == 1 and node.calls["commit"] == 0, "committed before its copy was queued"
    assert step in eng.sched.pending_steps()


def _failing_save(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    from pegaflow.client import batched

    def save(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(batched.DeviceCopier, "save", save)


def test_a_save_that_fails_while_its_step_is_in_flight_is_aborted_never_committed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    node = FakeNode()
    streams: list[ManualStream] = []
    eng = Engine(node, identity(), stream=lambda: streams.append(ManualStream()) or streams[-1])
    _failing_save(monkeypatch, RuntimeError("the copy stream refused it"))
    eng.run(prompt(1))
    # The failed batch's queued copies (if any) still hold the step: it settles later, and
    # the failure, reported now, must still count then.
    assert node.calls["reserve"] == 1 and node.calls["commit"] == node.calls["abort"] == 0
    assert eng.sched.pending_steps()
    monkeypatch.undo()
    for s in streams:
        s.complete()
    empty_step(eng)
    empty_step(eng)
    assert node.calls["commit"] == 0 and node.calls["abort"] == 1 and not node.stored
    assert not eng.sched.pending_steps()


def test_a_failed_batchs_queued_bounce_copies_hold_its_pages_until_they_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    from pegaflow.client.batched import IssueFailed

    node = FakeNode()
    streams: list[ManualStream] = []
    eng = Engine(node, identity(), stream=lambda: streams.append(ManualStream()) or streams[-1])
    bounce_copy = ManualEvent("bounce copy into the pool")  # queued before the batch failed
    _failing_save(monkeypatch, IssueFailed(RuntimeError("cudaMemcpyAsync failed"), (bounce_copy,)))
    eng.run(prompt(1))
    monkeypatch.undo()
    for s in streams:
        s.complete()
    eng.run(prompt(2))  # a later step with work (an idle one would wait for every copy)
    assert node.calls["abort"] == 0, "aborted (its pages free for others) while a copy still writes them"
    bounce_copy.done = True
    for s in streams:
        s.complete()
    empty_step(eng)
    assert node.calls["abort"] == 1 and node.calls["commit"] == 1  # the failed save, then prompt 2's


def test_the_forward_waits_for_the_gather_not_for_the_dma() -> None:
    node = FakeNode()
    stream = ManualStream()
    eng = Engine(node, identity(), stream=lambda: stream)
    eng.run(prompt(2))
    log = stream.log
    assert log[0] == "after_compute", "the copy starts after the forward that computed the blocks"
    waits = [i for i, entry in enumerate(log) if entry[0] == "waits"]
    assert len(waits) == 1, "the compute stream waits once, for the gather"
    gathered = log[waits[0]][1]
    at_gather = log.index(("record", gathered))
    pool = eng.workers[0]._pool  # noqa: SLF001
    lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel()
    into_pool = [i for i, entry in enumerate(log) if entry[0].startswith("copy") and lo <= entry[1] < hi]
    assert into_pool and min(into_pool) > at_gather, "the DMAs into the pool come after the gather's event"
    last = max(i for i, entry in enumerate(log) if entry[0] == "record")
    assert last > max(into_pool) and log[last][1] is not gathered, "the save's own event comes after the DMA"


def test_a_lease_is_released_only_after_the_load_that_reads_it() -> None:
    node = FakeNode()
    Engine(node, identity()).run(prompt(3))  # stored synchronously
    stream = ManualStream()
    eng = Engine(node, identity(), stream=lambda: stream)
    before = node.calls["release"]
    out = eng.run(prompt(3))
    assert out["external"] > 0
    assert node.calls["release"] == before, "released while the load still reads the leased pages"
    stream.complete()
    empty_step(eng)
    assert node.calls["release"] > before


def test_each_layer_waits_for_its_own_load_event_or_the_whole_load_under_a_cuda_graph() -> None:
    node = FakeNode()
    ident = identity(layers=3)
    first = Engine(node, ident)
    first.run(prompt(4))
    stream = ManualStream()
    eng = Engine(node, ident, stream=lambda: stream)
    w = eng.workers[0]
    req = eng.request(prompt(4))
    n_ext, _ = eng.sched.get_num_new_matched_tokens(req, 0)
    blocks = [eng.free.pop() for _ in range(-(-len(prompt(4)) // ident.block_size))]
    eng.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), n_ext)
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=n_ext)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={req.request_id: len(prompt(4)) - n_ext})
    meta = eng.sched.build_connector_meta(so)
    w.before_step(meta)
    w.start_load(meta)
    layers = w.layout.layer_names
    assert sorted(w._layer_events) == sorted(layers)  # noqa: SLF001
    events = {name: w._layer_events[name] for name in layers}  # noqa: SLF001
    assert len(set(map(id, events.values()))) == len(layers), "one event per layer"
    stream.log.clear()
    w.wait_for_layer(layers[1])
    assert stream.log == [("waits", events[layers[1]])]
    w.wait_for_layer(layers[1])  # a second micro-batch, on its own stream, waits too
    assert stream.log == [("waits", events[layers[1]])] * 2
    # After the forward, what comes next waits for every layer's load, waited for or not.
    stream.log.clear()
    w.save(meta)
    assert stream.log[0] == ("waits", events[layers[-1]])

    # Replayed as one graph: the compute stream waits for the whole load before the forward.
    stream.log.clear()
    w.start_load(meta, layerwise=False)
    assert not w._layer_events and stream.log[-1][0] == "waits"  # noqa: SLF001
    assert stream.log[-1][1] is stream.events[-1]


def test_the_slowest_rank_decides_and_a_step_a_rank_never_saw_is_aborted() -> None:
    assert PegaWorkerReport(done_through=7).aggregate(PegaWorkerReport(done_through=4)).done_through == 4
    node = FakeNode()
    streams: list[ManualStream] = []
    eng = Engine(node, identity(tp=2), stream=lambda: streams.append(ManualStream()) or streams[-1])
    eng.run(prompt(5))
    streams[0].complete()  # rank 0 done, rank 1 still copying
    eng.run(prompt(6))  # a later step with work (an idle one would wait for every copy)
    assert node.calls["commit"] == 0
    streams[1].complete()
    empty_step(eng)
    assert node.calls["commit"] >= 1

    # A step whose metadata a worker never got: its reservations are aborted.
    node2 = FakeNode()
    eng2 = Engine(node2, identity())
    so = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                         scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                               resumed_req_ids=set()))
    w = eng2.workers[0]
    m1 = eng2.sched.build_connector_meta(so)
    eng2.sched.update_connector_output(w.report(m1))
    eng2.sched._inflight[m1.step + 1] = _StepWork(reservations={(0, 99): (1, "", 0)})  # noqa: SLF001
    eng2.sched._step += 1  # noqa: SLF001 - step m1+1 was planned, and lost on the way
    m3 = eng2.sched.build_connector_meta(so)
    rep = w.report(m3)
    assert rep.lost_steps == frozenset({m1.step + 1})
    eng2.sched.update_connector_output(rep)
    assert node2.calls["abort"] == 1 and node2.calls["commit"] == 0


def test_an_async_load_is_finished_only_once_its_copy_completed_and_failures_wait_with_it() -> None:
    from pegaflow.connector.inflight import InFlight

    f = InFlight()
    f.begin(1)
    ev = ManualEvent("load")
    f.add(1, ev)
    f.add_load(ev, ["r1", "r2"])
    assert f.finished_loads() == set() and f.loading() == {"r1", "r2"} and f.done_through() == 0
    ev.done = True
    assert f.finished_loads() == {"r1", "r2"} and f.loading() == set() and f.done_through() == 1
    assert f.finished_loads() == set(), "reported once"
