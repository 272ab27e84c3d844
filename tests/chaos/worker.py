"""An engine-like process for the chaos scenarios; killed at random by the test.

    python -m tests.chaos.worker writer ADDR SEED UNIVERSE   # save random prefixes, forever
    python -m tests.chaos.worker reader ADDR SEED UNIVERSE   # load and verify, forever

Both print one JSON line of totals when they get SIGTERM (a SIGKILLed one prints nothing:
what it held is the node's to clean up): operations, blocks ``committed`` (a writer's, as
the node acknowledged them), blocks ``verified`` (a reader's: every page of every READY
answer), the ``wrong`` pages among those, ``misses`` and ``errors``. A reader checks every
page it is served against :func:`tests.chaos.common.page`; a writer writes exactly that
content, so a wrong page anywhere is a wrong byte the node served. With ``--slow S`` a
holder sleeps S seconds between taking pages and using them (a writer between Reserve and
its copy, a reader between Query and its copy): longer than the node's TTLs.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time

import numpy as np

from pegaflow.client import NodeError, NodeUnavailable, PegaClient
from tests.chaos.common import NS, PAGE, block_hash, page


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["writer", "reader"])
    p.add_argument("addr")
    p.add_argument("seed", type=int)
    p.add_argument("universe", type=int)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--base", type=int, default=0, help="the universe is blocks base .. base+universe-1")
    p.add_argument("--req-ids", type=int, default=0,
                   help="cycle through this many request ids (0: every query its own, as vLLM does)")
    a = p.parse_args()
    rng = random.Random(a.seed)
    totals = {"ops": 0, "committed": 0, "verified": 0, "wrong": 0, "misses": 0, "errors": 0}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    c = PegaClient(a.addr, timeout=10)
    c.register({NS: PAGE})
    print(json.dumps({"ready": True}), flush=True)
    while not stop:
        start = rng.randrange(0, a.universe)
        hs = [block_hash(a.base + (start + k) % a.universe) for k in range(a.blocks)]
        totals["ops"] += 1
        try:
            if a.role == "writer":
                r = c.reserve(NS, hs)
                if a.slow:
                    time.sleep(a.slow)
                for h, off in zip(hs, r.offsets, strict=True):
                    if off >= 0:
                        c.pool[off:off + PAGE].numpy()[:] = page(h)
                if r.reservation_id:
                    totals["committed"] += c.commit(r.reservation_id)
            else:
                n = totals["ops"] % a.req_ids if a.req_ids else totals["ops"]
                q = c.query([NS], hs, req_id=f"r{a.seed}-{n}")
                if q.status == "READY":
                    if a.slow:
                        time.sleep(a.slow)
                    for h, off in zip(hs, q.offsets[NS], strict=False):
                        got = q.pool[off:off + PAGE].numpy()
                        totals["verified"] += 1
                        if not np.array_equal(got, page(h)):
                            totals["wrong"] += 1
                    totals["misses"] += len(hs) - q.hit_blocks
                    if q.lease_id:
                        c.release(q.lease_id)
        except (NodeError, NodeUnavailable) as exc:
            totals["errors"] += 1
            totals.setdefault("first_error", str(exc)[:200])
    c.close()
    print(json.dumps(totals), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
