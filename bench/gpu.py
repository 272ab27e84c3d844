"""The CUDA data path: save and load GB/s of 64-block requests through a real node, against
pinned ``cudaMemcpy`` bulk bandwidth measured in the same run.

An 8B-shaped KV cache (32 layers, FlashAttention ``(2, blocks, 16, 8, 128)`` bf16: a 2 MiB
page, 64 segments) on the GPU; each request reserves 64 pages on a real ``pegaflow-node``,
saves them (``save_pages``: gathers on the GPU, one DMA per run of pool pages, the pool
registered with CUDA), commits, then queries and loads them into other blocks. The peer is
one copy of the same bytes between a pinned host buffer and the GPU, both ways. Goal: both
directions >= 0.8x the peer. The first request registers the pages it touches (its time
is reported apart, as the one-off registration cost per GiB).

Then the step-time overhead: an 8B-shaped layer stack (32 layers of QKV/O projections and
a gated MLP, hidden 4096, bf16; one layer's weights reused) runs a ``--prefill``-token
forward, alone and with a 64-block load (queued before it on the copy stream, each layer
waiting for its own event, as ``wait_for_layer_load`` does) and a 64-block save (queued
after it, the compute stream waiting only for the gather), as the connector does on a GPU
(``pegaflow/connector/inflight.py``). Goal: <= 5% longer steps.

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
    ap.add_argument("--prefill", type=int, default=10_000, help="tokens of the step whose overhead is measured")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--summary", type=Path)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device (torch.cuda.is_available() is False here)")
    import xxhash

    from pegaflow.client import PegaClient, load_pages, save_pages
    from pegaflow.client.cuda import _pin_metrics
    from pegaflow.connector.layout import build_page_layout
    from tests.e2e.harness import NodeDaemon

    nb = 4 * args.blocks
    caches = {f"model.layers.{i}.self_attn.attn":
              torch.randn(2, nb, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
              for i in range(LAYERS)}
    layout = build_page_layout(caches)
    page = layout.page_bytes
    nbytes = args.blocks * page
    pool_bytes = (2 * args.rounds + args.steps + 8) * nbytes  # every request and step saves new pages

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
        node = NodeDaemon(Path(tmp), pool_size=str(pool_bytes))
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
            overhead = step_overhead(torch, layout, client, args)
        finally:
            client.close()
            node.stop()
    save_gbps, load_gbps = statistics.median(saves), statistics.median(loads)
    pinned_gib = _pin_metrics().bytes._value.get() / 2**30  # noqa: SLF001 - our own gauges
    pin_s = _pin_metrics().seconds._value.get()  # noqa: SLF001
    out = {
        "request_mib": nbytes >> 20, "page_bytes": page, "segments": len(layout.segments),
        "pinned_d2h_gbps": d2h, "pinned_h2d_gbps": h2d,
        "save_gbps": save_gbps, "load_gbps": load_gbps,
        "save_over_pinned": save_gbps / d2h, "load_over_pinned": load_gbps / h2d,
        "first_save_s": first, "pinned_gib": pinned_gib, "pin_s_per_gib": pin_s / max(pinned_gib, 1e-9),
        **overhead,
    }
    print(f"save {save_gbps:.1f} GB/s = {out['save_over_pinned']:.2f}x pinned D2H; load {load_gbps:.1f} GB/s = "
          f"{out['load_over_pinned']:.2f}x pinned H2D (goal >= 0.8x both); first save (registering "
          f"{pinned_gib:.1f} GiB) {first * 1e3:.0f} ms; cudaHostRegister {out['pin_s_per_gib'] * 1e3:.0f} ms/GiB",
          flush=True)
    print(f"{args.prefill}-token step: {overhead['step_ms']:.1f} ms alone, {overhead['step_with_copies_ms']:.1f} ms "
          f"with a {args.blocks}-block load and save beside it: +{overhead['step_overhead'] * 100:.1f}% (goal <= 5%)",
          flush=True)
    if args.summary:
        args.summary.write_text(json.dumps(out, indent=2))


def step_overhead(torch, layout, client, args) -> dict[str, float]:  # noqa: ANN001
    """Mean step time of the layer stack alone and with a load and a save beside it."""
    import xxhash

    from pegaflow.client import issue_pages
    from pegaflow.client.cuda import CudaCopyStream

    hidden, inter, kv = 4096, 14336, KV_HEADS * HEAD_DIM
    w = {k: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.01 for k, shape in
         {"qkv": (hidden, hidden + 2 * kv), "o": (hidden, hidden), "up": (hidden, 2 * inter),
          "down": (inter, hidden)}.items()}
    x0 = torch.randn(args.prefill, hidden, device="cuda", dtype=torch.bfloat16)
    stream = CudaCopyStream(torch.device("cuda"))
    names = layout.layer_names
    last = layout.last_segments
    hashes = [xxhash.xxh3_128_digest(f"step:{i}".encode()) for i in range(args.blocks)]
    res = client.reserve("bench-gpu", hashes)
    client.commit(res.reservation_id)
    q = client.query(["bench-gpu"], hashes)
    load_offs = q.offsets["bench-gpu"]
    save_res = [client.reserve("bench-gpu", [xxhash.xxh3_128_digest(f"step:{s}:{i}".encode())
                                             for i in range(args.blocks)]) for s in range(args.steps + 2)]

    def forward(events: dict[str, object] | None) -> None:
        x = x0
        for name in names:
            if events is not None and name in events:
                stream.compute_waits(events.pop(name))
            h = x @ w["qkv"]
            x = x + h[:, :hidden] @ w["o"]
            g, u = (x @ w["up"]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(g) * u) @ w["down"]

    def step(k: int, copies: bool) -> None:
        events: dict[str, object] | None = None
        if copies:
            events = {}
            stream.after_compute()
            with stream.issuing():
                issue_pages(layout.segments, list(range(2 * args.blocks, 3 * args.blocks)), client.pool, load_offs,
                            False, after_segment=lambda s: events.__setitem__(last[s], stream.record()) if s in last
                            else None)
        forward(events)
        if copies:
            gathered = []
            stream.after_compute()
            with stream.issuing():
                issue_pages(layout.segments, list(range(args.blocks)), client.pool, save_res[k].offsets, True,
                            after_gather=lambda: gathered.append(stream.record()))
            stream.compute_waits(gathered[-1])

    def mean_ms(copies: bool) -> float:
        step(args.steps, copies)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(args.steps):
            step(k, copies)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / args.steps * 1e3

    alone = mean_ms(False)
    with_copies = mean_ms(True)
    client.release(q.lease_id)
    return {"step_ms": alone, "step_with_copies_ms": with_copies, "step_overhead": with_copies / alone - 1}


if __name__ == "__main__":
    main()
