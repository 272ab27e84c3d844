"""The CUDA data path on a GPU, bytes identical: KV caches on the GPU saved into a real
node's pool and loaded back for every layout the connector knows (``save_pages`` /
``load_pages`` -> ``DeviceCopier`` with ``CudaCopyStream``), the pool registered with CUDA
in the background (``PoolPins``) or not yet (bounce slots); the worker's asynchronous path
end to end (copies beside a forward, committed after their event); a request larger than
the staging whose pages cross a 1 GiB registration piece, one page straddling it; a
request of more chunks than bounce slots queued behind a forward; and a refused
registration that leaves no error behind for torch's next kernel.

Skipped, with the reason printed, where CUDA is absent (tests/gpu/conftest.py); run by
``scripts/gpu_check.sh`` on a GPU host.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch
import xxhash

from pegaflow.client import PegaClient, cuda, load_pages, save_pages
from pegaflow.client.batched import DeviceCopier
from pegaflow.connector.layout import build_page_layout
from tests.unit.test_batched import Unpinned
from tests.unit.test_connector_layout import LAYOUTS, NB, zeroed
from tests.waiting import wait_until


def _on_cuda(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The caches on the GPU with their strides (views of one buffer stay views of one)."""
    out = {}
    moved: dict[int, torch.Tensor] = {}
    for k, v in caches.items():
        storage = v.untyped_storage()
        base = moved.get(storage.data_ptr())
        if base is None:
            flat = torch.empty(0, dtype=torch.uint8)
            flat.set_(storage)
            base = moved[storage.data_ptr()] = flat.to("cuda")
        t = torch.empty(0, dtype=v.dtype, device="cuda")
        t.set_(base.untyped_storage(), v.storage_offset(), v.shape, v.stride())
        out[k] = t
    return out


def _hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


@pytest.mark.parametrize("registered", [True, False], ids=["registered", "bounce"])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_save_then_load_through_the_node_restores_every_byte(kind: str, registered: bool, gpu_node) -> None:  # noqa: ANN001
    make, _, _ = LAYOUTS[kind]
    src = _on_cuda(make())
    layout = build_page_layout(src, NB)
    client = PegaClient(gpu_node.addr)
    try:
        client.register({f"gpu-{kind}-{registered}": layout.page_bytes})
        if registered:
            size = client.pool.numel()  # the front holds a number, never the pool (it would outlive the test)
            pins = cuda.pins_for(client.pool, front=lambda: size)
            assert pins.wait(60) and pins.failed is None, f"registration refused: {pins.failed}"
        rng = np.random.default_rng(1)
        blocks = [int(b) for b in rng.permutation(NB)[:8]]
        ns = f"gpu-{kind}-{registered}"
        hashes = _hashes(kind, len(blocks))
        res = client.reserve(ns, hashes)
        assert all(o >= 0 for o in res.offsets)
        assert save_pages(layout.segments, blocks, client.pool, res.offsets) == len(blocks) * layout.page_bytes
        assert client.commit(res.reservation_id) == len(blocks)
        q = client.query([ns], hashes)
        assert q.hit_blocks == len(blocks)
        dst_caches = _on_cuda(zeroed(make))
        dst = build_page_layout(dst_caches, NB)
        targets = [int(b) for b in rng.permutation(NB)[:8]]
        load_pages(dst.segments, targets, client.pool, q.offsets[ns])
        client.release(q.lease_id)
        for b_src, b_dst in zip(blocks, targets, strict=True):
            assert torch.equal(layout.page(b_src), dst.page(b_dst)), f"block {b_src} -> {b_dst}"
    finally:
        client.close()


def test_a_request_over_the_staging_across_a_registration_piece_restores_every_byte(node_factory) -> None:  # noqa: ANN001
    """192 KiB pages (1 GiB is no multiple of them): one page straddles the 1 GiB boundary of
    the pool's registration; 5,600 blocks (1.05 GiB) through an 8 MiB staging."""
    node = node_factory(pool_size="2gb")
    layers, heads, hd, bs, nb = 3, 8, 128, 16, 5600
    src = {f"model.layers.{i}.self_attn.attn": torch.randn(2, nb, bs, heads, hd, device="cuda").half()
           for i in range(layers)}
    layout = build_page_layout(src, nb)
    assert (1 << 30) % layout.page_bytes
    client = PegaClient(node.addr, timeout=60)
    try:
        client.register({"gpu-big": layout.page_bytes})
        size = client.pool.numel()
        pins = cuda.pins_for(client.pool, front=lambda: size)
        assert pins.wait(120) and pins.complete
        hashes = _hashes("big", nb)
        offsets: list[int] = []
        rids = []
        for lo in range(0, nb, 1024):
            r = client.reserve("gpu-big", hashes[lo:lo + 1024])
            offsets += r.offsets
            rids.append(r.reservation_id)
        assert min(offsets) >= 0, "the node refused some reservations"
        assert min(offsets) < (1 << 30) < max(offsets), "the pages do not cross the first piece"
        stream = cuda.CudaCopyStream(torch.device("cuda"))
        copier = DeviceCopier(layout.segments, stream, split=cuda.CHUNK, staging_bytes=8 << 20)
        stream.after_compute()
        with stream.issuing():
            issued = copier.save(list(range(nb)), client.pool, offsets, pins)
        stream.record().synchronize()
        assert not issued.completions and issued.nbytes == nb * layout.page_bytes
        for rid in rids:
            client.commit(rid)
        dst = build_page_layout({k: torch.zeros_like(v) for k, v in src.items()}, nb)
        loader = DeviceCopier(dst.segments, stream, None, dst.layers_done_at, split=cuda.CHUNK, staging_bytes=8 << 20)
        with stream.issuing():
            loader.load(list(range(nb)), client.pool, offsets, pins)
        stream.record().synchronize()
        straddles = [i for i, o in enumerate(offsets) if o < (1 << 30) < o + layout.page_bytes]
        for b in [0, nb - 1, *straddles]:
            assert torch.equal(layout.page(b), dst.page(b)), f"block {b}"
        for a, b in zip(layout.segments, dst.segments, strict=True):
            assert torch.equal(a, b)
    finally:
        client.close()


def test_a_request_of_more_chunks_than_bounce_slots_behind_a_forward_restores_every_byte() -> None:
    """Before the pool is registered every chunk goes through one of 2 bounce slots; queued
    behind a slow forward, the third chunk finds both in use and waits for the first."""
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(2, 64, 16, 8, 128, device="cuda").half()
              for i in range(4)}
    layout = build_page_layout(caches, 64)
    pool = torch.zeros(16 * layout.page_bytes, dtype=torch.uint8)  # pageable: never a DMA's end
    offsets = [i * layout.page_bytes for i in range(10)]
    stream = cuda.CudaCopyStream(torch.device("cuda"))
    copier = DeviceCopier(layout.segments, stream, staging_bytes=2 * layout.page_bytes, bounce_slots=2)  # 5 chunks
    big = torch.randn(8192, 8192, device="cuda")
    for _ in range(6):  # the "forward" the copies queue behind
        big = big @ big
        big /= big.abs().amax()
    stream.after_compute()
    with stream.issuing():
        issued = copier.save(list(range(10)), pool, offsets, Unpinned(0, pool))
    for done in issued.completions:
        done.synchronize()
        assert getattr(done, "error", None) is None, done.error  # type: ignore[attr-defined]
    assert copier.bounce is not None and copier.bounce.waits >= 1 and len(issued.completions) == 5
    dst = build_page_layout({k: torch.zeros_like(v) for k, v in caches.items()}, 64)
    loader = DeviceCopier(dst.segments, stream, None, dst.layers_done_at, staging_bytes=2 * layout.page_bytes,
                          bounce_slots=2)
    for _ in range(6):
        big = big @ big
        big /= big.abs().amax()
    stream.after_compute()
    with stream.issuing():
        loader.load(list(range(20, 30)), pool, offsets, Unpinned(0, pool))
    torch.cuda.synchronize()
    assert loader.bounce is not None and loader.bounce.waits >= 1
    for b in range(10):
        assert torch.equal(dst.page(20 + b), layout.page(b)), f"block {b}"
    copier.close()
    loader.close()


def test_copies_beside_the_forward_read_and_write_the_kv_the_forward_sees() -> None:
    """The asynchronous path's ordering on a real device, as the worker issues it: a save
    queued after a forward that is still writing the blocks reads what the forward wrote,
    and a block the next forward overwrites as soon as the gather's event allows still
    reaches the pool as it was; a load's layers are read by the forward only after their
    band's event."""
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
              for i in range(8)}
    layout = build_page_layout(caches, 64)
    pool = torch.zeros(16 * layout.page_bytes, dtype=torch.uint8, pin_memory=True)
    stream = cuda.CudaCopyStream(torch.device("cuda"))
    copier = DeviceCopier(layout.segments, stream, None, layout.layers_done_at)
    big = torch.randn(8192, 8192, device="cuda")
    for t in caches.values():  # the "forward": slow work, then the KV it computed
        big = big @ big
        big /= big.abs().amax()  # finite: unscaled, it overflows to inf and NaN (NaN != NaN) by the 5th layer
        t[:, :8].copy_(big[:2 * 8 * 16 * 8, :128].reshape(2, 8, 16, 8, 128).to(torch.bfloat16))
    want = [layout.page(b).clone() for b in range(8)]  # queued after the writes: what they wrote
    gathered: list[object] = []
    stream.after_compute()
    with stream.issuing():
        copier.save(list(range(8)), pool, [i * layout.page_bytes for i in range(8)],
                    on_gathered=lambda: gathered.append(stream.record()))
    stream.compute_waits(gathered[-1])
    for t in caches.values():  # the next forward reuses the blocks
        t[:, :8].fill_(-1)
    stream.record().synchronize()
    for b in range(8):
        assert torch.equal(pool[b * layout.page_bytes:(b + 1) * layout.page_bytes].cuda(), want[b]), f"block {b}"
    released: dict[str, object] = {}
    stream.after_compute()
    with stream.issuing():
        copier.load(list(range(16, 24)), pool, [i * layout.page_bytes for i in range(8)],
                    on_layers=lambda names: released.update(dict.fromkeys(names, stream.record())))
    assert list(released) == list(layout.layer_names)
    seen = []
    for name, t in caches.items():
        stream.compute_waits(released[name])  # wait_for_layer_load
        seen.append(t[:, 16:24].clone())
    torch.cuda.synchronize()
    for b in range(8):
        assert torch.equal(layout.page(16 + b), want[b])
    for got, t in zip(seen, caches.values(), strict=True):
        assert torch.equal(got, t[:, 16:24]), "the forward read a layer before its load landed"


def test_the_asynchronous_worker_path_commits_what_it_copied_beside_the_forward() -> None:
    """The connector's worker with CUDA caches, a real CudaCopyStream and pinned pool
    memory: a save is committed only once its copy completed, and a second engine's load
    (released layer band by band to its forward) reads the same KV. Needs vLLM (the
    connector's messages are vLLM's types): skipped on a GPU host without it."""
    pytest.importorskip("vllm", reason="the connector's worker needs vLLM installed (the copier is tested above)")
    from tests.unit.connector_fakes import Engine, FakeNode, identity
    from tests.unit.test_connector_sides import prompt

    node = FakeNode(pool_bytes=1 << 24, pinned=True)
    ident = identity(layers=8, heads=8, hd=64, bs=16)
    # torch's pinned pool is registered already: CUDA answers 712, counted as registered.
    pins = lambda pool, front: cuda.pins_for(pool, lambda: pool.numel())  # noqa: E731
    first = Engine(node, ident, device="cuda", pins=pins)
    assert first.workers[0].copier is not None, "the GPU worker made its copier at register"
    tokens = prompt(11)
    saved = first.run(tokens)
    bs = ident.block_size
    full = (len(tokens) - 1) // bs
    expected = [first.block_content(0, b) for b in saved["block_ids"][:full]]
    first.workers[0].inflight.drain()
    from tests.unit.test_inflight import empty_step

    empty_step(first)
    assert node.calls["commit"] >= 1
    second = Engine(node, ident, device="cuda", pins=pins)
    out = second.run(tokens)
    torch.cuda.synchronize()
    assert out["external"] == full * bs
    assert out["loaded"][0] == expected


def test_a_refused_registration_leaves_no_error_for_the_next_kernel() -> None:
    rt = cuda.cudart()
    assert "libcudart" in rt.path
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    idx = torch.arange(0, 1 << 20, 7, device="cuda")
    # A raw refusal leaves CUDA's last error set on this thread; torch's next launch check
    # would report it (printed: what the registration must prevent).
    rc = rt.host_register(1, 4096, 1)
    assert rc != 0
    try:
        torch.index_select(x, 0, idx)
        torch.cuda.synchronize()
        print(f"raw cudaHostRegister refusal {rc}: torch's next kernel did not report it")
    except RuntimeError as exc:
        print(f"raw cudaHostRegister refusal {rc}: torch's next kernel raised {exc}")
    rt.get_last_error()
    # Through PoolPins: refused, counted, cleared; the next kernel runs.
    pins = cuda.PoolPins(1, 4096, rt, front=lambda: 4096, chunk=4096)
    failures = pins.metrics.failures._value.get()  # noqa: SLF001 - our own counter
    assert not pins.register(0) and pins.failed
    assert pins.metrics.failures._value.get() == failures + 1  # noqa: SLF001
    assert torch.equal(torch.index_select(x, 0, idx), x[::7])
    torch.cuda.synchronize()


def test_registration_runs_behind_the_node_prefault_in_the_background(node_factory) -> None:  # noqa: ANN001
    node = node_factory(pool_size="2gb")
    client = PegaClient(node.addr)
    try:
        client.register({"gpu-pin": 1 << 20})
        front, asked = [0], [0]

        def at() -> int:
            asked[0] += 1
            return front[0]

        pins = cuda.PoolPins(client.pool.data_ptr(), client.pool.numel(), cuda.cudart(), front=at)
        pins.start()
        wait_until(lambda: asked[0] >= 3, timeout=10, what="the registration thread looks at the front")
        assert not pins.pinned, "registered beyond the node's pre-fault front"
        front[0] = client.pool.numel()
        t0 = time.perf_counter()
        assert pins.wait(120) and pins.complete
        gib_s = client.pool.numel() / 2**30 / max(time.perf_counter() - t0, 1e-9)
        print(f"registered {client.pool.numel() / 2**30:.1f} GiB at {gib_s:.1f} GiB/s")
        wait_until(lambda: "pegaflow-pool-pin" not in {t.name for t in threading.enumerate()}, timeout=5,
                   what="the registration thread ends when done")
        pins.close()
    finally:
        client.close()
        gc.collect()
