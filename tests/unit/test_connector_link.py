"""NodeLink's contract: a call never waits longer than its own RPC on a hung node."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pegaflow.connector.link import NodeLink

RPC_S = 0.2  # what a call to the hung node takes before it fails (the client's RPC timeout)
REGISTER_S = 1.5  # a re-registration against it blocks this long, and closing that client 1 s more


class Unavailable(Exception):
    pass


class HungNodeClient:
    def __init__(self, hung: threading.Event, registering: threading.Event) -> None:
        self.hung, self.registering = hung, registering

    def register(self, namespaces: object) -> None:
        if self.hung.is_set():
            self.registering.set()
            time.sleep(REGISTER_S)
            raise Unavailable("register timed out")

    def close(self) -> None:
        if self.hung.is_set():
            time.sleep(1.0)


def test_calls_do_not_wait_on_a_reconnect_to_a_hung_node():
    hung, registering = threading.Event(), threading.Event()
    link = NodeLink("hung:0", {"ns": 1}, "t", client_factory=lambda a, i: HungNodeClient(hung, registering),
                    unavailable=(Unavailable,), rejected=(RuntimeError,))
    waits: dict[str, float] = {}

    def first(c: HungNodeClient) -> None:
        time.sleep(RPC_S)
        raise Unavailable("query timed out")  # starts the reconnect

    def second(c: HungNodeClient) -> None:  # in flight too, fails while the reconnect registers
        assert registering.wait(10)
        waits["second_failed"] = time.monotonic()
        raise Unavailable("query timed out")

    def run(fn, name: str) -> None:  # type: ignore[no-untyped-def]
        assert link.call(fn) is None
        waits[name] = time.monotonic()

    try:
        assert link.ready
        hung.set()
        with ThreadPoolExecutor(max_workers=2) as pool:
            calls = [pool.submit(run, f, n) for f, n in ((first, "first"), (second, "second"))]
            for c in calls:
                c.result(timeout=10)  # raises here what failed in its thread
        assert registering.is_set() and "second" in waits
        t0 = time.monotonic()
        link.reconnect()  # e.g. a stale pool epoch, while the node hangs
        after_failure = {"second call": waits["second"] - waits["second_failed"], "reconnect": time.monotonic() - t0}
        t0 = time.monotonic()
        assert link.call(first) is None  # down: answered at once, no RPC
        after_failure["later call"] = time.monotonic() - t0
        assert max(after_failure.values()) < 0.5, f"waited on the reconnect: {after_failure}"
    finally:
        hung.clear()
        link.close()


class ReadyClient:
    def register(self, namespaces: object) -> None:
        pass

    def close(self) -> None:
        pass

    def health(self) -> str:
        return "answer"


class ClosedAfterCheck:
    """The link's readiness, closing the link right after it answers "ready": close() on one
    thread landing between a call's check and its use of the client on another, made
    deterministic."""

    def __init__(self, link: NodeLink) -> None:
        self.link, self.ready = link, link._ready

    def is_set(self) -> bool:
        answer = self.ready.is_set()
        self.link._ready = self.ready  # close() clears the real event
        self.link.close()
        return answer


def test_a_call_racing_close_returns_none():
    link = NodeLink("node:0", {"ns": 1}, "t", client_factory=lambda a, i: ReadyClient(),  # type: ignore[arg-type,return-value]
                    unavailable=(Unavailable,), rejected=(RuntimeError,))
    assert link.call(lambda c: c.health()) == "answer"
    link._ready = ClosedAfterCheck(link)  # type: ignore[assignment]
    assert link.call(lambda c: c.health()) is None
    assert not link.ready and link.client is None
