"""An engine-like client process for the P2P tests (P2PCluster.client), run inside a host's namespace.

    python -m tests.harness.p2p_client save ADDR TAG N [--blocks-shape ...]
    python -m tests.harness.p2p_client load ADDR TAG N [--timeout S]

``save`` writes N blocks of a seeded KV cache (the same bytes for the same TAG) and
commits them. ``load`` queries until READY (printing each status change as a JSON line,
so a test can act while a pull is running), loads the hit pages into other block ids
and prints ``{"hit": k, "identical": bool, "statuses": [...]}``: identical is True iff
every loaded block equals the saved one, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import xxhash

from pegaflow.client import PegaClient, QueryResult, load_pages, page_bytes, save_pages
from tests.waiting import wait_until

LAYERS = 4


def namespace(heads: int = 2, dim: int = 64) -> str:
    return f"p2p-model|fp16|bs16|kv{heads}x{dim}"


NS = namespace()


def kv_cache(tag: str, blocks: int, heads: int, dim: int, fill: bool = True) -> list[torch.Tensor]:
    shape = (blocks, heads, 16, dim)
    if not fill:
        return [torch.zeros(shape, dtype=torch.float16) for _ in range(LAYERS)]
    # One generator per layer: block i's pages are the same whatever ``blocks`` is, so a load
    # of a prefix can check what a longer save stored.
    seed = xxhash.xxh32_intdigest(tag.encode())
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed + layer)).to(torch.float16)
            for layer in range(LAYERS)]


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["save", "load"])
    p.add_argument("addr")
    p.add_argument("tag")
    p.add_argument("n", type=int)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--until-hit", action="store_true", help="keep querying until every block hits")
    p.add_argument("--probe-each", action="store_true", help="then query every block alone, count those found")
    p.add_argument("--hold", type=float, default=0.0, help="save: keep the session (an engine) open this long after")
    a = p.parse_args()
    # Closed at the end, as a process's exit would: P2PCluster.client runs this in its host's
    # one agent process (tests/harness/netns.py), one command after another.
    with PegaClient(a.addr, timeout=10) as c:
        run(a, c)


def run(a: argparse.Namespace, c: PegaClient) -> None:
    kv = kv_cache(a.tag, 2 * a.n, a.heads, a.dim)
    hs = hashes(a.tag, a.n)
    ns = namespace(a.heads, a.dim)
    c.register({ns: page_bytes(kv)})
    if a.cmd == "save":
        r = c.reserve(ns, hs)
        save_pages(kv, list(range(a.n)), r.pool, r.offsets)
        print(json.dumps({"committed": c.commit(r.reservation_id), "page_bytes": page_bytes(kv)}), flush=True)
        time.sleep(a.hold)  # the node sees a registered engine until the process ends
        return
    statuses: list[str] = []

    def ask() -> QueryResult:
        q = c.query([ns], hs, req_id=f"load-{a.tag}")
        s = f"{q.status}:{q.hit_blocks}" + (f":{q.loading_from}" if q.loading_from else "")
        if q.loading_from:
            s += f":{q.expected_blocks}"  # the prefix length once the pull lands
        if not statuses or statuses[-1] != s:
            statuses.append(s)
            print(json.dumps({"status": q.status, "hit": q.hit_blocks}), flush=True)
        return q

    def answered() -> QueryResult | None:
        q = ask()
        if q.status == "READY" and (not a.until_hit or q.hit_blocks == a.n):
            return q
        if q.status == "READY" and q.lease_id:
            c.release(q.lease_id)
        return None

    try:
        q = wait_until(answered, a.timeout, "READY" + (" with every block" if a.until_hit else ""), every=0.02)
    except AssertionError:
        q = ask()  # past the bound a READY answer is taken as it is: the test judges its hits
        if q.status != "READY":
            print(json.dumps({"error": "timeout", "statuses": statuses}), flush=True)
            sys.exit(3)
    k = q.hit_blocks
    out = kv_cache(a.tag, 2 * a.n, a.heads, a.dim, fill=False)
    ids = list(range(a.n, a.n + k))
    if k:
        load_pages(out, ids, q.pool, q.offsets[ns])
    identical = all(torch.equal(w[i], o[j]) for w, o in zip(kv, out, strict=True) for i, j in zip(range(k), ids, strict=True))
    if q.lease_id:
        c.release(q.lease_id)
    visible = -1
    if a.probe_each:  # which single blocks are readable at all (a partial pull would show here)
        visible = 0

        def alone(h: bytes) -> QueryResult | None:
            q = c.query([ns], [h], lease=False)
            return q if q.status == "READY" else None

        for h in hs:
            visible += wait_until(lambda h=h: alone(h), a.timeout, "a READY answer for one block", every=0.02).hit_blocks
    print(json.dumps({"hit": k, "identical": identical, "statuses": statuses, "visible": visible}), flush=True)


if __name__ == "__main__":
    main()
