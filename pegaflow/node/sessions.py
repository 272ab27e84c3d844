"""Engine sessions and what they hold: leases (read pins) and reservations (pending writes).

Contracts:
- A session is created by Register and owned by one engine process, which keeps it alive
  with its ``Session`` stream. The stream ending (the engine died or disconnected) ends the
  session: its reservations are discarded (their pages never become visible) and its
  leases released. A session that opens no stream within ``session_open_timeout`` seconds
  of its Register is ended the same way (a client that registered and vanished).
- **A page held by a live session is never given to another block, whatever the clock
  says.** A lease pins its pages until Release or the session's end; a reservation holds
  PENDING pages that only its session writes until Commit/abort or the session's end.
  ``lease_ttl`` and ``reservation_ttl`` do not take pages away from a live holder (a writer
  slower than the TTL would otherwise overwrite pages already given to another block, a
  slow reader would copy someone else's bytes): a holding past its TTL is reported once
  (``Expiry``, then a metric and a log line at the node) and keeps its pages. Only the
  holder's session ending frees them.
- A session may use only the namespaces it registered (namespace isolation). Register is
  atomic: a registration that fails creates no namespace.
- Ids of sessions, leases and reservations are random 63-bit numbers (unguessable), and
  leases and reservations are looked up within their session only: one session can never
  release, commit or abort another's.
- A session holds at most ``MAX_LEASES`` leases: a lease does not take a page (it pins
  ones already held), so their number is not bounded by the pool, and an engine that
  never released them would grow the node's memory and every scrape's pass over them.
  Reservations take pages: the pool bounds them.

Not thread-safe: the node calls this from its event loop only.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from pegaflow.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pegaflow.core.block_index import PENDING, Block, BlockIndex, Namespace
from pegaflow.node.numa import prefer_node

IDS_PER_READ = 512  # random ids fetched per system call
SESSION_OPEN_TIMEOUT = 30.0  # seconds from Register to the Session stream (PegaClient opens it at once)
MAX_LEASES = 65_536  # per session: far above an engine's requests in flight (vLLM: max_num_seqs, hundreds)


@dataclass(eq=False)
class Lease:
    id: int
    session_id: int
    blocks: list[Block]
    expires: float
    overdue: bool = False  # held past lease_ttl by a live session (reported once)


@dataclass(eq=False)
class Reservation:
    id: int
    session_id: int
    ns: Namespace
    blocks: list[Block | None]  # index-aligned with the request's hashes
    expires: float
    committed: bool = False
    overdue: bool = False  # held past reservation_ttl by a live session (reported once)


@dataclass(eq=False)
class Session:
    id: int
    instance_id: str
    namespaces: dict[str, Namespace]
    leases: dict[int, Lease] = field(default_factory=dict)
    reservations: dict[int, Reservation] = field(default_factory=dict)
    streams: int = 0
    streamed: bool = False  # a Session stream was opened at least once
    created: float = 0.0
    watch_blocks: bool = False  # send block events on the Session stream (RegisterRequest.watch_blocks)
    numa_node: int | None = None  # the engine's NUMA node: its pages come from that part (node/numa.py)


@dataclass(frozen=True)
class Expiry:
    """What one :meth:`Sessions.expire` sweep found."""

    reservations_overdue: int = 0  # newly past reservation_ttl, kept (their session lives)
    leases_overdue: int = 0  # newly past lease_ttl, kept
    sessions_closed: int = 0  # never opened their Session stream in time: ended
    reservations_freed: int = 0  # ... with what they held
    leases_freed: int = 0


class RandomIds:
    """Unguessable 63-bit ids from the OS's CSPRNG, read ``IDS_PER_READ`` at a time: one
    ``getrandom`` per id (``secrets.randbits``) was ~6% of the node's CPU on a Query+Release
    and Reserve+Commit loop (py-spy, 2-core VM, where a system call is expensive)."""

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0

    def next(self) -> int:
        if self._pos >= len(self._buf):
            self._buf, self._pos = secrets.token_bytes(8 * IDS_PER_READ), 0
        i = int.from_bytes(self._buf[self._pos:self._pos + 8], "little") >> 1
        self._pos += 8
        return i


class Sessions:
    def __init__(
        self,
        index: BlockIndex,
        reservation_ttl: float = 120.0,
        lease_ttl: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        session_open_timeout: float = SESSION_OPEN_TIMEOUT,
        max_namespaces: int = 4096,
    ) -> None:
        self.index = index
        self.max_namespaces = max_namespaces
        self.reservation_ttl = reservation_ttl
        self.lease_ttl = lease_ttl
        self.session_open_timeout = session_open_timeout
        self.clock = clock
        self.sessions: dict[int, Session] = {}
        self._ns_users: dict[str, int] = {}  # namespace name -> live sessions that registered it
        # namespace name -> NUMA node of the GPU of the newest worker that registered it
        # (``writer_node``): where its pages go, whoever reserves them.
        self._ns_numa: dict[str, int] = {}
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Reservation] = {}
        # Ids of reservations that were committed or aborted, to tell "duplicate commit"
        # apart from "unknown reservation" in error messages (bounded).
        self._closed: dict[int, str] = {}
        self._ids = RandomIds()

    def _new_id(self, taken: Container[int]) -> int:
        while True:
            i = self._ids.next()
            if i and i not in taken and i not in self._closed:
                return i

    # ---- sessions ---------------------------------------------------------------------
    def open(self, instance_id: str, namespaces: Sequence[tuple[str, int]]) -> Session:
        wanted: dict[str, int] = {}
        for name, page_bytes in namespaces:
            if wanted.setdefault(name, page_bytes) != page_bytes:
                raise InvalidArgument(f"namespace {name!r} is registered twice, with page_bytes "
                                      f"{wanted[name]} and {page_bytes}")
        new = set()
        for name, page_bytes in wanted.items():  # all checked before any is created
            ns = self.index.get_namespace(name)
            if ns is not None and ns.page_bytes != page_bytes:
                raise InvalidArgument(
                    f"namespace {name!r} has page_bytes={ns.page_bytes}, registration asked for {page_bytes}"
                )
            if ns is None:
                new.add(name)
        if new and len(self.index.namespaces()) + len(new) > self.max_namespaces:
            raise ResourceExhausted(f"this node holds {len(self.index.namespaces())} namespaces; "
                                    f"{len(new)} more would pass --max-namespaces {self.max_namespaces}")
        nss = {name: self.index.namespace(name, page_bytes) for name, page_bytes in wanted.items()}
        s = Session(self._new_id(self.sessions), instance_id, nss, created=self.clock())
        self.sessions[s.id] = s
        for name in nss:
            self._ns_users[name] = self._ns_users.get(name, 0) + 1
        return s

    def uses(self, name: str) -> bool:
        """Whether a live session registered namespace ``name``."""
        return name in self._ns_users

    def get(self, session_id: int) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise FailedPrecondition(f"unknown session {session_id} (node restarted? register again)")
        return s

    def namespace(self, s: Session, name: str) -> Namespace:
        ns = s.namespaces.get(name)
        if ns is None:
            raise InvalidArgument(f"namespace {name!r} is not registered by session {s.id}")
        return ns

    def close(self, session_id: int) -> tuple[int, int]:
        """End a session; returns (reservations discarded, leases released)."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            return (0, 0)
        for name in s.namespaces:
            n = self._ns_users[name] - 1
            if n:
                self._ns_users[name] = n
            else:
                del self._ns_users[name]
        r = len(s.reservations)
        for res in list(s.reservations.values()):
            self._drop_reservation(res)
        n = len(s.leases)
        for lease in list(s.leases.values()):
            self._drop_lease(lease)
        return (r, n)

    # ---- leases -----------------------------------------------------------------------
    def lease(self, s: Session, blocks: list[Block]) -> Lease:
        if len(s.leases) >= MAX_LEASES:
            raise ResourceExhausted(f"session {s.id} holds {MAX_LEASES} leases: release them (Release) first")
        self.index.pin(blocks)
        lease = Lease(self._new_id(self.leases), s.id, blocks, self.clock() + self.lease_ttl)
        s.leases[lease.id] = lease
        self.leases[lease.id] = lease
        return lease

    def load_pins(self) -> tuple[int, int, int, int]:
        """The leases' pins (the load path's), as the original counts its pinned_for_load:
        (session, block) entries, references (blocks over every lease), distinct blocks, and
        their bytes. One pass over the leased blocks (a scrape's cost). Called from the
        /metrics thread while the loop adds and drops leases: it iterates a copy of the
        table (``tuple`` of a dict's values copies it in C, with the GIL held)."""
        refs = 0
        entries: set[tuple[int, Block]] = set()
        for lease in tuple(self.leases.values()):
            refs += len(lease.blocks)
            sid = lease.session_id
            entries.update((sid, b) for b in lease.blocks)
        unique = {b for _, b in entries}
        return len(entries), refs, len(unique), sum(b.size for b in unique)

    def release(self, s: Session, lease_id: int) -> None:
        lease = s.leases.get(lease_id)
        if lease is None:
            raise InvalidArgument(f"unknown lease {lease_id} for session {s.id}")
        self._drop_lease(lease)

    def _drop_lease(self, lease: Lease) -> None:
        self.leases.pop(lease.id, None)
        s = self.sessions.get(lease.session_id)
        if s is not None:
            s.leases.pop(lease.id, None)
        self.index.unpin(lease.blocks)

    def writer_node(self, s: Session) -> None:
        """``s`` registered from a GPU (its ``numa_node`` is that GPU's): its namespaces'
        pages go to that node. The engine's scheduler side reserves every page, from a
        process with no GPU; each TP rank's worker copies its own shard's pages, so the
        shard's pages belong near that rank's GPU (on a 2-socket host, half the ranks would
        otherwise copy across the sockets)."""
        if s.numa_node is not None:
            for name in s.namespaces:
                self._ns_numa[name] = s.numa_node

    # ---- reservations -----------------------------------------------------------------
    def reserve(self, s: Session, ns: Namespace, hashes: Sequence[bytes]) -> Reservation:
        with prefer_node(self.index.alloc, self._ns_numa.get(ns.name, s.numa_node)):
            blocks = self.index.reserve(ns, hashes)
        res = Reservation(self._new_id(self.reservations), s.id, ns, blocks, self.clock() + self.reservation_ttl)
        if any(b is not None for b in blocks):
            s.reservations[res.id] = res
            self.reservations[res.id] = res
        return res

    def commit(self, s: Session, reservation_id: int, indices: Sequence[int] = (), abort: bool = False) -> int:
        res = s.reservations.get(reservation_id)
        if res is None:
            why = self._closed.get(reservation_id)
            if why:
                raise InvalidArgument(f"reservation {reservation_id} was already {why}")
            raise InvalidArgument(f"unknown reservation {reservation_id} for session {s.id}")
        if abort:
            self._drop_reservation(res)
            self._remember(res.id, "aborted")
            return 0
        n = len(res.blocks)
        bad = [i for i in indices if not 0 <= i < n]
        if bad:
            raise InvalidArgument(f"indices out of range for reservation of {n} blocks: {bad[:8]}")
        if indices:
            chosen = [res.blocks[i] for i in sorted(set(indices))]
            if any(b is None for b in chosen):
                raise InvalidArgument("indices name blocks that were not reserved (offset -1)")
            pending = [b for b in chosen if b is not None]
        else:
            pending = [b for b in res.blocks if b is not None]
        committed = self.index.commit(pending)
        # Reserved pages not committed now are never written: free them.
        self.index.discard([b for b in res.blocks if b is not None and b.state == PENDING])
        self._forget(res)
        self._remember(res.id, "committed")
        return len(committed)

    def _drop_reservation(self, res: Reservation) -> None:
        self.index.discard([b for b in res.blocks if b is not None])
        self._forget(res)

    def _forget(self, res: Reservation) -> None:
        self.reservations.pop(res.id, None)
        s = self.sessions.get(res.session_id)
        if s is not None:
            s.reservations.pop(res.id, None)

    def _remember(self, rid: int, why: str) -> None:
        self._closed[rid] = why
        if len(self._closed) > 100_000:
            for k in list(itertools.islice(self._closed, 50_000)):
                del self._closed[k]

    # ---- expiry -----------------------------------------------------------------------
    def expire(self) -> Expiry:
        """One sweep: end sessions that never opened their stream in time (freeing what they
        held), and report holdings newly past their TTL. Nothing a live session holds is freed."""
        now = self.clock()
        stale = [s for s in self.sessions.values()
                 if not s.streamed and s.streams == 0 and now - s.created >= self.session_open_timeout]
        freed_r = freed_l = 0
        for s in stale:
            nr, nl = self.close(s.id)
            freed_r += nr
            freed_l += nl
        late_r = [r for r in self.reservations.values() if not r.overdue and r.expires <= now]
        for r in late_r:
            r.overdue = True
        late_l = [x for x in self.leases.values() if not x.overdue and x.expires <= now]
        for x in late_l:
            x.overdue = True
        return Expiry(len(late_r), len(late_l), len(stale), freed_r, freed_l)
