"""The SSD tier's on-disk format: the superblock, the segments, the records in them.

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
*generation* the segment was opened with, so a scan of a segment tells its records from
those left over from the segment's previous use (``store._walk``).

Reset records: a header-only record (hash ``TOMBSTONE``, no payload) says that every record
of its namespace with a smaller sequence number is void. Each file is FIFO, so a file's
reset record outlives every older record of that file it voids.

Contracts:
1. Headers and payloads start on a ``BLOCK`` boundary in the file and in memory, so every
   record is read and written with O_DIRECT through :func:`aligned_buffer` or pool pages.
2. :func:`unpack_header` accepts a header only if its magic, version, name length and own
   checksum hold: anything else (a torn write, a flipped bit, zeroes) is not a record.
3. The format is this module's and only this one's; changing any of it means a new
   ``FORMAT_VERSION``. A file of a newer format is refused, never rewritten (:mod:`files`).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import xxhash

from pegaflow.node.pool import page_checksum

BLOCK = 4096  # O_DIRECT unit and header size; pages are padded to it
FORMAT_VERSION = 1
SB_MAGIC = b"PEGAFLOW-SSDv1\x00\x00"  # 16 bytes; the version field says the real format
REC_MAGIC = b"PFR1"
MAX_NAME = 1024
TOMBSTONE = b"\xff" * 16  # the block hash of a reset record (a real block hash never is all ones)

_SB = struct.Struct("<16sIIQQQ")  # magic, version, flags, file_bytes, segment_bytes, created_ns
_HDR = struct.Struct("<4sHHQQQQ16s")  # magic, version, name_len, gen, seq, payload_len, payload_csum, hash
_CSUM = struct.Struct("<Q")

checksum = page_checksum  # the pool's one page checksum (a record's payload checksum)


def round_up(n: int, a: int = BLOCK) -> int:
    return (n + a - 1) // a * a


def record_bytes(payload_len: int) -> int:
    """Bytes a record of this payload occupies on disk (header block + padded payload)."""
    return BLOCK + round_up(payload_len)


def segment_start(index: int, segment_bytes: int) -> int:
    """Byte offset of segment ``index`` in its file (segments follow the superblock)."""
    return BLOCK + index * segment_bytes


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


# ---- the superblock -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Superblock:
    """A superblock as read back (:func:`unpack_superblock`); ``version`` may be any."""

    version: int
    file_bytes: int
    segment_bytes: int
    intact: bool  # its checksum holds (the fields mean something only if it does)


def pack_superblock(buf: bytearray, file_bytes: int, segment_bytes: int, created_ns: int) -> None:
    """Write a superblock of this ``FORMAT_VERSION`` into the first bytes of ``buf`` (a 4 KiB block)."""
    _SB.pack_into(buf, 0, SB_MAGIC, FORMAT_VERSION, 0, file_bytes, segment_bytes, created_ns)
    _CSUM.pack_into(buf, _SB.size, xxhash.xxh3_64_intdigest(memoryview(buf)[:_SB.size]))


def unpack_superblock(buf: bytes) -> Superblock | None:
    """The superblock at the start of ``buf``; None if ``buf`` does not start like one of ours."""
    if len(buf) < _SB.size + 8 or buf[:16] != SB_MAGIC:
        return None
    _magic, ver, _flags, file_bytes, seg_bytes, _created = _SB.unpack_from(buf, 0)
    intact = _CSUM.unpack_from(buf, _SB.size)[0] == xxhash.xxh3_64_intdigest(buf[:_SB.size])
    return Superblock(ver, file_bytes, seg_bytes, intact)


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
