"""The hit-rate ceiling r* = (N - U) / N over rolling windows.

N is the number of block requests in a window and U the number of distinct blocks among
them: even an infinite cache misses each distinct block once, so no cache can hit more
than (N - U) / N. Comparing r* with the measured hit rate tells an operator whether the
cache is near what the workload allows (hit rate ~ r*), far below it (more capacity,
admission or discovery would help) or whether the ceiling itself is low.

How it is kept, and why:

- U is estimated with DataSketches HyperLogLog (``HLL_4``); N and the hits are counted
  exactly. A window is a ring of ``buckets`` sub-window sketches; a read unions the buckets
  still in the window. A window therefore covers the current, partial bucket plus the
  ``buckets - 1`` before it: between ``(buckets - 1) / buckets`` of the nominal length and
  all of it.
- Each key is written to one sketch only: the current bucket of the **finest** window. Its
  content is folded (HLL union, plus the count deltas) into the coarser windows' buckets
  when the bucket rolls over, before every read, and before ``serialize``. Union is
  idempotent on HLL registers, so folding the same bucket again is harmless; counts are
  folded as deltas (``n - n_folded``), so they are never added twice. A finest bucket is
  filed under the coarser bucket that contains its start, so a coarse edge may be off by
  one finest bucket when the lengths do not divide.
- ``lg_k`` (the HLL bucket bits; the node passes its ``--metric-hll-bucket-bits``, the
  original's default 16) defaults to the largest value (at most 16) whose sketches, at
  their maximum size, all fit in ``max_bytes`` (1 MiB). The default 3 windows x 10 buckets get
  lg_k = 16: 30 x 33 KiB; relative standard error of a union 0.41%, so U is within 1% at
  ~2.4 sigma. 15 buckets would force lg_k = 15 (0.57%, 1% only at 1.7 sigma): the
  accuracy bought is worth the coarser roll-off.
- Keys are reduced with ``hash()`` before they reach the sketch. For ints ``hash()`` is
  deterministic across processes and hosts (not salted by ``PYTHONHASHSEED``), and the
  binding silently mangles ints wider than 64 bits (``2**100`` and ``2**100 + 1`` count as
  one), which 16-byte block hashes are.

Bucket indices are ``floor(t / bucket_length)`` of the ``clock``. Estimators whose
sketches are merged (``serialize`` on nodes, ``merge`` on the metaserver) must share a
clock: pass ``clock=time.time`` there; the default ``time.monotonic`` is per host.

Thread-safety: none; the owner serialises calls.
"""

from __future__ import annotations

import math
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import datasketches as ds

from pegaflow.core.durations import format_duration, parse_duration

# Only the distinct-set backend methods of CeilingEstimator touch one.
Distinct = Any  # a datasketches hll_sketch (a nanobind binding, untyped) or tests/oracles/ceiling.py's exact set
DEFAULT_WINDOWS: tuple[float, ...] = (900.0, 3600.0, 86400.0)
# Sub-window sketches per window: a window rolls off in steps of 1/10 of its length.
DEFAULT_BUCKETS = 10
# Budget for all sketches of all windows together (the bound).
MAX_BYTES = 1 << 20
# lg_k 16 is the smallest whose union error (0.41% RSE) keeps U within 1% at ~2.4 sigma;
# larger only costs memory.
MAX_LG_K = 16
MIN_LG_K = 8  # datasketches' own minimum is 4; below 8 the error exceeds 6%
_HLL_TYPE = ds.tgt_hll_type.HLL_4

_MAGIC = b"PFCE"
_VERSION = 1
_HEADER = struct.Struct("<4sBBHB")  # magic, version, lg_k, buckets, number of windows
_SLOT = struct.Struct("<qQQI")  # bucket index, n, hits, sketch length (0: empty slot)
_EMPTY = -(1 << 63)


def sketch_bytes(lg_k: int) -> int:
    """Largest size of one HLL_4 sketch of ``lg_k``, updatable or serialized."""
    return int(ds.hll_sketch.get_max_updatable_serialization_bytes(lg_k, _HLL_TYPE))


def choose_lg_k(sketches: int, max_bytes: int = MAX_BYTES) -> int:
    """Largest lg_k <= MAX_LG_K such that ``sketches`` sketches fit in ``max_bytes``."""
    for lg_k in range(MAX_LG_K, MIN_LG_K - 1, -1):
        if sketches * sketch_bytes(lg_k) <= max_bytes:
            return lg_k
    raise ValueError(f"{sketches} sketches do not fit in {max_bytes} bytes even at lg_k={MIN_LG_K}")


@dataclass(frozen=True)
class WindowStats:
    """One window's numbers at one instant, ready to export as gauges."""

    window: float  # seconds
    label: str  # "15m", "1h", ...
    requests: int  # N, exact
    hits: int  # exact
    distinct: float  # U, estimated
    ceiling: float  # r* = (N - U) / N clamped to [0, 1]; 0.0 when N = 0
    hit_rate: float  # hits / N; 0.0 when N = 0


class _Slot:
    """One bucket: requests in [index * length, (index + 1) * length)."""

    __slots__ = ("index", "distinct", "n", "hits", "n_folded", "hits_folded")

    def __init__(self) -> None:
        self.index = _EMPTY
        self.distinct: Distinct = None
        self.n = 0
        self.hits = 0
        # Finest window only: how much of n / hits is already in the coarser windows.
        self.n_folded = 0
        self.hits_folded = 0


class _Ring:
    __slots__ = ("window", "length", "slots")

    def __init__(self, window: float, buckets: int) -> None:
        self.window = window
        self.length = window / buckets
        self.slots = [_Slot() for _ in range(buckets)]

    def index_at(self, t: float) -> int:
        return math.floor(t / self.length)

    def live(self, k: int) -> list[_Slot]:
        """Slots of buckets k - buckets + 1 .. k (the window ending in bucket k)."""
        lo = k - len(self.slots)
        return [s for s in self.slots if lo < s.index <= k]


class CeilingEstimator:
    """Rolling-window r* and measured hit rate from batches of block requests.

    ``observe(keys, hits, now)`` adds one batch (a request's block keys, of which ``hits``
    were served from cache). Reads (``ceiling``, ``measured_hit_rate``, ``stats``) take a
    window by its length in seconds or its label (``"15m"``) and see every batch observed
    at a time inside it. A batch older than its finest window's ring is dropped
    (``dropped`` counts its requests). All sketches together stay within ``max_bytes``.
    """

    def __init__(
        self,
        windows: Sequence[float] = DEFAULT_WINDOWS,
        buckets: int = DEFAULT_BUCKETS,
        lg_k: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        ws = sorted(parse_duration(w) for w in windows)
        if not ws or len(set(ws)) != len(ws):
            raise ValueError(f"windows must be distinct and non-empty, got {windows!r}")
        if buckets < 1:
            raise ValueError(f"buckets must be >= 1, got {buckets}")
        n_sketches = len(ws) * buckets
        if lg_k is None:
            lg_k = choose_lg_k(n_sketches, max_bytes)
        elif not 4 <= lg_k <= 21:
            raise ValueError(f"lg_k must be in 4..21, got {lg_k}")
        elif n_sketches * sketch_bytes(lg_k) > max_bytes:
            raise ValueError(
                f"{len(ws)} windows x {buckets} buckets at lg_k={lg_k} need up to "
                f"{n_sketches * sketch_bytes(lg_k)} bytes > {max_bytes}"
            )
        self.windows: tuple[float, ...] = tuple(ws)
        self.buckets = int(buckets)
        self.lg_k = int(lg_k)
        self.clock = clock
        self.dropped = 0
        self._rings = [_Ring(w, self.buckets) for w in ws]
        self._fine = self._rings[0]  # same bucket count for all: shortest window = finest

    # --- distinct-set backend (tests/oracles/ceiling.py swaps it for exact Python sets) ----

    def _new_distinct(self) -> Distinct:
        return ds.hll_sketch(self.lg_k, _HLL_TYPE)

    def _add_keys(self, d: Distinct, keys: Sequence[int]) -> None:
        # No batch update in the binding; map + a zero-length deque runs the loop in C.
        deque(map(d.update, map(hash, keys)), maxlen=0)

    def _unite(self, parts: Sequence[Distinct]) -> Distinct:
        u = ds.hll_union(self.lg_k)
        for p in parts:
            u.update(p)
        return u

    def _union(self, parts: Sequence[Distinct]) -> Distinct:
        return self._unite(parts).get_result(_HLL_TYPE)

    def _count(self, parts: Sequence[Distinct]) -> float:
        if not parts:
            return 0.0
        if len(parts) == 1:
            return float(parts[0].get_estimate())
        # The union's own estimate, the same number as its result sketch's: building that
        # sketch (get_result, back to 4-bit buckets) was more than half of a refresh on the
        # event loop (10 buckets at 16 bucket bits: 3.3 ms with it, 1.5 ms without).
        return float(self._unite(parts).get_estimate())

    def _dump(self, d: Distinct) -> bytes:
        return bytes(d.serialize_compact())

    def _load(self, data: bytes) -> Distinct:
        """A sketch image; ValueError if datasketches cannot read it (it raises IndexError,
        RuntimeError, ... on a damaged image)."""
        try:
            return ds.hll_sketch.deserialize(data)
        except Exception as exc:  # noqa: BLE001 - the binding's errors, whatever their class
            raise ValueError(f"unreadable HLL sketch ({type(exc).__name__}: {exc})") from None

    # --- writing ----------------------------------------------------------------------------

    def observe(self, keys: Sequence[int], hits: int = 0, now: float | None = None) -> None:
        """Add a batch of block requests (keys may repeat), ``hits`` of them served from cache."""
        if not 0 <= hits <= len(keys):
            raise ValueError(f"hits must be in 0..{len(keys)}, got {hits}")
        if len(keys) == 0:
            return
        t = self.clock() if now is None else now
        slot = self._slot(self._fine, self._fine.index_at(t))
        if slot is None:
            self.dropped += len(keys)
            return
        if slot.distinct is None:
            slot.distinct = self._new_distinct()
        if hasattr(keys, "tolist"):
            keys = keys.tolist()  # numpy arrays: Python ints hash much faster than numpy scalars
        self._add_keys(slot.distinct, keys)
        slot.n += len(keys)
        slot.hits += hits

    def _slot(self, ring: _Ring, k: int) -> _Slot | None:
        """The slot for bucket k, recycled if it held an older bucket; None if k is too old."""
        s = ring.slots[k % len(ring.slots)]
        if s.index == k:
            return s
        if s.index > k:
            return None
        if ring is self._fine and s.index != _EMPTY:
            self._fold(s)
        s.index = k
        s.distinct = None
        s.n = s.hits = s.n_folded = s.hits_folded = 0
        return s

    def _fold(self, s: _Slot) -> None:
        """Copy what finest bucket ``s`` gained since its last fold into the coarser windows."""
        dn = s.n - s.n_folded
        dh = s.hits - s.hits_folded
        if dn == 0 and dh == 0:
            return
        start = s.index * self._fine.length
        for ring in self._rings[1:]:
            c = self._slot(ring, ring.index_at(start))
            if c is None:
                continue
            if s.distinct is not None:
                # Always a new object: s keeps growing and must not alias a coarse bucket.
                c.distinct = self._merge_into(c.distinct, s.distinct)
            c.n += dn
            c.hits += dh
        s.n_folded = s.n
        s.hits_folded = s.hits

    def _merge_into(self, dst: Distinct, src: Distinct) -> Distinct:
        return self._union([src] if dst is None else [dst, src])

    def _fold_all(self) -> None:
        for s in self._fine.slots:
            if s.index != _EMPTY:
                self._fold(s)

    # --- reading ----------------------------------------------------------------------------

    def _ring(self, window: float | str) -> _Ring:
        w = parse_duration(window)
        for ring in self._rings:
            if math.isclose(ring.window, w):
                return ring
        raise KeyError(f"no window {window!r}; configured: {', '.join(self.labels)}")

    @property
    def labels(self) -> tuple[str, ...]:
        """Window labels in order, e.g. ``("15m", "1h", "1d")``."""
        return tuple(format_duration(w) for w in self.windows)

    def stats(self, window: float | str, now: float | None = None) -> WindowStats:
        """All numbers of one window at ``now`` (default: the clock)."""
        t = self.clock() if now is None else now
        ring = self._ring(window)
        if ring is not self._fine:
            self._fold_all()
        live = ring.live(ring.index_at(t))
        n = sum(s.n for s in live)
        hits = sum(s.hits for s in live)
        u = self._count([s.distinct for s in live if s.distinct is not None])
        if n:
            u = min(max(u, 1.0), float(n))  # the estimate may stray past the possible range
            ceiling, rate = (n - u) / n, hits / n
        else:
            ceiling = rate = 0.0
        return WindowStats(ring.window, format_duration(ring.window), n, hits, u, ceiling, rate)

    def ceiling(self, window: float | str, now: float | None = None) -> float:
        """r* = (N - U) / N of the window, in [0, 1]; 0.0 when it saw no requests."""
        return self.stats(window, now).ceiling

    def measured_hit_rate(self, window: float | str, now: float | None = None) -> float:
        """hits / N of the window; 0.0 when it saw no requests."""
        return self.stats(window, now).hit_rate

    def snapshot(self, now: float | None = None) -> list[WindowStats]:
        """``stats`` of every window at one instant, shortest first."""
        t = self.clock() if now is None else now
        return [self.stats(w, t) for w in self.windows]

    # --- wire format and cluster union ------------------------------------------------------

    def serialize(self) -> bytes:
        """All buckets of all windows (compact sketches + exact counts); input to ``merge``."""
        self._fold_all()
        out = [_HEADER.pack(_MAGIC, _VERSION, self.lg_k, self.buckets, len(self._rings))]
        out.append(struct.pack(f"<{len(self.windows)}d", *self.windows))
        for ring in self._rings:
            for s in ring.slots:
                blob = b"" if s.distinct is None else self._dump(s.distinct)
                index = s.index if (s.n or blob) else _EMPTY
                out.append(_SLOT.pack(index, s.n, s.hits, len(blob)))
                out.append(blob)
        return b"".join(out)

    @staticmethod
    def _parse(data: bytes) -> tuple[int, int, tuple[float, ...], list[list[tuple[int, int, int, bytes]]]]:
        try:
            magic, version, lg_k, buckets, n_windows = _HEADER.unpack_from(data, 0)
            if magic != _MAGIC or version != _VERSION:
                raise ValueError(f"not a ceiling sketch (magic {magic!r}, version {version})")
            off = _HEADER.size
            windows = struct.unpack_from(f"<{n_windows}d", data, off)
            off += 8 * n_windows
            rings = []
            for _ in range(n_windows):
                slots = []
                for _ in range(buckets):
                    index, n, hits, size = _SLOT.unpack_from(data, off)
                    off += _SLOT.size
                    blob = bytes(data[off : off + size])
                    if len(blob) != size:
                        raise ValueError("truncated ceiling sketch")
                    off += size
                    slots.append((index, n, hits, blob))
                rings.append(slots)
        except struct.error as exc:
            raise ValueError(f"truncated ceiling sketch: {exc}") from None
        if off != len(data):
            raise ValueError(f"{len(data) - off} trailing bytes after ceiling sketch")
        return lg_k, buckets, tuple(windows), rings

    def merge(self, data: bytes) -> None:
        """Add another estimator's ``serialize()`` output: buckets are united by index.

        The result counts the union of both request streams: U of the union of keys, N and
        hits summed. Both sides must have the same windows, buckets, lg_k and clock. Merging
        the same bytes twice counts its N twice, so a collector (the metaserver) merges each
        node's latest snapshot into a fresh estimator rather than into a running one.
        A bucket this side has already recycled for a newer one is dropped.
        """
        lg_k, buckets, windows, rings = self._parse(data)
        if (lg_k, buckets, windows) != (self.lg_k, self.buckets, self.windows):
            raise ValueError(
                f"incompatible ceiling sketch: lg_k={lg_k} buckets={buckets} windows={windows}, "
                f"expected lg_k={self.lg_k} buckets={self.buckets} windows={self.windows}"
            )
        # Every image is read before anything is added: a damaged one leaves this side as it was.
        loaded = [[(index, n, hits, self._load(blob) if blob else None) for index, n, hits, blob in slots
                   if index != _EMPTY] for slots in rings]
        for ring, slots in zip(self._rings, loaded, strict=True):
            for index, n, hits, sketch in slots:
                s = self._slot(ring, index)
                if s is None:
                    continue
                if sketch is not None:
                    s.distinct = self._merge_into(s.distinct, sketch)
                s.n += n
                s.hits += hits
                if ring is self._fine:
                    # The sender folded this bucket into its coarser rings, merged just below.
                    s.n_folded += n
                    s.hits_folded += hits

    @classmethod
    def deserialize(cls, data: bytes, clock: Callable[[], float] = time.monotonic) -> CeilingEstimator:
        """A new estimator holding exactly the serialized state (same windows, buckets, lg_k)."""
        lg_k, buckets, windows, _ = cls._parse(data)
        est = cls(windows, buckets, lg_k, clock, max_bytes=1 << 62)
        est.merge(data)
        return est

    @classmethod
    def union_of(cls, blobs: Iterable[bytes], clock: Callable[[], float] = time.time) -> CeilingEstimator:
        """A fresh estimator holding the union of serialized ones (e.g. every node's latest).

        This is how a collector builds the cluster-wide view on each scrape: from the
        latest snapshot of each node, never by merging snapshots into a running estimator.
        """
        it = iter(blobs)
        first = next(it, None)
        if first is None:
            raise ValueError("union_of needs at least one serialized estimator")
        est = cls.deserialize(first, clock=clock)
        for blob in it:
            est.merge(blob)
        return est

    def rel_error(self, num_std_dev: int = 2) -> float:
        """Bound on the relative error of U at ``num_std_dev`` (1..3) standard deviations."""
        return abs(float(ds.hll_sketch.get_rel_err(True, True, self.lg_k, num_std_dev)))
