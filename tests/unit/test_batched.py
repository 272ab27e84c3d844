"""Batched page copies (pegaflow/client/batched.py), the accelerator path, run on CPU tensors.

Every layout the connector knows is saved and loaded through the batched plan and through
the reference path (``pages.py``'s native copy): the pool bytes and the KV cache bytes must
be identical. The plan itself is checked for what makes it fast: a handful of pool copies
(runs of consecutive pages), never one per block and segment.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pegaflow.client import load_pages, save_pages
from pegaflow.client.batched import Run, plan, plan_for, run_plan
from pegaflow.connector.layout import build_page_layout
from tests.unit.test_connector_layout import LAYOUTS, NB


def _pool_and_offsets(page: int, n: int, gap_every: int, rng: np.random.Generator) -> tuple[torch.Tensor, list[int]]:
    """Pages at consecutive offsets, a gap every ``gap_every``, shuffled: runs must be found."""
    offs, pos = [], 0
    for i in range(n):
        if i and i % gap_every == 0:
            pos += page  # a hole
        offs.append(pos)
        pos += page
    rng.shuffle(offs)
    return torch.zeros(pos + page, dtype=torch.uint8), offs


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("staging", [1 << 30, 3])  # one chunk; chunks of 3 pages (staging_bytes = 3 pages)
def test_batched_save_and_load_equal_the_reference_copy_for_every_layout(kind: str, staging: int) -> None:
    make, _, _ = LAYOUTS[kind]
    rng = np.random.default_rng(0)
    layout = build_page_layout(make())
    page = layout.page_bytes
    blocks = [int(b) for b in rng.permutation(NB)[:8]]
    ref_pool, offs = _pool_and_offsets(page, len(blocks), 3, rng)
    pool = torch.zeros_like(ref_pool)
    save_pages(layout.segments, blocks, ref_pool, offs)
    staging_bytes = staging * page if staging < 100 else staging
    p = plan_for(layout.segments, blocks, offs, pool, None, True, staging_bytes)
    assert run_plan(p, layout.segments, pool, True) == len(blocks) * page
    assert torch.equal(pool, ref_pool)
    # Runs: 8 pages with a hole after every 3rd -> 3 runs in one chunk.
    if staging_bytes >= len(blocks) * page:
        assert p.copies == 3

    out = build_page_layout({k: torch.zeros_like(v) for k, v in make().items()})
    ref = build_page_layout({k: torch.zeros_like(v) for k, v in make().items()})
    dst = [int(b) for b in rng.permutation(NB)[:8]]
    load_pages(ref.segments, dst, pool, offs)
    lp = plan_for(out.segments, dst, offs, pool, None, False, staging_bytes)
    seen: list[int] = []
    run_plan(lp, out.segments, pool, False, after_segment=seen.append)
    for a, b in zip(out.segments, ref.segments, strict=True):
        assert torch.equal(a, b)
    assert sorted(seen) == list(range(len(out.segments))), "every segment's load is signalled once"


def test_runs_are_cut_at_the_registration_split_and_never_span_it() -> None:
    runs = plan([4096], [10], np.arange(6), None, [4096 * i for i in range(6)], 1 << 20, True,
                split=3 * 4096 + 1000).chunks[0].runs
    # 24 KiB from 0, cut at 13288 and 26576: pieces that add up, none crossing a multiple.
    assert sum(r.nbytes for r in runs) == 6 * 4096
    assert runs[0] == Run(0, 0, 13288)
    for r in runs:
        assert r.pool_off // 13288 == (r.pool_off + r.nbytes - 1) // 13288
    assert [r.stage_off for r in runs] == [0, 13288, 26576][: len(runs)]


def test_a_64_block_request_is_a_few_copies_not_one_per_block_and_segment() -> None:
    """An 8B-shaped layout (32 layers, K and V: 64 segments) in consecutive pages: one pool
    copy and 64 gathers, against 4,096 per-block copies."""
    seg_len = [16 * 8 * 128 * 2] * 64
    page = sum(seg_len)
    p = plan(seg_len, [1000] * 64, np.arange(100, 164), None, [page * i for i in range(64)], 64 * page, True)
    assert p.copies == 1 and len(p.chunks[0].segments) == 64
    assert p.nbytes == 64 * page


def test_groups_skip_segments_a_window_left_and_saves_refuse_them() -> None:
    ka = torch.arange(NB * 8, dtype=torch.uint8).view(NB, 8)
    kb = (torch.arange(NB * 8, dtype=torch.uint8) + 100).view(NB, 8)
    segments, groups = [ka, kb], [0, 1]
    pool = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="cannot be saved"):
        plan_for(segments, [(1, -1)], [0], pool, groups, True)
    run_plan(plan_for(segments, [(1, 2), (3, 4)], [16, 0], pool, groups, True), segments, pool, True)
    ref = torch.zeros_like(pool)
    save_pages(segments, [(1, 2), (3, 4)], ref, [16, 0], groups)
    assert torch.equal(pool, ref)
    out = [torch.full((NB, 8), 7, dtype=torch.uint8), torch.full((NB, 8), 7, dtype=torch.uint8)]
    run_plan(plan_for(out, [(5, -1), (6, 9)], [16, 0], pool, groups, False), out, pool, False)
    assert torch.equal(out[0][5], ka[1]) and torch.equal(out[0][6], ka[3]) and torch.equal(out[1][9], kb[4])
    assert bool((out[1][:9] == 7).all()), "group 1 has no block in page 0: nothing of it is written"


@pytest.mark.parametrize("bad", [
    ({"offsets": [10**6]}, IndexError), ({"block_ids": [NB]}, IndexError), ({"block_ids": [-1]}, IndexError),
    ({"offsets": [0, 8]}, ValueError),
])
def test_bad_batches_are_refused_before_anything_moves(bad: tuple[dict, type]) -> None:
    kw, exc = bad
    seg = torch.ones(NB, 8, dtype=torch.uint8)
    pool = torch.zeros(64, dtype=torch.uint8)
    args = {"block_ids": [0], "offsets": [0], **kw}
    with pytest.raises(exc):
        plan_for([seg], args["block_ids"], args["offsets"], pool, None, True)
    assert int(pool.sum()) == 0


class FakeCudart:
    """The two driver calls the registration makes, recorded (the hardware edge)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at = fail_at

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        if self.fail_at is not None and ptr == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_the_pool_is_registered_lazily_in_chunks_once_each_and_unregistered_on_close() -> None:
    from pegaflow.client.cuda import Registration

    fake = FakeCudart()
    reg = Registration(1 << 40, 10 * 4096 + 100, chunk=4 * 4096, cudart=fake)
    assert fake.registered == [], "nothing is pinned before a copy touches it"
    assert reg.ensure(4096, 100)
    assert reg.ensure(0, 4096)  # same chunk: no second call
    assert fake.registered == [(1 << 40, 4 * 4096)]
    p = plan([4096], [64], np.arange(6), None, [4096 * i for i in range(3, 9)], reg.size, True, split=reg.chunk)
    for r in p.chunks[0].runs:
        assert reg.ensure(r.pool_off, r.nbytes)
    assert fake.registered == [(1 << 40, 4 * 4096), ((1 << 40) + 4 * 4096, 4 * 4096), ((1 << 40) + 8 * 4096, 2 * 4096 + 100)], \
        "a touched chunk is registered once; the last one is what is left of the pool"
    reg.close()
    assert sorted(fake.unregistered) == [1 << 40, (1 << 40) + 4 * 4096, (1 << 40) + 8 * 4096]
    assert not reg.pinned


def test_a_refused_registration_leaves_copies_pageable_and_is_not_retried() -> None:
    from pegaflow.client.cuda import Registration

    fake = FakeCudart(fail_at=(1 << 40) + 4096)
    reg = Registration(1 << 40, 8 * 4096, chunk=4096, cudart=fake)
    assert not reg.ensure(0, 3 * 4096)
    assert not reg.ensure(6 * 4096, 10), "after a refusal nothing more is tried"
    assert fake.registered == [(1 << 40, 4096)]
