"""The global index under faults: metaserver SIGKILLs and Redis outages while nodes publish.

Node-like publisher processes (the node's own ``EventPublisher``) mutate and publish; the
metaserver is SIGKILLed and restarted, Redis is stopped and started (empty, no AOF) in the
middle; at the end the index must equal the nodes' ground truth (``lost``: what the nodes
hold and the index does not name; naming a holder that does not hold a block is as bad),
and the time it took to converge after the last fault is reported.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from pegaflow.cluster import keys
from tests.chaos.common import Report, pick, tracebacks_in
from tests.harness.meta import MetaServer
from tests.harness.redis import start_server
from tests.integration.meta_harness import (
    PublisherProc,
    client,
    index_view,
    load_truth,
    start_meta,
    wait_converged,
)
from tests.waiting import wait_until


def test_index_converges_after_metaserver_kills_and_redis_outages(tmp_path: Path) -> None:
    rep = Report("metaserver SIGKILLs and Redis outages")
    srv = start_server(tmp_path / "redis")
    rng = random.Random(3)
    names = ["n1", "n2", "n3"]
    # The node-like publisher's own bookkeeping is quadratic in its state (it samples evictions
    # from a sorted set): past ~8000 operations the harness, not PegaFlow, is what is slow.
    ops = int(pick(3000, 6000))
    procs = {n: PublisherProc(srv.url, False, n, tmp_path / f"{n}.json", tmp_path / f"{n}.log", "--seed", str(i),
                              "--ops", str(ops), "--rate", "1500", "--hold", "--ttl", "3")
             for i, n in enumerate(names)}
    meta_logs: list[Path] = []

    def new_meta(k: int) -> MetaServer:
        log = tmp_path / f"meta{k}.log"
        meta_logs.append(log)
        return start_meta(srv.url, False, f"m{k}", log, lease_ttl=1.5)

    meta = new_meta(0)
    faults = 0
    unconverged = ""
    try:
        r = client(srv.url, False)
        wait_until(lambda: r.hlen(keys.NODES) == len(names), 30, "nodes registered")
        for k in range(1, int(pick(3, 8)) + 1):
            time.sleep(rng.uniform(0.1, 0.5))  # the chaos: a fault at a random point of the stream
            if k % 2:
                meta.kill()
                meta = new_meta(k)
            else:
                srv.stop()
                time.sleep(rng.uniform(0.3, 1.5))  # Redis down for a while
                srv.start()
                r = client(srv.url, False)
            faults += 1
        dropped = sum(p.wait_done(180)["dropped"] for p in procs.values())
        states = {n: p.state for n, p in procs.items()}
        t0 = time.monotonic()
        try:
            wait_converged(client(srv.url, False), states, timeout=120)
            converged: float | None = round(time.monotonic() - t0, 1)
        except AssertionError as exc:
            converged, unconverged = None, str(exc)
        truth, view = load_truth(states), index_view(client(srv.url, False))
    finally:
        for p in procs.values():
            p.kill()
        meta.stop()
        srv.stop()
    f = rep.fig
    f.tried = ops * len(names)
    # A publisher's operations do not fail: updates are buffered, and what Redis missed is
    # sent again in a snapshot. Whether that worked is ``lost``: (block, holder) pairs the
    # nodes hold that the index does not name once it converged.
    f.lost = sum(len(holders - view.get(k, frozenset())) for k, holders in truth.items())
    stale = sum(len(holders - truth.get(k, frozenset())) for k, holders in view.items())
    f.tracebacks = sum(tracebacks_in(p.read_text()) for p in meta_logs)
    f.notes.update(faults=faults, dropped_updates=dropped, blocks_indexed=len(truth), stale_holders=stale,
                   converged_after_s=converged if converged is not None else "never")
    rep.done()
    assert not f.bad() and not stale and converged is not None, (f, unconverged)
