"""The node's block index: which block lives in which pool page, and what to evict.

A *block* is one namespace's KV for one chunk of tokens, stored as one page of the pool.
States and who moves a block between them:

    (absent) --reserve--> PENDING --commit--> RESIDENT --evict--> (absent)
                              \\--discard/expire--> (absent)

- PENDING pages belong to the reserving engine, which is the only writer. They are in
  no lookup result and are never evicted; ``discard`` frees them (reservation expired or
  its session died).
- RESIDENT blocks are immutable and visible to every reader of the namespace. A block
  with ``pins > 0`` (a lease, or a transfer in progress) is out of the eviction order
  and cannot be evicted; it goes back to the most-recently-used end when its last pin goes.
- Eviction is one global LRU across namespaces and page sizes, per replacement class:
  *reclaimable* blocks (the cluster holds them elsewhere: copies pulled from peers, blocks
  the metaserver says enough nodes hold) are evicted before *retained* ones. A block's
  class is set when it is reserved and changed by :meth:`BlockIndex.reclassify`
  (docs/architecture.md, "Replacement classes").
- With an admission policy (TinyLFU), a new block that would need evictions is admitted
  only if the policy prefers it to the LRU victim; otherwise it is not stored.
- With namespace quotas (``pegaflow.policy.quota``, ``--namespace-quota``), namespaces
  are grouped and each group's held bytes are counted: the victim is the LRU block among
  the groups above their guarantee, the namespaces without a quota and the inserting
  group (which, while under its own guarantee, takes others' blocks first); a group at its
  maximum evicts its own LRU block. Pinned blocks stay out of it.

This class does no I/O and holds no pool memory: the node wraps it around a shared
memory pool, ``pegaflow replay`` runs it on offsets alone. It is not thread-safe; the
node calls it from its event loop only.

Performance: ``pegaflow replay`` drives this very class at 1-3M block accesses/s, so
the per-block paths keep Python out of the inner loop: blocks are found in one dict per
namespace keyed by the hash (a bytes key hashes once; an (id, hash) tuple would be built
and hashed on every lookup), the LRU is keyed by the Block itself (identity hash),
lookups and LRU moves are mapped over a request in C, a victim's page goes straight to
the new block when their sizes match (no allocator round trip), and event grouping is
skipped when nobody listens. Three pieces are C (``pegaflow/native/blockindex.c``, built
by the install as ``pegaflow.core._blockindex``) and are the only implementation of what
they do: ``Block``, the ``LRU`` eviction orders (OrderedDict's methods, one hash probe per
operation), and ``place``/``settle``, the loop of ``reserve``/``insert`` for its usual steps
(one namespace, victims of either class), which hands anything else back to the Python loop
below. That loop is the general case and, run alone, the reference the tests hold ``place``
equal to; the pure-Python ``Block`` is in ``tests/oracles/``. The allocator is pluggable for
the same reason (see ``__init__``).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Literal, Protocol, cast, overload

# Built by the install from pegaflow/native/blockindex.c: the Block type, the LRU eviction
# order, and place/settle, the reserve/insert loop's steady state (docs/architecture.md, "One
# source of truth": they are the implementation, measured 1.75x the Python loop on replay).
from pegaflow.core._blockindex import LRU
from pegaflow.core._blockindex import Block as Block
from pegaflow.core._blockindex import place as _native_place
from pegaflow.core._blockindex import reclass as _native_reclass
from pegaflow.core._blockindex import settle as _native_settle
from pegaflow.core.allocator import ExtentAllocator, OutOfSpace
from pegaflow.core.identity import block_key, block_keys, namespace_salt

PENDING = 0
RESIDENT = 1


class Shares(Protocol):
    """What the index needs from namespace quotas (``pegaflow.policy.quota.Quotas``)."""

    def group(self, namespace: str) -> int | None: ...  # the quota covering it, or None
    def limits(self, capacity: int) -> list[tuple[int, int]]: ...  # per group: (min, max) bytes


class Admission(Protocol):
    """What the index needs from an admission policy (``TinyLFU`` is the node's).

    A policy may also offer ``record_many(keys)`` (equal to ``record`` per key, in order);
    the index then records a request's blocks in one call instead of one call per block;
    and ``record_unseen(keys)`` (``record`` of each key it has not seen), which the index
    calls with the blocks a reserve places, so that a block stored without a lookup first
    (a saved decode block) is not a stranger to admission.
    """

    def record(self, key: int) -> None: ...
    def admit(self, candidate: int, victim: int) -> bool: ...


@dataclass(frozen=True, slots=True)
class Namespace:
    id: int  # node-local, dense: cheap dict keys
    name: str
    page_bytes: int
    salt: int  # namespace_salt(name): identical on every host, for block keys


class IndexEvent(enum.StrEnum):
    """What a listener is told happened to some blocks of one namespace."""

    INSERT = "insert"  # became RESIDENT (visible)
    EVICT = "evict"  # left the index to make room (memory pressure, a quota at its maximum)
    REMOVE = "remove"  # left the index because it was told to (clear: a reset; remove: a cleanup)


Listener = Callable[[IndexEvent, Namespace, list[bytes]], None]  # (event, namespace, hashes)

# Attribute reads mapped over a batch of blocks in C (``map(_HASH, blocks)``).
_HASH = attrgetter("hash")
_NS = attrgetter("ns")
_SIZE = attrgetter("size")
_RECLAIMABLE = attrgetter("reclaimable")


class PageAllocator(Protocol):
    """What the index needs from an allocator (``ExtentAllocator`` is the node's)."""

    @property
    def capacity(self) -> int: ...
    @property
    def free_bytes(self) -> int: ...
    @property
    def align(self) -> int: ...  # every page starts at a multiple of it
    @property
    def used_bytes(self) -> int: ...  # allocated pages
    def round(self, size: int) -> int: ...
    def alloc(self, size: int) -> int: ...  # raises OutOfSpace
    def free(self, offset: int, size: int) -> None: ...


class BlockIndex:
    def __init__(
        self,
        capacity: int,
        align: int = 4096,
        admission: Admission | None = None,
        allocator: PageAllocator | None = None,
        quotas: Shares | None = None,
    ) -> None:
        """``capacity`` bytes of pages aligned to ``align``, carved by an :class:`ExtentAllocator`.

        ``allocator`` replaces that allocator (then ``capacity`` and ``align`` are ignored):
        replay passes a constant-time one when every page has the same size, where any
        allocator that never fragments holds exactly ``capacity // page`` pages, so which
        blocks are evicted is unchanged.

        ``quotas`` (namespace shares, see the module docstring) are sized on the
        allocator's ``capacity``; empty or None: one global LRU, the code paths unchanged.
        """
        self.alloc: PageAllocator = allocator if allocator is not None else ExtentAllocator(capacity, align)
        self.admission = admission
        self._namespaces: dict[str, Namespace] = {}
        self._ns_by_id: dict[int, Namespace] = {}
        self._ns_ids = itertools.count(1)  # never reused: ids key checksums and SSD entries
        # RESIDENT and PENDING blocks, one dict per namespace id keyed by the hash: a bytes
        # key hashes once (cached), where an (id, hash) tuple is built and hashed per lookup.
        self._blocks: dict[int, dict[bytes, Block]] = {}
        # Evictable RESIDENT blocks, least recently used first, keyed by the Block itself
        # (identity hash: free). Pinned blocks are not here.
        self._lru = LRU()
        self._lru_reclaimable = LRU()
        self._listeners: list[Listener] = []
        self.resident_blocks = 0
        self.resident_bytes = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.evicted_reclaimable = 0  # of evictions, reclaimable blocks (the rest were retained)
        # RESIDENT blocks of the reclaimable class (pinned ones too); the rest are retained.
        self.reclaimable_blocks = 0
        self.reclaimable_bytes = 0
        self.demoted = 0  # blocks reclassify() moved from retained to reclaimable
        self.restored = 0  # ... and back
        self.admission_rejections = 0
        self.no_space = 0
        self._pending = 0  # PENDING blocks held; when 0, prefix() need not check states
        self._detached: set[Block] = set()  # dropped while pinned: page freed at the last unpin
        self.removed_held = 0  # blocks clear() dropped while pinned (into _detached), ever
        self._voided: set[Block] = set()  # PENDING when their namespace was cleared: freed at commit/discard
        # Namespace quotas: group of each grouped namespace id, bytes each group holds in the
        # table (PENDING + RESIDENT), its (min, max) bytes, and its namespaces' ids.
        self._shares: Shares | None = quotas if quotas else None
        self._quota_group: dict[int, int] = {}
        self._limits: list[tuple[int, int]] = []
        if self._shares is not None:
            self._limits = self._shares.limits(self.alloc.capacity)
        self.held: list[int] = [0] * len(self._limits)
        self._members: list[set[int]] = [set() for _ in self._limits]
        self.quota_evictions = 0  # victims taken by a group at its maximum from itself
        # Parked: blocks a victim search skipped at the head of ``_lru`` (not evictable for
        # that insert), moved out of it so the next search does not walk them again. Each is
        # older than every block in ``_lru``; ``_park_seq`` orders them (parking order is
        # age order), ``_parked`` holds them per class (quota group, -1: no quota).
        self._parked: dict[int, LRU] = {}
        self._park_seq: dict[Block, int] = {}
        self._park_next = 0

    # ---- namespaces -------------------------------------------------------------------
    def namespace(self, name: str, page_bytes: int) -> Namespace:
        """Get or create a namespace; its page size is fixed by the first registration."""
        ns = self._namespaces.get(name)
        if ns is None:
            ns = Namespace(next(self._ns_ids), name, page_bytes, namespace_salt(name))
            self._namespaces[name] = ns
            self._ns_by_id[ns.id] = ns
            if self._shares is not None:
                g = self._shares.group(name)
                if g is not None:
                    self._quota_group[ns.id] = g
                    self._members[g].add(ns.id)
        elif ns.page_bytes != page_bytes:
            raise ValueError(
                f"namespace {name!r} has page_bytes={ns.page_bytes}, registration asked for {page_bytes}"
            )
        return ns

    def get_namespace(self, name: str) -> Namespace | None:
        return self._namespaces.get(name)

    def namespace_by_id(self, ns_id: int) -> Namespace | None:
        return self._ns_by_id.get(ns_id)

    def drop_namespace(self, name: str) -> bool:
        """Forget namespace ``name`` if it holds no block in any state; True if it was dropped.
        The caller checks that nothing else refers to it (sessions, the SSD tier)."""
        ns = self._namespaces.get(name)
        if ns is None or self._blocks.get(ns.id):
            return False
        del self._namespaces[name]
        self._ns_by_id.pop(ns.id, None)
        self._blocks.pop(ns.id, None)
        g = self._quota_group.pop(ns.id, None)
        if g is not None:
            self._members[g].discard(ns.id)
        return True

    def namespaces(self) -> list[Namespace]:
        return list(self._namespaces.values())

    def add_listener(self, listener: Listener) -> None:
        """``listener(op, ns, hashes)`` with op ``insert``, ``evict`` or ``remove`` (both of the
        latter: the blocks left the index), called synchronously after each batch; it must not
        block (the event publisher only buffers)."""
        self._listeners.append(listener)

    def _emit(self, op: IndexEvent, ns: Namespace, hashes: list[bytes]) -> None:
        if hashes:
            for cb in self._listeners:
                cb(op, ns, hashes)

    # ---- lookups ----------------------------------------------------------------------
    def _table(self, ns_id: int) -> dict[bytes, Block]:
        t = self._blocks.get(ns_id)
        if t is None:
            t = self._blocks[ns_id] = {}
        return t

    def _current(self, b: Block) -> bool:
        """True iff ``b`` is the block the index holds for its (namespace, hash)."""
        t = self._blocks.get(b.ns.id)
        return t is not None and t.get(b.hash) is b

    def get(self, ns: Namespace, hash_: bytes) -> Block | None:
        t = self._blocks.get(ns.id)
        b = None if t is None else t.get(hash_)
        return b if b is not None and b.state == RESIDENT else None

    def contains(self, ns: Namespace, hash_: bytes) -> bool:
        return self.get(ns, hash_) is not None

    def prefix(self, ns: Namespace, hashes: Sequence[bytes], touch: bool = True) -> list[Block]:
        """RESIDENT blocks for the longest prefix of ``hashes``; marks them recently used."""
        t = self._blocks.get(ns.id)
        if not hashes or t is None or hashes[0] not in t:
            return []
        # All lookups in C, then cut at the first miss (cheaper than a Python loop that stops).
        found: list[Block | None] = list(map(t.get, hashes))
        try:
            del found[found.index(None) :]
        except ValueError:
            pass
        out = cast(list[Block], found)  # cut at the first None
        if self._pending:
            for i, b in enumerate(out):
                if b.state != RESIDENT:
                    del out[i:]
                    break
        if touch:
            self.touch(out)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Mark RESIDENT blocks most recently used (pinned ones stay out of the order) and
        record one access of each with the admission policy."""
        if not isinstance(blocks, list):
            blocks = list(blocks)
        try:
            # Common case, all evictable and local: move them in C. A miss (pinned or
            # reclaimable block) falls back to the full loop, which redoes the moves
            # already made in the same order, so the resulting order is the same.
            deque(map(self._lru.move_to_end, blocks), 0)
        except KeyError:
            for b in blocks:
                lru = self._lru_reclaimable if b.reclaimable else self._lru
                if b in lru:
                    lru.move_to_end(b)
                elif self._park_seq and self._unpark(b):
                    lru[b] = None
        if self.admission is not None and blocks:
            ns = blocks[0].ns
            if list(map(_NS, blocks)).count(ns) == len(blocks):  # one namespace: keys in C
                self._record(self.admission, block_keys(ns.salt, map(_HASH, blocks)))
            else:
                self._record(self.admission, [block_key(b.ns.salt, b.hash) for b in blocks])

    def record_access(self, ns: Namespace, hashes: Iterable[bytes]) -> None:
        """Tell the admission policy about requested blocks (hit or miss), in order."""
        if self.admission is not None:
            keys = block_keys(ns.salt, hashes)
            if keys:
                self._record(self.admission, keys)

    @staticmethod
    def _record(adm: Admission, keys: list[int]) -> None:
        # ``adm`` is read per call, not cached: replay swaps ``admission`` after construction.
        many = getattr(adm, "record_many", None)
        if many is not None:
            many(keys)
        else:
            for k in keys:
                adm.record(k)

    # ---- pins -------------------------------------------------------------------------
    def pin(self, blocks: Iterable[Block]) -> None:
        for b in blocks:
            if b.pins == 0 and b.state == RESIDENT:
                (self._lru_reclaimable if b.reclaimable else self._lru).pop(b, None)
                if self._park_seq:
                    self._unpark(b)
            b.pins += 1

    def unpin(self, blocks: Iterable[Block]) -> None:
        for b in blocks:
            b.pins -= 1
            if b.pins == 0 and b.state == RESIDENT:
                if self._current(b):
                    (self._lru_reclaimable if b.reclaimable else self._lru)[b] = None
                elif b in self._detached:  # dropped (reset) while pinned: its page is free now
                    self._detached.discard(b)
                    self.alloc.free(b.offset, b.size)

    # ---- replacement classes ----------------------------------------------------------
    def reclassify(self, ns: Namespace, hashes: Sequence[bytes], reclaimable: bool) -> int:
        """Put the RESIDENT blocks of ``hashes`` (of ``ns``) into the reclaimable class
        (``reclaimable``: evicted before any retained block) or back into the retained one;
        returns how many changed class. An unpinned block goes to the newest end of its new
        class's order (as the original does); a pinned one joins it when it is unpinned.
        Hashes not resident here, or already of that class, are skipped. The loop is C
        (``_blockindex.reclass``): a node may be told about a whole snapshot's blocks at once."""
        t = self._blocks.get(ns.id)
        if not t or not hashes:
            return 0
        reclaimable = bool(reclaimable)
        source, target = (self._lru, self._lru_reclaimable) if reclaimable else (self._lru_reclaimable, self._lru)
        moved: list[Block] = []
        parked: list[Block] = []
        _native_reclass(t, hashes if type(hashes) is list else list(hashes), reclaimable, source, target, moved,
                        parked)
        for b in parked:  # retained, skipped by a victim search under quotas (only a demotion finds them)
            self._unpark(b)
            target[b] = None
        if moved:
            n, nbytes = len(moved), sum(map(_SIZE, moved))
            if reclaimable:
                self.reclaimable_blocks += n
                self.reclaimable_bytes += nbytes
                self.demoted += n
            else:
                self.reclaimable_blocks -= n
                self.reclaimable_bytes -= nbytes
                self.restored += n
        return len(moved)

    # ---- writes -----------------------------------------------------------------------
    def reserve(
        self, ns: Namespace, hashes: Sequence[bytes], reclaimable: bool = False
    ) -> list[Block | None]:
        """PENDING pages for the hashes not already held, in order.

        ``None`` for a hash that is resident, pending elsewhere, repeated in the request,
        or for which no page could be found (then every later hash gets ``None`` too:
        prefix lookups could not use them). Never blocks: a full pool of pinned pages
        just yields fewer pages.
        """
        return self._reserve(ns, hashes, reclaimable, False)

    def insert(self, ns: Namespace, hashes: Sequence[bytes], reclaimable: bool = False) -> list[Block]:
        """``commit`` of the pages ``reserve`` gives, in one pass: for a writer whose pages
        are complete as soon as they are placed (``pegaflow replay``'s tiers). The same
        rules, victims and events as the two calls; returns the blocks made RESIDENT."""
        return self._reserve(ns, hashes, reclaimable, True)

    @overload
    def _reserve(
        self, ns: Namespace, hashes: Sequence[bytes], reclaimable: bool, commit: Literal[False]
    ) -> list[Block | None]: ...
    @overload
    def _reserve(
        self, ns: Namespace, hashes: Sequence[bytes], reclaimable: bool, commit: Literal[True]
    ) -> list[Block]: ...
    def _reserve(
        self, ns: Namespace, hashes: Sequence[bytes], reclaimable: bool, commit: bool
    ) -> list[Block | None] | list[Block]:
        out: list[Block | None] = []
        blocks = self._table(ns.id)
        size = ns.page_bytes
        alloc = self.alloc
        lru = self._lru
        adm = self.admission
        made: list[Block] = []
        evicted: list[Block] = []  # victims whose page went to a new block, counted at the end
        dropped: list[Block] = []  # victims _allocate evicted (counted there), reported at the end
        full = False
        group = self._quota_group.get(ns.id) if self._quota_group else None
        if adm is not None and (unseen := getattr(adm, "record_unseen", None)) is not None:
            if type(hashes) is not list:
                hashes = list(hashes)
            unseen(block_keys(ns.salt, [h for h in hashes if h not in blocks]))
        # place() takes free pages or this namespace's own LRU head: the quota rule's choice too,
        # unless the namespace's group has a maximum (own block though pages are free) or a
        # guarantee (under it, others' blocks go first), or a parked block it may evict is
        # older than that head.
        if (
            group is None or (not self._limits[group][0] and self._limits[group][1] >= self.alloc.capacity)
        ) and (not self._park_seq or self._parked_out_of_reach(group)):
            # The steady state (victims of this namespace, reclaimable ones first, as when
            # one engine or the ranks of one TP engine fill the pool) in C: it stops at the
            # first hash that needs anything else (a victim of another namespace, one that
            # admission refused), and the loop below, the general case, takes it from there.
            if type(hashes) is not list:
                hashes = list(hashes)
            done, refused = _native_place(
                blocks, lru, ns, hashes, 0, reclaimable, made, evicted, None if commit else out, alloc,
                alloc.round(size), adm, self._lru_reclaimable,
            )
            if refused:  # what the loop does for a refusal, then the rest of the request
                self.admission_rejections += 1
                full = True
                self.no_space += 1
                if not commit:
                    out.append(None)
                done += 1
            hashes = hashes[done:] if done else hashes
            if group is not None:  # place() evicts only this namespace's own blocks
                self.held[group] += (len(made) - len(evicted)) * size
        allocate = self._allocate if not self._quota_group else self._allocate_shared
        for h in hashes:
            existing = blocks.get(h)
            if full or existing is not None:
                if existing is not None and existing.state == RESIDENT:
                    if adm is None and not existing.pins and not existing.reclaimable and not self._park_seq:
                        lru.move_to_end(existing)  # what touch() does for it, minus the call
                    else:
                        self.touch((existing,))
                if not commit:
                    out.append(None)
                continue
            offset = allocate(ns, h, dropped)
            if offset is None:
                full = True
                self.no_space += 1
                if not commit:
                    out.append(None)
                continue
            b = Block(ns, h, offset, reclaimable)
            blocks[h] = b
            made.append(b)
            if group is not None:
                self.held[group] += size
            if not commit:
                out.append(b)
        if evicted:
            k = len(evicted)
            self.resident_blocks -= k
            self.resident_bytes -= k * size
            self.evictions += k
            self.evicted_bytes += k * size
            rk = sum(map(_RECLAIMABLE, evicted))  # place() takes reclaimable victims first
            if rk:
                self.evicted_reclaimable += rk
                self.reclaimable_blocks -= rk
                self.reclaimable_bytes -= rk * size
        if self._listeners and (evicted or dropped):
            for ens, hs in _group(evicted + dropped if dropped else evicted).items():
                self._emit(IndexEvent.EVICT, ens, hs)
        if not commit:
            self._pending += len(made)
            return out
        # commit(made): fresh blocks are current, unpinned and in this call's order.
        _native_settle(made, self._lru_reclaimable if reclaimable else lru)
        self.resident_blocks += len(made)
        self.resident_bytes += len(made) * size
        if reclaimable:
            self.reclaimable_blocks += len(made)
            self.reclaimable_bytes += len(made) * size
        if self._listeners and made:
            self._emit(IndexEvent.INSERT, ns, list(map(_HASH, made)))
        return made

    def commit(self, pending: Sequence[Block]) -> list[Block]:
        """Make PENDING blocks RESIDENT (visible). Returns the blocks committed."""
        done: list[Block] = []
        tables = self._blocks
        lru = self._lru
        nbytes = 0
        rblocks = rbytes = 0
        for b in pending:
            # .get: the namespace may be gone (cleared while the block was written, then dropped)
            if b.state != PENDING or (t := tables.get(b.ns.id)) is None or t.get(b.hash) is not b:
                if b in self._voided:  # its namespace was cleared while it was written
                    self._voided.discard(b)
                    self.alloc.free(b.offset, b.size)
                continue
            b.state = RESIDENT
            nbytes += b.size
            if b.reclaimable:
                rblocks += 1
                rbytes += b.size
                if b.pins == 0:
                    self._lru_reclaimable[b] = None
            elif b.pins == 0:
                lru[b] = None
            done.append(b)
        self._pending -= len(done)
        self.resident_blocks += len(done)
        self.resident_bytes += nbytes
        self.reclaimable_blocks += rblocks
        self.reclaimable_bytes += rbytes
        if self._listeners:
            for ns, hs in _group(done).items():
                self._emit(IndexEvent.INSERT, ns, hs)
        return done

    def discard(self, pending: Iterable[Block]) -> int:
        """Free PENDING pages that will never be committed."""
        n = 0
        for b in pending:
            if b.state == PENDING and self._current(b):
                del self._blocks[b.ns.id][b.hash]
                self.alloc.free(b.offset, b.size)
                self._uncharge(b)
                n += 1
            elif b in self._voided:
                self._voided.discard(b)
                self.alloc.free(b.offset, b.size)
        self._pending -= n
        return n

    def remove(self, blocks: Iterable[Block]) -> list[Block]:
        """Drop RESIDENT unpinned blocks (e.g. a failed checksum). Returns those removed."""
        # dict.fromkeys: a block named twice is removed once
        gone = [b for b in dict.fromkeys(blocks) if b.state == RESIDENT and b.pins == 0 and self._current(b)]
        for b in gone:
            self._drop(b)
        for ns, hs in _group(gone).items():
            self._emit(IndexEvent.REMOVE, ns, hs)
        return gone

    def clear(self, ns: Namespace) -> tuple[list[bytes], int]:
        """Drop every RESIDENT block of ``ns`` (a reset: the engine says its cache is stale).

        Unpinned blocks free their page now. Pinned ones (leased, or being sent to a peer or
        written to SSD) leave the lookup table at once, so no later Query finds them, and free
        their page when their last pin goes. PENDING pages (a save or an SSD promotion in
        flight) leave the table too and never become visible: their writer's commit or
        discard frees them. Remove events are emitted for the RESIDENT ones. Returns the
        hashes dropped and how many were pinned or pending.
        """
        t = self._blocks.get(ns.id)
        if not t:
            return [], 0
        gone = [b for b in t.values() if b.state == RESIDENT]
        pending = [b for b in t.values() if b.state == PENDING]
        for b in pending:
            del t[b.hash]
            self._voided.add(b)
            self._uncharge(b)
        self._pending -= len(pending)
        busy = len(pending)
        for b in gone:
            if b.pins == 0:
                self._drop(b)
            else:
                del t[b.hash]
                self.resident_blocks -= 1
                self.resident_bytes -= b.size
                self._unclass(b)
                self._uncharge(b)
                self._detached.add(b)
                self.removed_held += 1
                busy += 1
        hashes = [b.hash for b in gone]
        self._emit(IndexEvent.REMOVE, ns, hashes)
        return hashes, busy

    # ---- eviction ---------------------------------------------------------------------
    def _allocate(self, ns: Namespace, h: bytes, dropped: list[Block]) -> int | None:
        """A page for block ``h`` of ``ns``: free space, else the page of the eviction order's
        head (reclaimable copies first) if it fits and admission prefers ``h``, else evict
        until one is carved. Victims are counted here and appended to ``dropped`` (the caller
        reports them); None: no room (or admission refused)."""
        size = ns.page_bytes
        alloc = self.alloc
        need = alloc.round(size)
        if alloc.free_bytes >= need:  # else alloc() would raise; exceptions are slow
            try:
                return alloc.alloc(size)
            except OutOfSpace:
                pass
        lru = self._lru_reclaimable or self._lru  # reclaimable copies go first
        if not lru:
            return None
        victim = next(iter(lru))
        if self.admission is not None:
            if not self.admission.admit(block_key(ns.salt, h), block_key(victim.ns.salt, victim.hash)):
                self.admission_rejections += 1
                return None
        vsize = victim.size
        if vsize == size or alloc.round(vsize) == need:
            # The victim's page fits exactly: hand it over instead of freeing and carving
            # it again. One eviction either way, as the loop below would do.
            lru.popitem(last=False)
            del self._blocks[victim.ns.id][victim.hash]
            self.resident_blocks -= 1
            self.resident_bytes -= vsize
            self._unclass(victim)
            self._evicted(victim, dropped)
            return victim.offset
        while True:
            oldest = self._peek_victim()
            if oldest is None:
                return None
            self._drop(oldest)
            self._evicted(oldest, dropped)
            if self.alloc.free_bytes >= self.alloc.round(size):
                try:
                    return self.alloc.alloc(size)
                except OutOfSpace:
                    continue

    def _peek_victim(self) -> Block | None:
        if self._lru_reclaimable:
            return next(iter(self._lru_reclaimable))
        if self._lru:
            return next(iter(self._lru))
        return None

    def _drop(self, b: Block) -> None:
        del self._blocks[b.ns.id][b.hash]
        (self._lru_reclaimable if b.reclaimable else self._lru).pop(b, None)
        self.alloc.free(b.offset, b.size)
        self.resident_blocks -= 1
        self.resident_bytes -= b.size
        self._unclass(b)
        if self._quota_group:
            self._uncharge(b)
            if self._park_seq:
                self._unpark(b)

    def _unclass(self, b: Block) -> None:
        """RESIDENT ``b`` left the table: its class holds it no more."""
        if b.reclaimable:
            self.reclaimable_blocks -= 1
            self.reclaimable_bytes -= b.size

    def _uncharge(self, b: Block) -> None:
        """``b`` left the table: its group (if any) holds its page no more."""
        g = self._quota_group.get(b.ns.id)
        if g is not None:
            self.held[g] -= b.size

    # ---- eviction with namespace quotas -----------------------------------------------
    def _allocate_shared(self, ns: Namespace, h: bytes, dropped: list[Block]) -> int | None:
        """``_allocate`` under namespace quotas (module docstring): a group at its maximum
        takes its own LRU block, anyone else the LRU block of a namespace that may lose
        one; free space is used first unless the group is at its maximum. Admission, when
        set, is asked once, about the first victim."""
        size = ns.page_bytes
        alloc = self.alloc
        need = alloc.round(size)
        g = self._quota_group.get(ns.id)
        adm = self.admission
        asked = adm is None
        carving = False  # once a victim is freed, carve (as _allocate's loop): no hand-over
        while True:
            capped = g is not None and self.held[g] + size > self._limits[g][1]
            if not capped and alloc.free_bytes >= need:
                try:
                    return alloc.alloc(size)
                except OutOfSpace:
                    pass
            victim = self._shared_victim(g, capped, g is not None and self.held[g] + size <= self._limits[g][0])
            if victim is None:
                return None
            if not asked and adm is not None:  # (asked is False only with a policy)
                asked = True
                if not adm.admit(block_key(ns.salt, h), block_key(victim.ns.salt, victim.hash)):
                    self.admission_rejections += 1
                    return None
            if capped:
                self.quota_evictions += 1
            vsize = victim.size
            if not carving and (vsize == size or alloc.round(vsize) == need):  # hand its page over
                if not self._unpark(victim):
                    (self._lru_reclaimable if victim.reclaimable else self._lru).pop(victim)
                del self._blocks[victim.ns.id][victim.hash]
                self.resident_blocks -= 1
                self.resident_bytes -= vsize
                self._unclass(victim)
                self._uncharge(victim)
                self._evicted(victim, dropped)
                return victim.offset
            self._drop(victim)
            self._evicted(victim, dropped)
            carving = True

    def _evicted(self, victim: Block, dropped: list[Block]) -> None:
        """Count one eviction (to make room) and hand the victim to the caller's events."""
        self.evictions += 1
        self.evicted_bytes += victim.size
        if victim.reclaimable:
            self.evicted_reclaimable += 1
        dropped.append(victim)

    def _shared_victim(self, g: int | None, capped: bool, claiming: bool) -> Block | None:
        """The least recently used block the inserting group ``g`` may evict (reclaimable
        copies first): with ``capped``, one of its own; else one of a namespace that is not
        in another group at or under its guarantee. ``claiming`` (the new block still fits
        in ``g``'s guarantee): others' blocks first, its own only when nobody else has one
        to give, so a group always grows to its guarantee."""
        if capped:
            return self._oldest(lambda c: c == g)
        held, limits = self.held, self._limits
        blocked = {i for i, (lo, _) in enumerate(limits) if i != g and lo and held[i] <= lo}
        if claiming:
            victim = self._oldest(lambda c: c != g and c not in blocked)
            return victim if victim is not None else self._oldest(lambda c: c == g)
        if not blocked:
            return self._oldest(None)
        return self._oldest(lambda c: c not in blocked)

    def _oldest(self, ok: Callable[[int], bool] | None) -> Block | None:
        """The oldest evictable block whose class (quota group, -1: none) is ``ok`` (None: any):
        reclaimable copies first, then parked blocks (older than all of ``_lru``), then
        ``_lru`` from its head, parking what it skips. Each block is parked at most once
        until it is used again, so the walk is amortised O(1) per eviction."""
        cls = self._quota_group.get
        for b in self._lru_reclaimable:  # copies pulled from peers: few, not parked
            if ok is None or ok(cls(b.ns.id, -1)):
                return b
        if self._park_seq:
            seq = self._park_seq
            best: Block | None = None
            for c, plru in self._parked.items():
                if plru and (ok is None or ok(c)):
                    head = next(iter(plru))
                    if best is None or seq[head] < seq[best]:
                        best = head
            if best is not None:
                return best
        lru = self._lru
        while lru:
            b = next(iter(lru))
            c = cls(b.ns.id, -1)
            if ok is None or ok(c):
                return b
            lru.popitem(last=False)  # park it: older than every block left in _lru
            parked = self._parked.get(c)
            if parked is None:
                parked = self._parked[c] = LRU()
            parked[b] = None
            self._park_seq[b] = self._park_next
            self._park_next += 1
        return None

    def _parked_out_of_reach(self, g: int | None) -> bool:
        """No parked block may be evicted by group ``g`` now: each is in another group at or
        under its guarantee. (place() only evicts ``g``'s own blocks, so this holds for a
        whole request.)"""
        held, limits = self.held, self._limits
        return all(
            c >= 0 and c != g and limits[c][0] and held[c] <= limits[c][0]
            for c, plru in self._parked.items()
            if plru
        )

    def _unpark(self, b: Block) -> bool:
        """Take ``b`` out of the parked blocks; False if it was not parked."""
        if self._park_seq.pop(b, None) is None:
            return False
        self._parked[self._quota_group.get(b.ns.id, -1)].pop(b)
        return True

    # ---- inspection -------------------------------------------------------------------
    def quota_usage(self) -> list[tuple[int, int, int]]:
        """Per quota group (``Quotas`` order): (held bytes, guaranteed bytes, maximum bytes)."""
        return [(held, lo, hi) for held, (lo, hi) in zip(self.held, self._limits, strict=True)]

    def resident(self, ns: Namespace | None = None) -> list[Block]:
        return [
            b for t in self._blocks.values() for b in t.values() if b.state == RESIDENT and (ns is None or b.ns is ns)
        ]

    def blocks_by_namespace(self) -> dict[str, int]:
        out = {ns.name: 0 for ns in self._namespaces.values()}
        for t in self._blocks.values():
            for b in t.values():
                if b.state == RESIDENT:
                    out[b.ns.name] += 1
        return out

    def oldest_retained(self) -> Iterator[Block]:
        """Evictable retained blocks, the next to be evicted first (the decode backup's
        candidates, ``pegaflow/node/backup.py``): lazy, so a caller walks only what it takes;
        the index must not change while it walks."""
        if self._park_seq:
            yield from sorted(self._park_seq, key=self._park_seq.__getitem__)
        yield from self._lru

    def lru_order(self) -> list[Block]:
        """Eviction order (first evicted first); pinned blocks excluded."""
        parked = sorted(self._park_seq, key=self._park_seq.__getitem__)
        return [*self._lru_reclaimable, *parked, *self._lru]


def _group(blocks: Iterable[Block]) -> dict[Namespace, list[bytes]]:
    if isinstance(blocks, list) and blocks:
        ns = blocks[0].ns
        if list(map(_NS, blocks)).count(ns) == len(blocks):  # one namespace: no hashing of ns
            return {ns: list(map(_HASH, blocks))}
    out: dict[Namespace, list[bytes]] = {}
    for b in blocks:
        out.setdefault(b.ns, []).append(b.hash)
    return out
