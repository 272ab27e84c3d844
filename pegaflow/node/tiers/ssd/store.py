"""The SSD tier's in-memory index and allocator over its cache files, and recovery by scan.

Each cache file (opened by :mod:`files`, laid out as :mod:`records` says) is a circular
log of segments. The allocator appends each record to the open segment of the file with
the fewest bytes written (striping); when a file's log wraps, its oldest segment is
reclaimed whole and its blocks leave the index (FIFO eviction; :mod:`records` says why a
log). A segment is opened with a new *generation* each time, which all its records carry.
After any restart the index is rebuilt from the record headers (:meth:`SsdIndex.scan`).

Resets are durable: :meth:`SsdIndex.tombstone` writes a reset record for the namespace into
every file, and a scan ignores every record of that namespace with a smaller sequence
number.

Contracts:
- A record is in the index only after its write completed; an entry names the exact
  (generation, sequence) it expects to find, and every read verifies the header and
  the payload checksum. A torn, overwritten or flipped page is therefore a miss, never
  wrong bytes.
- The index and the allocator are used from the node's event loop only (not thread-safe).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog

from pegaflow.node.tiers.ssd.records import (
    BLOCK,
    TOMBSTONE,
    Header,
    aligned_buffer,
    pack_header,
    record_bytes,
    unpack_header,
)

log = structlog.get_logger("pegaflow.ssd")

SCAN_THREADS = 32  # parallel header reads at start-up (one chain per segment; I/O-bound)
SCAN_WINDOW = 256 << 10  # start-up reads of small records: many headers per I/O
_ZERO_BLOCK = bytes(BLOCK)


# ---- the logs' state ------------------------------------------------------------------
@dataclass(eq=False)
class Segment:
    """One segment of one file. ``gen`` 0 = free. Keys are those whose entry lives here."""

    file: int
    index: int
    start: int  # byte offset in the file
    gen: int = 0
    fill: int = 0  # bytes used from ``start``
    keys: set[tuple[int, bytes]] = field(default_factory=set)


@dataclass(eq=False)
class CacheFile:
    """One open, locked cache file (:func:`files.open_files`) and its log's state."""

    path: str
    fd: int
    file_bytes: int
    segment_bytes: int
    segments: list[Segment]
    cursor: int = -1  # index of the open segment (-1: none yet)
    bytes_written: int = 0
    created: bool = False  # made by this start (not there before): a start that fails removes it
    made_dirs: tuple[str, ...] = ()  # directories this start made for it, outermost first


# ---- the index ------------------------------------------------------------------------
@dataclass(slots=True, eq=False)
class Entry:
    """Where one block's record lives. Immutable once in the index."""

    file: int
    segment: int
    offset: int  # record start in the file
    gen: int
    seq: int
    ns_name: str
    payload_len: int

    @property
    def size(self) -> int:
        return record_bytes(self.payload_len)


@dataclass(slots=True, eq=False)
class Slot:
    """Space handed out for one record that is being written."""

    file: int
    segment: int
    offset: int
    gen: int
    seq: int


class SsdIndex:
    """Which blocks are on SSD and where; allocates record space and reclaims segments.

    Keys are ``(namespace id, hash)`` with the L1 :class:`BlockIndex`'s namespace ids;
    ``ns_id(name, page_bytes)`` maps a namespace name found on disk to its id.
    """

    def __init__(self, files: list[CacheFile], ns_id: Callable[[str, int], int | None]) -> None:
        self.files = files
        self.ns_id = ns_id
        self.entries: dict[tuple[int, bytes], Entry] = {}
        self.per_namespace: collections.Counter[int] = collections.Counter()  # namespace id -> entries
        self.capacity = sum(len(f.segments) * f.segment_bytes for f in files)
        self.used_bytes = 0  # record bytes of indexed entries
        self.evicted_blocks = 0
        self.max_record = min(f.segment_bytes for f in files)
        self._gen = time.time_ns()
        self._seq = 0

    # ---- recovery ---------------------------------------------------------------------
    def scan(self) -> int:
        """Rebuild the index from the record headers on disk; returns blocks found.

        Each segment is walked from its start while headers are valid and carry the
        generation of the segment's first record. Payloads are not read here: they are
        verified on every read instead (a torn last record is found then and dropped).
        """
        t0 = time.perf_counter()
        jobs = [(f, s) for f in self.files for s in f.segments]
        with ThreadPoolExecutor(SCAN_THREADS) as ex:
            chains = list(ex.map(lambda fs: _walk(fs[0], fs[1]), jobs))
        max_gen = max_seq = 0
        newest: list[tuple[int, int]] = [(0, -1)] * len(self.files)
        reset_at: dict[str, int] = {}  # namespace -> sequence of its newest reset record
        for chain in chains:
            for _off, h in chain:
                if h.is_reset and h.seq > reset_at.get(h.ns_name, 0):
                    reset_at[h.ns_name] = h.seq
        voided = 0
        for (_f, seg), chain in zip(jobs, chains, strict=True):
            if not chain:
                continue
            seg.gen = chain[0][1].gen
            max_gen = max(max_gen, seg.gen)
            if seg.gen > newest[seg.file][0]:
                newest[seg.file] = (seg.gen, seg.index)
            for off, h in chain:
                max_seq = max(max_seq, h.seq)
                seg.fill = off + record_bytes(h.payload_len) - seg.start
                if h.is_reset or h.seq < reset_at.get(h.ns_name, 0):
                    voided += not h.is_reset
                    continue
                nid = self.ns_id(h.ns_name, h.payload_len)
                if nid is None:
                    continue
                key = (nid, h.hash)
                old = self.entries.get(key)
                if old is not None:
                    if old.seq > h.seq:
                        continue
                    self._forget(key, old)
                e = Entry(seg.file, seg.index, off, h.gen, h.seq, h.ns_name, h.payload_len)
                self.entries[key] = e
                self.per_namespace[nid] += 1
                seg.keys.add(key)
                self.used_bytes += e.size
        found = len(self.entries)
        for f, (_g, idx) in zip(self.files, newest, strict=True):
            # Records of one generation come from one process lifetime: the next record
            # opens the segment after the newest one rather than appending after a tail
            # that may hold torn records of the crashed run.
            f.cursor = idx
            if idx >= 0:
                f.segments[idx].fill = f.segment_bytes
        self._gen = max(self._gen, max_gen + 1)
        self._seq = max_seq
        log.info("ssd_scan_done", blocks=found, used_bytes=self.used_bytes, capacity=self.capacity,
                 voided_by_reset=voided, seconds=round(time.perf_counter() - t0, 3))
        return found

    # ---- lookups ----------------------------------------------------------------------
    def get(self, key: tuple[int, bytes]) -> Entry | None:
        return self.entries.get(key)

    def age(self, e: Entry) -> float:
        """0.0 = newest segment of its file, ~1.0 = next to be reclaimed."""
        f = self.files[e.file]
        n = len(f.segments)
        return ((f.cursor - e.segment) % n) / n

    # ---- writes -----------------------------------------------------------------------
    def allocate(self, payload_len: int) -> tuple[Slot, list[tuple[int, bytes]]]:
        """Space for one record, on the file with the fewest bytes written (striping).

        Returns the slot and the keys evicted to make room (their segment was reclaimed).
        Raises ValueError if the record can never fit a segment.
        """
        size = record_bytes(payload_len)
        if size > self.max_record:
            raise ValueError(f"record of {size} bytes exceeds the segment size {self.max_record}")
        return self._allocate_in(min(self.files, key=lambda x: x.bytes_written), size)

    def _allocate_in(self, f: CacheFile, size: int, fresh: bool = False) -> tuple[Slot, list[tuple[int, bytes]]]:
        evicted: list[tuple[int, bytes]] = []
        seg = f.segments[f.cursor] if f.cursor >= 0 else None
        if fresh or seg is None or seg.gen == 0 or seg.fill + size > f.segment_bytes:
            f.cursor = (f.cursor + 1) % len(f.segments)
            seg = f.segments[f.cursor]
            evicted = self._reclaim(seg)
            seg.gen = self._gen
            self._gen += 1
        off = seg.start + seg.fill
        seg.fill += size
        f.bytes_written += size
        self._seq += 1
        return Slot(seg.file, seg.index, off, seg.gen, self._seq), evicted

    def tombstone(self, ns_name: str, fresh_segment: bool = False) -> list[tuple[int, bytes]]:
        """Make a reset of ``ns_name`` durable: a reset record in every file, written and
        ``fdatasync``-ed before this returns (a few ms on the event loop; resets are rare).
        Returns the keys whose segments were reclaimed for it. Raises ``OSError``.

        ``fresh_segment``: writes are in flight. Each record then opens a segment of its own,
        as its first record. Behind a slot whose write never lands (the node dies first) a
        scan may not reach it: that slot holds zeros where the file was never written, which
        a scan reads as the end of the segment (:func:`_walk`), and the reset would be lost.
        The cost: the rest of each file's open segment is left unused until the log wraps."""
        evicted: list[tuple[int, bytes]] = []
        buf = aligned_buffer(BLOCK)
        for f in self.files:
            slot, ev = self._allocate_in(f, record_bytes(0), fresh=fresh_segment)
            evicted += ev
            buf[:] = bytes(BLOCK)
            pack_header(buf, slot.gen, slot.seq, ns_name.encode(), TOMBSTONE, 0, 0)
            os.pwritev(f.fd, [buf], slot.offset)
            os.fdatasync(f.fd)
        return evicted

    def add(self, key: tuple[int, bytes], slot: Slot, ns_name: str, payload_len: int) -> bool:
        """Index a record whose write completed. False if its segment was reclaimed meanwhile."""
        seg = self.files[slot.file].segments[slot.segment]
        if seg.gen != slot.gen:
            return False
        old = self.entries.get(key)
        if old is not None:
            self._forget(key, old)
        e = Entry(slot.file, slot.segment, slot.offset, slot.gen, slot.seq, ns_name, payload_len)
        self.entries[key] = e
        self.per_namespace[key[0]] += 1
        seg.keys.add(key)
        self.used_bytes += e.size
        return True

    def remove(self, key: tuple[int, bytes]) -> None:
        e = self.entries.get(key)
        if e is not None:
            self._forget(key, e)

    def holds_namespace(self, ns_id: int) -> bool:
        return self.per_namespace[ns_id] > 0

    def _uncount(self, ns_id: int) -> None:
        n = self.per_namespace[ns_id] - 1
        if n > 0:
            self.per_namespace[ns_id] = n
        else:
            del self.per_namespace[ns_id]

    def _forget(self, key: tuple[int, bytes], e: Entry) -> None:
        del self.entries[key]
        self._uncount(key[0])
        self.files[e.file].segments[e.segment].keys.discard(key)
        self.used_bytes -= e.size

    def _reclaim(self, seg: Segment) -> list[tuple[int, bytes]]:
        keys = list(seg.keys)
        for k in keys:
            e = self.entries.get(k)
            if e is not None:
                del self.entries[k]
                self._uncount(k[0])
                self.used_bytes -= e.size
        self.evicted_blocks += len(keys)
        seg.keys.clear()
        seg.fill = 0
        seg.gen = 0
        return keys

    def close(self) -> None:
        for f in self.files:
            try:
                os.close(f.fd)
            except OSError:
                pass


def _walk(f: CacheFile, seg: Segment) -> list[tuple[int, Header]]:
    """Valid records of one segment in order (see :meth:`SsdIndex.scan`).

    Small records are scanned through ``SCAN_WINDOW`` reads (many headers per I/O);
    large ones with one 4 KiB read per header, so start-up never reads the payloads.

    A header that is not valid where the previous record ends (a damaged sector, a torn
    write, a write that never landed) does not end the segment: the walk resynchronises at
    the next 4 KiB block that holds a valid header (records are 4 KiB aligned). One of the
    segment's generation resumes the chain, so a damaged record loses only itself. One of
    an older generation is the stale content of the segment's previous use (its tail, or a
    slot of this use whose write never landed): skipped like a damaged one, so a record
    written behind such a slot (a reset record) is still found. One of a newer generation
    than the chain's means the chain so far was the previous use's records (this use's
    first writes never landed): the chain starts again from it. The segment's end ends
    the walk.
    The segment's first record is no exception: only a first block of zeros (never
    written) ends the walk at once; a damaged first header makes the first valid header
    found the start of the chain.
    Cost: at most the rest of the segment, read in ``SCAN_WINDOW`` chunks, and only where
    the chain broke (a full segment's tail is shorter than one record).
    """
    out: list[tuple[int, Header]] = []
    buf = aligned_buffer(SCAN_WINDOW)
    mv = memoryview(buf)
    pos = 0
    win_start, win_len = 0, 0
    gen = None
    last_size = 0
    resyncing = False
    while pos + BLOCK <= f.segment_bytes:
        if not (win_start <= pos and pos + BLOCK <= win_start + win_len):
            big = last_size > SCAN_WINDOW // 4 and not resyncing
            want = BLOCK if big else min(SCAN_WINDOW, f.segment_bytes - pos)
            try:
                n = os.preadv(f.fd, [mv[:want]], seg.start + pos)
            except OSError:
                break
            win_start, win_len = pos, n
            if n < BLOCK:
                break
        block = mv[pos - win_start:pos - win_start + BLOCK]
        h = unpack_header(block)
        if h is None:
            if gen is None and not resyncing and block == _ZERO_BLOCK:
                break  # zeros at the segment's start: never written (a sparse file's holes)
            if not resyncing:
                resyncing = True
                damaged_at = pos
            pos += BLOCK
            continue
        if gen is not None and h.gen != gen:
            if h.gen < gen:  # stale: not a record of this use of the segment
                if not resyncing:
                    resyncing = True
                    damaged_at = pos
                pos += BLOCK
                continue
            out.clear()  # the previous use's records; this use's first writes never landed
        size = record_bytes(h.payload_len)
        if pos + size > f.segment_bytes:
            break
        if resyncing:
            resyncing = False
            log.warning("ssd_scan_resynced", file=f.path, segment=seg.index, damaged_offset=seg.start + damaged_at,
                        skipped_bytes=pos - damaged_at)
        gen = h.gen
        out.append((seg.start + pos, h))
        pos += size
        last_size = size
    return out
