"""Batched page copies: native path and torch fallback, CPU and CUDA-shaped layouts."""

import pytest
import torch

from pegaflow.client import pages
from pegaflow.client.pages import load_pages, page_bytes, save_pages


def cpu_layout(blocks=16, layers=3):
    buf = torch.randn(layers, blocks, 2, 16, 64).to(torch.float16)
    return [buf[i] for i in range(layers)]


def cuda_shaped_layout(blocks=16, layers=3):
    # vLLM FlashAttention: per layer (2, num_blocks, block_size, kv_heads, head_dim); K and V segments.
    kv = [torch.randn(2, blocks, 16, 2, 64).to(torch.float16) for _ in range(layers)]
    return [t[i] for t in kv for i in range(2)]


@pytest.mark.parametrize("make", [cpu_layout, cuda_shaped_layout])
@pytest.mark.parametrize("native", [True, False])
def test_round_trip_through_pool_pages(make, native, monkeypatch):
    if not native:
        monkeypatch.setattr(pages, "_native", None)
    elif pages._native is None:
        pytest.fail("native page copier was not built by the install")
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
