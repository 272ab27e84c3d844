"""The scheduler side's one wait rule, in every case a request waits.

A request the node cannot serve from DRAM yet waits: for blocks being promoted or pulled
(``(None, False)``, or an asynchronous load already promised to vLLM), for the blocks its
prefill stored (the decode half of a disaggregated request), or for the state page at its
hit's end. Each case asks the node again every ``LOADING_POLL_S`` and gives up at
``LOADING_WAIT_S`` after the wait began: at that poll, never before; a wait the node
satisfies ends, and a later one has a deadline of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from pegaflow.connector import scheduler as scheduler_mod
from pegaflow.connector.scheduler import Awaiting, _Wait
from pegaflow.connector.settings import LOAD_ONLY, ConnectorSettings
from pegaflow.core.router_protocol import ROUTER_KEY
from tests.unit.connector_fakes import Engine, FakeNode, identity
from tests.unit.test_connector_state_space import TOKENS, StateEngine, cold_run, idle_step

BS = 16
# Powers of two, so the clock lands on the deadline exactly (0.005 s steps would not).
POLL, WAIT = 2.0**-7, 1.0
T0 = 1000.0

Answer = tuple[int | None, bool]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The scheduler's monotonic clock, advanced by hand."""
    now = [T0]
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(scheduler_mod, "LOADING_POLL_S", POLL)
    monkeypatch.setattr(scheduler_mod, "LOADING_WAIT_S", WAIT)
    return now


def prompt(seed: int, n: int = 5 * BS + 3) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 for i in range(n)]


@dataclass
class Case:
    node: FakeNode
    ask: Callable[[], Answer]  # vLLM's get_num_new_matched_tokens for the request
    withhold: Callable[[], None]  # the node lacks what the request waits for
    deliver: Callable[[], None]  # ... and now holds it
    hit: Answer  # the answer once delivered
    at_deadline: Answer  # the answer once the wait is over


def promoting(node: FakeNode) -> tuple[Callable[[], None], Callable[[], None]]:
    """``withhold`` and ``deliver`` for what the node promotes: until delivered it answers
    LOADING (to queries of the namespaces ``node.loading_match`` names)."""

    def withhold() -> None:
        node.loading = 10**6

    def deliver() -> None:
        node.loading = 0

    return withhold, deliver


def promotion() -> Case:
    """Blocks the node is promoting (a LOADING answer without an expected length)."""
    node = FakeNode()
    p = prompt(1)
    Engine(node, identity()).run(p)
    b = Engine(node, identity())
    req = b.request(p)
    return Case(node, lambda: b.sched.get_num_new_matched_tokens(req, 0), *promoting(node),
                hit=(5 * BS, False), at_deadline=(0, False))


def on_their_way(node: FakeNode) -> tuple[Callable[[], None], Callable[[], None]]:
    """Withhold and deliver the node's blocks past the first two (still on their way)."""
    later = sorted(node.stored, key=node.stored.__getitem__)[2:]
    offsets = {k: node.stored[k] for k in later}

    def withhold() -> None:
        for k in later:
            node.stored.pop(k, None)

    def deliver() -> None:
        node.stored.update(offsets)

    return withhold, deliver


def prefill() -> Case:
    """The decode half of a disaggregated request: its prefill stored 5 blocks."""
    node = FakeNode()
    p = prompt(2)
    Engine(node, identity()).run(p)
    decode = Engine(node, identity(), settings=ConnectorSettings(mode=LOAD_ONLY))
    req = decode.request(p, kv_transfer_params={ROUTER_KEY: {"expect_blocks": 5}})
    withhold, deliver = on_their_way(node)  # blocks 2..4
    return Case(node, lambda: decode.sched.get_num_new_matched_tokens(req, 0), withhold, deliver,
                hit=(5 * BS, False), at_deadline=(2 * BS, False))


def full_prefix() -> Case:
    """``pegaflow.wait_for_full_prefix`` (the original's key): a request waits for every full
    block of its prompt, of which the node holds 2 of 5 yet."""
    node = FakeNode()
    p = prompt(4)
    Engine(node, identity()).run(p)
    eng = Engine(node, identity(), settings=ConnectorSettings(wait_for_full_prefix=True))
    req = eng.request(p)
    withhold, deliver = on_their_way(node)
    return Case(node, lambda: eng.sched.get_num_new_matched_tokens(req, 0), withhold, deliver,
                hit=(5 * BS, False), at_deadline=(2 * BS, False))


def state_page() -> Case:
    """The state page at the hit's end of a hybrid state-space model, being promoted."""
    node = FakeNode()
    cold_run(StateEngine(node), TOKENS)
    node.loading_match = "|state="
    eng = StateEngine(node)
    req = eng.request(TOKENS)
    return Case(node, lambda: eng.sched.get_num_new_matched_tokens(req, 0), *promoting(node),
                hit=(6 * BS, True), at_deadline=(0, False))


CASES = [promotion, prefill, full_prefix, state_page]


def test_the_rule_polls_every_interval_and_ends_at_the_deadline(clock: list[float]) -> None:
    wait = _Wait(Awaiting.PROMOTION, since=T0, next_poll=T0)
    assert wait.due(T0) and wait.hold(T0)
    assert not wait.due(T0 + POLL / 2) and wait.due(T0 + POLL)
    assert wait.hold(T0 + WAIT - POLL) and wait.next_poll == T0 + WAIT
    assert not wait.hold(T0 + WAIT) and wait.over(T0 + WAIT)
    abandoned = _Wait(Awaiting.PROMOTION, since=T0, next_poll=T0)
    abandoned.abandon()
    assert abandoned.over(T0) and not abandoned.hold(T0)


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__)
def test_a_wait_times_out_at_its_deadline_never_before(clock: list[float], make: Callable[[], Case]) -> None:
    case = make()
    case.withhold()
    assert case.ask() == (None, False)
    queries = case.node.calls["query"]
    clock[0] = T0 + WAIT - POLL  # the last poll before the deadline
    assert case.ask() == (None, False)
    assert case.node.calls["query"] > queries, "a poll asks the node"
    clock[0] = T0 + WAIT
    assert case.ask() == case.at_deadline


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__)
def test_a_satisfied_wait_ends_and_a_later_one_has_its_own_deadline(
    clock: list[float], make: Callable[[], Case]
) -> None:
    case = make()
    case.withhold()
    assert case.ask() == (None, False)
    clock[0] = T0 + WAIT - POLL
    case.deliver()
    assert case.ask() == case.hit
    case.withhold()  # vLLM asks again (e.g. it could not allocate) and the node lacks it again
    assert case.ask() == (None, False)
    clock[0] = T0 + WAIT  # the first wait's deadline
    assert case.ask() == (None, False)


def async_load(node: FakeNode, clock: list[float]) -> tuple[Engine, Any, list[int]]:
    """A request whose blocks the node promotes, promised to vLLM as an asynchronous load."""
    p = prompt(3)
    Engine(node, identity()).run(p)
    b = Engine(node, identity())
    node.loading, node.loading_dram, node.loading_from, node.loading_expected = 10**6, 1, "ssd", 5
    req = b.request(p)
    block_ids = [b.free.pop() for _ in range(6)]
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    return b, req, block_ids


def test_an_async_load_times_out_at_its_deadline_never_before(clock: list[float]) -> None:
    node = FakeNode()
    b, req, block_ids = async_load(node, clock)
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 5 * BS)
    clock[0] = T0 + WAIT - POLL
    queries = node.calls["query"]
    assert b.sched.build_connector_meta(idle_step()).loads == ()
    assert node.calls["query"] > queries, "a poll asks the node"
    clock[0] = T0 + WAIT
    (ld,) = b.sched.build_connector_meta(idle_step()).loads
    assert ld.block_ids == () and ld.missing == tuple(block_ids[:5])


def test_an_async_load_vllm_allocated_otherwise_fails_at_its_first_poll(clock: list[float]) -> None:
    node = FakeNode()
    b, req, block_ids = async_load(node, clock)
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 5 * BS - 1)
    assert b.sched.build_connector_meta(idle_step()).loads == (), "not due yet"
    clock[0] = T0 + POLL
    queries = node.calls["query"]
    (ld,) = b.sched.build_connector_meta(idle_step()).loads
    assert ld.block_ids == () and ld.missing and node.calls["query"] == queries, "nothing left to ask for"


def test_waiting_for_the_full_prefix_promises_no_part_of_it_until_the_deadline(clock: list[float]) -> None:
    """The node will hold 3 of the prompt's 5 blocks once its promotion lands: with
    ``pegaflow.wait_for_full_prefix`` that is no asynchronous load while the wait lasts (the
    original's all or nothing); at the deadline the request takes what the node will hold."""
    node = FakeNode()
    p = prompt(5)
    Engine(node, identity()).run(p)
    eng = Engine(node, identity(), settings=ConnectorSettings(wait_for_full_prefix=True))
    node.loading, node.loading_dram, node.loading_from, node.loading_expected = 10**6, 1, "ssd", 3
    req = eng.request(p)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    clock[0] = T0 + WAIT - POLL
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    clock[0] = T0 + WAIT
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    plain = Engine(node, identity())  # without the key: the same answer at once
    assert plain.sched.get_num_new_matched_tokens(plain.request(p), 0) == (3 * BS, True)
