"""A soak: writers and readers for a while against one node; every page verified, the node's
private memory and file descriptors sampled, and nothing held once the clients are gone.

No fault is injected, so no operation may fail. ``lost`` is not defined here: the pool
(256 pages for a universe of 4096 blocks) evicts by design, and an evicted block is not
told apart from a lost one.
"""

from __future__ import annotations

import time

import psutil

from tests.chaos.common import PAGE, Report, pick, tracebacks_in
from tests.chaos.procs import Worker, nothing_held
from tests.waiting import wait_until

MAX_GROWTH = 0.25  # private memory of the node, last sample over the one after warm-up


def test_soak_verifies_every_page_and_leaks_nothing(node_factory):  # type: ignore[no-untyped-def]
    rep = Report("soak: writers + readers, RSS and fds sampled")
    node = node_factory(f"{256 * PAGE >> 20}mb")
    proc = psutil.Process(node.proc.pid)
    # Request ids cycle through 2,000 per reader: the node's memory of recent requests
    # (bounded, 65,536 keys) fills at once, so growth after warm-up is what would leak.
    workers = [Worker(role, node.addr, 500 + i, 4096, "--blocks", "16", "--req-ids", "2000")
               for i, role in enumerate(["writer", "writer", "reader", "reader"])]
    for w in workers:
        w.wait_ready()
    duration = pick(10, 450)
    samples: list[tuple[float, int, int]] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < duration:
        mem = proc.memory_full_info()
        samples.append((time.monotonic() - t0, mem.uss, proc.num_fds()))
        time.sleep(1.0)  # sampling period
    totals = [w.finish() for w in workers]
    wait_until(lambda: nothing_held(node.addr), 30, "every client's holdings and session gone")
    # Every block of every READY answer the node gave (only the readers query) must have
    # been compared byte for byte: the node's own count is the floor of what was verified.
    served = int(node.metric("pegaflow_node_hit_blocks_total", 'tier="l1"'))
    verified = sum(t["verified"] for t in totals)
    warm = samples[len(samples) // 4]
    last = samples[-1]
    growth = (last[1] - warm[1]) / max(1, warm[1])
    f = rep.fig
    f.tried = sum(t["ops"] for t in totals)
    f.failed = sum(t["errors"] for t in totals)
    f.wrong = sum(t["wrong"] for t in totals)
    f.crashes = int(node.proc.poll() is not None)
    f.tracebacks = tracebacks_in(node.log())
    f.leaked = max(0, last[2] - warm[2] - 4)  # fds beyond a few of noise
    f.notes.update(blocks_committed=sum(t["committed"] for t in totals), blocks_served=served,
                   blocks_verified=verified, uss_mib_after_warmup=round(warm[1] / 2**20, 1),
                   uss_mib_end=round(last[1] / 2**20, 1), uss_growth_pct=round(100 * growth, 1),
                   fds=f"{warm[2]}->{last[2]}")
    rep.done()
    assert not f.bad(), (f, [t.get("first_error") for t in totals if t["errors"]])
    assert verified >= served > 0, f"the node served {served} blocks and the readers verified {verified}"
    assert growth <= MAX_GROWTH, f"node private memory grew {100 * growth:.1f}%"
