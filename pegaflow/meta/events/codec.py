"""Compact binary codec for node events (one stream entry field ``e``).

Layout, little-endian (schema version 1)::

    u8 version | u8 op | u8 flags | u8 0 | u32 nid | u64 epoch | u64 seq
    | u16 len(node) | u16 len(namespace) | u32 count | node utf-8 | namespace utf-8
    | count * 16 bytes of block hashes

``flags``: ``FLAG_LAST`` (a snapshot's last chunk), ``FLAG_SSD`` (an add of blocks held only
on the node's SSD tier; schema.py). A 512-block entry is ~8.2 KB, 16.05 bytes per block. Decoding checks every length and
raises :class:`MalformedEvent`; it never returns a partial event.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from pegaflow.core.identity import HASH_BYTES
from pegaflow.meta.events.schema import SCHEMA_VERSION, Event, Op

FIELD = b"e"  # the one field of a stream entry
_HEADER = struct.Struct("<BBBxIQQHHI")
_OPS = {int(o): o for o in Op}


class MalformedEvent(ValueError):
    """The bytes are not a valid event of a schema version this code understands."""


def encode(ev: Event) -> bytes:
    node = ev.node.encode()
    ns = ev.namespace.encode()
    if len(ev.blob) % HASH_BYTES:
        raise ValueError("hash blob length is not a multiple of 16")
    head = _HEADER.pack(
        SCHEMA_VERSION,
        int(ev.op),
        ev.flags,
        ev.nid,
        ev.epoch,
        ev.seq,
        len(node),
        len(ns),
        len(ev.blob) // HASH_BYTES,
    )
    return b"".join((head, node, ns, ev.blob))


def decode(data: bytes) -> Event:
    """Decode one entry; raise MalformedEvent on any inconsistency."""
    if len(data) < _HEADER.size:
        raise MalformedEvent(f"event too short ({len(data)} bytes)")
    version, op, flags, nid, epoch, seq, nlen, slen, count = _HEADER.unpack_from(data)
    if version != SCHEMA_VERSION:
        raise MalformedEvent(f"unknown schema version {version}")
    if op not in _OPS:
        raise MalformedEvent(f"unknown op {op}")
    off = _HEADER.size
    end = off + nlen + slen + count * HASH_BYTES
    if end != len(data):
        raise MalformedEvent(f"length mismatch: header says {end} bytes, got {len(data)}")
    try:
        node = data[off : off + nlen].decode()
        ns = data[off + nlen : off + nlen + slen].decode()
    except UnicodeDecodeError as exc:
        raise MalformedEvent(f"bad utf-8: {exc}") from None
    if not node:
        raise MalformedEvent("empty node name")
    o = _OPS[op]
    if o in (Op.INSERT, Op.EVICT, Op.SNAPSHOT) and count and not ns:
        raise MalformedEvent("hashes without a namespace")
    return Event(node, nid, epoch, seq, o, ns, bytes(data[off + nlen + slen : end]), flags)


def decode_entry(fields: Mapping[bytes, bytes]) -> Event:
    """Decode a stream entry's field map as returned by redis-py (bytes keys)."""
    data = fields.get(FIELD)
    if data is None:
        raise MalformedEvent(f"entry has no field {FIELD!r}")
    return decode(data)
