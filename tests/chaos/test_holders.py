"""Engines that die or dawdle while they hold pages: never a wrong byte, never a leak.

* Writers and readers SIGKILLed at random moments (mid-Reserve, mid-copy, mid-Commit) while
  an observer reads and verifies every page it is served.
* Slow holders: writers and readers that sleep past ``--reservation-ttl`` / ``--lease-ttl``
  between taking pages and using them, on a pool small enough that others want the pages.

Neither kills nor TTLs make a client's call fail, so no operation may fail. ``lost`` is not
defined here: both pools are kept full on purpose, and an evicted block is not told apart
from a lost one.
"""

from __future__ import annotations

import random
import time

from tests.chaos.common import PAGE, Report, pick, tracebacks_in
from tests.chaos.procs import Worker, node_stats, nothing_held
from tests.waiting import wait_until


def test_killed_writers_and_readers_expose_nothing_and_leak_nothing(node_factory):  # type: ignore[no-untyped-def]
    rep = Report("SIGKILLed writers and readers, with an observer")
    universe = 2048
    node = node_factory(f"{512 * PAGE >> 20}mb")  # 512 pages: the writers keep it full
    rng = random.Random(7)
    observer = Worker("reader", node.addr, 1, universe, "--blocks", "16")
    observer.wait_ready()
    duration = pick(8, 120)
    kills = 0
    deadline = time.monotonic() + duration
    seed = 100
    try:
        while time.monotonic() < deadline:
            batch = [Worker(rng.choice(["writer", "writer", "reader"]), node.addr, seed + k, universe)
                     for k in range(3)]
            seed += 3
            for w in batch:
                w.wait_ready()
            time.sleep(rng.uniform(0.05, 0.6))  # the chaos: each dies at a random moment of its work
            for w in batch:
                w.kill()
                kills += 1
        totals = observer.finish()
        wait_until(lambda: nothing_held(node.addr), 30, "the killed engines' holdings and sessions freed")
    finally:
        observer.kill()
    st = node_stats(node.addr)
    f = rep.fig
    f.tried = totals["ops"] + kills
    f.failed = totals["errors"]
    f.wrong = totals["wrong"]
    f.leaked = st.active_reservations + st.active_leases + max(0, st.sessions)
    f.crashes = int(node.proc.poll() is not None)
    f.tracebacks = tracebacks_in(node.log())
    f.notes.update(kills=kills, observer_blocks_verified=totals["verified"], resident_blocks=st.resident_blocks)
    rep.done()
    assert not f.bad() and totals["verified"] > 0, (f, totals.get("first_error"))


def test_holders_slower_than_every_ttl_never_see_or_write_anothers_bytes(node_factory):  # type: ignore[no-untyped-def]
    rep = Report("holders slower than --reservation-ttl and --lease-ttl")
    universe = 256
    node = node_factory(f"{64 * PAGE >> 20}mb", ["--reservation-ttl", "0.1", "--lease-ttl", "0.1"])
    slow = [Worker(role, node.addr, 10 + i, universe, "--slow", "0.4", "--blocks", "8")
            for i, role in enumerate(["writer", "writer", "reader", "reader"])]
    fast = [Worker(role, node.addr, 20 + i, universe, "--blocks", "8") for i, role in enumerate(["writer", "reader"])]
    for w in slow + fast:
        w.wait_ready()
    wait_until(lambda: node.metric("pegaflow_node_expired_total") >= pick(10, 200), pick(60, 300),
               "holders to outlive their TTLs")
    totals = [w.finish() for w in slow + fast]
    wait_until(lambda: nothing_held(node.addr), 30, "holdings freed")
    f = rep.fig
    f.tried = sum(t["ops"] for t in totals)
    f.failed = sum(t["errors"] for t in totals)
    f.wrong = sum(t["wrong"] for t in totals)
    f.crashes = int(node.proc.poll() is not None)
    f.tracebacks = tracebacks_in(node.log())
    f.notes.update(late_holdings=int(node.metric("pegaflow_node_expired_total")),
                   blocks_verified=sum(t["verified"] for t in totals))
    rep.done()
    assert not f.bad() and f.notes["blocks_verified"], (f, [t.get("first_error") for t in totals if t["errors"]])
