"""Page copies on the CPU (one native call per request): CPU and CUDA-shaped layouts, what is refused."""

import pytest
import torch

from pegaflow.client.pages import load_pages, page_bytes, save_pages


def cpu_layout(blocks=16, layers=3):
    buf = torch.randn(layers, blocks, 2, 16, 64).to(torch.float16)
    return [buf[i] for i in range(layers)]


def cuda_shaped_layout(blocks=16, layers=3):
    # vLLM FlashAttention: per layer (2, num_blocks, block_size, kv_heads, head_dim); K and V segments.
    kv = [torch.randn(2, blocks, 16, 2, 64).to(torch.float16) for _ in range(layers)]
    return [t[i] for t in kv for i in range(2)]


@pytest.mark.parametrize("make", [cpu_layout, cuda_shaped_layout])
def test_round_trip_through_pool_pages(make):
    src = make()
    pb = page_bytes(src)
    pool = torch.zeros(pb * 40 + 4096 * 40, dtype=torch.uint8)
    offsets = [i * (pb + 4096) + 64 for i in (7, 2, 30, 11)]
    save_pages(src, [3, 0, 15, 9], pool, offsets)
    # page layout: concatenation of the segments of one block
    first = torch.cat([s[3].reshape(-1).view(torch.uint8) for s in src])
    assert torch.equal(pool[offsets[0]:offsets[0] + pb], first)
    dst = [torch.zeros_like(s) for s in src]
    load_pages(dst, [1, 2, 4, 5], pool, offsets)
    for s, d in zip(src, dst, strict=True):
        for a, b in zip([3, 0, 15, 9], [1, 2, 4, 5], strict=True):
            assert torch.equal(s[a], d[b])
        assert not d[0].any()


def test_out_of_range_offsets_and_blocks_are_refused():
    src = cpu_layout()
    pool = torch.zeros(page_bytes(src) * 2, dtype=torch.uint8)
    with pytest.raises(IndexError):
        save_pages(src, [0], pool, [page_bytes(src) * 2 - 10])
    with pytest.raises(IndexError):
        save_pages(src, [99], pool, [0])
    with pytest.raises(ValueError):
        save_pages(src, [0, 1], pool, [0])


@pytest.mark.parametrize("offset", [2**63 - 1, 2**63 - 4096, 2**64 - 1, 2**63, -(2**63)])
@pytest.mark.parametrize("copy", [save_pages, load_pages])
def test_offsets_near_the_int64_limit_are_refused_not_copied(offset, copy):
    # offset + page_bytes overflowed the bounds check and the native copy wrote out of bounds.
    src = cpu_layout()
    pool = torch.zeros(page_bytes(src) * 4, dtype=torch.uint8)
    with pytest.raises(IndexError):
        copy(src, [0], pool, [offset])
    assert int(pool.sum()) == 0


def test_a_cpu_kv_cache_with_a_pool_elsewhere_is_refused():
    # Only the batched path copies between devices, and it starts from the KV cache's device.
    src = cpu_layout()
    pool = torch.zeros(page_bytes(src), dtype=torch.uint8, device="meta")
    for copy in (save_pages, load_pages):
        with pytest.raises(ValueError, match="pool on the CPU, not on meta"):
            copy(src, [0], pool, [0])


def test_a_layout_with_segments_on_two_devices_is_refused():
    src = cpu_layout()
    src[1] = src[1].to("meta")
    pool = torch.zeros(page_bytes(src), dtype=torch.uint8)
    with pytest.raises(ValueError, match="on one device"):
        save_pages(src, [0], pool, [0])
    assert int(pool.sum()) == 0


def test_consecutive_blocks_into_consecutive_pages_of_one_segment_are_one_copy() -> None:
    from pegaflow.client.pages import _coalesce, _plan

    cross = torch.randint(0, 255, (16, 3, 4096), dtype=torch.uint8)  # one run per block (a cross-layer cache)
    seg = [cross.view(16, -1)]
    page = seg[0].shape[1]
    pieces = _coalesce(*_plan(seg, [4, 5, 6, 9, 10], [0, page, 2 * page, 3 * page, 5 * page], 8 * page))
    assert [int(n) // page for n in pieces[2]] == [3, 1, 1], "blocks 4-6 into pages 0-2 are one copy"
    pool = torch.zeros(8 * page, dtype=torch.uint8)
    save_pages(seg, [4, 5, 6, 9, 10], pool, [0, page, 2 * page, 3 * page, 5 * page])
    assert torch.equal(pool[:3 * page], cross[4:7].reshape(-1)) and torch.equal(pool[5 * page:6 * page], cross[10].reshape(-1))
    layered = cpu_layout()  # a page's next piece is another layer's: nothing to merge
    n = _plan(layered, [1, 2], [0, page_bytes(layered)], 4 * page_bytes(layered))[2].size
    assert _coalesce(*_plan(layered, [1, 2], [0, page_bytes(layered)], 4 * page_bytes(layered)))[2].size == n
