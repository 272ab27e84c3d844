"""The operator's manual cleanup: ``POST /admin/cleanup-expired-blocks`` (the original's).

The original removes every owner registration (a node's ownership of a block) whose last
``InsertBlockHashes`` was strictly more than an hour before the pass started, whatever the
node's liveness, and answers ``{"removed_owners": N, "removed_keys": M}``: ownerships
removed, and block keys left without any owner. A removed owner becomes discoverable again
when its node registers the block again.

Here a registration is an add (``INSERT`` or ``SNAPSHOT``) in the node's stream, and its
time is the entry's id (milliseconds of Redis's clock): the stream holds, for each
incarnation, everything it said since its ``RESET`` (``pegaflow/meta/events/``), so
replaying it gives each (block, incarnation) pair's last registration exactly.

Contracts:

1. The removal is an ``EVICT`` of those pairs appended to the node's own stream, so every
   reader of the streams agrees (each replica's consumer and in-memory view, and
   ``pegaflow-meta rebuild``) and nothing brings the pairs back but a new add. The append
   is a script that first checks the stream still ends at the entry the replay read last:
   a block the node added again meanwhile is never evicted (the replay reads the new
   entries and tries again, up to ``APPEND_TRIES`` times, then leaves that node for the
   next call).
2. The evictions are also applied to the index at once (through ``Index.apply_many``, as
   the consumer applies them), so the answer reflects them; the consumer applying the
   same ``EVICT`` later changes nothing (suffix replay, ``pegaflow/meta/index.py``).
3. The counts are read from the index just before the removal: a holder entry of a pair
   removed is an owner, a block whose only holder it was is a key.
4. Incarnations already retired are skipped: their entries are the sweeper's.
5. One cleanup at a time in the cluster (``keys.CLEANUP_LOCK``); another call answers that
   one is running.

Cost: one read of every node stream and memory for the pairs old enough, so it is for
explicit maintenance, as the original's (which holds shard locks while it scans).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import structlog

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import Client, Script, held
from pegaflow.meta.events.codec import FIELD, MalformedEvent, decode_entry, encode
from pegaflow.meta.events.schema import Event, Op, Update
from pegaflow.meta.index import Index

log = structlog.get_logger("pegaflow.meta.cleanup")

MANUAL_CLEANUP_AGE_MS = 3_600_000  # the original's fixed hour ("manual_cleanup_age=1h"), not --ttl-minutes
XRANGE_COUNT = 512  # stream entries per read
EVICT_BLOCKS = 512  # hashes per appended EVICT, as the node's own entries (publishing.BATCH_BLOCKS)
APPEND_TRIES = 10  # the node kept writing between our read and our append this often: next call
LOCK_MS = 600_000  # the lock of a cleanup that died with its replica lapses after this

# Append entries only if the stream still ends at ARGV[1] (the last entry the caller read).
_APPEND_IF_LAST = Script(
    """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 or last[1][1] ~= ARGV[1] then return 0 end
for i = 3, #ARGV do redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[i]) end
return #ARGV - 2
"""
)


class CleanupBusy(Exception):
    """Another cleanup holds the lock."""


@dataclass(frozen=True)
class CleanupResult:
    removed_owners: int
    removed_keys: int


Group = tuple[str, int, int]  # (namespace, nid, epoch)


@dataclass
class _Replay:
    """One stream read so far: per incarnation and namespace, the blocks whose last add is
    older than the cutoff and that were not evicted since."""

    cutoff_ms: int
    last_id: bytes = b""
    old: dict[Group, set[bytes]] = field(default_factory=dict)
    seq: dict[tuple[int, int], int] = field(default_factory=dict)  # (nid, epoch) -> last seq seen

    def feed(self, entries: Iterable[tuple[bytes, dict[bytes, bytes]]], node: str) -> None:
        for eid, fields in entries:
            self.last_id = eid
            try:
                ev = decode_entry(fields)
            except MalformedEvent:
                continue  # the consumer skips it too
            if ev.node != node or ev.op == Op.RESET:
                continue
            self.seq[(ev.nid, ev.epoch)] = max(ev.seq, self.seq.get((ev.nid, ev.epoch), 0))
            if not ev.blob:
                continue
            group = self.old.setdefault((ev.namespace, ev.nid, ev.epoch), set())
            hashes = ev.hashes
            if ev.op != Op.EVICT and int(eid.split(b"-")[0]) < self.cutoff_ms:
                group.update(hashes)
            else:  # registered again (or evicted) since the cutoff: not old
                group.difference_update(hashes)


def _read(r: Client, stream: str, start: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return cast("list[tuple[bytes, dict[bytes, bytes]]]", r.xrange(stream, min=start, max="+", count=XRANGE_COUNT))


def _after(eid: bytes) -> str:
    ms, seq = eid.decode().split("-")
    return f"{ms}-{int(seq) + 1}"


def _evictions(node: str, rep: _Replay, retired: set[int]) -> list[Event]:
    out = []
    for (ns, nid, epoch), hs in sorted(rep.old.items()):
        if nid in retired or not hs:
            continue
        ordered = sorted(hs)
        for i in range(0, len(ordered), EVICT_BLOCKS):
            out.append(Event(node, nid, epoch, rep.seq.get((nid, epoch), 0), Op.EVICT, ns,
                             b"".join(ordered[i : i + EVICT_BLOCKS])))
    return out


def _cleanup_node(r: Client, index: Index, node: str, cutoff_ms: int, retired: set[int]) -> CleanupResult:
    stream = stream_key(node)
    rep = _Replay(cutoff_ms)
    start = "-"
    for _ in range(APPEND_TRIES):
        while chunk := _read(r, stream, start):
            rep.feed(chunk, node)
            start = _after(chunk[-1][0])
        evicts = _evictions(node, rep, retired)
        if not evicts:
            return CleanupResult(0, 0)
        # Counted before the removal (contract 3).
        owners = removed_keys = 0
        for ev in evicts:
            for holders in index.holders(ev.namespace, ev.hashes):
                if ev.nid in holders:
                    owners += 1
                    removed_keys += holders == {ev.nid}
        if _APPEND_IF_LAST(r, [stream], [rep.last_id, FIELD, *(encode(ev) for ev in evicts)]):
            index.apply_many([Update(Op.EVICT, ev.namespace, ev.nid, ev.blob) for ev in evicts])
            return CleanupResult(owners, removed_keys)
    log.warning("cleanup_skipped_node", node=node, reason="its stream kept growing; the next call tries again")
    return CleanupResult(0, 0)


def cleanup_expired_blocks(r: Client, age_ms: int = MANUAL_CLEANUP_AGE_MS) -> CleanupResult:
    """Remove every owner registration older than ``age_ms`` (the module's contracts);
    :class:`CleanupBusy` when another cleanup runs, Redis errors are raised."""
    with held(r, keys.CLEANUP_LOCK, f"cleanup-{time.time_ns()}", LOCK_MS) as mine:
        if not mine:
            raise CleanupBusy("another cleanup is running")
        return _cleanup(r, age_ms)


def _cleanup(r: Client, age_ms: int) -> CleanupResult:
    t0 = time.monotonic()
    cutoff_ms = registry.redis_ms(cast("list[bytes]", r.time())) - age_ms
    retired = registry.retired(r)
    index = Index(r)
    owners = removed_keys = 0
    for node in sorted(registry.nodes(r)):
        res = _cleanup_node(r, index, node, cutoff_ms, retired)
        owners += res.removed_owners
        removed_keys += res.removed_keys
    log.info("cleanup_expired_blocks", removed_owners=owners, removed_keys=removed_keys,
             age_secs=age_ms // 1000, seconds=round(time.monotonic() - t0, 3))
    return CleanupResult(owners, removed_keys)

