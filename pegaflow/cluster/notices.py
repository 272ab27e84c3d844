"""Class notices: the metaserver tells a node which of its blocks changed replacement class.

Layout: one Redis list per (namespace, holder nid), ``keys.notice_key(tag, nid)``, in the
namespace's slot. The index's scripts (``pegaflow/meta/index.py``) append to it in the same
atomic step as the index change that moved a block's owner count, so notices are in the
order of the changes; the node pops them (:func:`pop`, from its publisher thread) and
applies them in that order (``pegaflow/node/classes.py``). Each element is one script's
notices for that holder: an op byte (:data:`DEMOTE`: the block is reclaimable now,
:data:`RESTORE`: retained again) and the 16-byte hashes. A list keeps its newest
:data:`MAX_ENTRIES` elements and expires :data:`TTL_MS` after its last append (a holder
that is gone never pops it); a node that misses notices keeps the classes it had, which
changes the order of eviction, never a block's bytes.

The decode backup's planner (``pegaflow/meta/backup.py``) appends to the same lists
(:func:`push`): :data:`BACKUP` demotes blocks a backup target now holds (the node counts them
under ``reason="backup_hint"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pegaflow.cluster import keys
from pegaflow.core.identity import HASH_BYTES

if TYPE_CHECKING:  # a type only: a node that never publishes does not import redis-py
    from pegaflow.cluster.redis_conn import Client

DEMOTE = b"d"
RESTORE = b"r"
BACKUP = b"b"  # reclaimable now: a backup target holds a copy (the decode backup)
MAX_ENTRIES = 4096  # elements kept per list; one script call appends at most two per holder
TTL_MS = 3_600_000
POP_COUNT = 512  # elements per LPOP


class MalformedNotice(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Notice:
    """One element: these blocks (of the list's namespace) are ``reclaimable`` now, or retained."""

    reclaimable: bool
    hashes: list[bytes]
    backup: bool = False  # demoted because a backup target holds them (op BACKUP)


def decode(element: bytes) -> Notice:
    op, blob = element[:1], element[1:]
    if op not in (DEMOTE, RESTORE, BACKUP) or len(blob) % HASH_BYTES:
        raise MalformedNotice(f"class notice of {len(element)} bytes starting {element[:1]!r}")
    return Notice(op != RESTORE, [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)], op == BACKUP)


def encode(notice: Notice) -> bytes:
    """What the scripts append (for tests and tools)."""
    op = BACKUP if notice.backup else DEMOTE if notice.reclaimable else RESTORE
    return op + b"".join(notice.hashes)


def push(r: Client, tag: str, nid: int, notice: Notice) -> None:
    """Append ``notice`` to holder ``nid``'s list in namespace ``tag``, kept as the scripts keep it."""
    key = keys.notice_key(tag, nid)
    p = r.pipeline(transaction=False)  # one key
    p.rpush(key, encode(notice))
    p.ltrim(key, -MAX_ENTRIES, -1)
    p.pexpire(key, TTL_MS)
    p.execute()


def pop(r: Client, nid: int, tags: Iterable[str]) -> dict[str, list[bytes]]:
    """Take every element queued for ``nid`` in these namespaces' lists (one pipeline round
    per :data:`POP_COUNT` elements); tag -> elements, oldest first."""
    out: dict[str, list[bytes]] = {}
    todo = list(dict.fromkeys(tags))
    while todo and nid:
        p = r.pipeline(transaction=False)
        for tag in todo:
            p.lpop(keys.notice_key(tag, nid), POP_COUNT)
        more = []
        for tag, got in zip(todo, p.execute(), strict=True):
            if got:
                out.setdefault(tag, []).extend(got)
                if len(got) == POP_COUNT:
                    more.append(tag)
        todo = more
    return out
