"""Engine sessions and what they hold: leases (read pins) and reservations (pending writes).

Contracts:
- A session is created by Register and owned by one engine process. Its keep-alive stream
  ending (the engine died or disconnected) ends the session: its reservations are
  discarded (their pages never become visible) and its leases released.
- A lease pins the pages of a Query's hits until Release, the session's end, or
  ``lease_ttl`` seconds (a safety net against leaks), whichever comes first.
- A reservation holds PENDING pages that only its session writes. Commit makes them
  visible; after ``reservation_ttl`` seconds without a commit they are freed.
- A session may use only the namespaces it registered (namespace isolation).

Not thread-safe: the node calls this from its event loop only.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pegaflow.common.errors import FailedPrecondition, InvalidArgument
from pegaflow.node.block_index import PENDING, Block, BlockIndex, Namespace


@dataclass(eq=False)
class Lease:
    id: int
    session_id: int
    blocks: list[Block]
    expires: float


@dataclass(eq=False)
class Reservation:
    id: int
    session_id: int
    ns: Namespace
    blocks: list[Block | None]  # index-aligned with the request's hashes
    expires: float
    committed: bool = False


@dataclass(eq=False)
class Session:
    id: int
    instance_id: str
    namespaces: dict[str, Namespace]
    leases: dict[int, Lease] = field(default_factory=dict)
    reservations: dict[int, Reservation] = field(default_factory=dict)
    streams: int = 0
    created: float = 0.0


class Sessions:
    def __init__(
        self,
        index: BlockIndex,
        reservation_ttl: float = 120.0,
        lease_ttl: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.reservation_ttl = reservation_ttl
        self.lease_ttl = lease_ttl
        self.clock = clock
        self._ids = itertools.count(1)
        self.sessions: dict[int, Session] = {}
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Reservation] = {}
        # Ids of reservations that were committed or aborted, to tell "duplicate commit"
        # apart from "unknown reservation" in error messages (bounded).
        self._closed: dict[int, str] = {}
        self.expired_reservations = 0
        self.expired_leases = 0

    # ---- sessions ---------------------------------------------------------------------
    def open(self, instance_id: str, namespaces: Sequence[tuple[str, int]]) -> Session:
        nss: dict[str, Namespace] = {}
        for name, page_bytes in namespaces:
            try:
                nss[name] = self.index.namespace(name, page_bytes)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        s = Session(next(self._ids), instance_id, nss, created=self.clock())
        self.sessions[s.id] = s
        return s

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
        r = len(s.reservations)
        for res in list(s.reservations.values()):
            self._drop_reservation(res)
        n = len(s.leases)
        for lease in list(s.leases.values()):
            self._drop_lease(lease)
        return (r, n)

    # ---- leases -----------------------------------------------------------------------
    def lease(self, s: Session, blocks: list[Block]) -> Lease:
        self.index.pin(blocks)
        lease = Lease(next(self._ids), s.id, blocks, self.clock() + self.lease_ttl)
        s.leases[lease.id] = lease
        self.leases[lease.id] = lease
        return lease

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

    # ---- reservations -----------------------------------------------------------------
    def reserve(self, s: Session, ns: Namespace, hashes: Sequence[bytes]) -> Reservation:
        blocks = self.index.reserve(ns, hashes)
        res = Reservation(next(self._ids), s.id, ns, blocks, self.clock() + self.reservation_ttl)
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
            raise InvalidArgument(f"unknown or expired reservation {reservation_id} for session {s.id}")
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
    def expire(self) -> tuple[int, int]:
        """Drop reservations and leases past their deadline; returns how many of each."""
        now = self.clock()
        rs = [r for r in self.reservations.values() if r.expires <= now]
        for r in rs:
            self._drop_reservation(r)
            self._remember(r.id, "expired")
        ls = [x for x in self.leases.values() if x.expires <= now]
        for x in ls:
            self._drop_lease(x)
        self.expired_reservations += len(rs)
        self.expired_leases += len(ls)
        return (len(rs), len(ls))
