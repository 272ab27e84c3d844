"""SSD holders in a cluster: a prefix only on one node's SSD, pulled by an engine on another
node, against that SSD tier's own read bandwidth measured in the same run.

    python bench/p2p_ssd.py [--page-kib 1024] [--blocks 1024] [--rounds 3] [--pool 4gb]
                            [--peer-pool 2gb] [--ssd-dir /var/tmp] [--ssd-capacity 8gb]
                            [--summary out.json]

Three real pegaflow-node processes in network namespaces (tests/harness/netns.py;
loopback addresses when namespaces cannot be made), redis-server + pegaflow-meta in the hub.
Node 0 has a DRAM pool of ``--pool`` and an SSD tier; per round:

1. an engine-like client of node 0 saves two prefixes P and Q of ``--blocks`` pages, then
   filler prefixes until both left node 0's DRAM (every save waits for its SSD writes);
   QueryPrefix must list node 0 for P with every block on SSD (tier SSD);
2. the tier's own read: a client of node 0 queries Q until READY with every block (the
   SSD tier promotes it; the time runs from the first Query to READY), and fio reads the
   same number of bytes, O_DIRECT, in pages, from a file in ``--ssd-dir`` (a reference);
3. the pull: a client of node 2 queries P until READY with every block: node 2 misses,
   finds node 0 as an SSD holder, pins P in chunks; node 0 reads each chunk from its SSD
   straight into the transfer (PENDING pages, not promoted; pegaflow/node/tiers/remote/pins.py)
   while it sends the ones before (pegaflow/node/tiers/remote/puller.py, SSD_CHUNK_BYTES);
4. the transfer alone: node 0 saves a prefix R of the same size (it stays in its DRAM) and
   node 2 pulls it.

Per phase it also reads the whole machine's busy CPU fraction (/proc/stat). A pull from SSD
cannot beat the slower of promotion and the DRAM pull, nor the CPU bound: both phases' CPU
per byte (busy fraction / rate) added up, 1 / that sum. It prints the pull against the lower
of those too (``vs_bound``: how well the two overlap), beside the goal's ratio.

Every page both clients end up with is compared with what was saved (xxh3). Steps 2 and 3
swap order every other round. The default prefix, 1 GiB, measures both at the disk's
sustained rate: a 256 MiB one (``--blocks 256 --pool 1gb``) is over in ~0.15 s, where the
pull's fixed edges (the first chunk's read before any transfer, the last chunk's transfer
after the last read: ~30 ms) weigh ~20% and the promotion rides the disk's burst. The goal: pull rate >= 0.8x the promotion rate of step 2.
Root is needed for namespaces. Timing figures are only meaningful on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.p2p import _run  # noqa: E402

POLL_S = "0.002"

TIERS = """
import sys, json, grpc, xxhash
from pegaflow._proto import meta_pb2, meta_pb2_grpc
addr, ns, tag, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
hs = [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]
stub = meta_pb2_grpc.MetaServiceStub(grpc.insecure_channel(addr))
res = stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace=ns, hashes=hs), timeout=5)
print(json.dumps({x.node: [x.prefix_len, x.ssd_blocks] for x in res.nodes}))
"""


def holders(cluster, ns: str, tag: str, n: int) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    r = cluster.c.hub.py(TIERS, cluster.meta_addr, ns, tag, str(n))
    return json.loads(r.stdout.strip()) if r.returncode == 0 else {}


def save0(cluster, ns: str, tag: str, n: int, page: int) -> None:  # type: ignore[no-untyped-def]
    """Save through node 0 and wait for its SSD writes (queued writes pin their pages)."""
    from tests.harness import wait_until

    def count(name: str) -> float:
        """The sum of a metric's series on node 0 (0 while not exported)."""
        pat = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
        return sum(float(v) for v in pat.findall(cluster.metrics(0)))

    before = count("pegaflow_node_ssd_written_blocks_total")
    skipped = count("pegaflow_node_ssd_skipped_writes_total")
    out = _run(cluster, 0, "save", ns, tag, str(n), str(page))
    if out["committed"] != n:
        raise SystemExit(f"node 0 committed {out['committed']} of {n} blocks of {tag}")

    def written() -> bool:
        if count("pegaflow_node_ssd_skipped_writes_total") > skipped:
            raise SystemExit(f"node 0's SSD skipped writes of {tag}: a prefix must fit half its --pool")
        return (count("pegaflow_node_ssd_written_blocks_total") >= before + n
                and count("pegaflow_node_ssd_write_queue_blocks") == 0)

    wait_until(written, 300, f"{tag} on node 0's SSD")


def fio_read(directory: Path, nbytes: int, page: int, depth: int) -> float | None:
    """Bytes/s of an O_DIRECT sequential read of ``nbytes`` in ``page`` I/Os (None: no fio)."""
    if not shutil.which("fio"):
        return None
    f = directory / "pf-bench-fio.dat"
    try:
        args = ["fio", "--name=r", f"--filename={f}", f"--size={nbytes}", f"--bs={page}", "--direct=1",
                "--ioengine=io_uring", f"--iodepth={depth}", "--output-format=json"]
        subprocess.run([*args, "--rw=write"], check=True, capture_output=True, timeout=600)
        r = subprocess.run([*args, "--rw=read"], check=True, capture_output=True, timeout=600, text=True)
        return json.loads(r.stdout)["jobs"][0]["read"]["bw_bytes"]
    finally:
        f.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-kib", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=1024, help="blocks per prefix")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool", default="4gb", help="node 0's DRAM pool (a prefix must fit half of it: its SSD "
                   "write queue is at most half the pool)")
    p.add_argument("--peer-pool", default="2gb", help="the other nodes' pools (a prefix must fit)")
    p.add_argument("--ssd-dir", type=Path, default=Path("/var/tmp"), help="node 0's SSD tier directory")
    p.add_argument("--ssd-capacity", default="8gb")
    p.add_argument("--ssd-queue-depth", type=int, default=32)
    p.add_argument("--summary", type=Path, help="write the figures as JSON")
    a = p.parse_args()

    from pegaflow.core.units import parse_size
    from tests.harness import wait_until
    from tests.harness.dirs import temp_dir_removed_at_exit
    from tests.harness.p2p import P2PCluster

    page = a.page_kib << 10
    pool_pages = parse_size(a.pool) // page
    if 4 * a.blocks * page > parse_size(a.ssd_capacity):
        raise SystemExit("--ssd-capacity must hold P, Q and the filler (4 x --blocks pages)")
    tmp = Path(temp_dir_removed_at_exit("pegaflow-bench-p2pssd-"))
    ssd = Path(tempfile.mkdtemp(prefix="pegaflow-bench-ssd-", dir=a.ssd_dir))
    cluster = P2PCluster(tmp, 3, pool=a.peer_pool, node_args=("--log-level", "warning"), per_node_args={0: (
        "--pool-size", a.pool, "--ssd-cache-path", str(ssd / "cache"), "--ssd-cache-capacity", a.ssd_capacity,
        "--ssd-queue-depth", str(a.ssd_queue_depth), "--ssd-write-queue-size", str(a.blocks * page))})
    if cluster.fallback_reason:
        print(f"network namespaces unavailable ({cluster.fallback_reason}): loopback addresses instead")
    rows = []
    try:
        ns = f"bench-ssd|p{a.page_kib}k"
        pids = ",".join(str(n.proc.pid) for n in cluster.nodes[::2])
        fill = max(1, min(a.blocks, pool_pages // 2))  # a save must fit the SSD write queue
        for r in range(a.rounds):
            tp, tq = f"P{r}", f"Q{r}"
            save0(cluster, ns, tp, a.blocks, page)
            save0(cluster, ns, tq, a.blocks, page)
            k = 0
            while (holders(cluster, ns, tp, a.blocks).get("node-0") != [a.blocks, a.blocks]
                   or holders(cluster, ns, tq, a.blocks).get("node-0") != [a.blocks, a.blocks]):
                if k * fill > 2 * pool_pages:
                    raise SystemExit(f"P/Q still in node 0's DRAM: {holders(cluster, ns, tp, a.blocks)}")
                save0(cluster, ns, f"fill{r}-{k}", fill, page)
                k += 1
                time.sleep(0.2)  # the index follows the node within the publisher's flush interval
            wait_until(lambda tp=tp: holders(cluster, ns, tp, a.blocks).get("node-0") == [a.blocks, a.blocks], 30,
                       "P listed on node 0's SSD")

            def local(tq: str = tq) -> dict:
                return _run(cluster, 0, "pull", ns, tq, str(a.blocks), str(page), POLL_S, pids)

            def remote(tp: str = tp) -> dict:
                return _run(cluster, 2, "pull", ns, tp, str(a.blocks), str(page), POLL_S, pids)

            first, second = (local, remote) if r % 2 == 0 else (remote, local)
            o1, o2 = first(), second()
            lo, re = (o1, o2) if first is local else (o2, o1)
            # The same bytes pulled from node 0's DRAM: the transfer alone, with its CPU.
            tr = f"R{r}"
            save0(cluster, ns, tr, a.blocks, page)
            wait_until(lambda tr=tr: holders(cluster, ns, tr, a.blocks).get("node-0") == [a.blocks, 0], 30,
                       "R listed on node 0's DRAM")
            l1 = _run(cluster, 2, "pull", ns, tr, str(a.blocks), str(page), POLL_S, pids)
            for name, o in (("promotion", lo), ("pull", re), ("DRAM pull", l1)):
                if o["bad_pages"] or o["first"] != "LOADING":
                    raise SystemExit(f"{name}: {o}")
            nbytes = a.blocks * page
            fio = fio_read(ssd, nbytes, page, a.ssd_queue_depth)
            row = {"promote_gbps": nbytes / lo["seconds"] / 1e9, "pull_gbps": nbytes / re["seconds"] / 1e9,
                   "dram_pull_gbps": nbytes / l1["seconds"] / 1e9, "fio_read_gbps": fio / 1e9 if fio else None,
                   "busy": {"promotion": lo["busy"], "pull": re["busy"], "dram_pull": l1["busy"]},
                   "cpu_s": {"promotion": lo["cpu"], "pull": re["cpu"], "dram_pull": l1["cpu"]}}
            row["ratio"] = row["pull_gbps"] / row["promote_gbps"]
            # Perfect overlap of the holder's SSD read with the transfer reaches the slower of
            # the two, unless the CPUs run out first: both phases' whole-machine CPU per byte
            # (busy fraction / rate) added up, a promote-then-send pull cannot beat 1 / that
            # sum. The holder reads into the transfer without hashing what it read (the
            # puller does), so the pull may beat this bound by the promotion's hashing.
            b = row["busy"]
            row["overlap_gbps"] = min(row["promote_gbps"], row["dram_pull_gbps"])
            row["cpu_bound_gbps"] = 1 / (b["promotion"] / row["promote_gbps"] + b["dram_pull"] / row["dram_pull_gbps"])
            row["vs_bound"] = row["pull_gbps"] / min(row["overlap_gbps"], row["cpu_bound_gbps"])
            rows.append(row)
            print(f"round {r}: {nbytes >> 20} MiB; node 0's SSD promotion {row['promote_gbps']:.3f} GB/s (CPUs "
                  f"{b['promotion']:.0%} busy); pull by node 2 from node 0's SSD {row['pull_gbps']:.3f} GB/s "
                  f"({row['ratio']:.2f}x; CPUs {b['pull']:.0%} busy); bytes verified\n"
                  f"  from node 0's DRAM {row['dram_pull_gbps']:.3f} GB/s (CPUs {b['dram_pull']:.0%} busy); "
                  f"CPU bound of promotion + transfer {row['cpu_bound_gbps']:.3f} GB/s; the SSD pull is "
                  f"{row['vs_bound']:.2f}x the lower of that and the slower phase; fio read "
                  + (f"{row['fio_read_gbps']:.3f} GB/s" if fio else "n/a"), flush=True)
        ratios = [x["ratio"] for x in rows]
        bound = statistics.median(x["vs_bound"] for x in rows)
        print(f"\nratio median {statistics.median(ratios):.2f}x (goal >= 0.8x of the tier's own read); "
              f"{bound:.2f}x the bound (CPU or slower phase)")
        if a.summary:
            a.summary.write_text(json.dumps({"rounds": rows, "ratio_median": statistics.median(ratios),
                                             "vs_bound_median": bound}))
    finally:
        cluster.close()
        shutil.rmtree(ssd, ignore_errors=True)


if __name__ == "__main__":
    main()
