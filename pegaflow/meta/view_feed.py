"""Keeps a replica's in-memory view of the index current from the node streams, and answers
lookups from it while it is fresh (issue #55).

Why: a lookup answered from Redis costs a round trip, its replies read in Python, and the
liveness keys read beside it (``lookup.py``); from the replica's own memory it is one C call
(``view.PrefixView.walk``, ~5-8 us for 128 hashes). Redis stays the durable, shared index
every replica answers from when its view cannot (``--view-max-lag-ms``, docs/meta.md).

How: one thread (``pf-meta-view``) runs rounds. A round is one round trip (every shard
written before any is read: ``redis_conn.raw_round_trip``) carrying the registry's version,
every node's liveness key and heartbeat stamp, Redis's clock (what the Redis path reads per
lookup: ``registry.visibility_commands``) and a plain ``XREAD`` of every node's stream from
where the last round stopped, ``READ_COUNT`` entries a stream. Plain, not the consumer group:
the consumer (``apply_process.py``) keeps applying the same entries to Redis, unchanged, and
acking them. On standalone Redis it is one ``XREAD`` of every stream, on a cluster one per
stream (their keys are in different slots). While nothing is new the thread sleeps between
rounds: ``poll_s`` after a round that read something, twice as long after each empty one, up
to ``idle_s`` (a quarter of the bound: 25 ms at the default 100 ms). An idle round asks what
the last one asked, so its commands are packed once and sent again as they were: 51-63 µs of
CPU a round against 165 µs packing them each time (2-core host K; partly under the
interpreter lock that lookups need). Before the backoff, polling every 5 ms, this thread of an
idle metaserver used 7.9% of a core, 2.3% with it (rounds of ~0.4-0.6 ms then). The first
event after a quiet spell is read within ``idle_s``, inside the bound. Not ``XREAD BLOCK``: Redis times a blocked client out only when its event loop wakes, every
1/hz s (100 ms at the default hz 10), so a blocking round would last that long whenever
nothing is written, and its liveness would be as old. A second thread (``pf-meta-view-watch``)
holds a ``BLPOP`` of a key nobody writes on the registry's shard, so the view goes out of use
the moment that connection drops (Redis stopped, restarted or failed over), not a poll later.

Contracts:

1. Freshness. A round whose every stream returned fewer than ``READ_COUNT`` entries drained
   them: the view then holds every event written before the round was sent. With the
   liveness read in that same round, that send time is the ``at`` of the :class:`Snapshot`
   lookups read; :meth:`ViewFeed.holders` answers only while ``now - at <= max_lag_s`` and
   returns None otherwise (the caller reads Redis). So no answer from the view misses an
   event or a liveness change older than the bound. (The Redis index lags the streams by
   the consumer's own delay, which the view does not add to.)
2. The same facts as the index. Per incarnation (nid) the view applies what the consumer
   applies to Redis, in stream order: INSERT and SNAPSHOT add in their tier, EVICT removes,
   RESET changes no block (``events/schema.py``). Each stream is read from its first entry:
   the RESET of the node's current epoch, or an older epoch's entries not trimmed yet (they
   go to that incarnation's slot, cleared once it is superseded). An incarnation is
   *complete* once its RESET was applied; lookups read the view only while every visible
   incarnation is complete (streams deleted by hand, a stream recreated under an old read
   position: the view cannot tell what it misses). An incomplete one still visible after the
   streams drained for ``RESTART_AFTER_S`` makes the view start over (doubling up to
   ``RESTART_MAX_S``).
3. Liveness is the Redis path's rule (``registry.fresh``: the live key, ``--node-stale-secs``
   against Redis's clock) read every round, so a node that dies or restarts leaves the
   view's answers within the bound (the Redis path: at its next lookup).
4. Slots: at most ``view.MAX_SLOTS`` incarnations at a time. One is superseded when it is
   neither its node's newest registration nor its live key's (a newer registration, a
   reaped node), judged only on a registry read after its slot was taken (a round later);
   its events are skipped from then on and its slot is cleared in steps of ``CLEAR_BUDGET``
   entries between rounds (no step holds the GIL more than ~1 ms at 1M blocks), then reused.
   More incarnations than slots, or namespaces than ``view.MAX_NAMESPACES``: lookups read
   Redis, and the view starts over once few enough incarnations are referenced.
5. A Redis error puts the view out of use at once (lookups read Redis, and fail as they did)
   and the view starts over from the streams' beginning once Redis answers again (it may
   have restarted empty, its streams with it).
6. Threads: only the feeder thread writes the view and its maps. A lookup reads the snapshot
   and walks the view under ``_lock`` (every view call holds the GIL, so each is atomic); the
   feeder takes it only to give a slot a new incarnation or to start over, so no walk reads a
   reused slot under the node name of an older snapshot.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import hiredis
import redis
import structlog

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import (
    Client,
    Command,
    Reply,
    checked,
    error_text,
    is_cluster,
    parallel,
    raw_round_trip,
    relearn,
)
from pegaflow.common.priority import name_thread
from pegaflow.meta.events.codec import FIELD, MalformedEvent, decode
from pegaflow.meta.events.schema import Event, Op
from pegaflow.meta.view import MAX_NAMESPACES, MAX_SLOTS, PrefixView

log = structlog.get_logger("pegaflow.meta.view_feed")

READ_COUNT = 64  # entries per stream per round (~0.5 MB at 512 hashes an entry): bounds one round's work
POLL_S = 0.005  # sleep after a round that read something (and at most a twentieth of the bound)
IDLE_FRACTION = 0.25  # the sleep doubles after each empty round up to this share of the bound
WATCH_S = 0.5  # the watcher's BLPOP timeout (below redis_conn.connect's 5 s socket timeout)
CLEAR_BUDGET = 32768  # entries one clear step visits: ~0.3-0.7 ms at 1M blocks (clear_slot_part)
CLEAR_ROUND_S = 0.002  # clear steps per round stop after this long
RETRY_S = 0.2  # after a Redis error
RESTART_AFTER_S = 5.0  # an incomplete visible incarnation this long after the streams drained: start over
RESTART_MAX_S = 300.0  # the wait doubles up to this while starting over does not help
START = b"0-0"  # a stream read from its first entry
MAX_DEAD = 1 << 16  # superseded nids remembered (their events skipped); each incarnation is one


# A round's commands: per shard as lists and packed (RESP), and the registry's count (ViewFeed._commands).
_Asked = tuple[list[tuple[str, list[Command]]], list[tuple[str, bytes, int]], int]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a lookup reads: the visible incarnations' slots, as of ``at``."""

    at: float  # time.monotonic() of the round the view and the liveness below are as of
    live_mask: int  # bit s: slot s is a visible incarnation's
    nodes: dict[int, tuple[str, str]]  # slot -> (node name, address) of the visible incarnations


@dataclass(slots=True)
class _Slot:
    nid: int
    node: str
    round: int  # the round its first event was read in
    complete: bool  # its RESET applied: the view holds all its events


@dataclass(frozen=True, slots=True)
class _Registry:
    """One round's registry (its version matched the nodes loaded)."""

    round: int
    newest: dict[str, int]  # node -> its newest registration's nid
    live: dict[str, int]  # node -> the nid its live key names (visible unless stale)
    visible: dict[int, str]  # nid -> node: live and fresh (registry.fresh)


class ViewFeed:
    """The view of one replica and the thread feeding it (the module's contracts).

    ``max_lag_s``: the bound of contract 1 (``--view-max-lag-ms``); ``stale_ms``: the
    metaserver's ``--node-stale-secs`` in ms, as ``Lookup`` gets it.
    """

    def __init__(self, r: Client, max_lag_s: float, stale_ms: int | None = None) -> None:
        if max_lag_s <= 0:
            raise ValueError("max_lag_s must be positive (no view: do not build one)")
        self.r = r
        self.max_lag_s = max_lag_s
        self.stale_ms = stale_ms
        self.cluster = is_cluster(r)
        self.poll_s = min(POLL_S, max_lag_s / 20)
        self.idle_s = max(self.poll_s, max_lag_s * IDLE_FRACTION)
        self.snapshot: Snapshot | None = None  # None: lookups read Redis
        self.restarts = 0  # times the view started over (not counting the first start)
        self.malformed = 0  # entries skipped (the consumer logs and counts them too)
        self.updates = 0  # block updates applied (hashes of INSERT, SNAPSHOT and EVICT), over start-overs too
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._native: bool | None = None  # raw_round_trip works (a real socket); None: not asked yet
        self._asked_for: tuple[tuple[str, ...], tuple[bytes, ...]] | None = None  # (nodes, positions) of _asked
        self._asked: _Asked = ([], [], 0)  # the last round's commands (_commands)
        self._round = 0
        self._version = -1  # of the nodes below
        self._names: list[str] = []
        self._addrs: dict[str, str] = {}
        self._newest: dict[str, int] = {}
        self._key_node: dict[bytes, str] = {}
        self._pos: dict[str, bytes] = {}  # node -> id of the last entry read from its stream
        self._reg: _Registry | None = None
        self._broken = False  # a Redis error since the last round: start over first
        self._stuck_since: float | None = None
        self._restart_after = RESTART_AFTER_S
        self._empty()

    def _empty(self) -> None:
        """A new, empty view; every stream read again from its first entry."""
        with self._lock:
            self.snapshot = None
            self.view = PrefixView()
            self._ns_ids: dict[str, int] = {}
        self._slots: list[_Slot | None] = [None] * MAX_SLOTS
        self._slot_of: dict[int, int] = {}  # nid -> its slot
        self._free = list(range(MAX_SLOTS - 1, -1, -1))  # lowest slot first
        self._dying: list[tuple[int, int]] = []  # (slot, clear_slot_part cursor) being cleared
        # Superseded nids, their events skipped: the newest MAX_DEAD (one forgotten is judged
        # superseded again by the registry at its next event, and skipped then).
        self._dead: dict[int, None] = {}
        self._overflow = False
        self._drained_at = -math.inf
        self._pos = dict.fromkeys(self._pos, START)
        self._reg = None  # judged superseded again only on a registry read from now on

    # --- what lookups call ----------------------------------------------------------------

    def holders(self, namespace: str, hashes: Sequence[bytes]) -> list[tuple[str, str, int, int]] | None:
        """(node, address, prefix_len, ssd_blocks) of every visible node holding block 0 of
        ``hashes``, as ``index.prefix_tiers`` and the liveness filter of ``lookup.py`` would
        answer; None when the view is out of use or older than the bound (read Redis)."""
        with self._lock:
            snap = self.snapshot
            if snap is None or time.monotonic() - snap.at > self.max_lag_s:
                return None
            ns = self._ns_ids.get(namespace)
            if ns is None:  # no event of it yet: nobody holds anything of it
                return []
            rows = self.view.walk(ns, hashes, snap.live_mask)
        nodes = snap.nodes
        return [(*nodes[slot], n, ssd) for slot, n, ssd in rows]

    def dump(self) -> dict[tuple[str, bytes], frozenset[str]] | None:
        """{(namespace, hash): visible nodes holding it} of the whole view as of its snapshot,
        any tier (tests and tools: ``Index.dump``'s counterpart); None while out of use."""
        with self._lock:
            snap = self.snapshot
            if snap is None:
                return None
            out: dict[tuple[str, bytes], frozenset[str]] = {}
            for namespace, ns in list(self._ns_ids.items()):  # the feeder may add one meanwhile
                for h, (l1, ssd) in self.view.dump(ns).items():
                    held = (l1 | ssd) & snap.live_mask
                    if held:
                        out[(namespace, h)] = frozenset(snap.nodes[s][0] for s in snap.nodes if held >> s & 1)
            return out

    def lag_s(self) -> float:
        """Seconds since the view last held every event written (inf: not since it started)."""
        return time.monotonic() - self._drained_at

    def incarnations(self) -> int:
        """Slots in use, those being cleared included."""
        return MAX_SLOTS - len(self._free)

    # --- the thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="pf-meta-view", daemon=True)
        self._thread.start()
        # Not joined at stop: it ends at its next BLPOP timeout, and holds nothing.
        threading.Thread(target=self.watch, name="pf-meta-view-watch", daemon=True).start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.snapshot = None

    def run(self) -> None:
        """Rounds until :meth:`stop`; Redis errors put the view out of use (contract 5)."""
        name_thread()
        failing = False
        sleep = self.poll_s
        while not self._stop.is_set():
            try:
                busy = self.step()
                if failing:
                    log.info("view_feed_redis_back", restarts=self.restarts)
                    failing = False
                if busy:
                    sleep = self.poll_s
                else:
                    self._stop.wait(sleep)
                    sleep = min(2 * sleep, self.idle_s)
            except (redis.RedisError, OSError) as exc:
                self.snapshot = None
                self._broken = True
                if str(exc).startswith(("MOVED", "ASK")):
                    relearn(self.r)  # resharded: re-learn who owns the slots
                if not failing:
                    log.warning("view_feed_redis_unavailable; lookups read Redis", error=error_text(exc))
                    failing = True
                self._stop.wait(RETRY_S)
            except Exception:  # a bug: lookups read Redis, the view starts over (logged once a streak)
                self.snapshot = None
                self._broken = True
                if not failing:
                    log.exception("view_feed_failed; lookups read Redis")
                    failing = True
                self._stop.wait(RETRY_S)

    def watch(self) -> None:
        """Block on Redis until :meth:`stop`; a dropped connection puts the view out of use
        at once (contract 5)."""
        name_thread()
        while not self._stop.is_set():
            try:
                self.r.blpop([keys.VIEW_WATCH], timeout=WATCH_S)
            except (redis.RedisError, OSError):
                self.snapshot = None
                self._broken = True  # the feeder starts over once Redis answers
                self._stop.wait(RETRY_S)

    def step(self) -> bool:
        """One round (the module's "How"); True when it read or cleared something."""
        if self._broken:
            self._broken = False
            self._version = -1  # Redis may have restarted empty: reload the nodes too
            self._start_over("redis error")
        self._round += 1
        names = self._names
        t_send = time.monotonic()
        version, vis_replies, reads = self._read(names)
        drained = True
        busy = False
        for node, entries in reads:
            if len(entries) >= READ_COUNT:
                drained = False
            if entries:
                busy = True
                self._apply(node, entries)
        if version != self._version:
            self._load_nodes()
            return True  # the registry moved: the next round judges liveness on it
        reg = self._registry(names, vis_replies)
        if drained:
            self._drained_at = t_send
        self._reg = reg
        self._supersede(reg)
        self._publish(reg, drained)
        return self._clear_some() or busy

    # --- reading ---------------------------------------------------------------------------

    def _read(self, names: list[str]) -> tuple[int, list[Reply], list[tuple[str, list[Reply]]]]:
        """The round trip: (registry version, replies of the visibility commands, entries per stream)."""
        asked_for = (tuple(names), tuple(self._pos[n] for n in names))
        if asked_for != self._asked_for:  # the nodes changed or a stream moved: this round asks anew
            self._asked, self._asked_for = self._commands(names), asked_for
        groups, packed, n_reg = self._asked  # else what the last round asked, packed once (~0.1 ms of Python)
        replies = self._round_trip(groups, packed)
        reg = replies[0][:n_reg]
        xreads = replies[0][n_reg:] if not self.cluster else [g[0] for g in replies[1:]]
        out: list[tuple[str, list[Reply]]] = []
        for rep in xreads:
            # {stream: entries} (RESP3, as redis-py connects to Redis 7), or [[stream, entries], ...]
            for key, entries in (rep.items() if isinstance(rep, dict) else rep or ()):
                node = self._key_node.get(bytes(key))
                if node is not None:
                    out.append((node, entries))
        return int(reg[0] or 0), reg[1:], out

    def _commands(self, names: list[str]) -> _Asked:
        """A round's commands per shard, as lists (``parallel``, no real socket) and packed
        (``raw_round_trip``), and how many of the first group's are the registry's."""
        reg_cmds: list[Command] = [["GET", keys.VERSION]]
        if names:
            reg_cmds += registry.visibility_commands(names)
        streams = [stream_key(n) for n in names]
        groups: list[tuple[str, list[Command]]]
        if self.cluster:
            groups = [(keys.VERSION, reg_cmds)]
            groups += [(k, [["XREAD", "COUNT", READ_COUNT, "STREAMS", k, self._pos[n]]])
                       for n, k in zip(names, streams, strict=True)]
        else:
            cmds = list(reg_cmds)
            if names:
                cmds.append(["XREAD", "COUNT", READ_COUNT, "STREAMS", *streams, *(self._pos[n] for n in names)])
            groups = [(keys.VERSION, cmds)]
        packed = [(k, b"".join(hiredis.pack_command(tuple(c))  # type: ignore[arg-type]  # the stub: a 1-tuple
                               for c in cmds), len(cmds)) for k, cmds in groups]
        return groups, packed, len(reg_cmds)

    def _round_trip(self, groups: list[tuple[str, list[Command]]], packed: list[tuple[str, bytes, int]]
                    ) -> list[list[Reply]]:
        if self._native is not False:
            got = raw_round_trip(self.r, packed)
            if got is not None:
                self._native = True
                return [checked(g) for g in got]
            self._native = False
        out = parallel(self.r, groups)  # no real socket (fakeredis)
        for g in out:
            for rep in g:
                if isinstance(rep, Exception):
                    raise rep
        return out

    def _load_nodes(self) -> None:
        version = registry.version(self.r)
        info = registry.nodes(self.r)
        self._names = sorted(info)
        self._addrs = {n: i.addr for n, i in info.items()}
        self._newest = {n: i.nid for n, i in info.items()}
        self._key_node = {stream_key(n).encode(): n for n in self._names}
        self._pos = {n: self._pos.get(n, START) for n in self._names}  # a reaped node's position goes
        self._version = version

    def _registry(self, names: list[str], replies: list[Reply]) -> _Registry:
        if not names:
            return _Registry(self._round, {}, {}, {})
        live_raw, seen, now = replies
        live = {n: int(v) for n, v in zip(names, live_raw, strict=True) if v is not None}
        visible = registry.fresh(names, live_raw, seen, registry.redis_ms(now), self.stale_ms)
        return _Registry(self._round, dict(self._newest), live, visible)

    # --- applying --------------------------------------------------------------------------

    def _apply(self, node: str, entries: list[Reply]) -> None:
        view = self.view
        for eid, fields in entries:
            self._pos[node] = eid
            try:
                ev = decode(_field(fields))
                if ev.node != node:
                    raise MalformedEvent(f"event of node {ev.node!r} in stream of {node!r}")
            except MalformedEvent:
                self.malformed += 1  # the consumer logs and counts it
                continue
            slot = self._slot_for(ev)
            if slot is None or ev.op == Op.RESET or not ev.blob:
                continue
            ns = self._ns_ids.get(ev.namespace)
            if ns is None:
                if len(self._ns_ids) >= MAX_NAMESPACES:
                    self._overflowed("namespaces")
                    continue
                ns = self._ns_ids[ev.namespace] = len(self._ns_ids)
            view.apply(ns, slot, ev.op, ev.blob, ev.tier)
            self.updates += len(ev.blob) // 16

    def _slot_for(self, ev: Event) -> int | None:
        """The slot of ``ev``'s incarnation, taken on its first event; None: skip the event."""
        slot = self._slot_of.get(ev.nid)
        if slot is not None:
            return slot
        if ev.nid in self._dead or self._overflow:
            return None
        reg = self._reg
        if reg is not None and _superseded(reg, ev.node, ev.nid):
            self._bury(ev.nid)
            return None
        if not self._free:
            self._overflowed("incarnations")
            return None
        with self._lock:  # contract 6: no walk between reading a snapshot and this
            slot = self._free.pop()
            self._slots[slot] = _Slot(ev.nid, ev.node, self._round, ev.op == Op.RESET)
            self._slot_of[ev.nid] = slot
        return slot

    def _bury(self, nid: int) -> None:
        self._dead[nid] = None
        if len(self._dead) > MAX_DEAD:
            del self._dead[next(iter(self._dead))]

    def _overflowed(self, what: str) -> None:
        if not self._overflow:
            log.warning("view_full; lookups read Redis", what=what, slots=MAX_SLOTS, namespaces=len(self._ns_ids))
        self._overflow = True
        self.snapshot = None

    def _supersede(self, reg: _Registry) -> None:
        """Contract 4: slots of incarnations no registration names any more start clearing."""
        referenced = set(reg.newest.values()) | set(reg.live.values())
        for nid, slot in list(self._slot_of.items()):
            s = self._slots[slot]
            assert s is not None
            if s.round < reg.round and nid not in referenced:
                del self._slot_of[nid]
                self._bury(nid)
                self._dying.append((slot, 0))

    def _clear_some(self) -> bool:
        """Clear steps of dying slots for at most CLEAR_ROUND_S; True when there was any."""
        if not self._dying:
            return False
        t_end = time.monotonic() + CLEAR_ROUND_S
        while self._dying and time.monotonic() < t_end:
            slot, cursor = self._dying[0]
            _, cursor = self.view.clear_slot_part(slot, cursor, CLEAR_BUDGET)
            if cursor:
                self._dying[0] = (slot, cursor)
            else:
                self._dying.pop(0)
                self._slots[slot] = None
                self._free.append(slot)
        return True

    def _publish(self, reg: _Registry, drained: bool) -> None:
        """The snapshot lookups read, or None while the view cannot answer (contract 2)."""
        nodes: dict[int, tuple[str, str]] = {}
        mask = 0
        missing = ""
        for nid, node in reg.visible.items():
            slot = self._slot_of.get(nid)
            s = None if slot is None else self._slots[slot]
            if slot is None or s is None or not s.complete:
                missing = node
                break
            mask |= 1 << slot
            nodes[slot] = (node, self._addrs.get(node, ""))
        if self._overflow or missing or self._broken:
            self.snapshot = None
            if drained:
                self._maybe_start_over(reg, missing)
            return
        self._stuck_since = None
        self._restart_after = RESTART_AFTER_S
        self.snapshot = Snapshot(self._drained_at, mask, nodes)

    def _maybe_start_over(self, reg: _Registry, missing: str) -> None:
        now = time.monotonic()
        if self._stuck_since is None:
            self._stuck_since = now
            return
        few = len(set(reg.newest.values()) | set(reg.live.values())) <= MAX_SLOTS
        if now - self._stuck_since >= self._restart_after and (not self._overflow or few):
            self._start_over(f"incarnation of {missing} incomplete" if missing else "full")
            self._stuck_since = None
            self._restart_after = min(2 * self._restart_after, RESTART_MAX_S)

    def _start_over(self, why: str) -> None:
        log.info("view_start_over", reason=why, blocks=len(self.view))
        self._empty()
        self.restarts += 1


def _superseded(reg: _Registry, node: str, nid: int) -> bool:
    """Older than its node's newest registration and not what its live key names: no
    registration will make it visible again (nids only grow)."""
    newest = reg.newest.get(node)
    return newest is not None and nid < newest and reg.live.get(node) != nid


def _field(fields: Reply) -> bytes:
    """The event field of a stream entry's field list (``[field, value, ...]``, or a dict)."""
    if isinstance(fields, dict):
        data = fields.get(FIELD)
    else:
        data = next((fields[i + 1] for i in range(0, len(fields) - 1, 2) if fields[i] == FIELD), None)
    if not isinstance(data, bytes):
        raise MalformedEvent(f"entry has no field {FIELD!r}")
    return data
