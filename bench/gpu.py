"""The CUDA data path: save and load GB/s of 64-block requests through a real node, against
pinned ``cudaMemcpy`` bulk bandwidth measured in the same run; the step-time overhead of
copies beside a forward; the pool's registration with CUDA, measured apart.

An 8B-shaped KV cache (32 layers, FlashAttention ``(2, blocks, 16, 8, 128)`` bf16: a 2 MiB
page, 64 segments) on the GPU. First the node's whole pool is registered with CUDA the way
a worker does it (``PoolPins``: a background thread, behind the node's pre-fault) and its
rate reported (goal >= 2 GiB/s; the time spent inside ``cudaHostRegister``): never inside
a timed copy. Then each request reserves 64 pages on a real ``pegaflow-node``, saves them
(``DeviceCopier`` on a ``CudaCopyStream``: one gather of every layer into the staging, one
DMA per run of pool pages), commits, queries and loads them into other blocks (one strided
DMA and one scatter per band of layers). The peer is one copy of the same bytes between a
pinned host buffer and the GPU, both ways. Goal: both directions >= 0.8x the peer.

Then the step-time overhead: an 8B-shaped layer stack (32 layers of QKV/O projections and
a gated MLP, hidden 4096, bf16; one layer's weights reused) runs a ``--prefill``-token
forward, alone and with a 64-block load (queued before it on the copy stream, each layer
waiting for its band's event, as ``wait_for_layer_load`` does) and a 64-block save (queued
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

    from pegaflow.client import PegaClient, cuda
    from pegaflow.client.batched import DeviceCopier
    from pegaflow.connector.layout import build_page_layout
    from tests.harness.dirs import temp_dir_removed_at_exit
    from tests.harness.node import Node

    nb = 4 * args.blocks
    caches = {f"model.layers.{i}.self_attn.attn":
              torch.randn(2, nb, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
              for i in range(LAYERS)}
    layout = build_page_layout(caches, nb)
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

    node = Node(Path(temp_dir_removed_at_exit("pf-bench-gpu-")), str(pool_bytes), http=False).start()
    client = PegaClient(node.addr, timeout=30)
    try:
        client.register({"bench-gpu": page})
        pins = cuda.pins_for(client.pool, front=lambda: int(client.health().pool_prefaulted_bytes))
        if not pins.wait(120) or pins.failed is not None:
            sys.exit(f"bench/gpu.py: the pool was not registered with CUDA (error {pins.failed})")
        pin_gib_s = pins.size / 2**30 / max(pins.seconds, 1e-9)
        print(f"registered the {pins.size / 2**30:.1f} GiB pool in {pins.seconds * 1e3:.0f} ms inside "
              f"cudaHostRegister: {pin_gib_s:.1f} GiB/s (goal >= 2 GiB/s), in the background", flush=True)
        stream = cuda.CudaCopyStream(torch.device("cuda"))
        copier = DeviceCopier(layout.segments, stream, None, layout.layers_done_at, split=cuda.CHUNK)

        def issue(fn, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            stream.after_compute()
            with stream.issuing():
                out = fn(*a, **kw)
            stream.record().synchronize()
            return out

        saves, loads = [], []
        for r in range(args.rounds + 1):  # round 0 is not timed (first copies, the staging's first use)
            hashes = [xxhash.xxh3_128_digest(f"gpu:{r}:{i}".encode()) for i in range(args.blocks)]
            src = list(range(r % 2 * args.blocks, r % 2 * args.blocks + args.blocks))
            res = client.reserve("bench-gpu", hashes)
            if min(res.offsets) < 0:
                raise SystemExit(f"bench/gpu.py: the node refused {sum(o < 0 for o in res.offsets)} reservations")
            s = timed(lambda: issue(copier.save, src, client.pool, res.offsets, pins))  # noqa: B023
            client.commit(res.reservation_id)
            q = client.query(["bench-gpu"], hashes)
            dst = [b + 2 * args.blocks for b in src]
            ld = timed(lambda: issue(copier.load, dst, client.pool, q.offsets["bench-gpu"], pins))  # noqa: B023
            client.release(q.lease_id)
            if r:
                saves.append(nbytes / s / 1e9)
                loads.append(nbytes / ld / 1e9)
        assert torch.equal(layout.page(args.blocks), layout.page(3 * args.blocks)), "a loaded page differs from its source"
        overhead = step_overhead(torch, layout, client, copier, stream, pins, args)
    finally:
        client.close()
        node.stop()
    save_gbps, load_gbps = statistics.median(saves), statistics.median(loads)
    out = {
        "request_mib": nbytes >> 20, "page_bytes": page, "segments": len(layout.segments),
        "pinned_d2h_gbps": d2h, "pinned_h2d_gbps": h2d,
        "save_gbps": save_gbps, "load_gbps": load_gbps,
        "save_over_pinned": save_gbps / d2h, "load_over_pinned": load_gbps / h2d,
        "pin_gib_per_s": pin_gib_s, "pin_gib": pins.size / 2**30, "pin_s": pins.seconds,
        **overhead,
    }
    print(f"save {save_gbps:.1f} GB/s = {out['save_over_pinned']:.2f}x pinned D2H; load {load_gbps:.1f} GB/s = "
          f"{out['load_over_pinned']:.2f}x pinned H2D (goal >= 0.8x both)", flush=True)
    print(f"{args.prefill}-token step: {overhead['step_ms']:.1f} ms alone, {overhead['step_with_copies_ms']:.1f} ms "
          f"with a {args.blocks}-block load and save beside it: +{overhead['step_overhead'] * 100:.1f}% (goal <= 5%)",
          flush=True)
    if args.summary:
        args.summary.write_text(json.dumps(out, indent=2))


def step_overhead(torch, layout, client, copier, stream, pins, args) -> dict[str, float]:  # noqa: ANN001
    """Mean step time of the layer stack alone and with a load and a save beside it."""
    import xxhash

    hidden, inter, kv = 4096, 14336, KV_HEADS * HEAD_DIM
    w = {k: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.01 for k, shape in
         {"qkv": (hidden, hidden + 2 * kv), "o": (hidden, hidden), "up": (hidden, 2 * inter),
          "down": (inter, hidden)}.items()}
    x0 = torch.randn(args.prefill, hidden, device="cuda", dtype=torch.bfloat16)
    names = layout.layer_names
    hashes = [xxhash.xxh3_128_digest(f"step:{i}".encode()) for i in range(args.blocks)]
    res = client.reserve("bench-gpu", hashes)
    client.commit(res.reservation_id)
    q = client.query(["bench-gpu"], hashes)
    load_offs = q.offsets["bench-gpu"]
    save_res = [client.reserve("bench-gpu", [xxhash.xxh3_128_digest(f"step:{s}:{i}".encode())
                                             for i in range(args.blocks)]) for s in range(args.steps + 2)]
    if min(min(r.offsets) for r in (res, *save_res)) < 0:
        raise SystemExit("bench/gpu.py: the node refused reservations (pool too small for --blocks and --steps)")

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

            def released(layers: tuple[str, ...]) -> None:
                ev = stream.record()
                for name in layers:
                    events[name] = ev  # type: ignore[index]

            stream.after_compute()
            with stream.issuing():
                copier.load(list(range(2 * args.blocks, 3 * args.blocks)), client.pool, load_offs, pins, released)
        forward(events)
        if copies:
            gathered = []
            stream.after_compute()
            with stream.issuing():
                copier.save(list(range(args.blocks)), client.pool, save_res[k].offsets, pins,
                            on_gathered=lambda: gathered.append(stream.record()))
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
