"""TinyLFU admission: decide whether a new block is worth the block it would evict.

Shared, unchanged, by the node's eviction path and by ``pegaflow replay``; a what-if in
replay is only meaningful because it runs this very code.

Structure (Einziger, Friedman, Manes: "TinyLFU: A Highly Efficient Cache Admission Policy"):

- a **count-min sketch** of ``depth`` rows of 4-bit saturating counters (0..15), two per
  byte, in one numpy ``uint8`` table;
- a **doorkeeper**: a Bloom filter in front of the sketch. The first access of a key in a
  sample period only sets its doorkeeper bits; later accesses increment the sketch. One-hit
  wonders (the bulk of a scan) therefore never touch the sketch and cannot inflate the
  counts of the keys they collide with;
- **aging**: after ``sample_size`` recorded accesses every counter is halved and the
  doorkeeper cleared, so the sketch follows a changing working set; the sample count is
  halved too, so later periods are ``sample_size / 2`` accesses long.

Contracts a caller may rely on:

- ``estimate(k)`` = min over rows of k's counters + 1 if k is in the doorkeeper, so at most 16.
- Never under-counts: between agings and below saturation, ``estimate(k) >= accesses(k)``.
- Over-counts by at most ``epsilon * N + 1`` with probability ``>= 1 - exp(-depth)`` per key,
  where N is the number of sketch increments since the last aging and ``epsilon = e / width``
  (the usual count-min bound; the ``+ 1`` is a doorkeeper false positive).
- ``record_many(keys)`` equals ``for k in keys: record(k)`` (aging happens at the same
  access), except that on the vectorised path (batches of 4096 keys or more) a doorkeeper false positive *between two keys of the same batch*
  is not seen: both keys count as first accesses. This is rare, and the estimate is then
  one lower than the scalar path's but still never below the true count.
- Keys are ints of any size, taken mod 2**64 (the block index passes 64-bit keys cut from
  16-byte block hashes, whose low bits are as random as any). Scalar calls take Python
  ints; batch calls also take integer ndarrays (uint64 arrays cost nothing to convert).
  No salted hash is involved, so decisions are identical across processes and runs.

Performance: the per-key paths (``record``, ``estimate``, ``admit`` and ``record_many``
below 4096 keys) run in C (``pegaflow/native/sketch.c``, built by the install as
``pegaflow.core._sketch``) on the same two buffers: tens of ns a key, exactly the scalar
semantics (so a request's ~30 keys cost less than numpy's fixed cost per call). They are
the only per-key implementation (~200 ns a call from Python against ~1.5 µs for the Python
reference, measured here; docs/architecture.md, "One source of
truth"); its pure-Python reference lives in ``tests/oracles/tinylfu_scalar.py``, which the
tests hold the C code equal to. Larger batches and
``estimate_many``, ``admit_many``, ``admit_in_order`` are numpy-vectorised (with the
in-batch doorkeeper exception above). In Python (the reference) a scalar call is a few dozen bytecodes
(~1.5 µs here), and it touches the table through a ``bytearray`` that shares memory with
the numpy view, because indexing a ``bytearray`` is several times faster than indexing an
ndarray.

Not done (as in Caffeine's simple mode): no random admission of warm candidates against
hash-flooding adversaries; block hashes are not attacker-chosen here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from pegaflow.core._sketch import Sketch as _Sketch  # built by the install from pegaflow/native/sketch.c

# Counters per sketch row for each cache entry: with width = 4 x capacity and the default
# sample of 10 x capacity accesses, the mean collision noise per counter stays below 2.5
# before aging; the table costs depth * 4 / 2 = 8 bytes per entry at depth 4 (as Caffeine).
COUNTERS_PER_ENTRY = 4
# Doorkeeper bits per sampled access (rounded up to a power of two). With the two probes
# the code uses, the false-positive rate stays ~5% even when every sampled access is
# distinct (a pure scan); a third probe would cost more bytecodes than it saves.
DOORKEEPER_BITS_PER_SAMPLE = 8
# Narrowest row; below this the count-min error bound becomes useless.
MIN_WIDTH = 64
COUNTER_MAX = 15
# record_many is record per key, in C, below this many keys (~20 ns a key);
# from here on it takes the vectorised path, whose in-batch doorkeeper approximation is
# part of the contract above.
_NATIVE_BELOW = 4096
# record_many works in chunks of at most 2**20 keys so that a key's position in its chunk
# fits the 20 low bits of the sort tag used to find first occurrences.
_POS_BITS = 20
_MAX_CHUNK = 1 << _POS_BITS
_POS_MASK = _MAX_CHUNK - 1
_KEY_TAG_MASK = ((1 << 64) - 1) ^ _POS_MASK

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
# A two-round multiply-xorshift finaliser (the shape of splitmix64): sequential ints
# (tests, synthetic traces) spread as well as real block hashes, at half fmix64's cost.
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B97F4A7C15


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def reduce_keys(keys: Sequence[int] | np.ndarray) -> np.ndarray:
    """Every key mod 2**64 as a uint64 array: the batch twin of ``key & (2**64 - 1)``.

    An integer ndarray is reinterpreted without a copy where possible; a list of ints that
    fit in 64 bits is converted in C; only wider ints (16-byte block hashes) cost a Python
    call per key. Callers that keep keys as uint64 arrays pay nothing here.
    """
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64:
            return keys
        if keys.dtype.kind in "iu":
            return keys.astype(np.int64, copy=False).view(np.uint64)
        raise TypeError(f"keys must be integers, got dtype {keys.dtype}")
    try:
        return np.array(keys, dtype=np.uint64)
    except OverflowError:
        return np.fromiter(map(_M64.__and__, keys), dtype=np.uint64, count=len(keys))


class TinyLFU:
    """Frequency sketch + doorkeeper that answers "is the candidate more popular than the victim?".

    ``capacity`` is the number of entries the guarded cache holds; it sizes the sketch
    (``width = next_pow2(4 * capacity)`` counters per row) and the sample period
    (``sample_size = sample_factor * capacity`` accesses between agings). ``seed`` selects
    an independent hash family (same seed, same decisions).

    Thread-safety: none; the owner serialises calls (the node calls it under its index lock).
    """

    __slots__ = (
        "capacity",
        "depth",
        "width",
        "sample_size",
        "doorkeeper_bits",
        "admitted",
        "rejected",
        "agings",
        "table",
        "door",
        "_samples",
        "_seed_mix",
        "_wmask",
        "_dmask",
        "_door_step0",
        "_use_doorkeeper",
        "_buf",
        "_dbuf",
        "_row_base_bytes",
        "_row_base_nibbles",
        "_row_steps",
        "_nib_u32",
        "_core",
    )

    def __init__(
        self,
        capacity: int,
        *,
        sample_factor: int = 10,
        depth: int = 4,
        seed: int = 0,
        doorkeeper: bool = True,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        if sample_factor <= 0:
            raise ValueError(f"sample_factor must be > 0, got {sample_factor}")
        if not 1 <= depth <= 16:
            raise ValueError(f"depth must be in 1..16, got {depth}")
        self.capacity = int(capacity)
        self.depth = int(depth)
        self.width = max(MIN_WIDTH, _next_pow2(COUNTERS_PER_ENTRY * self.capacity))
        self.sample_size = int(sample_factor) * self.capacity
        self.doorkeeper_bits = max(64, _next_pow2(DOORKEEPER_BITS_PER_SAMPLE * self.sample_size))
        self.admitted = 0
        self.rejected = 0
        self.agings = 0
        self._samples = 0
        self._seed_mix = (int(seed) * _GOLDEN) & _M64
        self._wmask = self.width - 1
        self._dmask = self.doorkeeper_bits - 1
        self._use_doorkeeper = bool(doorkeeper)
        # Row i holds nibbles [i * width, (i + 1) * width); nibble j is byte j >> 1, low half
        # when j is even. Key k uses nibble (h1 + i * h2) mod width of row i (double hashing,
        # Kirsch-Mitzenmacher) and doorkeeper bits h1 + depth * h2 and h1 + (depth + 1) * h2.
        # The bytearray and the ndarray are two views of the same memory.
        self._buf = bytearray(self.depth * self.width // 2)
        self.table = np.frombuffer(self._buf, dtype=np.uint8)
        self._dbuf = bytearray(self.doorkeeper_bits // 8)
        self.door = np.frombuffer(self._dbuf, dtype=np.uint8)
        self._door_step0 = self.depth
        self._row_base_bytes = tuple(i * (self.width // 2) for i in range(self.depth))
        self._row_base_nibbles = (np.arange(self.depth, dtype=np.int64) * self.width)[:, None]
        self._row_steps = np.arange(self.depth, dtype=np.int64)[:, None]
        self._nib_u32 = self.depth * self.width <= (1 << 32)
        # The per-key paths in C on the same two buffers, when the extension is built.
        self._core = _Sketch(
            self._buf,
            self._dbuf,
            self.depth,
            self.width,
            self.doorkeeper_bits,
            self._door_step0,
            self._seed_mix,
            self.sample_size,
            self._use_doorkeeper,
        )

    # --- properties ---------------------------------------------------------------------

    @property
    def epsilon(self) -> float:
        """Count-min error factor: over-count <= epsilon * N w.p. >= 1 - exp(-depth)."""
        return math.e / self.width

    @property
    def samples(self) -> int:
        """Accesses recorded since the last aging (after an aging: half the sample size)."""
        return self._samples

    @property
    def nbytes(self) -> int:
        """Memory held by the sketch and the doorkeeper."""
        return len(self._buf) + len(self._dbuf)

    # --- per-key path: C (pegaflow/native/sketch.c) -------------------------------------

    def record(self, key: int) -> None:
        """Count one access of ``key``; ages the sketch when the sample period is full."""
        self._samples, aged = self._core.record(key, self._samples)
        self.agings += aged

    def estimate(self, key: int) -> int:
        """Estimated accesses of ``key`` in the current sample period (0..16, never low)."""
        return self._core.estimate(key)

    def record_unseen(self, keys: Iterable[int]) -> None:
        """Record one access of each key the sketch has not seen (estimate 0): a block stored
        without a request for it first (a saved decode block, the block of a prompt's last
        token) gets the sighting a lookup would have given it, as the original counts an
        insert; without it, it lost every admission to any victim, however cold."""
        est, rec = self._core.estimate, self._core.record
        for k in keys:
            if not est(k):
                self._samples, aged = rec(k, self._samples)
                self.agings += aged

    def admit(self, candidate: int, victim: int) -> bool:
        """True iff ``candidate``'s estimated frequency is strictly greater than ``victim``'s.

        Ties reject: replacing an equally popular resident only costs a write. The caller
        records the candidate's access (``record``) before asking, as TinyLFU prescribes.
        """
        if self._core.admit(candidate, victim):
            self.admitted += 1
            return True
        self.rejected += 1
        return False

    # --- batch path ---------------------------------------------------------------------

    def _split(self, keys: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(h1, h2) as int64 arrays: the batch twin of the scalar mixing above."""
        x = reduce_keys(keys) ^ np.uint64(self._seed_mix)
        x *= np.uint64(_C1)
        x ^= x >> np.uint64(29)
        x *= np.uint64(_C2)
        x ^= x >> np.uint64(32)
        h1 = (x >> np.uint64(32)).view(np.int64)
        h2 = ((x & np.uint64(_M32)) | np.uint64(1)).view(np.int64)
        return h1, h2

    def _nibbles(self, h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
        """Flat nibble index of each key's counter in each row, shape (depth, n), int64."""
        # Annotated: numpy types the result of indexing as Any.
        nib: np.ndarray = self._row_base_nibbles + (
            (h1[None, :] + self._row_steps * h2[None, :]) & self._wmask
        )
        return nib

    def _door_positions(self, h1: np.ndarray, h2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = (h1 + self._door_step0 * h2) & self._dmask
        return p, (p + h2) & self._dmask

    def _door_test(self, p: np.ndarray, q: np.ndarray) -> np.ndarray:
        door = self.door
        both: np.ndarray = (
            (door[p >> 3] >> (p & 7).astype(np.uint8)) & (door[q >> 3] >> (q & 7).astype(np.uint8)) & 1
        )
        return both.view(np.bool_)

    def _estimate_split(self, h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
        nib = self._nibbles(h1, h2)
        vals = (self.table[nib >> 1] >> ((nib & 1) << 2).astype(np.uint8)) & 15
        est: np.ndarray = vals.min(axis=0).astype(np.int64)  # annotated: numpy's indexing is Any
        if self._use_doorkeeper:
            est += self._door_test(*self._door_positions(h1, h2))
        return est

    def estimate_many(self, keys: Sequence[int] | np.ndarray) -> np.ndarray:
        """``estimate`` for every key, as an int64 array (vectorised)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.int64)
        return self._estimate_split(*self._split(keys))

    def admit_many(
        self, candidates: Sequence[int] | np.ndarray, victims: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """``admit(c, v)`` for each pair, as a bool array; updates ``admitted``/``rejected``.

        Every pair is judged against the same sketch state and each victim is compared with
        its own candidate only; for an eviction queue use :meth:`admit_in_order`.
        """
        if len(candidates) != len(victims):
            raise ValueError(f"{len(candidates)} candidates but {len(victims)} victims")
        out = self.estimate_many(candidates) > self.estimate_many(victims)
        n_in = int(out.sum())
        self.admitted += n_in
        self.rejected += len(out) - n_in
        return out

    def admit_in_order(
        self, candidates: Sequence[int] | np.ndarray, victims: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """Admission of ``candidates`` (in order) against an eviction queue (next victim first).

        Candidate i meets the first victim not yet evicted; if admitted it evicts that victim
        (the next candidate meets the next victim), if rejected the victim stays. This is the
        sequential LRU + TinyLFU rule for one request's misses in a full cache, decided with
        two vectorised estimate calls. ``victims`` must hold at least as many entries as
        could be evicted (``len(candidates)`` is always enough); returns one bool per
        candidate and updates ``admitted``/``rejected``.
        """
        n = len(candidates)
        out = np.zeros(n, dtype=bool)
        if n == 0:
            return out
        ce = self.estimate_many(candidates).tolist()
        ve = self.estimate_many(victims[:n]).tolist()
        nv = len(ve)
        taken: list[int] = []
        j = 0
        for i, c in enumerate(ce):
            if j < nv and c > ve[j]:
                taken.append(i)
                j += 1
        out[taken] = True
        self.admitted += j
        self.rejected += n - j
        return out

    def record_many(self, keys: Sequence[int] | np.ndarray) -> None:
        """Count one access per element of ``keys`` (repeats count repeatedly), vectorised."""
        n = len(keys)
        if n < _NATIVE_BELOW:
            if isinstance(keys, np.ndarray):
                keys = np.ascontiguousarray(reduce_keys(keys))
            self._samples, aged = self._core.record_many(keys, self._samples)
            self.agings += aged
            return
        h1, h2 = self._split(keys)
        start = 0
        while start < n:
            end = min(n, start + self.sample_size - self._samples, start + _MAX_CHUNK)
            self._record_split(h1[start:end], h2[start:end])
            self._samples += end - start
            if self._samples >= self.sample_size:
                self.age()
            start = end

    def _record_split(self, h1: np.ndarray, h2: np.ndarray) -> None:
        if self._use_doorkeeper:
            p, q = self._door_positions(h1, h2)
            absent = ~self._door_test(p, q)
            if absent.any():
                # The first occurrence of each absent key goes to the doorkeeper; repeats
                # inside the batch and keys already present go to the sketch. One sort of
                # (44 key bits | 20 position bits) finds first occurrences without argsort;
                # two keys equal in those 44 bits count as one (a doorkeeper false positive).
                idx = np.flatnonzero(absent)
                tagged = ((h1[idx] << 32) | h2[idx]).view(np.uint64) & np.uint64(_KEY_TAG_MASK)
                tagged |= idx.view(np.uint64)
                tagged.sort()
                tag = tagged & np.uint64(_KEY_TAG_MASK)
                is_first = np.empty(len(tag), dtype=bool)
                is_first[0] = True
                np.not_equal(tag[1:], tag[:-1], out=is_first[1:])
                to_door = (tagged[is_first] & np.uint64(_POS_MASK)).view(np.int64)
                for pos in (p[to_door], q[to_door]):
                    np.bitwise_or.at(
                        self.door, pos >> 3, np.left_shift(np.uint8(1), (pos & 7).astype(np.uint8))
                    )
                keep = np.ones(len(h1), dtype=bool)
                keep[to_door] = False
                h1 = h1[keep]
                h2 = h2[keep]
                if len(h1) == 0:
                    return
        nib = self._nibbles(h1, h2).ravel()
        if self._nib_u32:
            nib = nib.astype(np.uint32)  # sorts twice as fast as int64
        nib, counts = np.unique(nib, return_counts=True)
        nib = nib.astype(np.int64, copy=False)
        byte = nib >> 1
        high = (nib & 1).astype(bool)
        table = self.table
        # Two passes, low nibbles then high ones: inside a pass every byte occurs once,
        # so the fancy-indexed read-modify-write cannot lose an update.
        for sel, shift in ((~high, 0), (high, 4)):
            b = byte[sel]
            if len(b) == 0:
                continue
            old = table[b]
            cur = ((old >> shift) & 15).astype(np.int64)
            new = np.minimum(cur + counts[sel], COUNTER_MAX).astype(np.uint8)
            table[b] = (old & np.uint8(~(15 << shift) & 0xFF)) | (new << np.uint8(shift))

    # --- aging ----------------------------------------------------------------------------

    def age(self) -> None:
        """Halve every counter, clear the doorkeeper and halve the sample count."""
        t = self.table
        # A byte holds two nibbles; shifting the byte right moves the high nibble's low bit
        # into the low nibble's top bit, which the 0x77 mask clears.
        np.right_shift(t, 1, out=t)
        np.bitwise_and(t, 0x77, out=t)
        self.door.fill(0)
        self._samples //= 2
        self.agings += 1

    def clear(self) -> None:
        """Forget everything (counters, doorkeeper, sample count); keeps admitted/rejected."""
        self.table.fill(0)
        self.door.fill(0)
        self._samples = 0
