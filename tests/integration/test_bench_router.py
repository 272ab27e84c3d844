"""bench/router.py's sending path (``run``: one driver for one at a time, open loop and
closed loop) against a real ``pegaflow router`` in front of two stand-in engines
(tests/fakes/openai_engine.py): every request answered once, results in trace order, the
open loop paced, sends in trace order. The vLLM benchmark itself is not run here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

from bench.router import run
from tests.harness.router import FakeEngine, RouterProc

N = 12


class SettledNodes:
    """No nodes behind the stand-ins: nothing is ever left to commit."""

    def __init__(self) -> None:
        self.polls = 0

    def settled(self) -> bool:
        self.polls += 1
        return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProc, list[FakeEngine]]]:
    logs: Path = tmp_path_factory.mktemp("bench-router")
    engines = [FakeEngine(logs, f"e{i}", "--delay", "0.02", "--model", "m") for i in range(2)]
    router = RouterProc(logs, "--engine", *(e.url for e in engines), "--policy", "round-robin")
    try:
        yield router, engines
    finally:
        router.stop()
        for e in engines:
            e.stop()


@pytest.mark.parametrize(("rate", "concurrency"), [(0.0, 0), (40.0, 0), (0.0, 3)],
                         ids=["one-at-a-time", "open-loop", "closed-loop"])
def test_every_mode_sends_each_request_once_in_trace_order(
        cluster: tuple[RouterProc, list[FakeEngine]], rate: float, concurrency: int) -> None:
    router, engines = cluster
    before = [len(e.served()) for e in engines]
    prompts = [[100 + k, 7, 7, 7] for k in range(N)]  # the first token names the request
    nodes = SettledNodes()
    res, wall = run(router, nodes, "m", prompts, f"salt-{rate}-{concurrency}", 2, "t", rate,  # type: ignore[arg-type]
                    concurrency)
    assert len(res) == N and wall > 0
    served = [b for e, k in zip(engines, before, strict=True) for b in e.served()[k:]]
    assert sorted(b["prompt"][0] for b in served) == [100 + k for k in range(N)]  # each once
    # the router's header, per request: round-robin shares them out evenly
    assert Counter(r["engine"] for r in res) == {e.url: N // 2 for e in engines}
    assert all(r["ttft_s"] > 0 for r in res)
    if not rate and not concurrency:  # results in trace order: one at a time, round-robin alternates
        assert all(r["engine"] == res[k % 2]["engine"] for k, r in enumerate(res))
    sent = [r["sent_s"] for r in res]
    assert sent == sorted(sent)  # sent in trace order
    # what predict() is given: the first token after the send, the answer's end after that
    assert all(r["sent_s"] < r["first_s"] <= r["done_s"] for r in res)
    if not rate and not concurrency:  # one at a time: each prefill over before the next send
        assert all(a["done_s"] < b["sent_s"] for a, b in pairwise(res))
    if concurrency:  # closed loop: several in flight at once, so replay's completions matter
        assert any(b["sent_s"] < a["first_s"] for a, b in pairwise(res))
    if rate:
        assert all(s >= k / rate for k, s in enumerate(sent))  # paced, not all at once
    # one at a time waits for the saves after every request; the others once at the end
    assert nodes.polls == (N + 1 if not rate and not concurrency else 1)
