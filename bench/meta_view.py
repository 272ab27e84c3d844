"""The metaserver's in-memory prefix view (pegaflow/meta/view.py, issue #55) alone, in this process.

    python bench/meta_view.py [--blocks 1048576,8388608] [--lookups 2000] [--json FILE]

Per index size: two namespaces of chains of ``PREFIX`` blocks held by ``NODES`` node slots,
each chain whole by one slot and its first half by a second one (on SSD only for one chain in
four, so the walk counts SSD blocks too); the chains reach the view as node events of up to
512 hashes (one ``apply`` each, as the consumer would call it). Reported:

- apply: (block, slot) pairs / s of the inserts (every block new, then every second holder),
  and of evicting one slot's blocks entry by entry;
- B/block: the view's own account (``nbytes``) and the process's RSS growth, per indexed block;
- walk: one ``walk`` call of a 128-hash lookup, the hashes as the gRPC request gives them (a
  list of 16-byte ``bytes``) and as one blob: µs p50 / p99 and ns per hash (every answer
  checked against the workload);
- clear_slot: one pass over the view removing one slot (a node reset or retired).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pegaflow.core.tiers import Tier  # noqa: E402
from pegaflow.meta.events.schema import Op  # noqa: E402
from pegaflow.meta.view import ALL_SLOTS, PrefixView  # noqa: E402

NODES = 8
PREFIX = 128
NAMESPACES = 2
ENTRY = 512  # hashes per node event (pegaflow/node/publishing.py's batches)


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(xs: list[int], q: float) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(q * len(s)))])


class Workload:
    """Per namespace: the hashes (chains of PREFIX), each chain's whole holder ``a`` and
    half holder ``b``, and whether ``b`` holds its half only on SSD."""

    def __init__(self, blocks: int, seed: int = 1) -> None:
        rng = np.random.default_rng(seed)
        per_ns = blocks // NAMESPACES // PREFIX * PREFIX
        self.chains = per_ns // PREFIX
        self.hashes = [rng.integers(1, 2**63, size=(per_ns, 2), dtype=np.uint64).view(np.uint8).reshape(per_ns, 16)
                       for _ in range(NAMESPACES)]
        self.a = [rng.integers(0, NODES, size=self.chains) for _ in range(NAMESPACES)]
        self.b = [(a + rng.integers(1, NODES, size=self.chains)) % NODES for a in self.a]
        self.b_ssd = [rng.random(self.chains) < 0.25 for _ in range(NAMESPACES)]

    @property
    def blocks(self) -> int:
        return NAMESPACES * self.chains * PREFIX

    def events(self, half: bool) -> list[tuple[int, int, bytes, Tier]]:
        """(ns, slot, blob, tier): the whole chains by their ``a`` (half=False) or the first
        halves by their ``b``, per (ns, slot, tier) in entries of up to ENTRY hashes."""
        out = []
        n = PREFIX // 2 if half else PREFIX
        for ns in range(NAMESPACES):
            holder = self.b[ns] if half else self.a[ns]
            for slot in range(NODES):
                for ssd in (False, True):
                    pick = (holder == slot) & (self.b_ssd[ns] == ssd if half else not ssd)
                    rows = np.flatnonzero(pick)
                    if not rows.size:
                        continue
                    blob = self.hashes[ns].reshape(self.chains, PREFIX, 16)[rows, :n].tobytes()
                    for j in range(0, len(blob), ENTRY * 16):
                        out.append((ns, slot, blob[j : j + ENTRY * 16], Tier.SSD if ssd else Tier.L1))
        return out

    def lookup(self, ns: int, chain: int) -> tuple[bytes, list[tuple[int, int, int]]]:
        """The 128 hashes of a chain as one blob, and the walk's answer."""
        blob = self.hashes[ns][chain * PREFIX : (chain + 1) * PREFIX].tobytes()
        a, b = int(self.a[ns][chain]), int(self.b[ns][chain])
        half = PREFIX // 2
        return blob, sorted([(a, PREFIX, 0), (b, half, half if self.b_ssd[ns][chain] else 0)])


def measure(blocks: int, lookups: int) -> dict[str, float]:
    w = Workload(blocks)
    whole, halves = w.events(half=False), w.events(half=True)
    gc.collect()
    r0 = rss()
    view = PrefixView()
    t0 = time.perf_counter()
    for ns, slot, blob, tier in whole:
        view.apply(ns, slot, Op.INSERT, blob, tier)
    t1 = time.perf_counter()
    for ns, slot, blob, tier in halves:
        view.apply(ns, slot, Op.INSERT, blob, tier)
    t2 = time.perf_counter()
    assert len(view) == w.blocks, (len(view), w.blocks)
    pairs = w.blocks + w.blocks // 2
    out = {
        "blocks": w.blocks,
        "insert_new_pairs_per_s": w.blocks / (t1 - t0),
        "insert_second_holder_pairs_per_s": (w.blocks // 2) / (t2 - t1),
        "insert_pairs_per_s": pairs / (t2 - t0),
        "bytes_per_block": view.nbytes / w.blocks,
        "rss_bytes_per_block": (rss() - r0) / w.blocks,
    }
    rng = random.Random(2)
    reqs = [(ns, *w.lookup(ns, rng.randrange(w.chains))) for ns in (i % NAMESPACES for i in range(lookups))]
    as_list = [(ns, [blob[j : j + 16] for j in range(0, len(blob), 16)], want) for ns, blob, want in reqs]
    for ns, hs, want in as_list:
        got = view.walk(ns, hs, ALL_SLOTS)
        assert got == want, (got, want)
    timed: list[tuple[str, list[tuple[int, bytes | list[bytes]]]]] = [
        ("list", [(ns, hs) for ns, hs, _ in as_list]), ("blob", [(ns, blob) for ns, blob, _ in reqs])]
    for name, rs in timed:
        lat = []
        walk = view.walk
        for ns, q in rs:
            t = time.perf_counter_ns()
            walk(ns, q, ALL_SLOTS)
            lat.append(time.perf_counter_ns() - t)
        out[f"walk_{name}_p50_us"] = pct(lat, 0.5) / 1e3
        out[f"walk_{name}_p99_us"] = pct(lat, 0.99) / 1e3
        out[f"walk_{name}_ns_per_hash"] = pct(lat, 0.5) / PREFIX
    # evict slot 0's whole chains, entry by entry, then clear slot 1 in one pass
    mine = [e for e in whole if e[1] == 0]
    t3 = time.perf_counter()
    gone = sum(view.apply(ns, slot, Op.EVICT, blob) for ns, slot, blob, _ in mine)
    t4 = time.perf_counter()
    out["evict_pairs_per_s"] = gone / (t4 - t3)
    entries = len(view)
    t5 = time.perf_counter()
    removed = view.clear_slot(1)
    out["clear_slot_ms"] = (time.perf_counter() - t5) * 1e3
    out["clear_slot_entries"] = entries
    out["clear_slot_pairs"] = removed
    del view
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", default="1048576,8388608")
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = [measure(int(b), args.lookups) for b in args.blocks.split(",")]
    print("| blocks | insert pairs/s (new / 2nd holder) | evict pairs/s | B/block (nbytes / RSS) "
          "| walk 128 µs p50 / p99 (list) | ns/hash (list / blob) | clear_slot ms (entries) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['blocks']:,} | {r['insert_pairs_per_s'] / 1e6:.2f}M ({r['insert_new_pairs_per_s'] / 1e6:.2f}M / "
              f"{r['insert_second_holder_pairs_per_s'] / 1e6:.2f}M) | {r['evict_pairs_per_s'] / 1e6:.2f}M "
              f"| {r['bytes_per_block']:.1f} / {r['rss_bytes_per_block']:.1f} "
              f"| {r['walk_list_p50_us']:.1f} / {r['walk_list_p99_us']:.1f} "
              f"| {r['walk_list_ns_per_hash']:.0f} / {r['walk_blob_ns_per_hash']:.0f} "
              f"| {r['clear_slot_ms']:.0f} ({r['clear_slot_entries']:,.0f}) |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
