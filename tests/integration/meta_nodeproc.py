"""A node-like process for metaserver tests: real EventPublisher, synthetic block workload.

    python -m tests.integration.meta_nodeproc --redis-url URL --node NAME --state FILE [...]

Holds a set of blocks per namespace, mutated on an asyncio loop exactly as the node does
(mutate, then call the listener). ``--state`` is loaded at start (the blocks a restarted
node still has, like its SSD tier) and the final state is written there after the
workload, then ``done`` is printed. With ``--hold`` the process then keeps heartbeating
until killed. With ``--keep N`` only N random blocks of the loaded state survive the
restart (the rest were "lost").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

from pegaflow.cluster.redis_conn import connect
from pegaflow.common.logging import configure_logging
from pegaflow.node.publishing import EventPublisher

# A namespace's held blocks: a dict used as an insertion-ordered set, so that a seeded
# workload is reproducible without sorting the set before each eviction draw (sorting it
# was ~90% of this process's CPU at --ops 6000).
Held = dict[bytes, None]


def load_state(path: str) -> dict[str, Held]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {ns: dict.fromkeys(bytes.fromhex(h) for h in hs) for ns, hs in json.load(f).items()}


def save_state(path: str, state: dict[str, Held]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({ns: sorted(h.hex() for h in hs) for ns, hs in state.items()}, f)
    os.replace(tmp, path)


async def main_async(a: argparse.Namespace) -> None:
    rng = random.Random(a.seed)
    state = load_state(a.state)
    if a.keep is not None:
        flat = [(ns, h) for ns, hs in state.items() for h in hs]
        keep = set(rng.sample(flat, min(a.keep, len(flat))))
        state = {ns: dict.fromkeys(h for h in hs if (ns, h) in keep) for ns, hs in state.items()}
    namespaces = [f"model-{i}|fp16|bs16" for i in range(a.namespaces)]
    for ns in namespaces:
        state.setdefault(ns, {})
    loop = asyncio.get_running_loop()
    r = connect(a.redis_url, a.cluster)

    def snapshot() -> list[tuple[str, list[bytes]]]:
        return [(ns, sorted(hs)) for ns, hs in state.items() if hs]

    pub = EventPublisher(
        r, a.node, f"127.0.0.1:{a.port}", snapshot, loop=loop, ttl_seconds=a.ttl, buffer_blocks=a.buffer
    )
    pub.start()
    for i in range(a.ops):
        ns = rng.choice(namespaces)
        held = state[ns]
        if held and rng.random() < a.evict_ratio:
            gone = rng.sample(list(held), min(len(held), rng.randint(1, a.batch)))
            for h in gone:
                del held[h]
            pub.on_evict(ns, gone)
        else:
            new = [rng.randbytes(16) for _ in range(rng.randint(1, a.batch))]
            held.update(dict.fromkeys(new))
            pub.on_insert(ns, new)
        if a.rate and i % 10 == 0:
            await asyncio.sleep(10 / a.rate)
        elif i % 100 == 0:
            await asyncio.sleep(0)
    while not await loop.run_in_executor(None, pub.wait_idle, 1.0):
        pass
    save_state(a.state, state)
    print(
        json.dumps({"done": True, "nid": pub.nid, "epoch": pub.epoch, "dropped": pub.stats.dropped_blocks}),
        flush=True,
    )
    if a.hold:
        while True:
            await asyncio.sleep(3600)
    pub.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--redis-url", required=True)
    p.add_argument("--cluster", action="store_true")
    p.add_argument("--node", required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--batch", type=int, default=40)
    p.add_argument("--evict-ratio", type=float, default=0.3)
    p.add_argument("--namespaces", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=0.0, help="ops per second (0: as fast as possible)")
    p.add_argument("--ttl", type=float, default=10.0)
    p.add_argument("--buffer", type=int, default=1_000_000)
    p.add_argument("--keep", type=int, default=None)
    p.add_argument("--port", type=int, default=50055)
    p.add_argument("--hold", action="store_true")
    a = p.parse_args()
    configure_logging("warning")
    t0 = time.monotonic()
    asyncio.run(main_async(a))
    sys.stderr.write(f"nodeproc {a.node} finished in {time.monotonic() - t0:.2f}s\n")


if __name__ == "__main__":
    main()
