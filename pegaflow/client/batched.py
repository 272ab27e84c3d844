"""Page copies for a KV cache on an accelerator: a request in a number of operations that
does not grow with the number of layers.

A page is the concatenation of a block's row in every segment (``pages.py``); an 8B model
has 64 segments (K and V of 32 layers), so a copy per segment would be 64 launches per
request and ~4,000 small DMAs. Instead, one request moves through a **staging** buffer on
the KV cache's device, allocated once (``DeviceCopier``):

* **one view over every segment** (``UnitSpan``): the segments' rows, whatever tensor
  they belong to, are whole *units* of one view of the address range they span (a unit is
  the largest size that divides every row's offset, length and block stride: 32 KiB for
  an 8B model's rows); so gathering every segment row of every page into the staging is
  **one** ``index_select`` and scattering them back **one** ``index_copy_``, over an index
  of ``pages × units per page`` entries (built with numpy, sent from pinned memory). The
  view never touches memory between the segments: only the indexed units are read or
  written. Where the unit would be smaller than ``MIN_UNIT`` (odd row sizes), the copy
  goes segment by segment instead, logged once;
* **DMAs per run** of pages at consecutive pool offsets (the node places a request's pages
  next to each other), between the staging and the pool, through the ``DeviceStream``'s
  ``copy``/``copy2d`` (on a GPU ``cudaMemcpyAsync``/``cudaMemcpy2DAsync`` from pool memory
  registered with CUDA; ``pegaflow.client.cuda``);
* a **load** is issued in ``LOAD_BANDS`` bands of consecutive layers: the pool bytes of one
  band of every page (one strided DMA per run) land in the band's own region of the
  staging, which is scattered at once, so layer 0 waits for a quarter of the transfer,
  not the whole (``on_layers`` tells the caller which layers are complete, per band);
* a **save** gathers whole pages (``on_gathered`` once the KV cache has been read: the
  forward may overwrite those blocks from then on) and writes each run with one DMA.

A request larger than the staging goes in chunks of whole pages (chunks run one after the
other on the copy stream). Runs are cut where the pool's registration pieces end
(``split``), a page that straddles such a boundary going as two pieces, so that no DMA
spans two registrations. A run whose pool piece is not registered yet (``Pins``) goes
through a pinned **bounce** slot (``Bounce``): a load copies it there on the host first, a
save copies it out on a finisher thread once its DMA completed (an ``Event`` the step
waits for). The planning is numpy and the copies plain torch plus the stream's DMAs, so
the same code runs on CPU tensors, with a host ``DeviceStream``, in the tests.

Layouts are those of ``pages.py``: a list of segments, ``seg[b]`` contiguous; several KV
cache groups give one block id per group and page, ``-1`` where a group holds no block
(loads skip that segment of that page; saves refuse it).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import queue
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from pegaflow.client.blocks import BlockIds, block_matrix, check_batch

log = logging.getLogger("pegaflow.client.batched")

# Staging per copier, allocated once on the KV cache's device (64 MiB: 32 pages of an 8B
# model; a 64-block request goes in two chunks, the second's gather ~0.05 ms on a GPU).
DEFAULT_STAGING_BYTES = 64 << 20
# A load is issued in this many bands of layers: the forward's first layer waits for a
# quarter of the transfer, and the launches per request stay 4 × (runs + 1).
LOAD_BANDS = 4
# Below this unit the index would be over 3% of the bytes moved: copy per segment instead.
MIN_UNIT = 256
# Pinned index buffers in flight: a buffer is reused once its upload completed (with vLLM's
# asynchronous scheduling the host runs a step or two ahead of the copy stream).
INDEX_SLOTS = 16


class Event(Protocol):
    """A point in a copy stream (a CUDA event; a host stand-in in the tests)."""

    def query(self) -> bool:
        """True once every copy issued before the event was recorded has completed."""
        ...

    def synchronize(self) -> None: ...


@runtime_checkable
class DeviceStream(Protocol):
    """The copy stream as the copier uses it: its DMAs and page-locked host memory
    (``pegaflow.client.cuda.CudaCopyStream`` on a GPU). The ordering against the compute
    stream is the caller's (``pegaflow.connector.inflight.CopyStream``)."""

    def issuing(self) -> AbstractContextManager[object]:
        """While entered, torch work is queued on the copy stream."""
        ...

    def record(self) -> Event:
        """An event after the copies issued so far."""
        ...

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy of ``nbytes`` from address ``src`` to ``dst`` (either on the host)."""
        ...

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        """Queue ``height`` rows of ``width`` bytes, rows ``spitch``/``dpitch`` bytes apart."""
        ...

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A host buffer the device copies to and from asynchronously (page-locked)."""
        ...

    def recycle(self, event: Event) -> None:
        """Nobody queries or waits for ``event`` again: it may be recorded anew."""
        ...

    def bind_thread(self) -> None:
        """Called first on a thread of the copier's own (``Finisher``): the stream's device
        becomes that thread's."""
        ...


class Pins(Protocol):
    def registered(self, first: int, nbytes: int) -> bool:
        """The pool bytes ``[first, first + nbytes)`` are registered for DMA (one piece)."""
        ...


class AllPinned:
    """Pool memory every DMA may use as it is (a CPU stand-in; a fully registered pool)."""

    def registered(self, first: int, nbytes: int) -> bool:
        return True


ALL_PINNED = AllPinned()


class BounceBusy(RuntimeError):
    """Pool memory not registered yet and no bounce slots to copy it through."""


class IssueFailed(RuntimeError):
    """A batch failed after some of its copies were queued. ``completions``: the host work
    those queued (a save's bounce copies into the pool), which still runs: the pages it
    writes must not be handed out again before it is done."""

    def __init__(self, cause: BaseException, completions: tuple[Event, ...]) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.completions = completions


def alias(ptr: int, nbytes: int, device: torch.device, keep: object) -> torch.Tensor:
    """A uint8 tensor over ``[ptr, ptr + nbytes)`` of ``device`` memory that ``keep`` owns
    (kept alive with the tensor). Only the parts a caller indexes are ever touched."""
    if device.type == "cpu":
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        t = torch.frombuffer(buf, dtype=torch.uint8)
        t._pegaflow_keep = (buf, keep)  # type: ignore[attr-defined]  # not a Tensor field: keeps the memory alive with t
        return t

    class _Memory:  # __cuda_array_interface__ v3: torch keeps this object with the tensor
        def __init__(self) -> None:
            self.keep = keep
            self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                             "version": 3, "strides": None}

    return torch.as_tensor(_Memory(), device=device)


class UnitSpan:
    """Every segment's rows as whole units of one view (``view``: ``(count, unit)`` of
    ``dtype``) over the address range the segments span.

    Unit ``first[s] + b * stride[s] + k`` (``k < length[s]``) is unit ``k`` of block ``b``'s
    row of segment ``s``. ``None`` from ``of`` when the unit would be below ``MIN_UNIT``."""

    def __init__(self, segments: Sequence[torch.Tensor], unit: int, base: int, end: int) -> None:
        self.unit = unit
        self.count = (end - base) // unit
        self.first = np.array([(s.data_ptr() - base) // unit for s in segments], dtype=np.int64)
        self.stride = np.array([s.stride(0) // unit for s in segments], dtype=np.int64)
        self.length = np.array([s.shape[1] // unit for s in segments], dtype=np.int64)
        # Wider elements move faster through the index kernels; the span's base and the unit
        # are multiples of 8 wherever the allocator aligns tensors (CUDA: 256 bytes).
        self.dtype = torch.int64 if unit % 8 == 0 and base % 8 == 0 else torch.uint8
        raw = alias(base, end - base, segments[0].device, keep=tuple(segments))
        self.view = raw.view(self.dtype).view(self.count, unit // raw.view(self.dtype).element_size())
        # Units of each segment's row, back to back (the order within a page).
        self.within = np.concatenate([np.arange(n, dtype=np.int64) for n in self.length])
        self.seg_of_unit = np.repeat(np.arange(len(segments)), self.length)

    @staticmethod
    def of(segments: Sequence[torch.Tensor]) -> UnitSpan | None:
        ptrs = [s.data_ptr() for s in segments]
        base = min(ptrs)
        end = max(p + (s.shape[0] - 1) * s.stride(0) + s.shape[1] for p, s in zip(ptrs, segments, strict=True))
        parts = [p - base for p in ptrs] + [s.shape[1] for s in segments]
        parts += [s.stride(0) for s in segments if s.shape[0] > 1]
        unit = functools.reduce(math.gcd, parts, 0)
        if unit < MIN_UNIT:
            return None
        return UnitSpan(segments, unit, base, end)


@dataclass(frozen=True)
class Band:
    """Segments ``[lo, hi)``: bytes ``[start, end)`` of every page; ``layers``: the layers
    complete once this band (and those before it) is written."""

    lo: int
    hi: int
    start: int
    end: int
    layers: tuple[str, ...]

    @property
    def width(self) -> int:
        return self.end - self.start


def bands_of(seg_len: Sequence[int], layers_done_at: dict[int, tuple[str, ...]], n: int) -> tuple[Band, ...]:
    """At most ``n`` bands of consecutive segments of about equal bytes, each ending where
    layers are complete (``layers_done_at``; the last segment always ends one)."""
    starts = np.concatenate(([0], np.cumsum(seg_len))).astype(np.int64)
    page = int(starts[-1])
    ends = sorted(set(layers_done_at) | {len(seg_len) - 1})
    bands: list[Band] = []
    lo = 0
    for k in range(1, n + 1):
        target = page * k // n
        cut = next((e for e in ends if e >= lo and starts[e + 1] >= target), ends[-1])
        if cut < lo:
            continue
        names = tuple(name for s in range(lo, cut + 1) for name in layers_done_at.get(s, ()))
        bands.append(Band(lo, cut + 1, int(starts[lo]), int(starts[cut + 1]), names))
        lo = cut + 1
        if lo >= len(seg_len):
            break
    return tuple(bands)


@dataclass(frozen=True)
class Run:
    """Pages ``[row, row + pages)`` of a chunk, at consecutive pool offsets from ``pool_off``;
    ``part``: ``(start, end)`` bytes of the one page it holds, when a registration boundary
    cuts that page (the run is then that part of one page)."""

    pool_off: int
    row: int
    pages: int
    part: tuple[int, int] | None = None


@dataclass(frozen=True)
class Chunk:
    """Pages that fit the staging at once: ``order`` indexes the batch's pages."""

    order: np.ndarray
    runs: tuple[Run, ...]


def _runs(offs: np.ndarray, page: int, split: int | None) -> list[Run]:
    """Maximal runs of pages at consecutive offsets (``offs`` sorted), cut at multiples of
    ``split``; a page across such a multiple is two runs of one part each."""
    if not offs.size:
        return []
    out: list[Run] = []
    breaks = np.flatnonzero(np.diff(offs) != page) + 1
    for idx in np.split(np.arange(offs.size), breaks):
        row, n, start = int(idx[0]), int(idx.size), int(offs[idx[0]])
        while n:
            if split is None:
                out.append(Run(start, row, n))
                break
            boundary = (start // split + 1) * split
            whole = min(n, (boundary - start) // page)
            if whole:
                out.append(Run(start, row, whole))
                start, row, n = start + whole * page, row + whole, n - whole
                continue
            cut = boundary - start  # this page straddles the boundary: one run per side
            out.append(Run(start, row, 1, (0, cut)))
            out.append(Run(start, row, 1, (cut, page)))
            start, row, n = start + page, row + 1, n - 1
    return out


@dataclass(frozen=True)
class Batch:
    """One batch of pages, checked: ``ids[i, g]`` the block of page ``i`` in group ``g``."""

    ids: np.ndarray
    seg_group: np.ndarray
    offs: np.ndarray
    chunks: tuple[Chunk, ...]
    skips: bool  # some page has no block in some group (-1): loads skip those rows


def plan(seg_len: Sequence[int], nblocks: Sequence[int], block_ids: np.ndarray, seg_group: np.ndarray | None,
         offsets: Sequence[int], pool_bytes: int, to_pool: bool, rows_per_chunk: int,
         split: int | None = None) -> Batch:
    """The pages of one batch, in pool order, in chunks of ``rows_per_chunk`` pages, runs
    cut at ``split``. ``block_ids``: ``(pages,)`` with one KV cache group (``seg_group``
    None), else ``(pages, groups)``. Raises ``IndexError``/``ValueError`` as ``pages.py``
    does, before anything moves."""
    lens = np.asarray(seg_len, dtype=np.int64)
    page = int(lens.sum())
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
    skips = bool((per_seg == -1).any())
    if to_pool and skips:
        raise ValueError("a page with a group that has no block (-1) cannot be saved")
    if offs.size and np.unique(offs).size != offs.size:
        raise ValueError("two pages of one batch at the same pool offset")
    order = np.argsort(offs, kind="stable")
    chunks = []
    for lo in range(0, offs.size, rows_per_chunk):
        sel = order[lo:lo + rows_per_chunk]
        chunks.append(Chunk(sel, tuple(_runs(offs[sel], page, split))))
    return Batch(ids, seg_group, offs, tuple(chunks), skips)


class _Slot:
    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.ptr = buf.data_ptr()
        self.busy: Event | None = None


class HostCompletion:
    """An ``Event`` done once a host-side step after a device event has run (``Finisher``)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def finish(self, error: BaseException | None = None) -> None:
        """The host step ran (``error``: it failed)."""
        self.error = error
        self._done.set()


class Finisher:
    """One thread that waits for device events and then runs host work (a save's bounce
    copy into the pool), in order; the engine thread never waits for the device. Each
    event goes back to the stream (``recycle``) once waited for."""

    def __init__(self, recycle: Callable[[Event], None] | None = None, bind: Callable[[], None] | None = None) -> None:
        self._recycle = recycle
        self._bind = bind  # first, on the thread (``DeviceStream.bind_thread``)
        self._q: queue.SimpleQueue[tuple[Event, Callable[[], None], HostCompletion] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pegaflow-bounce", daemon=True)
        self._thread.start()

    def after(self, event: Event, fn: Callable[[], None]) -> HostCompletion:
        done = HostCompletion()
        self._q.put((event, fn, done))
        return done

    def _run(self) -> None:
        unusable: BaseException | None = None  # the device could not be made current here
        if self._bind is not None:
            try:
                self._bind()
            except BaseException as exc:  # noqa: BLE001 - every completion fails with it, none hangs
                log.error("PegaFlow bounce thread cannot use the device: %s", exc)
                unusable = exc
        while (item := self._q.get()) is not None:
            event, fn, done = item
            if unusable is not None:
                done.finish(unusable)
                continue
            try:
                event.synchronize()
                if self._recycle is not None:
                    self._recycle(event)
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported through the completion
                log.error("PegaFlow bounce copy failed: %s", exc)
                done.finish(exc)
                continue
            done.finish()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5.0)


class Bounce:
    """Pinned host slots, one chunk of staging each, for pool pieces not registered yet.
    ``count(runs)`` is told of every run that goes through one (a metric).

    The slots are taken in turn, and one still in use is waited for on the host (``waits``
    counts it): a batch larger than the slots reuses them, and on a GPU its copies start
    only after the forward, so its third chunk finds the first slot in use. Refusing there
    would fail every load or save of more than two chunks until the pool is registered,
    after some of its copies were queued. The engine thread then waits for the device, as
    it does for a pinned index buffer (``DeviceCopier._host_slot``, the same turn); only
    while a piece of the pool is not registered."""

    def __init__(self, stream: DeviceStream, slot_bytes: int, slots: int = 2,
                 count: Callable[[int], None] | None = None) -> None:
        self.slots = [_Slot(stream.pinned(slot_bytes)) for _ in range(slots)]
        self.finisher = Finisher(stream.recycle, stream.bind_thread)
        self._stream = stream
        self.used = 0  # runs that went through a slot
        self.waits = 0  # takes that waited on the host for a slot in use
        self._next = 0
        self._count = count

    def counted(self, runs: int) -> None:
        self.used += runs
        if self._count is not None:
            self._count(runs)

    def take(self) -> _Slot:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        if slot.busy is not None:
            if not slot.busy.query():
                slot.busy.synchronize()  # the class docstring
                self.waits += 1
            self._stream.recycle(slot.busy)  # a load's event (a save's completion is no stream's: ignored)
            slot.busy = None
        return slot

    def close(self) -> None:
        self.finisher.close()


@dataclass
class Issued:
    """What a ``DeviceCopier`` call queued: bytes moved to or from the pool, and host work
    (bounce copies) the step must wait for beyond the stream's own event."""

    nbytes: int = 0
    completions: tuple[Event, ...] = ()


class DeviceCopier:
    """Copies between one KV cache layout on a device and pool pages, with everything it
    needs allocated once: the staging and index buffers on the device, pinned index
    buffers, and (``bounce_slots`` > 0) pinned bounce slots.

    Not thread-safe: one worker issues on one copy stream. Calls queue work on ``stream``
    (entered with ``stream.issuing()`` by the caller, which also orders it after the
    compute stream) and return at once; the bytes are where they go once the stream has
    run that work and every completion in the result is done.
    """

    def __init__(self, segments: Sequence[torch.Tensor], stream: DeviceStream, groups: Sequence[int] | None = None,
                 layers_done_at: dict[int, tuple[str, ...]] | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, bands: int = LOAD_BANDS, split: int | None = None,
                 bounce_slots: int = 0, bounce_count: Callable[[int], None] | None = None) -> None:
        if not segments:
            raise ValueError("empty layout")
        for seg in segments:
            if seg.dtype != torch.uint8 or seg.dim() != 2 or seg.stride(1) != 1:
                raise ValueError("each segment must be a (blocks, bytes) uint8 view with contiguous rows")
        self.segments = tuple(segments)
        self.device = segments[0].device
        self.stream = stream
        self.groups = None if groups is None else tuple(groups)
        self.seg_len = np.array([s.shape[1] for s in segments], dtype=np.int64)
        self.seg_start = np.concatenate(([0], np.cumsum(self.seg_len)[:-1])).astype(np.int64)
        self.nblocks = [s.shape[0] for s in segments]
        self.page = int(self.seg_len.sum())
        self.split = split
        last = len(segments) - 1
        self.save_band = Band(0, len(segments), 0, self.page, ())
        self.load_bands = bands_of(self.seg_len.tolist(), layers_done_at or {last: ()}, bands)
        self.span = UnitSpan.of(self.segments)
        if self.span is None:
            log.warning("PegaFlow: KV cache rows share no unit of %d bytes or more; copying segment by segment "
                        "(%d launches per request)", MIN_UNIT, len(segments))
        # Loads that skip rows (-1) select the rows they keep into the staging's second half.
        halves = 2 if groups is not None else 1
        self.rows_per_chunk = max(1, staging_bytes // (self.page * halves))
        self.staging = torch.empty(self.rows_per_chunk * self.page * halves, dtype=torch.uint8, device=self.device)
        units = self.rows_per_chunk * (self.page // self.span.unit if self.span is not None else len(segments))
        self._index_entries = 2 * units  # destination and, when rows are skipped, source rows
        self.index = torch.empty(self._index_entries, dtype=torch.int64, device=self.device)
        self._host_index = [stream.pinned(self._index_entries * 8) for _ in range(INDEX_SLOTS)]
        self._host_busy: list[Event | None] = [None] * INDEX_SLOTS
        self._next_host = 0
        self.bounce = (Bounce(stream, self.rows_per_chunk * self.page, bounce_slots, bounce_count)
                       if bounce_slots else None)

    # -- planning --------------------------------------------------------------------------
    def plan(self, block_ids: BlockIds, pool: torch.Tensor, offsets: Sequence[int], to_pool: bool) -> Batch:
        check_batch(block_ids, pool, offsets)
        ids, seg_group = block_matrix(block_ids, self.groups, len(self.segments), to_pool)
        return plan(self.seg_len.tolist(), self.nblocks, ids, seg_group, offsets, pool.numel(), to_pool,
                    self.rows_per_chunk, self.split)

    # -- the copies --------------------------------------------------------------------------
    def save(self, block_ids: BlockIds, pool: torch.Tensor, offsets: Sequence[int], pins: Pins = ALL_PINNED,
             on_gathered: Callable[[], None] | None = None) -> Issued:
        """Queue a save of pages ``block_ids`` into the pool at ``offsets``. ``on_gathered``
        is called once the last read of the KV cache is queued (before the last DMAs)."""
        batch = self.plan(block_ids, pool, offsets, True)
        return self._issue(batch, pool, pins, True, on_gathered=on_gathered)

    def load(self, block_ids: BlockIds, pool: torch.Tensor, offsets: Sequence[int], pins: Pins = ALL_PINNED,
             on_layers: Callable[[tuple[str, ...]], None] | None = None) -> Issued:
        """Queue a load of the pool pages at ``offsets`` into blocks ``block_ids``.
        ``on_layers(names)`` is called once the writes of those layers are queued (per band,
        in layer order, every layer once)."""
        batch = self.plan(block_ids, pool, offsets, False)
        return self._issue(batch, pool, pins, False, on_layers=on_layers)

    def _issue(self, batch: Batch, pool: torch.Tensor, pins: Pins, to_pool: bool,
               on_gathered: Callable[[], None] | None = None,
               on_layers: Callable[[tuple[str, ...]], None] | None = None) -> Issued:
        out = Issued()
        completions: list[Event] = []
        bands = (self.save_band,) if to_pool else self.load_bands
        try:
            self._chunks(batch, pool, pins, to_pool, bands, out, completions, on_gathered, on_layers)
        except Exception as exc:
            if not completions:
                raise
            raise IssueFailed(exc, tuple(completions)) from exc
        out.completions = tuple(completions)
        return out

    def _chunks(self, batch: Batch, pool: torch.Tensor, pins: Pins, to_pool: bool, bands: Sequence[Band], out: Issued,
                completions: list[Event], on_gathered: Callable[[], None] | None,
                on_layers: Callable[[tuple[str, ...]], None] | None) -> None:
        pool_ptr = pool.data_ptr()
        last = len(batch.chunks) - 1
        for k, chunk in enumerate(batch.chunks):
            rows = chunk.order.size
            slot = self._bounce_for(chunk, pins) if self.bounce is not None else None
            if slot is None and any(not pins.registered(r.pool_off + (r.part[0] if r.part else 0),
                                                        self._run_bytes(r)) for r in chunk.runs):
                raise BounceBusy("pool memory is not registered and there is no bounce buffer")
            try:
                index = self._upload_index(batch, chunk, bands)
                if to_pool:
                    self._gather(batch, chunk, index[0])
                    if on_gathered is not None and k == last:
                        on_gathered()
                    out.nbytes += self._dma_out(chunk, pool_ptr, slot, completions)
                else:
                    if slot is not None:
                        self._fill_bounce(chunk, pool_ptr, slot)
                    for b, band in enumerate(bands):
                        out.nbytes += self._dma_in(chunk, rows, band, pool_ptr, slot)
                        self._scatter(batch, chunk, band, index[b])
                        if on_layers is not None and k == last and band.layers:
                            on_layers(band.layers)
                    if slot is not None:
                        slot.busy = self.stream.record()
            except BaseException:
                if slot is not None and slot.busy is None:
                    # DMAs into or out of the slot may be queued ahead of the failure: on a device
                    # they run later, so the slot is not free before they did (a load taking it
                    # would fill it on the host, then read the failed save's bytes from it).
                    with contextlib.suppress(Exception):  # a broken stream: nothing runs anyway
                        slot.busy = self.stream.record()
                raise

    def _run_bytes(self, r: Run) -> int:
        return r.part[1] - r.part[0] if r.part else r.pages * self.page

    def _bounce_for(self, chunk: Chunk, pins: Pins) -> _Slot | None:
        assert self.bounce is not None
        if all(pins.registered(r.pool_off + (r.part[0] if r.part else 0), self._run_bytes(r)) for r in chunk.runs):
            return None
        return self.bounce.take()

    # Index entries of a chunk: per band, the destination (load) or source (save) unit of
    # every (page, segment unit), page-major; with skipped rows, the kept rows' staging units.
    def _upload_index(self, batch: Batch, chunk: Chunk, bands: Sequence[Band]) -> list[tuple[torch.Tensor, ...]]:
        if self.span is None:
            return [() for _ in bands]
        span = self.span
        ids = batch.ids[chunk.order][:, batch.seg_group]  # (rows, segments)
        rows = ids.shape[0]
        parts: list[np.ndarray] = []
        shapes: list[tuple[int, ...]] = []
        for band in bands:
            seg = slice(band.lo, band.hi)
            u0 = int(self.seg_start[band.lo] // span.unit)
            u1 = int((self.seg_start[band.hi - 1] + self.seg_len[band.hi - 1]) // span.unit)
            owner = span.seg_of_unit[u0:u1]
            blocks = ids[:, seg][:, owner - band.lo]  # (rows, band units): the block of each unit
            dst = span.first[owner][None, :] + blocks * span.stride[owner][None, :] + span.within[u0:u1][None, :]
            if batch.skips and (blocks == -1).any():
                keep = (blocks != -1).ravel()
                src = np.flatnonzero(keep)
                parts += [dst.ravel()[keep], src]
                shapes.append((int(keep.sum()), int(src.size)))
            else:
                parts.append(dst.ravel())
                shapes.append((rows * (u1 - u0),))
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        host = self._host_slot()
        host.view(torch.int64).numpy()[:flat.size] = flat
        self.stream.copy(self.index.data_ptr(), host.data_ptr(), flat.size * 8)
        self._host_busy[(self._next_host - 1) % INDEX_SLOTS] = self.stream.record()  # the upload read it
        out: list[tuple[torch.Tensor, ...]] = []
        pos = 0
        for shape in shapes:
            views = []
            for n in shape:
                views.append(self.index[pos:pos + n])
                pos += n
            out.append(tuple(views))
        return out

    def _host_slot(self) -> torch.Tensor:
        i = self._next_host
        self._next_host = (i + 1) % INDEX_SLOTS
        busy, self._host_busy[i] = self._host_busy[i], None
        if busy is not None:
            if not busy.query():
                busy.synchronize()  # INDEX_SLOTS uploads still queued: the copies are far behind
            self.stream.recycle(busy)
        return self._host_index[i]

    def _stage_units(self, rows: int, band: Band, second_half: bool = False) -> torch.Tensor:
        span = self.span
        assert span is not None
        base = rows * band.start + (self.rows_per_chunk * self.page if second_half else 0)
        region = self.staging[base:base + rows * band.width]
        return region.view(span.dtype).view(-1, span.view.shape[1])

    def _gather(self, batch: Batch, chunk: Chunk, index: tuple[torch.Tensor, ...]) -> None:
        rows = chunk.order.size
        if self.span is None:
            stage = self.staging[:rows * self.page].view(rows, self.page)
            ids = batch.ids[chunk.order][:, batch.seg_group]
            for s, seg in enumerate(self.segments):
                a, n = int(self.seg_start[s]), int(self.seg_len[s])
                idx = torch.from_numpy(np.ascontiguousarray(ids[:, s])).to(self.device, non_blocking=True)
                stage[:, a:a + n] = seg.index_select(0, idx)
            return
        torch.index_select(self.span.view, 0, index[0], out=self._stage_units(rows, self.save_band))

    def _scatter(self, batch: Batch, chunk: Chunk, band: Band, index: tuple[torch.Tensor, ...]) -> None:
        rows = chunk.order.size
        if self.span is None:
            region = self.staging[rows * band.start:rows * band.end].view(rows, band.width)
            ids = batch.ids[chunk.order][:, batch.seg_group]
            for s in range(band.lo, band.hi):
                a = int(self.seg_start[s]) - band.start
                n = int(self.seg_len[s])
                keep = np.flatnonzero(ids[:, s] != -1)
                if not keep.size:
                    continue
                src = region[:, a:a + n]
                if keep.size != rows:
                    src = src[torch.from_numpy(keep).to(self.device, non_blocking=True)]
                idx = torch.from_numpy(np.ascontiguousarray(ids[keep, s])).to(self.device, non_blocking=True)
                self.segments[s].index_copy_(0, idx, src)
            return
        stage = self._stage_units(rows, band)
        if len(index) == 1:
            self.span.view.index_copy_(0, index[0], stage)
            return
        dst, src = index
        if not dst.numel():
            return
        kept = self._stage_units(rows, band, second_half=True)[:src.numel()]
        torch.index_select(stage, 0, src, out=kept)
        self.span.view.index_copy_(0, dst, kept)

    def _dma_out(self, chunk: Chunk, pool_ptr: int, slot: _Slot | None, completions: list[Event]) -> int:
        stage = self.staging.data_ptr()
        moved = 0
        if slot is None:
            for r in chunk.runs:
                a = r.part[0] if r.part else 0
                self.stream.copy(pool_ptr + r.pool_off + a, stage + r.row * self.page + a, self._run_bytes(r))
                moved += self._run_bytes(r)
            return moved
        assert self.bounce is not None
        runs = chunk.runs
        for r in runs:
            a = r.part[0] if r.part else 0
            self.stream.copy(slot.ptr + r.row * self.page + a, stage + r.row * self.page + a, self._run_bytes(r))
            moved += self._run_bytes(r)
        page = self.page

        def out() -> None:
            for r in runs:
                a = r.part[0] if r.part else 0
                ctypes.memmove(pool_ptr + r.pool_off + a, slot.ptr + r.row * page + a, self._run_bytes(r))

        done = self.bounce.finisher.after(self.stream.record(), out)
        slot.busy = done
        self.bounce.counted(len(runs))
        completions.append(done)
        return moved

    def _fill_bounce(self, chunk: Chunk, pool_ptr: int, slot: _Slot) -> None:
        """A load through ``slot``: the chunk's runs are copied there on the host first, at
        the rows the staging will hold them (so the DMAs read the slot with pool pitches)."""
        assert self.bounce is not None
        for r in chunk.runs:
            a = r.part[0] if r.part else 0
            ctypes.memmove(slot.ptr + r.row * self.page + a, pool_ptr + r.pool_off + a, self._run_bytes(r))
        self.bounce.counted(len(chunk.runs))

    def _dma_in(self, chunk: Chunk, rows: int, band: Band, pool_ptr: int, slot: _Slot | None) -> int:
        """The band's bytes of every run into the band's region of the staging (rows of
        ``band.width``), one strided copy per run."""
        region = self.staging.data_ptr() + rows * band.start
        moved = 0
        for r in chunk.runs:
            src = (slot.ptr + r.row * self.page) if slot is not None else (pool_ptr + r.pool_off)
            if r.part is None:
                self.stream.copy2d(region + r.row * band.width, band.width, src + band.start, self.page,
                                   band.width, r.pages)
                moved += r.pages * band.width
                continue
            lo, hi = max(r.part[0], band.start), min(r.part[1], band.end)
            if lo < hi:  # the part of a straddling page inside this band
                self.stream.copy(region + r.row * band.width + lo - band.start, src + lo, hi - lo)
                moved += hi - lo
        return moved

    def close(self) -> None:
        if self.bounce is not None:
            self.bounce.close()
