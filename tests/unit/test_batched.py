"""Page copies for a KV cache on an accelerator (pegaflow/client/batched.py), run on CPU tensors.

The copier is device-agnostic; its hardware edge (the copy stream's DMAs, pinned buffers)
is the host stand-in of tests/fakes/device.py. What is proved here:

* the bytes: every layout the connector knows is saved and loaded through the copier and
  through the reference path (``pages.py``'s native copy), with per-layer tensors placed as
  a GPU allocator places them (aligned, apart), in one chunk or several, with pages cut by
  a registration boundary, and through the bounce slots: pool and KV cache bytes identical;
* the cost: the operations one call dispatches (torch's dispatch mode counts them) and the
  DMAs it queues do not grow with the number of layers, and nothing is allocated per call;
* a load is issued layer band by band, each band's scatter right after its own DMAs, so
  the first layers are released to the forward before the last bytes arrive.
"""

from __future__ import annotations

import math
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pegaflow.client import load_pages, save_pages
from pegaflow.client.batched import MIN_UNIT, DeviceCopier, Run, UnitSpan, _runs, plan
from pegaflow.connector.layout import build_page_layout
from tests.fakes.device import HostStream
from tests.unit.test_connector_layout import LAYOUTS, NB, zeroed


def placed(caches: dict[str, torch.Tensor], align: int = 1 << 16) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same caches, each layer's tensor at its own ``align``-aligned place in one arena
    with a gap after it (as a GPU allocator places separate allocations); strides kept."""
    arena_bytes = sum(align * (2 + -(-t.untyped_storage().nbytes() // align)) for t in caches.values()) + align
    arena = torch.zeros(arena_bytes, dtype=torch.uint8)
    base = -arena.data_ptr() % align
    out = {}
    for name, t in caches.items():
        n = t.untyped_storage().nbytes()
        raw = arena[base:base + n]
        whole = torch.empty(0, dtype=torch.uint8)
        whole.set_(t.untyped_storage())
        raw.copy_(whole)
        view = torch.empty(0, dtype=t.dtype)
        view.set_(raw.untyped_storage(), base // t.element_size() + t.storage_offset(), t.shape, t.stride())
        out[name] = view
        base += align * (2 + -(-n // align))  # a gap, as between two allocations
    return out, arena


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


class Unpinned:
    """A pool registered only below ``upto`` bytes (the rest goes through the bounce slots)."""

    def __init__(self, upto: int, pool: torch.Tensor) -> None:
        self.upto = upto
        self.pool = pool

    def registered(self, first: int, nbytes: int) -> bool:
        return first + nbytes <= self.upto


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("staging_pages", [100, 3])  # one chunk; chunks of 3 pages
@pytest.mark.parametrize("split", [None, "mid-page"])  # no registration pieces; a piece ending inside a page
def test_save_and_load_equal_the_reference_copy_for_every_layout(kind: str, staging_pages: int, split: str | None) -> None:
    make, _, _ = LAYOUTS[kind]
    rng = np.random.default_rng(0)
    caches, _arena = placed(make())
    layout = build_page_layout(caches)
    page = layout.page_bytes
    blocks = [int(b) for b in rng.permutation(NB)[:8]]
    ref_pool, offs = _pool_and_offsets(page, len(blocks), 3, rng)
    pool = torch.zeros_like(ref_pool)
    save_pages(layout.segments, blocks, ref_pool, offs)
    stream = HostStream()
    cut = None if split is None else page * 2 + page // 3 + 64  # inside the third page
    copier = DeviceCopier(layout.segments, stream, staging_bytes=staging_pages * page, split=cut,
                          layers_done_at=layout.layers_done_at)
    assert copier.span is not None, "aligned per-layer tensors share a unit: one gather for all layers"
    assert copier.save(blocks, pool, offs).nbytes == len(blocks) * page
    assert torch.equal(pool, ref_pool)

    out_caches, _out_arena = placed(zeroed(make))
    out = build_page_layout(out_caches)
    ref = build_page_layout(zeroed(make))
    dst = [int(b) for b in rng.permutation(NB)[:8]]
    load_pages(ref.segments, dst, pool, offs)
    seen: list[str] = []
    loader = DeviceCopier(out.segments, HostStream(), staging_bytes=staging_pages * page, split=cut,
                          layers_done_at=out.layers_done_at)
    assert loader.load(dst, pool, offs, on_layers=seen.extend).nbytes == len(dst) * page
    for b in range(NB):  # the loaded blocks hold the pages, the others are untouched (zero)
        assert torch.equal(out.page(b), ref.page(b)), f"block {b}"
    assert seen == list(out.layer_names), "every layer is released once, in order"


def test_runs_are_cut_at_the_registration_split_and_a_page_across_it_goes_in_two_parts() -> None:
    page = 4096
    runs = _runs(np.arange(6, dtype=np.int64) * page, page, split=3 * page + 1000)
    # Pages 0-2 before the cut at 13288; page 3 (12288-16384) straddles it; 4-5 after.
    assert runs[0] == Run(0, 0, 3)
    assert runs[1] == Run(3 * page, 3, 1, (0, 1000)) and runs[2] == Run(3 * page, 3, 1, (1000, page))
    assert runs[3] == Run(4 * page, 4, 2)
    for r in runs:
        lo = r.pool_off + (r.part[0] if r.part else 0)
        hi = r.pool_off + (r.part[1] if r.part else r.pages * page)
        assert lo // 13288 == (hi - 1) // 13288, f"{r} spans a registration boundary"


def test_a_64_block_request_is_one_gather_and_one_dma_per_run_not_one_per_block_and_segment() -> None:
    """An 8B-shaped layout (32 layers, K and V: 64 segments) in consecutive pages."""
    seg_len = [16 * 8 * 128 * 2] * 64
    page = sum(seg_len)
    b = plan(seg_len, [1000] * 64, np.arange(100, 164), None, [page * i for i in range(64)], 64 * page, True,
             rows_per_chunk=64)
    assert len(b.chunks) == 1 and b.chunks[0].runs == (Run(0, 0, 64),)


# Operations that make a view (no kernel on any device).
VIEWS = {"aten.view", "aten.detach", "aten.slice", "aten.select", "aten.as_strided", "aten._unsafe_view", "aten.alias"}


class Ops(TorchDispatchMode):
    """Counts the aten operations dispatched while active (every launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _flash(layers: int) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.randn(2, 40, 16, 4, 64).half() for i in range(layers)}


@pytest.mark.parametrize("direction", ["save", "load"])
def test_operations_per_call_do_not_grow_with_the_layer_count_and_nothing_is_allocated(direction: str) -> None:
    counts = {}
    for layers in (4, 32):
        caches, _arena = placed(_flash(layers))
        layout = build_page_layout(caches)
        stream = HostStream()
        copier = DeviceCopier(layout.segments, stream, layers_done_at=layout.layers_done_at)
        pool = torch.zeros(64 * layout.page_bytes, dtype=torch.uint8)
        offs = [i * layout.page_bytes for i in range(16)]  # one run
        ids = list(range(3, 19))
        if direction == "save":
            copier.save(ids, pool, offs)  # warm
        stream.dma = dict.fromkeys(stream.dma, 0)
        with Ops() as ops:
            (copier.save if direction == "save" else copier.load)(ids, pool, offs)
        counts[layers] = (dict(ops.ops), dict(stream.dma))
        assert not {k for k in ops.ops if k.startswith(("aten.empty", "aten.zeros", "aten.new_"))}, \
            f"allocated per call: {ops.ops}"
    assert counts[4] == counts[32], f"operations grow with the layers: {counts}"
    ops4, dma4 = counts[4]
    kernels = {k: n for k, n in ops4.items() if k not in VIEWS}
    # A save: one gather; a load: one scatter per band of layers. Plus the index upload and
    # one DMA per run (per band: a load's are strided, one per run and band).
    assert kernels == ({"aten.index_select": 1} if direction == "save" else {"aten.index_copy_": 4}), ops4
    assert dma4 == ({"copy": 2, "copy2d": 0} if direction == "save" else {"copy": 1, "copy2d": 4}), dma4


def test_a_load_releases_each_band_of_layers_before_the_next_bands_dmas() -> None:
    """Layer-wise loads pipeline: band k's scatter (and its event) is queued before band
    k+1's DMAs, so layer 0 waits for its own bytes only."""
    caches, _arena = placed(_flash(8))
    layout = build_page_layout(caches)
    log: list[tuple[str, object]] = []

    class Logged(HostStream):
        def copy2d(self, *a: int) -> None:
            super().copy2d(*a)
            log.append(("dma", a[4] * a[5]))

    copier = DeviceCopier(layout.segments, Logged(), layers_done_at=layout.layers_done_at)
    pool = torch.zeros(8 * layout.page_bytes, dtype=torch.uint8)
    copier.load(list(range(8)), pool, [i * layout.page_bytes for i in range(8)],
                on_layers=lambda names: log.append(("released", names)))
    released = [i for i, e in enumerate(log) if e[0] == "released"]
    dmas = [i for i, e in enumerate(log) if e[0] == "dma"]
    assert len(released) == 4 and released[0] < dmas[1], f"band 0 released after later DMAs: {log}"
    assert log[released[0]][1] == tuple(layout.layer_names[:2])
    assert sum(e[1] for e in log if e[0] == "dma") == 8 * layout.page_bytes  # type: ignore[misc]


def test_pool_pieces_not_registered_go_through_the_bounce_slots_never_by_direct_dma() -> None:
    caches, _arena = placed(_flash(3))
    layout = build_page_layout(caches)
    page = layout.page_bytes
    pool = torch.zeros(16 * page, dtype=torch.uint8)
    ref = torch.zeros_like(pool)
    offs = [i * page for i in (2, 3, 4, 9, 10, 11)]
    ids = [5, 1, 7, 9, 2, 30]
    save_pages(layout.segments, ids, ref, offs)
    stream = HostStream()
    touched: list[int] = []

    class Watch(HostStream):
        def copy(self, dst: int, src: int, nbytes: int) -> None:
            super().copy(dst, src, nbytes)
            touched.extend([dst, src])

        def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
            super().copy2d(dst, dpitch, src, spitch, width, height)
            touched.extend([dst, src])

    stream = Watch()
    pins = Unpinned(8 * page, pool)  # pages 9-11 are in a piece not registered yet
    copier = DeviceCopier(layout.segments, stream, staging_bytes=3 * page, bounce_slots=2)
    issued = copier.save(ids, pool, offs, pins)
    for done in issued.completions:
        done.synchronize()
    assert torch.equal(pool, ref)
    assert copier.bounce is not None and copier.bounce.used >= 1 and issued.completions
    hi = pool.data_ptr() + pool.numel()
    assert not [a for a in touched if pool.data_ptr() + 8 * page <= a < hi], "a DMA touched unregistered memory"

    out_caches, _a2 = placed({k: torch.zeros_like(v) for k, v in caches.items()})
    out = build_page_layout(out_caches)
    touched.clear()
    loader = DeviceCopier(out.segments, stream, staging_bytes=3 * page, bounce_slots=2)
    loader.load(ids, pool, offs, pins)
    for i in ids:
        assert torch.equal(out.page(i), layout.page(i))
    assert not [a for a in touched if pool.data_ptr() + 8 * page <= a < hi]


class _LagEvent:
    """A device event: completes ``lag`` seconds after it was recorded, on its own."""

    def __init__(self, lag: float) -> None:
        self._done = threading.Event()
        threading.Timer(lag, self._done.set).start()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        assert self._done.wait(5.0), "the device never got there"


class LaggingStream(HostStream):
    """A copy stream whose events complete a while after they are recorded, as on a GPU
    where the copies start only after the forward (the DMAs themselves run at once here)."""

    def __init__(self, lag: float = 0.2) -> None:
        super().__init__()
        self.lag = lag

    def record(self) -> _LagEvent:  # type: ignore[override]
        self.records += 1
        return _LagEvent(self.lag)


def test_a_batch_larger_than_the_bounce_slots_reuses_them_in_turn_waiting_for_each() -> None:
    caches, _arena = placed(_flash(3))
    layout = build_page_layout(caches)
    page = layout.page_bytes
    pool = torch.zeros(16 * page, dtype=torch.uint8)
    ref = torch.zeros_like(pool)
    ids = [5, 1, 7, 9, 2, 30, 11, 3, 14, 20, 6, 25]
    offs = [i * page for i in range(len(ids))]
    save_pages(layout.segments, ids, ref, offs)
    pins = Unpinned(0, pool)  # nothing registered yet: every chunk goes through a slot
    stream = LaggingStream()
    saver = DeviceCopier(layout.segments, stream, staging_bytes=3 * page, bounce_slots=2)  # 4 chunks, 2 slots
    issued = saver.save(ids, pool, offs, pins)
    for done in issued.completions:
        done.synchronize()
    # A slot taken again before its bytes were copied out into the pool would have lost them.
    assert torch.equal(pool, ref)
    assert saver.bounce is not None and saver.bounce.waits >= 1 and len(issued.completions) == 4

    out_caches, _a2 = placed({k: torch.zeros_like(v) for k, v in caches.items()})
    out = build_page_layout(out_caches)
    loader = DeviceCopier(out.segments, stream, staging_bytes=3 * page, bounce_slots=2)
    assert loader.bounce is not None
    take = loader.bounce.take
    refilled_busy: list[object] = []

    def watched_take() -> object:
        before = {id(s): s.busy for s in loader.bounce.slots}  # type: ignore[union-attr]
        slot = take()
        last = before[id(slot)]
        if last is not None and not last.query():  # its last DMA may still read it
            refilled_busy.append(slot)
        return slot

    loader.bounce.take = watched_take  # type: ignore[method-assign]
    loader.load(ids, pool, offs, pins)
    for i in ids:
        assert torch.equal(out.page(i), layout.page(i))
    assert loader.bounce.waits >= 1 and not refilled_busy  # never refilled under a DMA still reading it


class _Queued:
    """A device event the device has not reached yet."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("waited for on the host")


def test_a_save_that_fails_part_way_keeps_its_bounce_slot_until_its_queued_copies_ran() -> None:
    """Its first DMAs into the slot were queued (on a device they run later); the slot must
    not be handed out as free, or a load would fill it on the host and then read the
    failed save's bytes from it into the KV cache."""
    caches, _arena = placed(_flash(3))
    layout = build_page_layout(caches)
    page = layout.page_bytes
    pool = torch.zeros(4 * page, dtype=torch.uint8)

    class FailsThirdCopy(HostStream):
        def __init__(self) -> None:
            super().__init__()
            self.copies = 0

        def record(self) -> _Queued:  # type: ignore[override]
            return _Queued()

        def copy(self, dst: int, src: int, nbytes: int) -> None:
            self.copies += 1  # 1: the index upload, 2: the first run into the slot, 3: the second
            if self.copies == 3:
                raise RuntimeError("cudaMemcpyAsync: invalid argument")
            super().copy(dst, src, nbytes)

    saver = DeviceCopier(layout.segments, FailsThirdCopy(), bounce_slots=1)
    with pytest.raises(RuntimeError, match="invalid argument"):
        saver.save([0, 1], pool, [0, 2 * page], Unpinned(0, pool))  # two runs, nothing registered
    assert saver.bounce is not None
    (slot,) = saver.bounce.slots
    assert slot.busy is not None and not slot.busy.query(), "the slot looks free under its queued copy"


def test_a_bounce_thread_that_cannot_bind_the_device_fails_its_copies_instead_of_hanging() -> None:
    from pegaflow.client.batched import Finisher

    def boom() -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    f = Finisher(bind=boom)
    ran: list[int] = []
    done = f.after(_Queued(), lambda: ran.append(1))
    assert done._done.wait(5.0), "the completion never finished: every bounced save would hang"  # noqa: SLF001
    assert isinstance(done.error, RuntimeError) and not ran
    f.close()


def test_rows_without_a_common_unit_are_copied_segment_by_segment_with_the_same_bytes() -> None:
    seg = [torch.randint(0, 255, (NB, 8), dtype=torch.uint8), torch.randint(0, 255, (NB, 24), dtype=torch.uint8)]
    assert UnitSpan.of(seg) is None or UnitSpan.of(seg).unit >= MIN_UNIT  # type: ignore[union-attr]
    copier = DeviceCopier(seg, HostStream())
    assert copier.span is None
    pool, ref = torch.zeros(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    copier.save([3, 1], pool, [64, 0])
    save_pages(seg, [3, 1], ref, [64, 0])
    assert torch.equal(pool, ref)
    out = [torch.zeros_like(s) for s in seg]
    DeviceCopier(out, HostStream()).load([4, 6], pool, [64, 0])
    assert torch.equal(out[0][4], seg[0][3]) and torch.equal(out[1][6], seg[1][1])


@pytest.mark.parametrize("aligned", [True, False])
def test_groups_skip_segments_a_window_left_and_saves_refuse_them(aligned: bool) -> None:
    n = 512 if aligned else 8
    arena = torch.zeros(4 * NB * n, dtype=torch.uint8)
    ka = arena[:NB * n].view(NB, n)
    kb = arena[2 * NB * n:3 * NB * n].view(NB, n)
    ka.copy_(torch.randint(0, 255, ka.shape, dtype=torch.uint8))
    kb.copy_(torch.randint(0, 255, kb.shape, dtype=torch.uint8))
    segments, groups = [ka, kb], [0, 1]
    pool = torch.zeros(8 * n, dtype=torch.uint8)
    copier = DeviceCopier(segments, HostStream(), groups)
    assert (copier.span is not None) == aligned
    with pytest.raises(ValueError, match="cannot be saved"):
        copier.save([(1, -1)], pool, [0])
    copier.save([(1, 2), (3, 4)], pool, [2 * n, 0])
    ref = torch.zeros_like(pool)
    save_pages(segments, [(1, 2), (3, 4)], ref, [2 * n, 0], groups)
    assert torch.equal(pool, ref)
    out_arena = torch.full_like(arena, 7)
    out = [out_arena[:NB * n].view(NB, n), out_arena[2 * NB * n:3 * NB * n].view(NB, n)]
    DeviceCopier(out, HostStream(), groups).load([(5, -1), (6, 9)], pool, [2 * n, 0])
    assert torch.equal(out[0][5], ka[1]) and torch.equal(out[0][6], ka[3]) and torch.equal(out[1][9], kb[4])
    assert bool((out[1][:9] == 7).all()), "group 1 has no block in page 0: nothing of it is written"
    assert bool((out_arena[NB * n:2 * NB * n] == 7).all()), "the memory between the segments is never touched"


@pytest.mark.parametrize("bad", [
    ({"offsets": [10**6]}, IndexError), ({"block_ids": [NB]}, IndexError), ({"block_ids": [-1]}, IndexError),
    ({"offsets": [0, 8]}, ValueError), ({"block_ids": [0, 1], "offsets": [0, 0]}, ValueError),
])
def test_bad_batches_are_refused_before_anything_moves(bad: tuple[dict, type]) -> None:
    kw, exc = bad
    seg = torch.ones(NB, 512, dtype=torch.uint8)
    pool = torch.zeros(4096, dtype=torch.uint8)
    args = {"block_ids": [0], "offsets": [0], **kw}
    with pytest.raises(exc):
        DeviceCopier([seg], HostStream()).save(args["block_ids"], pool, args["offsets"])
    assert int(pool.sum()) == 0


def test_the_unit_is_the_largest_size_every_row_offset_length_and_stride_shares() -> None:
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    base = -arena.data_ptr() % 4096
    a = arena[base:base + 8 * 1536].view(8, 1536)
    b = arena[base + 65536:base + 65536 + 8 * 1536].view(8, 1536)
    span = UnitSpan.of([a, b])
    assert span is not None and span.unit == math.gcd(1536, 65536) == 512
    assert list(span.length) == [3, 3] and list(span.stride) == [3, 3] and list(span.first) == [0, 128]
