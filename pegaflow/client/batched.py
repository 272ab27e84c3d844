"""Batched page copies for KV caches on an accelerator: a request in a few large operations.

A per-block path (one ``copy_`` per block and segment) would be ~4,000 small
copies for a 64-block request of an 8B model; on a GPU each is a launch and a DMA of a few
KiB. Here a request moves through a *staging* buffer on the KV cache's device that holds
its pages back to back, in pool order:

* save: one ``index_select`` per segment gathers the segment's rows of every page into the
  staging buffer (device bandwidth), then one copy per **run** (pages at consecutive pool
  offsets) writes the staging bytes into the pool (with the pool registered, a DMA);
* load: one copy per run reads the pool into the staging buffer, then one ``index_copy_``
  per segment scatters it into the KV cache blocks.

The planning (which bytes go where: page order, runs, which pages carry each segment) is
numpy on the host and the copies are plain torch, so the same code runs on CPU tensors and
is tested there; only stream and registration handling is CUDA-specific
(``pegaflow.client.cuda``). Pages are ordered by pool offset so that pages the node placed
next to each other become one run. ``staging_bytes`` bounds the buffer: a larger request
goes in chunks of whole pages. ``split`` cuts runs at multiples of that many pool bytes
(pool memory registered with CUDA in chunks: one DMA never spans two registrations).

Layouts are those of ``pages.py``: a list of segments, ``seg[b]`` contiguous; several KV
cache groups give one block id per group and page, ``-1`` where a group holds no block
(loads skip that segment of that page; saves refuse it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pegaflow.client.blocks import block_matrix, check_layout

DEFAULT_STAGING_BYTES = 256 << 20  # per chunk: 128 pages of an 8B model's 2 MiB page


@dataclass(frozen=True)
class Run:
    """``nbytes`` between pool offset ``pool_off`` and staging offset ``stage_off``."""

    pool_off: int
    stage_off: int
    nbytes: int


@dataclass(frozen=True)
class SegmentRows:
    """Segment ``seg`` of the chunk: staging rows ``rows`` (``None``: every row) hold blocks ``ids``."""

    seg: int
    ids: np.ndarray
    rows: np.ndarray | None


@dataclass(frozen=True)
class Chunk:
    """Pages that fit the staging buffer at once."""

    pages: int
    runs: tuple[Run, ...]
    segments: tuple[SegmentRows, ...]


@dataclass(frozen=True)
class BatchPlan:
    page_bytes: int
    seg_start: tuple[int, ...]  # each segment's byte offset within a page
    seg_len: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for c in self.chunks for r in c.runs)

    @property
    def copies(self) -> int:
        """Pool copies (DMAs) the plan makes."""
        return sum(len(c.runs) for c in self.chunks)


def _runs(offs: np.ndarray, page: int, split: int | None) -> list[Run]:
    """Maximal runs of pages at consecutive offsets (``offs`` sorted), cut at ``split``."""
    if not offs.size:
        return []
    breaks = np.flatnonzero(np.diff(offs) != page) + 1
    out: list[Run] = []
    for idx in np.split(np.arange(offs.size), breaks):
        start, n = int(offs[idx[0]]), idx.size * page
        stage = int(idx[0]) * page
        while n:
            take = n if split is None else min(n, split - start % split)
            out.append(Run(start, stage, take))
            start, stage, n = start + take, stage + take, n - take
    return out


def plan(seg_len: Sequence[int], nblocks: Sequence[int], block_ids: np.ndarray, seg_group: np.ndarray | None,
         offsets: Sequence[int], pool_bytes: int, to_pool: bool, staging_bytes: int = DEFAULT_STAGING_BYTES,
         split: int | None = None) -> BatchPlan:
    """The copies of one batch of pages. ``block_ids``: ``(pages,)`` with one KV cache group
    (``seg_group`` None), else ``(pages, groups)`` with ``seg_group[s]`` the group of segment
    ``s`` (``-1``: that group has no block there). Raises ``IndexError``/``ValueError`` as
    ``pages.py`` does, before anything moves."""
    lens = np.asarray(seg_len, dtype=np.int64)
    page = int(lens.sum())
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    try:
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise IndexError("page offset out of range") from None
    if offs.size != len(block_ids):
        raise ValueError(f"{len(block_ids)} block ids but {offs.size} offsets")
    if offs.size and (page > pool_bytes or offs.min() < 0 or offs.max() > pool_bytes - page):
        raise IndexError("page offset out of range of the pool")
    if split is not None and split <= 0:
        raise ValueError("split must be positive")
    ids = np.asarray(block_ids, dtype=np.int64)
    if seg_group is None:
        if ids.ndim != 1:
            raise ValueError("block ids per KV cache group need the segments' groups")
        if ids.size and ids.min() < 0:
            raise IndexError("block id out of range of the KV cache")
        ids, seg_group = ids.reshape(-1, 1), np.zeros(len(lens), dtype=np.int64)
    per_seg = ids[:, seg_group] if ids.size else ids.reshape(0, len(lens))
    if per_seg.size and ((per_seg < -1).any() or (per_seg >= np.asarray(nblocks)[None, :]).any()):
        raise IndexError("block id out of range of the KV cache")
    if to_pool and (per_seg == -1).any():
        raise ValueError("a page with a group that has no block (-1) cannot be saved")
    order = np.argsort(offs, kind="stable")
    offs_sorted, ids_sorted = offs[order], ids[order]
    rows_per_chunk = max(1, staging_bytes // max(page, 1))
    chunks = []
    for lo in range(0, offs_sorted.size, rows_per_chunk):
        c_offs, c_ids = offs_sorted[lo:lo + rows_per_chunk], ids_sorted[lo:lo + rows_per_chunk]
        # One (ids, rows) per group, shared by the group's segments: one index tensor each.
        by_group: dict[int, tuple[np.ndarray, np.ndarray | None] | None] = {}
        for g in np.unique(seg_group).tolist():
            col = c_ids[:, g]
            keep = col != -1
            by_group[g] = (col, None) if keep.all() else (col[keep], np.flatnonzero(keep)) if keep.any() else None
        segs = tuple(SegmentRows(s, *sel) for s, g in enumerate(seg_group.tolist())
                     if (sel := by_group[g]) is not None)
        chunks.append(Chunk(int(c_offs.size), tuple(_runs(c_offs, page, split)), segs))
    return BatchPlan(page, tuple(int(x) for x in starts), tuple(int(x) for x in lens), tuple(chunks))


def plan_for(segments: Sequence[torch.Tensor], block_ids: Sequence[int] | Sequence[Sequence[int]],
             offsets: Sequence[int], pool: torch.Tensor, groups: Sequence[int] | None, to_pool: bool,
             staging_bytes: int = DEFAULT_STAGING_BYTES, split: int | None = None) -> BatchPlan:
    """``plan`` for a layout's segments (as ``save_pages``/``load_pages`` take them; block ids
    parsed and refused as they are there)."""
    check_layout(segments, block_ids, pool, offsets)
    for seg in segments:
        if seg.dtype != torch.uint8 or seg.dim() != 2 or seg.stride(1) != 1:
            raise ValueError("each segment must be a (blocks, bytes) uint8 view with contiguous rows")
    ids, seg_group = block_matrix(block_ids, groups, len(segments), to_pool)
    return plan([s.shape[1] for s in segments], [s.shape[0] for s in segments], ids, seg_group, offsets,
                pool.numel(), to_pool, staging_bytes, split)


def _index(ids: np.ndarray, device: torch.device, cache: dict[int, torch.Tensor]) -> torch.Tensor:
    """``ids`` as a long tensor on ``device``, made once per distinct array of a chunk."""
    t = cache.get(id(ids))
    if t is None:
        t = torch.from_numpy(np.ascontiguousarray(ids)).to(device, non_blocking=True)
        cache[id(ids)] = t
    return t


def run_plan(p: BatchPlan, segments: Sequence[torch.Tensor], pool: torch.Tensor, to_pool: bool,
             staging: torch.Tensor | None = None, after_segment: Callable[[int], None] | None = None,
             after_gather: Callable[[], None] | None = None) -> int:
    """Issue the plan's copies on the current stream (on CPU: run them); returns the bytes moved
    to or from the pool. ``staging``: a uint8 buffer on the segments' device of at least one
    chunk (made here if None). ``after_segment(s)`` is called once a load has issued every
    write of segment ``s`` (per-layer events hang off it); ``after_gather()`` once a save has
    issued its last read of the KV cache (before its last DMAs)."""
    if not p.chunks:
        return 0
    device = segments[0].device
    rows_max = max(c.pages for c in p.chunks)
    need = rows_max * p.page_bytes
    if staging is None:
        staging = torch.empty(need, dtype=torch.uint8, device=device)
    elif staging.numel() < need or staging.dtype != torch.uint8 or staging.device != device:
        raise ValueError(f"staging buffer must be >= {need} uint8 bytes on {device}")
    moved = 0
    last = len(p.chunks) - 1
    signalled: set[int] = set()
    for k, chunk in enumerate(p.chunks):
        stage = staging[: chunk.pages * p.page_bytes]
        rows = stage.view(chunk.pages, p.page_bytes)
        cache: dict[int, torch.Tensor] = {}
        if to_pool:
            for sr in chunk.segments:
                a, n = p.seg_start[sr.seg], p.seg_len[sr.seg]
                rows[:, a:a + n] = segments[sr.seg].index_select(0, _index(sr.ids, device, cache))
            if after_gather is not None and k == last:
                after_gather()
            for r in chunk.runs:
                pool[r.pool_off:r.pool_off + r.nbytes].copy_(stage[r.stage_off:r.stage_off + r.nbytes],
                                                             non_blocking=True)
                moved += r.nbytes
        else:
            for r in chunk.runs:
                stage[r.stage_off:r.stage_off + r.nbytes].copy_(pool[r.pool_off:r.pool_off + r.nbytes],
                                                                non_blocking=True)
                moved += r.nbytes
            for sr in chunk.segments:
                a, n = p.seg_start[sr.seg], p.seg_len[sr.seg]
                src = rows[:, a:a + n] if sr.rows is None else rows[_index(sr.rows, device, cache), a:a + n]
                segments[sr.seg].index_copy_(0, _index(sr.ids, device, cache), src)
                if after_segment is not None and k == last:
                    after_segment(sr.seg)
                    signalled.add(sr.seg)
    if after_segment is not None and not to_pool:
        for s in range(len(segments)):  # segments the last chunk does not write (all -1 there)
            if s not in signalled:
                after_segment(s)
    return moved
