"""The SSD tier's on-disk layout, its in-memory index, and start-up validation and recovery.

Layout. Every ``--ssd-cache-path`` holds one cache file of ``capacity / len(paths)`` bytes,
allocated in full at creation (``posix_fallocate``), so the tier can never grow past its
capacity and never meets ENOSPC later. A file is::

    [superblock 4 KiB][segment 0][segment 1] ... [segment n-1]

and each file is an independent circular log of fixed-size *segments*. A segment is filled
front to back with *records*, one per block::

    [header 4 KiB: magic, version, generation, sequence, namespace name, block hash,
                   payload length, payload checksum (xxh3_64), header checksum]
    [payload: the page, padded to 4 KiB]

Pages go to disk straight from the L1 pool (O_DIRECT, no staging copy), which is why the
header has a 4 KiB block of its own: the payload then starts 4 KiB-aligned on disk and
in memory. Records never straddle segments.

Why a log of segments (and FIFO eviction): writes are sequential per file (the best case
for any SSD's FTL, no fragmentation, no free-space allocator), the space bound is exact,
and recovery needs no separate index file: the records describe themselves. A segment
is reclaimed whole, oldest first, when the log wraps; every record in it carries the
*generation* the segment was opened with, so a scan of a segment stops at the first
record that is torn or left over from the segment's previous use.

Resets are durable: :meth:`SsdIndex.tombstone` writes a header-only *reset record* (hash
``TOMBSTONE``, no payload) for the namespace into every file, and a scan ignores every record
of that namespace with a smaller sequence number. Each file is FIFO, so its reset record
outlives every older record of that file it voids.

Contracts:
- A record is in the index only after its write completed; an entry names the exact
  (generation, sequence) it expects to find, and every read verifies the header and
  the payload checksum. A torn, overwritten or flipped page is therefore a miss, never
  wrong bytes.
- The index and the allocator are used from the node's event loop only (not thread-safe).
- Foreign or newer files are never overwritten: :func:`open_files` raises :class:`SsdError`.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import stat
import struct
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog
import xxhash

from pegaflow.node.pool import page_checksum

log = structlog.get_logger("pegaflow.ssd")

BLOCK = 4096  # O_DIRECT unit and header size; pages are padded to it
FORMAT_VERSION = 1
SB_MAGIC = b"PEGAFLOW-SSDv1\x00\x00"  # 16 bytes; the version field says the real format
REC_MAGIC = b"PFR1"
CACHE_FILE_NAME = "pegaflow-ssd.cache"  # used when a --ssd-cache-path is a directory
MAX_SEGMENT = 64 << 20  # large enough for any KV page we expect; small enough to reclaim fast
MIN_SEGMENTS = 8  # per file: keeps FIFO reclaim granular on small caches
SCAN_THREADS = 32  # parallel header reads at start-up (one chain per segment; I/O-bound)
SCAN_WINDOW = 256 << 10  # start-up reads of small records: many headers per I/O
MAX_NAME = 1024
TOMBSTONE = b"\xff" * 16  # the block hash of a reset record (a real block hash never is all ones)

_SB = struct.Struct("<16sIIQQQ")  # magic, version, flags, file_bytes, segment_bytes, created_ns
_HDR = struct.Struct("<4sHHQQQQ16s")  # magic, version, name_len, gen, seq, payload_len, payload_csum, hash
_CSUM = struct.Struct("<Q")


class SsdError(Exception):
    """The SSD tier cannot start as configured (one line for the operator)."""


def round_up(n: int, a: int = BLOCK) -> int:
    return (n + a - 1) // a * a


def record_bytes(payload_len: int) -> int:
    """Bytes a record of this payload occupies on disk (header block + padded payload)."""
    return BLOCK + round_up(payload_len)


def aligned_buffer(n: int, align: int = BLOCK) -> bytearray:
    """A bytearray of ``n`` bytes whose data starts on an ``align`` boundary (O_DIRECT).

    CPython's ``del ba[:k]`` only moves the start pointer, and a small tail deletion does
    not reallocate, so trimming an over-allocated bytearray leaves an aligned one.
    """
    ba = bytearray(n + align)
    addr = ctypes.addressof((ctypes.c_char * len(ba)).from_buffer(ba))
    pad = (-addr) % align
    if pad:
        del ba[:pad]
    del ba[n:]
    if ctypes.addressof((ctypes.c_char * len(ba)).from_buffer(ba)) % align:
        raise RuntimeError("could not align an I/O buffer")
    return ba


checksum = page_checksum  # the pool's one page checksum (a record's payload checksum)


# ---- record headers -------------------------------------------------------------------
def pack_header(buf: bytearray, gen: int, seq: int, ns_name: bytes, hash_: bytes, payload_len: int,
                payload_csum: int) -> None:
    """Write a record header into the first bytes of ``buf`` (a 4 KiB block)."""
    n = _HDR.size
    _HDR.pack_into(buf, 0, REC_MAGIC, FORMAT_VERSION, len(ns_name), gen, seq, payload_len, payload_csum, hash_)
    buf[n:n + len(ns_name)] = ns_name
    end = n + len(ns_name)
    _CSUM.pack_into(buf, end, xxhash.xxh3_64_intdigest(memoryview(buf)[:end]))
    buf[end + 8:end + 16] = bytes(8)


@dataclass(frozen=True, slots=True)
class Header:
    gen: int
    seq: int
    ns_name: str
    hash: bytes
    payload_len: int
    payload_csum: int

    @property
    def is_reset(self) -> bool:
        """A reset record (``SsdIndex.tombstone``), not a block."""
        return self.hash == TOMBSTONE and self.payload_len == 0


def unpack_header(buf: bytes | bytearray | memoryview) -> Header | None:
    """The header at the start of ``buf``, or None if it is not a valid record header."""
    mv = memoryview(buf)
    if len(mv) < _HDR.size or bytes(mv[:4]) != REC_MAGIC:
        return None
    magic, ver, name_len, gen, seq, plen, pcsum, h = _HDR.unpack_from(mv, 0)
    if ver != FORMAT_VERSION or name_len > MAX_NAME:
        return None
    end = _HDR.size + name_len
    if end + 8 > BLOCK or len(mv) < end + 8:
        return None
    if _CSUM.unpack_from(mv, end)[0] != xxhash.xxh3_64_intdigest(mv[:end]):
        return None
    try:
        name = bytes(mv[_HDR.size:end]).decode()
    except UnicodeDecodeError:
        return None
    return Header(gen, seq, name, bytes(h), plen, pcsum)


# ---- files ----------------------------------------------------------------------------
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
    path: str
    fd: int
    file_bytes: int
    segment_bytes: int
    segments: list[Segment]
    cursor: int = -1  # index of the open segment (-1: none yet)
    bytes_written: int = 0


def _cache_file_path(path: str) -> str:
    return os.path.join(path, CACHE_FILE_NAME) if os.path.isdir(path) else path


def _geometry(file_bytes: int) -> tuple[int, int]:
    """(segment bytes, segment count) for a file of ``file_bytes``."""
    data = file_bytes - BLOCK
    seg = min(MAX_SEGMENT, data // MIN_SEGMENTS) // BLOCK * BLOCK
    if seg < 2 * BLOCK:
        raise SsdError(f"SSD cache file of {file_bytes} bytes is too small (need >= {BLOCK + MIN_SEGMENTS * 2 * BLOCK})")
    return seg, data // seg


def _read_superblock(fd: int) -> bytes:
    buf = aligned_buffer(BLOCK)
    n = os.preadv(fd, [buf], 0)
    return bytes(buf[:n])


def _check_existing(path: str, fd: int) -> tuple[int, int] | None:
    """Validate an existing non-empty file; returns its (file_bytes, segment_bytes).

    Raises SsdError for a foreign or newer file (never overwritten)."""
    sb = _read_superblock(fd)
    if len(sb) < _SB.size + 8 or sb[:16] != SB_MAGIC:
        raise SsdError(f"{path} exists and is not a PegaFlow SSD cache file (refusing to overwrite it)")
    magic, ver, flags, file_bytes, seg_bytes, created = _SB.unpack_from(sb, 0)
    if ver > FORMAT_VERSION:
        raise SsdError(f"{path} has SSD cache format {ver}, newer than this PegaFlow's {FORMAT_VERSION} "
                       "(refusing to overwrite it)")
    if ver != FORMAT_VERSION or _CSUM.unpack_from(sb, _SB.size)[0] != xxhash.xxh3_64_intdigest(sb[:_SB.size]):
        raise SsdError(f"{path} has a corrupt or unknown PegaFlow SSD superblock (move it away to start over)")
    return file_bytes, seg_bytes


def _write_superblock(fd: int, file_bytes: int, seg_bytes: int) -> None:
    buf = aligned_buffer(BLOCK)
    _SB.pack_into(buf, 0, SB_MAGIC, FORMAT_VERSION, 0, file_bytes, seg_bytes, time.time_ns())
    _CSUM.pack_into(buf, _SB.size, xxhash.xxh3_64_intdigest(memoryview(buf)[:_SB.size]))
    os.pwritev(fd, [buf], 0)
    os.fsync(fd)


def _invalidate_segment_heads(fd: int, seg_bytes: int, count: int) -> None:
    """Zero the first block of every segment (a re-formatted file must not resurrect records)."""
    z = aligned_buffer(BLOCK)
    for i in range(count):
        os.pwritev(fd, [z], BLOCK + i * seg_bytes)


def open_files(paths: Iterable[str], capacity: int) -> list[CacheFile]:
    """Open or create the cache files, validating everything before touching anything.

    Raises SsdError (one line) for: an unusable path, a foreign or newer file, a capacity
    the filesystem cannot hold, or a capacity too small for the layout.
    """
    paths = list(paths)
    if not paths:
        raise SsdError("no --ssd-cache-path given")
    resolved = [_cache_file_path(p) for p in paths]
    if len({os.path.realpath(p) for p in resolved}) != len(resolved):
        raise SsdError("the same --ssd-cache-path is given twice")
    per_file = capacity // len(paths) // BLOCK * BLOCK
    _geometry(per_file)
    # 1. validate every path (no writes yet)
    plan: list[tuple[str, bool, int]] = []  # (path, exists-and-ours, bytes to allocate)
    need_by_dev: dict[int, int] = {}
    for p in resolved:
        parent = os.path.dirname(os.path.abspath(p)) or "."
        if not os.path.isdir(parent):
            raise SsdError(f"--ssd-cache-path {p}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise SsdError(f"--ssd-cache-path {p}: directory {parent} is not writable")
        exists = os.path.exists(p)
        if exists:
            st = os.stat(p)
            if not stat.S_ISREG(st.st_mode):
                raise SsdError(f"--ssd-cache-path {p} is not a regular file")
            if not os.access(p, os.R_OK | os.W_OK):
                raise SsdError(f"--ssd-cache-path {p} is not readable and writable")
            if st.st_size:
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
                except OSError as exc:
                    raise SsdError(f"--ssd-cache-path {p}: cannot open with O_DIRECT: {exc.strerror}") from None
                try:
                    _check_existing(p, fd)
                finally:
                    os.close(fd)
            have = st.st_blocks * 512
            dev = st.st_dev
        else:
            _probe_dir(p, parent)
            have = 0
            dev = os.stat(parent).st_dev
        need_by_dev[dev] = need_by_dev.get(dev, 0) + max(0, per_file - have)
        plan.append((p, exists, per_file))
    for dev, need in need_by_dev.items():
        where = next(p for p in resolved if _dev_of(p) == dev)
        vfs = os.statvfs(os.path.dirname(os.path.abspath(where)) or ".")
        free = vfs.f_bavail * vfs.f_frsize
        if need > free:
            raise SsdError(f"--ssd-cache-capacity needs {need >> 20} MiB more on the filesystem of {where} "
                           f"but only {free >> 20} MiB are free")
    # 2. open / create
    files: list[CacheFile] = []
    for i, (p, existed, file_bytes) in enumerate(plan):
        created = False
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SsdError(f"--ssd-cache-path {p}: cannot open: {exc.strerror}") from None
        try:
            try:  # one node per cache file: a second one would overwrite the first one's log
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SsdError(f"--ssd-cache-path {p} is in use by another process") from None
            size = os.fstat(fd).st_size
            geo = _check_existing(p, fd) if size else None
            seg_bytes, nseg = _geometry(file_bytes)
            if geo != (file_bytes, seg_bytes):
                if geo is not None:
                    log.warning("ssd_cache_reformat", path=p, old_bytes=geo[0], new_bytes=file_bytes,
                                reason="capacity or layout changed")
                created = not existed
                try:
                    os.posix_fallocate(fd, 0, file_bytes)
                except OSError as exc:
                    raise SsdError(f"--ssd-cache-path {p}: cannot allocate {file_bytes >> 20} MiB: "
                                   f"{exc.strerror}") from None
                if size > file_bytes:
                    os.ftruncate(fd, file_bytes)
                _invalidate_segment_heads(fd, seg_bytes, nseg)
                _write_superblock(fd, file_bytes, seg_bytes)
        except BaseException:
            os.close(fd)
            if created:
                os.unlink(p)
            for f in files:
                os.close(f.fd)
            raise
        segs = [Segment(i, k, BLOCK + k * seg_bytes) for k in range(nseg)]
        files.append(CacheFile(p, fd, file_bytes, seg_bytes, segs))
    return files


def _probe_dir(p: str, parent: str) -> None:
    """Create and remove a probe file: catches read-only mounts, /proc-like filesystems,
    permissions (access() says yes to root) and filesystems without O_DIRECT (tmpfs)."""
    probe = os.path.join(parent, f".pegaflow-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        why = "does not support O_DIRECT" if exc.errno == 22 else f"is not writable ({exc.strerror})"
        raise SsdError(f"--ssd-cache-path {p}: directory {parent} {why}") from None
    os.close(fd)
    os.unlink(probe)


def _dev_of(p: str) -> int:
    return os.stat(p if os.path.exists(p) else os.path.dirname(os.path.abspath(p)) or ".").st_dev


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

    def _allocate_in(self, f: CacheFile, size: int) -> tuple[Slot, list[tuple[int, bytes]]]:
        evicted: list[tuple[int, bytes]] = []
        seg = f.segments[f.cursor] if f.cursor >= 0 else None
        if seg is None or seg.gen == 0 or seg.fill + size > f.segment_bytes:
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

    def tombstone(self, ns_name: str) -> list[tuple[int, bytes]]:
        """Make a reset of ``ns_name`` durable: a reset record in every file, written and
        ``fdatasync``-ed before this returns (a few ms on the event loop; resets are rare).
        Returns the keys whose segments were reclaimed for it. Raises ``OSError``."""
        evicted: list[tuple[int, bytes]] = []
        buf = aligned_buffer(BLOCK)
        for f in self.files:
            slot, ev = self._allocate_in(f, record_bytes(0))
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
    write) does not end the segment: the walk resynchronises at the next 4 KiB block that
    holds a valid header (records are 4 KiB aligned). One of the segment's generation
    resumes the chain, so a damaged record loses only itself; one of an older generation
    (the stale tail of the segment's previous use) or the segment's end ends the walk.
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
        h = unpack_header(mv[pos - win_start:pos - win_start + BLOCK])
        if h is None:
            if gen is None:
                break  # nothing valid at the segment's start: empty or never written
            if not resyncing:
                resyncing = True
                damaged_at = pos
            pos += BLOCK
            continue
        if gen is not None and h.gen != gen:
            break
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
