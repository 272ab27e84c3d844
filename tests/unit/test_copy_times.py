"""An engine's copy times, from the worker that copies to the node (fake node here; the real
one: tests/integration/test_copy_times.py).

The worker times each save and load batch (one rank's copies of one step) and counts the
load batches that fail; its report carries them (``PegaWorkerReport.copies``, joined over TP
ranks) and the scheduler side sends them on the next Commit or Release it sends anyway,
never on a call of their own, and keeps them while the node is unreachable.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import pegaflow.connector.worker as worker_mod
from pegaflow.client.client import NO_COPIES, CopyTimes
from pegaflow.common.validate import MAX_COPY_TIMES
from pegaflow.connector.intents import PegaWorkerReport
from tests.unit.connector_fakes import Engine, FakeNode, identity
from tests.unit.test_connector_sides import prompt
from tests.unit.test_inflight import ManualStream, empty_step
from tests.waiting import wait_until


def sent(node: FakeNode) -> list[CopyTimes]:
    """What the Commits and Releases carried, the empty ones left out."""
    return [c for c in node.copies if c]


def test_a_save_and_a_load_each_reach_the_node_once() -> None:
    node = FakeNode()
    Engine(node, identity()).run(prompt(1))
    (saved,) = sent(node)  # on the Commit of the step's reservation
    assert len(saved.save_seconds) == 1 and not saved.load_seconds and saved.load_failures == 0
    assert 0 < saved.save_seconds[0] < 10
    Engine(node, identity()).run(prompt(1))
    _, loaded = sent(node)  # on the Release of the load's lease
    assert len(loaded.load_seconds) == 1 and not loaded.save_seconds and loaded.load_failures == 0


def test_no_call_is_added_for_the_report() -> None:
    a, b = FakeNode(), FakeNode()
    Engine(a, identity()).run(prompt(2))
    Engine(a, identity()).run(prompt(2))
    # The same traffic with reports that carry nothing: the calls are the same ones.
    orig = worker_mod.WorkerSide._take_copies  # noqa: SLF001
    try:
        worker_mod.WorkerSide._take_copies = lambda self, done_through, failed=frozenset(): NO_COPIES  # type: ignore[method-assign]  # noqa: SLF001
        Engine(b, identity()).run(prompt(2))
        Engine(b, identity()).run(prompt(2))
    finally:
        worker_mod.WorkerSide._take_copies = orig  # type: ignore[method-assign]  # noqa: SLF001
    assert a.calls == b.calls and sent(a) and not sent(b)


def test_tp_ranks_each_report_their_batch() -> None:
    node = FakeNode()
    Engine(node, identity(tp=2)).run(prompt(3))
    (saved,) = sent(node)
    assert len(saved.save_seconds) == 2, "one save batch per rank"
    Engine(node, identity(tp=2)).run(prompt(3))
    assert len(sent(node)[1].load_seconds) == 2


def test_a_load_that_fails_is_counted_and_not_timed() -> None:
    node = FakeNode()
    Engine(node, identity()).run(prompt(4))
    eng = Engine(node, identity())

    def broken(*args: object, **kwargs: object) -> int:
        raise RuntimeError("copy failed (test)")

    eng.workers[0]._load_pages = broken  # type: ignore[method-assign]  # noqa: SLF001
    out = eng.run(prompt(4))
    assert out["errors"], "vLLM recomputes the blocks"
    report = sent(node)[-1]
    assert report.load_failures == 1 and not report.load_seconds


def test_a_copy_on_a_copy_stream_is_timed_until_the_report_that_finds_it_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(worker_mod, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    node = FakeNode()
    stream = ManualStream()
    eng = Engine(node, identity(), stream=lambda: stream)
    eng.run(prompt(5), generate=[7])  # the save is issued at 100.0; a decode step's report finds its DMA running
    assert not sent(node), "not done: neither committed nor timed"
    now[0] = 100.5
    stream.complete()
    empty_step(eng)  # the step is done: committed, with the save's time
    (saved,) = sent(node)
    assert saved.save_seconds == (0.5,)


def test_copy_times_wait_while_the_node_is_down_and_go_with_the_first_call_after() -> None:
    node = FakeNode()
    Engine(node, identity()).run(prompt(6))
    eng = Engine(node, identity())
    q = eng.request(prompt(6))
    eng.sched.get_num_new_matched_tokens(q, 0)  # leased
    node.up = False
    eng.sched.link.call(lambda c: c.query(["x"], []))  # the link notices
    waiting = CopyTimes(save_seconds=(0.5,), load_seconds=(0.25,), load_failures=1)
    eng.sched.update_connector_output(PegaWorkerReport(done_through=-1, copies=waiting))
    eng.sched.request_finished(q)  # its lease's Release does not reach the node
    assert not sent(node)[1:]
    node.up = True
    wait_until(lambda: eng.sched.link.ready, 10.0, "the link to reconnect")
    eng.run(prompt(8))  # a miss: its save's Commit carries what waited, and its own time
    later = sent(node)[1]
    assert later.save_seconds[:1] == (0.5,) and len(later.save_seconds) == 2
    assert later.load_seconds == (0.25,) and later.load_failures == 1


def test_merging_keeps_the_newest_durations_within_the_nodes_limit() -> None:
    a = CopyTimes(save_seconds=tuple(float(i) for i in range(MAX_COPY_TIMES)), load_failures=2)
    b = CopyTimes(save_seconds=(-1.0, -2.0), load_seconds=(3.0,), load_failures=1)
    m = a.merge(b)
    assert len(m.save_seconds) == MAX_COPY_TIMES and m.save_seconds[-2:] == (-1.0, -2.0)
    assert m.save_seconds[0] == 2.0 and m.load_seconds == (3.0,) and m.load_failures == 3
    assert NO_COPIES.merge(b) is b and b.merge(NO_COPIES) is b and not NO_COPIES
