"""Block ids and layouts as ``save_pages``/``load_pages`` take them: parsed and refused in one
place for the native path (``pages``) and the batched one (``batched``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

BlockIds = Sequence[int | Sequence[int]]  # per page: one id, or one per KV cache group (every page alike)


def block_matrix(block_ids: BlockIds, groups: Sequence[int] | None, nseg: int,
                 to_pool: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, seg_group)``: ``ids[i, g]`` is page ``i``'s block in group ``g``, ``seg_group[s]``
    the group of segment ``s``. A save refuses a ``-1`` (a page is written whole)."""
    try:
        ids = np.asarray(block_ids, dtype=np.int64)
    except OverflowError:
        raise IndexError("block id out of range") from None
    if groups is None and ids.size and ids.min() < 0:
        raise IndexError("block id out of range of the KV cache")  # -1 needs the segments' groups
    if ids.ndim == 1:
        ids = ids.reshape(-1, 1)
    elif ids.ndim != 2:
        raise ValueError("block_ids must give one id, or one per KV cache group, for each page")
    seg_group = np.zeros(nseg, dtype=np.int64) if groups is None else np.asarray(groups, dtype=np.int64)
    if seg_group.shape != (nseg,):
        raise ValueError(f"{len(seg_group)} segment groups for {nseg} segments")
    if nseg and (seg_group.min() < 0 or seg_group.max() >= ids.shape[1]) and ids.size:
        raise ValueError(f"segment group out of range of the {ids.shape[1]} block ids given per page")
    if to_pool and ids.size and (ids[:, np.unique(seg_group)] == -1).any():
        raise ValueError("a page with a group that has no block (-1) cannot be saved")
    return ids, seg_group


def check_batch(block_ids: BlockIds, pool: torch.Tensor, offsets: Sequence[int]) -> None:
    """One batch against its pool (the layout checked apart: a copier checks it once)."""
    if len(block_ids) != len(offsets):
        raise ValueError(f"{len(block_ids)} block ids but {len(offsets)} offsets")
    if pool.dtype != torch.uint8 or pool.dim() != 1:
        raise ValueError("pool must be a 1-D uint8 tensor")


def check_layout(segments: Sequence[torch.Tensor], block_ids: BlockIds, pool: torch.Tensor,
                 offsets: Sequence[int]) -> None:
    check_batch(block_ids, pool, offsets)
    if not segments:
        raise ValueError("empty layout")
    for seg in segments:
        if not seg[0].is_contiguous():
            raise ValueError("each segment's per-block slice must be contiguous")
