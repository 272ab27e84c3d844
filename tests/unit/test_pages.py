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


@pytest.mark.parametrize("to_pool", [1, 0])
def test_native_copy_of_odd_lengths_and_misaligned_addresses_is_exact(to_pool):
    """The non-temporal paths align the destination, split large pieces into four streams
    and finish with a tail: every byte lands, none outside its range is touched."""
    if pages._native is None:
        pytest.fail("native page copier was not built by the install")
    import numpy as np

    rng = np.random.default_rng(7)
    lengths = [4095, 4096, 4097, 5000, 65536 + 37, 262144, 300001]
    shifts = [0, 1, 17, 33, 63]
    pool = np.full(4 << 20, 0xEE, dtype=np.uint8)
    other = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    offs, addrs, lens = [], [], []
    pos_pool, pos_other = 0, 0
    for i, n in enumerate(lengths):
        pool_off = pos_pool + shifts[i % len(shifts)]
        other_off = pos_other + shifts[(i + 2) % len(shifts)]
        offs.append(pool_off)
        addrs.append(other.ctypes.data + other_off)
        lens.append(n)
        pos_pool = pool_off + n + 128
        pos_other = other_off + n + 128
    if not to_pool:
        pool[:] = rng.integers(0, 256, pool.size, dtype=np.uint8)
    before_pool, before_other = pool.copy(), other.copy()
    offs_a, addrs_a, lens_a = (np.array(offs, dtype=np.int64), np.array(addrs, dtype=np.uint64),
                               np.array(lens, dtype=np.int64))  # alive across the call
    pages._native.pf_copy_segments(
        pool.ctypes.data, offs_a.ctypes.data, addrs_a.ctypes.data, lens_a.ctypes.data, len(lens), to_pool, 1)
    dst, dst_before, src = (pool, before_pool, before_other) if to_pool else (other, before_other, before_pool)
    expect = dst_before.copy()
    for off, addr, n in zip(offs, addrs, lens, strict=True):
        o = addr - other.ctypes.data
        if to_pool:
            expect[off:off + n] = src[o:o + n]
        else:
            expect[o:o + n] = src[off:off + n]
    assert np.array_equal(dst, expect)


@pytest.mark.parametrize("offset", [2**63 - 1, 2**63 - 4096, 2**64 - 1, 2**63, -(2**63)])
@pytest.mark.parametrize("copy", [save_pages, load_pages])
def test_offsets_near_the_int64_limit_are_refused_not_copied(offset, copy):
    # offset + page_bytes overflowed the bounds check and the native copy wrote out of bounds.
    src = cpu_layout()
    pool = torch.zeros(page_bytes(src) * 4, dtype=torch.uint8)
    with pytest.raises(IndexError):
        copy(src, [0], pool, [offset])
    assert int(pool.sum()) == 0
