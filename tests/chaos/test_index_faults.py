"""The global index under faults: metaserver SIGKILLs and Redis outages while nodes publish.

Node-like publisher processes (the node's own ``EventPublisher``) mutate and publish; the
metaserver is SIGKILLed and restarted, Redis is stopped and started (empty, no AOF) in the
middle; at the end the index must equal the nodes' ground truth, and the time it took to
converge after the last fault is reported.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from pegaflow.cluster import keys
from tests.chaos.common import Report, pick, tracebacks_in
from tests.integration import redis_fixtures
from tests.integration.meta_harness import MetaProc, NodeProc, client, load_truth, wait_converged, wait_until


def test_index_converges_after_metaserver_kills_and_redis_outages(tmp_path: Path) -> None:
    rep = Report("metaserver SIGKILLs and Redis outages")
    srv = redis_fixtures.start_server(tmp_path / "redis")
    rng = random.Random(3)
    names = ["n1", "n2", "n3"]
    # The node-like publisher's own bookkeeping is quadratic in its state (it samples evictions
    # from a sorted set): past ~8000 operations the harness, not PegaFlow, is what is slow.
    ops = int(pick(3000, 6000))
    procs = {n: NodeProc(srv.url, False, n, tmp_path / f"{n}.json", tmp_path / f"{n}.log", "--seed", str(i),
                         "--ops", str(ops), "--rate", "1500", "--hold", "--ttl", "3")
             for i, n in enumerate(names)}
    meta_logs: list[Path] = []

    def new_meta(k: int) -> MetaProc:
        log = tmp_path / f"meta{k}.log"
        meta_logs.append(log)
        return MetaProc(srv.url, False, f"m{k}", log, lease_ttl=1.5)

    meta = new_meta(0)
    faults = 0
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
        for p in procs.values():
            p.wait_done(180)
        t0 = time.monotonic()
        wait_converged(client(srv.url, False), {n: p.state for n, p in procs.items()}, timeout=120)
        converged = time.monotonic() - t0
        truth = load_truth({n: p.state for n, p in procs.items()})
    finally:
        for p in procs.values():
            p.kill()
        meta.stop()
        srv.stop()
    f = rep.fig
    f.tried = ops * len(names)
    f.failed = faults
    f.tracebacks = sum(tracebacks_in(p.read_text()) for p in meta_logs)
    f.notes.update(faults=faults, blocks_indexed=len(truth), converged_after_s=round(converged, 1))
    rep.done()
    assert not f.bad(), f
