"""The CUDA data path: save and load GB/s of 64-block requests through a real node, against
pinned ``cudaMemcpy`` bulk bandwidth measured in the same run.

An 8B-shaped KV cache (32 layers, FlashAttention ``(2, blocks, 16, 8, 128)`` bf16: a 2 MiB
page, 64 segments) on the GPU; each request reserves 64 pages on a real ``pegaflow-node``,
saves them (``save_pages``: gathers on the GPU, one DMA per run of pool pages, the pool
registered with CUDA), commits, then queries and loads them into other blocks. The peer is
one copy of the same bytes between a pinned host buffer and the GPU, both ways. Goal: both
directions >= 0.8x the peer. The first request registers the pages it touches (its time
is reported apart, as the one-off registration cost per GiB).

Needs CUDA: without it, exits with a one-line message.

    python bench/gpu.py [--rounds 5] [--blocks 64] [--summary out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 32, 16, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=64, help="pages per request")
    ap.add_argument("--summary", type=Path)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device (torch.cuda.is_available() is False here)")
    import xxhash

    from pegaflow.client import PegaClient, load_pages, save_pages
    from pegaflow.client.cuda import _pin_metrics
    from pegaflow.connector.layout import build_page_layout
    from tests.e2e.harness import NodeProc

    nb = 4 * args.blocks
    caches = {f"model.layers.{i}.self_attn.attn":
              torch.randn(2, nb, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
              for i in range(LAYERS)}
    layout = build_page_layout(caches)
    page = layout.page_bytes
    nbytes = args.blocks * page
    pool_bytes = (args.rounds + 2) * nbytes * 2

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def timed(fn) -> float:  # noqa: ANN001
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(2):
        timed(lambda: host.copy_(dev, non_blocking=True))
        timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = statistics.median(nbytes / timed(lambda: host.copy_(dev, non_blocking=True)) / 1e9 for _ in range(args.rounds))
    h2d = statistics.median(nbytes / timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9 for _ in range(args.rounds))
    print(f"pinned bulk copy of {nbytes >> 20} MiB: D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s", flush=True)

    with tempfile.TemporaryDirectory(prefix="pf-bench-gpu-") as tmp:
        node = NodeProc(Path(tmp), pool_size=str(pool_bytes))
        client = PegaClient(node.addr)
        try:
            client.register({"bench-gpu": page})
            saves, loads, first = [], [], None
            for r in range(args.rounds + 1):
                hashes = [xxhash.xxh3_128_digest(f"gpu:{r}:{i}".encode()) for i in range(args.blocks)]
                src = list(range(r % 2 * args.blocks, r % 2 * args.blocks + args.blocks))
                res = client.reserve("bench-gpu", hashes)
                s = timed(lambda: save_pages(layout.segments, src, client.pool, res.offsets))  # noqa: B023
                client.commit(res.reservation_id)
                q = client.query(["bench-gpu"], hashes)
                dst = [b + 2 * args.blocks for b in src]
                ld = timed(lambda: load_pages(layout.segments, dst, client.pool, q.offsets["bench-gpu"]))  # noqa: B023
                client.release(q.lease_id)
                if r == 0:
                    first = s  # registers the pages it touches
                    continue
                saves.append(nbytes / s / 1e9)
                loads.append(nbytes / ld / 1e9)
            assert torch.equal(layout.page(0), layout.page(2 * args.blocks)), "a loaded page differs from its source"
        finally:
            client.close()
            node.stop()
    save_gbps, load_gbps = statistics.median(saves), statistics.median(loads)
    pinned_gib = _pin_metrics().bytes._value.get() / 2**30  # noqa: SLF001 - our own gauge
    out = {
        "request_mib": nbytes >> 20, "page_bytes": page, "segments": len(layout.segments),
        "pinned_d2h_gbps": d2h, "pinned_h2d_gbps": h2d,
        "save_gbps": save_gbps, "load_gbps": load_gbps,
        "save_over_pinned": save_gbps / d2h, "load_over_pinned": load_gbps / h2d,
        "first_save_s": first, "pinned_gib": pinned_gib,
    }
    print(f"save {save_gbps:.1f} GB/s = {out['save_over_pinned']:.2f}x pinned D2H; load {load_gbps:.1f} GB/s = "
          f"{out['load_over_pinned']:.2f}x pinned H2D (goal >= 0.8x both); first save (registering "
          f"{pinned_gib:.1f} GiB) {first * 1e3:.0f} ms", flush=True)
    if args.summary:
        args.summary.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
