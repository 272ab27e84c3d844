"""Replay's cluster model (pegaflow/replay/cluster.py) against a live cluster: the same
requests on three real nodes with L1 + SSD each, peer pulls through pegaflow-meta, and
the hit rate each gives.

    python bench/cluster_model.py [--conversations 24] [--turns 6] [--l1-blocks 96]
                                  [--page-kib 64] [--seed 1] [--json OUT]

The workload is multi-turn conversations behind one shared system prompt: turn t of a
conversation is its turn t-1 plus a few new blocks; conversations interleave at random
and requests go to the nodes round-robin (so a conversation's next turn usually lands
on another node: peer pulls, and SSD holders once the L1s turn over). One driver process
plays every engine: per request it queries its node until READY (LOADING while the node
promotes from its SSD or pulls from a peer), counts the hit, releases the lease, stores
the blocks it missed, and waits until that node's SSD wrote them and the index lists the
node, and until the metaserver has applied every node's events and every class notice it
sent has been taken by its node (replacement classes by owner count, docs/architecture.md:
pegaflow-meta's default --min-reclaimable-owner-count, 3, which the model applies too),
so the next request sees what a model with no lag sees. Then replay's cluster
model runs the same requests with the same L1 (pool / page) and an SSD that never fills
(as the live ones do not), and both hit rates are printed, with what the live nodes say
about pins (holds of pulled pages ended by a lease or by their timeout, pulled copies
evicted). ``--json`` writes both per request. Root for namespaces.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NS = "model-check|p{}k"
SYSTEM_BLOCKS = 4


def workload(conversations: int, turns: int, seed: int) -> list[list[bytes]]:
    """Requests (block hashes) in arrival order."""
    import xxhash

    rng = random.Random(seed)
    sys_p = [xxhash.xxh3_128_digest(f"sys:{i}".encode()) for i in range(SYSTEM_BLOCKS)]
    convs = []
    for c in range(conversations):
        blocks, prompts = list(sys_p), []
        for t in range(turns):
            blocks = blocks + [xxhash.xxh3_128_digest(f"c{c}:t{t}:{i}".encode()) for i in range(rng.randint(1, 4))]
            prompts.append(list(blocks))
        convs.append(prompts)
    order = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    nxt = [0] * conversations
    out = []
    for c in order:
        out.append(convs[c][nxt[c]])
        nxt[c] += 1
    return out


def _settled(r, nodes: int) -> bool:  # noqa: ANN001 - a redis client
    """The metaserver applied every event of every node, and no class notice waits for its node."""
    from pegaflow.cluster.keys import stream_key

    for k in range(nodes):
        key = stream_key(f"node-{k}")
        last = r.xinfo_stream(key)["last-generated-id"]
        if any(g["pending"] or g["last-delivered-id"] != last for g in r.xinfo_groups(key)):
            return False
    return not any(r.llen(k) for k in r.scan_iter(match="pf:c:*"))


def _drive(argv: list[str]) -> None:
    """In host 0's namespace: ADDRS(comma) META HTTPS(comma) PAGE CONVS TURNS SEED REDIS -> JSON hits."""
    import time

    import grpc

    from pegaflow._proto import meta_pb2, meta_pb2_grpc
    from pegaflow.client import PegaClient
    from pegaflow.cluster.redis_conn import connect
    from tests.harness import wait_until

    addrs, meta, https = argv[0].split(","), argv[1], argv[2].split(",")
    page, reqs = int(argv[3]), workload(int(argv[4]), int(argv[5]), int(argv[6]))
    redis = connect(argv[7])
    ns = NS.format(page >> 10)
    clients = [PegaClient(a, timeout=30) for a in addrs]
    for c in clients:
        c.register({ns: page})
    stub = meta_pb2_grpc.MetaServiceStub(grpc.insecure_channel(meta))
    import urllib.request

    def metric(i: int, name: str) -> float:
        text = urllib.request.urlopen(f"http://{https[i]}/metrics", timeout=5).read().decode()
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))

    hits = []
    shorts = []
    for i, hs in enumerate(reqs):
        k = i % len(clients)
        c = clients[k]

        def ready(c=c, hs=hs, i=i):  # noqa: ANN001, ANN202
            q = c.query([ns], hs, req_id=f"r{i}", lease=True)
            return q if q.status == "READY" else None

        q = wait_until(ready, 30, f"request {i} READY", every=0.005)
        hits.append(q.hit_blocks)
        if q.lease_id:
            c.release(q.lease_id)
        shorts.append(0)
        if q.hit_blocks < len(hs):
            r = c.reserve(ns, hs)
            new = sum(1 for o in r.offsets if o >= 0)
            if r.reservation_id:
                c.commit(r.reservation_id)
            shorts[-1] = len(hs) - q.hit_blocks - new  # not stored: held already, or no room
            # The commit queued its SSD writes before it answered (blocks already on SSD are
            # not written again): once the queue is empty they landed.
            wait_until(lambda k=k: metric(k, "pegaflow_node_ssd_write_queue_blocks") == 0, 30, "SSD writes")
        node = f"node-{k}"
        held = c.query([ns], hs, lease=False, peek=True).hit_blocks  # its DRAM prefix now

        def indexed(hs=hs, node=node, held=held) -> bool:  # noqa: ANN001
            res = stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace=ns, hashes=hs), timeout=5)
            return held == 0 or any(x.node == node and x.prefix_len >= held for x in res.nodes)

        wait_until(indexed, 30, f"request {i} indexed on {node}", every=0.005)
        wait_until(lambda: _settled(redis, len(clients)), 30, f"request {i}: events applied, notices taken",
                   every=0.01)
        for cl in clients:  # an RPC after the notices were taken: the node's loop moved their blocks first
            cl.query([ns], hs[:1], lease=False, peek=True)
        time.sleep(0)  # (every wait above is on a condition)

    def total(name: str, labels: str = "") -> float:
        out = 0.0
        for k in range(len(clients)):
            text = urllib.request.urlopen(f"http://{https[k]}/metrics", timeout=5).read().decode()
            out += sum(float(v) for v in re.findall(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", text, re.M))
        return out

    print(json.dumps({
        "hits": hits, "short": sum(shorts), "shorts": shorts,
        "ssd_skipped": total("pegaflow_node_ssd_skipped_writes_total"),
        "hold_leased": total("pegaflow_node_p2p_hold_ended_blocks_total", '{reason="leased"}'),
        "hold_expired": total("pegaflow_node_p2p_hold_ended_blocks_total", '{reason="expired"}'),
        "evicted_pulled": total("pegaflow_node_evicted_blocks_by_class_total", '{class="reclaimable"}'),
        "evicted": total("pegaflow_node_evicted_blocks_by_class_total", '{class="retained"}'),
        "demoted": total("pegaflow_node_class_demotions_total", '{reason="reclaim_hint"}'),
        "by": {o: total("pegaflow_node_request_blocks_total", f'{{outcome="{o}"}}') for o in ("l1", "ssd", "remote")},
        "pulls": {st: total("pegaflow_node_p2p_pulls_total", f'{{status="{st}"}}')
                  for st in ("ok", "partial", "gone", "error", "no_space", "checksum", "bad_answer")},
    }), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_drive":
        _drive(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--l1-blocks", type=int, default=96, help="each node's L1, in pages")
    p.add_argument("--page-kib", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write both runs' hits per request here")
    a = p.parse_args()

    from pegaflow.replay.cluster import NodeCluster
    from tests.harness.p2p import HTTP_PORT, P2PCluster

    page = a.page_kib << 10
    reqs = workload(a.conversations, a.turns, a.seed)
    distinct = len({h for r in reqs for h in r})
    tmp = Path(tempfile.mkdtemp(prefix="pegaflow-bench-model-"))
    ssd_bytes = max(64 << 20, 4 * distinct * (page + 4096))
    per = {i: ("--pool-size", str(a.l1_blocks * page), "--ssd-cache-path", str(tmp / f"ssd{i}"),
               "--ssd-cache-capacity", str(ssd_bytes)) for i in range(3)}
    cluster = P2PCluster(tmp, 3, node_args=("--log-level", "warning", "--peer-backoff", "1"), per_node_args=per)
    if cluster.fallback_reason:
        print(f"network namespaces unavailable ({cluster.fallback_reason}): loopback addresses instead")
    try:
        addrs = ",".join(n.addr for n in cluster.nodes)
        https = ",".join(f"{n.host.ip}:{HTTP_PORT}" for n in cluster.nodes)
        h0 = cluster.nodes[0].host
        r = h0.run([sys.executable, str(Path(__file__).resolve()), "_drive", addrs, cluster.meta_addr, https,
                    str(page), str(a.conversations), str(a.turns), str(a.seed), cluster.redis_url], timeout=1800)
        if r.returncode != 0:
            raise SystemExit(f"driver failed: {r.stdout}\n{r.stderr[-3000:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        live = out["hits"]
    finally:
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)
    model = NodeCluster(3, (a.l1_blocks, True), (4 * distinct, True), {"m": 1})  # owner classes as pegaflow-meta's
    split = [model.serve(i % 3, "m", hs) for i, hs in enumerate(reqs)]
    demoted = model.owners.demoted if model.owners is not None else 0
    predicted = [sum(x) for x in split]
    by = [sum(x[j] for x in split) for j in range(4)]
    blocks = sum(len(r) for r in reqs)
    lr, mr = sum(live) / blocks, sum(predicted) / blocks
    differ = sum(1 for x, y in zip(live, predicted, strict=True) if x != y)
    print(f"{len(reqs)} requests, {blocks} block accesses, {distinct} distinct; L1 {a.l1_blocks} pages per node; "
          f"model's hits: own L1 {by[0]}, own SSD {by[1]}, peer L1 {by[2]}, peer SSD {by[3]}")
    print(f"live cluster hit rate {lr:.2%}, replay's cluster model {mr:.2%} ({(mr - lr) * 100:+.2f} pp); "
          f"requests whose hits differ: {differ}; blocks the live engine could not store: {out['short']}, "
          f"live SSD writes skipped: {out['ssd_skipped']:.0f}")
    lb = out["by"]
    print(f"live hits (the nodes' pegaflow_node_request_blocks_total): own L1 {lb['l1']:.0f}, own SSD "
          f"{lb['ssd']:.0f}, peers {lb['remote']:.0f}; model: {by[0]}, {by[1]}, {by[2] + by[3]}")
    print(f"live pull holds ended by a lease {out['hold_leased']:.0f} pages, by the timeout "
          f"{out['hold_expired']:.0f}; evicted: {out['evicted']:.0f} retained, {out['evicted_pulled']:.0f} "
          f"reclaimable; pulls: {', '.join(f'{k} {v:.0f}' for k, v in out['pulls'].items() if v)}")
    print(f"blocks demoted by owner count (3 holders): live {out['demoted']:.0f}, model {demoted}")
    if a.json:
        a.json.write_text(json.dumps({"l1_blocks": a.l1_blocks, "live": live, "model": predicted, "split": split,
                                      **{k: v for k, v in out.items() if k != "hits"}}))


if __name__ == "__main__":
    main()
