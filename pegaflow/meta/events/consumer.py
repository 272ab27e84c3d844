"""Metaserver side: consume every node stream through one consumer group and apply it to an
:class:`IndexWriter` (the metaserver's is ``pegaflow.meta.index.Index``).

Work sharing: each node stream is consumed by exactly one replica at a time, the holder
of a lease key ``pf:{pf}:own:<node>`` (TTL ``lease_ms``, renewed every step). Replicas
heartbeat into ``pf:{pf}:consumers`` and take at most ``ceil(streams / replicas)``
streams each, releasing extras, so work spreads as replicas come and go.

Why leases on top of the consumer group: index updates of one node must be applied in
stream order (an old INSERT applied after a newer EVICT would resurrect a block). A
consumer group alone hands entries of one stream to whichever consumer asks.

Contracts:

- An entry is acked only after its index update returned from Redis.
- On taking a stream over, the new owner first claims *all* pending entries of the
  stream (``XAUTOCLAIM``, in id order; a dead owner's unacked entries), applies and acks
  them, then reads new ones. Entries applied but not acked by the dead owner are applied
  again; that is safe because replaying a suffix of one node's events in order leaves the
  index unchanged (``index.py``).
- A malformed entry, or one whose node differs from its stream's, is logged, counted,
  acked and skipped; the consumer keeps going.
- Events of retired incarnations are skipped (their entries are being swept).
- Applying a snapshot's last chunk makes that epoch visible (``registry.switch``) and
  trims older entries from the stream.
- A zombie owner (paused past its lease) could apply a stale batch once; the lease is
  re-checked before every batch, which narrows but does not close that window.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import redis
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.typing import StreamIdT

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import RELEASE_IF_HELD, RENEW_IF_HELD, Client, Script, error_text
from pegaflow.meta.events.codec import MalformedEvent, decode_entry
from pegaflow.meta.events.schema import Event, Op, Update
from pegaflow.meta.events.streams import GROUP

log = structlog.get_logger("pegaflow.meta.events.consumer")

READ_ENTRIES = 256  # entries per step over all owned streams (~131k updates at 512/entry, ~1 s):
# big enough to amortise round trips, small enough that a step stays well inside a lease
CLAIM_COUNT = 256
RESET_SCAN = 1 << 20  # entries read back at most for a snapshot's RESET (a snapshot: up to ~8k entries of 512)
REFRESH_SECONDS = 1.0  # registry / lease / retired-set refresh period
# Sleep when no stream had anything (cluster reads cannot block), doubling while idle:
# polling every 5 ms held the GIL ~20% of the time in an idle metaserver and put its
# QueryPrefix p99 at 3-4 ms (measured with py-spy, bench/meta.py). At most IDLE_SLEEP_MAX
# of delay before the first event after a quiet spell is applied.
IDLE_SLEEP = 0.002
IDLE_SLEEP_MAX = 0.05

# Take a free lease, or keep one this replica still holds (e.g. after it reset its state).
_ACQUIRE = Script(
    """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if cur then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
)


def default_consumer_name() -> str:
    """``HOST-PID-RANDOM``: two replicas under host networking (one hostname, and PID 1 in
    their containers) would otherwise share a name: each renew the other's leases and read
    the same streams as one consumer, applying their entries out of order."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


# A node's newest registration: (nid, epoch, the nid still visible while it re-syncs in process).
_Incarnation = tuple[int, int, int | None]


def _of(ev: Event, inc: _Incarnation | None) -> bool:
    """Whether ``ev`` is an event of a node whose registration is ``inc``: of its newest
    incarnation, or of the one readers still see while the newest re-syncs (the node wrote
    it before its new RESET: its evictions and inserts until the switch, which the Redis
    path answers from meanwhile, as the view does)."""
    return inc is not None and ((ev.nid, ev.epoch) == inc[:2] or ev.nid == inc[2])


@dataclass
class ConsumerStats:
    entries: int = 0
    blocks: int = 0
    malformed: int = 0
    stale: int = 0
    claimed: int = 0
    switches: int = 0


@dataclass
class _Stream:
    node: str
    key: str
    claimed: bool = False  # pending entries taken over and applied
    resets: dict[int, bytes] = field(default_factory=dict)  # epoch -> id of its RESET entry


class IndexWriter(Protocol):
    """What the consumer needs from the index: apply one node's updates in stream order
    (raising on a Redis error). ``pegaflow.meta.index.Index`` is the Redis one."""

    def apply_many(self, updates: Sequence[Update]) -> int: ...


class ConsumerMetrics:
    """The consumer's Prometheus series, on the registry given (a private one without).

    The metaserver builds them on its registry (``MetaMetrics.consumer``); a consumer in a
    child process counts into its own and the parent folds them in
    (``pegaflow.meta.apply_process``), so every series here is one the parent serves.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.events_applied = Counter(
            "pegaflow_meta_events_applied_total", "Node events applied to the index", ["op"], registry=reg
        )
        self.blocks_applied = Counter(
            "pegaflow_meta_blocks_applied_total", "Block updates applied to the index", registry=reg
        )
        self.events_malformed = Counter(
            "pegaflow_meta_events_malformed_total", "Stream entries skipped as malformed", registry=reg
        )
        self.events_stale = Counter(
            "pegaflow_meta_events_stale_total", "Events of retired incarnations skipped", registry=reg
        )
        self.entries_claimed = Counter(
            "pegaflow_meta_entries_claimed_total", "Pending entries claimed from other consumers", registry=reg
        )
        self.streams_owned = Gauge("pegaflow_meta_streams_owned", "Node streams this replica consumes", registry=reg)


class Consumer:
    """One replica's consumer: call :meth:`step` in a loop, or :meth:`run` in a thread."""

    def __init__(
        self, r: Client, index: IndexWriter, name: str | None = None, *, lease_ms: int = 10_000,
        metrics: ConsumerMetrics | None = None,
    ) -> None:
        self.r = r
        self.name = name or default_consumer_name()
        self.lease_ms = lease_ms
        self.index = index
        self.metrics = metrics if metrics is not None else ConsumerMetrics()
        self.stats = ConsumerStats()
        self.streams: dict[str, _Stream] = {}  # owned, by node name
        self._retired: set[int] = set()
        self._known_tags: set[str] = set()
        self._next_refresh = 0.0
        self._to_ack: dict[str, list[bytes]] = {}

    # --- leases --------------------------------------------------------------------------

    def refresh(self) -> None:
        """Heartbeat, renew/acquire/release stream leases, reload the retired set."""
        now_ms = int(time.time() * 1000)
        paused = self.r.get(keys.PAUSE) is not None
        self.r.zadd(keys.CONSUMERS, {self.name: now_ms + self.lease_ms})
        self.r.zremrangebyscore(keys.CONSUMERS, "-inf", now_ms)
        n_consumers = max(1, self.r.zcard(keys.CONSUMERS))
        nodes = sorted(registry.nodes(self.r))
        for node in list(self.streams):
            if (
                paused
                or node not in nodes
                or not RENEW_IF_HELD(self.r, [keys.owner_key(node)], [self.name, self.lease_ms])
            ):
                self._release(node)
        if not paused:
            target = math.ceil(len(nodes) / n_consumers)
            # Start at a replica-specific offset so replicas don't all race for the same streams.
            start = hash(self.name) % max(1, len(nodes))
            for node in nodes[start:] + nodes[:start]:
                if len(self.streams) >= target:
                    break
                if node in self.streams:
                    continue
                if _ACQUIRE(self.r, [keys.owner_key(node)], [self.name, self.lease_ms]):
                    self._ensure_group(stream_key(node))
                    self.streams[node] = _Stream(node, stream_key(node))
                    log.info("took stream", consumer=self.name, node=node)
            while len(self.streams) > target:
                self._release(next(iter(self.streams)))
        self._retired = registry.retired(self.r)
        # Reloaded, not just cached: Redis may have restarted empty.
        self._known_tags = set(registry.namespace_tags(self.r))
        self.metrics.streams_owned.set(len(self.streams))

    def _release(self, node: str) -> None:
        self._flush_acks()
        self.streams.pop(node, None)
        RELEASE_IF_HELD(self.r, [keys.owner_key(node)], [self.name])
        log.info("released stream", consumer=self.name, node=node)

    def release_all(self) -> None:
        for node in list(self.streams):
            self._release(node)
        self.r.zrem(keys.CONSUMERS, self.name)

    def _ensure_group(self, key: str) -> None:
        try:
            self.r.xgroup_create(key, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set; Redis errors are logged and retried, never fatal."""
        idle = IDLE_SLEEP
        while not stop.is_set():
            try:
                if self.step() == 0:
                    stop.wait(idle)
                    idle = min(idle * 2, IDLE_SLEEP_MAX)
                else:
                    idle = IDLE_SLEEP
            except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError, OSError) as exc:
                log.warning("redis unavailable; retrying", consumer=self.name, error=error_text(exc))
                self.streams.clear()  # re-take leases (and re-claim) once Redis is back
                self._to_ack.clear()
                stop.wait(0.5)
            except redis.ResponseError as exc:
                log.warning("redis error; retrying", consumer=self.name, error=error_text(exc))
                self.streams.clear()
                self._to_ack.clear()
                stop.wait(0.2)
        try:
            self.release_all()
        except redis.RedisError:
            pass

    def step(self) -> int:
        """Refresh leases if due, claim taken-over streams, read and apply one batch.

        Returns the number of entries handled (0 when idle).
        """
        self._refresh_if_due()
        handled = 0
        for st in list(self.streams.values()):
            if not st.claimed:
                handled += self._claim(st)
        # Claiming may take long: a lease may have lapsed meanwhile and the stream gone to
        # another replica. A read past it would leave the entries read in this consumer's
        # pending list, where the new owner, which reads only new entries, never finds them.
        self._refresh_if_due()
        batches = self._read()
        for st, entries in batches:
            self._apply(st, entries)
            handled += len(entries)
        self._flush_acks()
        return handled

    def _forget_gone_consumers(self, st: _Stream) -> None:
        """Drop from the stream's group the consumers of replicas that are gone (not in
        ``keys.CONSUMERS``) and hold nothing (their entries were just claimed): every replica
        restart is a new name, and the group kept each for the stream's lifetime."""
        alive = {m.decode() for m in cast("list[bytes]", self.r.zrange(keys.CONSUMERS, 0, -1))}
        for c in cast("list[dict[str, object]]", self.r.xinfo_consumers(st.key, GROUP)):
            name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
            if name != self.name and name not in alive and not c.get("pending"):
                self.r.xgroup_delconsumer(st.key, GROUP, name)

    def _refresh_if_due(self) -> None:
        if time.monotonic() >= self._next_refresh:
            self.refresh()
            self._next_refresh = time.monotonic() + min(REFRESH_SECONDS, self.lease_ms / 3000)

    def _claim(self, st: _Stream) -> int:
        start: StreamIdT = "0-0"
        n = 0
        while True:
            res = self.r.xautoclaim(st.key, GROUP, self.name, 0, start_id=start, count=CLAIM_COUNT)
            start, entries = res[0], res[1]
            if entries:
                entries = [(i, f) for i, f in entries if f is not None]
                self._apply(st, entries)
                n += len(entries)
                self._flush_acks()
            if start in (b"0-0", "0-0"):
                break
        st.claimed = True
        self._forget_gone_consumers(st)
        if n:
            self.stats.claimed += n
            self.metrics.entries_claimed.inc(n)
            log.info("claimed pending entries", consumer=self.name, node=st.node, entries=n)
        return n

    def _read(self) -> list[tuple[_Stream, list[tuple[bytes, dict]]]]:
        owned = [st for st in self.streams.values() if st.claimed]
        if not owned:
            return []
        count = max(4, READ_ENTRIES // len(owned))
        p = self.r.pipeline(transaction=False)
        for st in owned:
            p.xreadgroup(GROUP, self.name, {st.key: ">"}, count=count)
        out = []
        for st, res in zip(owned, p.execute(raise_on_error=False), strict=True):
            if isinstance(res, Exception):
                if "NOGROUP" in str(res):
                    if self.r.hexists(keys.NODES, st.node):  # Redis restarted empty: start over
                        self._ensure_group(st.key)
                    else:  # the node was reaped and its stream deleted
                        self._release(st.node)
                    continue
                raise res
            for _key, entries in res or []:
                if entries:
                    out.append((st, entries))
        return out

    def _apply(self, st: _Stream, entries: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> None:
        updates: list[Update] = []
        switches: list[tuple[Event, bytes]] = []  # (the LAST snapshot entry, its id)
        new_tags: dict[str, str] = {}
        ops: dict[str, int] = {}
        blocks = 0
        current = self._incarnation(st.node)
        for eid, fields in entries:
            self._to_ack.setdefault(st.key, []).append(eid)
            try:
                ev = decode_entry(fields)
                if ev.node != st.node:
                    raise MalformedEvent(f"event of node {ev.node!r} in stream of {st.node!r}")
            except MalformedEvent as exc:
                self.stats.malformed += 1
                self.metrics.events_malformed.inc()
                log.warning("skipping malformed event", stream=st.key, id=eid, error=str(exc))
                continue
            self.stats.entries += 1
            ops[ev.op.name] = ops.get(ev.op.name, 0) + 1
            if ev.op == Op.RESET:
                st.resets[ev.epoch] = eid
                continue
            if not _of(ev, current):
                # Registration happens before a node writes an incarnation's events, so a
                # newer one is already in the registry: read it again once before judging.
                current = self._incarnation(st.node)
            if ev.nid in self._retired or not _of(ev, current):
                # Neither the node's newest incarnation nor the one still visible while that
                # one re-syncs: superseded, or written before Redis lost its data. Its updates
                # must not land under any nid.
                self.stats.stale += 1
                self.metrics.events_stale.inc()
                continue
            if ev.blob:
                updates.append(Update.of(ev))
                blocks += ev.count
                tag = keys.ns_tag(ev.namespace)
                if tag not in self._known_tags:
                    new_tags[tag] = ev.namespace
            if ev.op == Op.SNAPSHOT and ev.last:
                switches.append((ev, eid))
        if new_tags:
            registry.add_namespace_tags(self.r, new_tags)
            self._known_tags.update(new_tags)
        if updates:
            if not self._still_owner(st):
                self._to_ack.pop(st.key, None)
                raise redis.ResponseError(f"lost the lease of {st.node} before applying")
            self.index.apply_many(updates)
        for ev, last_id in switches:
            if registry.switch(self.r, ev.node, ev.nid):
                self.stats.switches += 1
                # Its RESET was read by another consumer object (the stream changed hands, the
                # consumer process restarted mid-snapshot): found in the stream, so the older
                # epochs are trimmed all the same.
                reset_id = st.resets.get(ev.epoch) or self._find_reset(st.key, ev.epoch, last_id)
                if reset_id is not None:
                    self.r.xtrim(st.key, minid=reset_id, approximate=False)
        self.stats.blocks += blocks
        self.metrics.blocks_applied.inc(blocks)
        for op, n in ops.items():
            self.metrics.events_applied.labels(op.lower()).inc(n)

    def _find_reset(self, key: str, epoch: int, last_id: bytes) -> bytes | None:
        """The id of ``epoch``'s RESET in stream ``key``, read back from its snapshot's LAST
        entry ``last_id`` (a snapshot's entries follow its RESET); None past ``RESET_SCAN``
        entries, or at an entry of another epoch first."""
        end: bytes | str = last_id
        seen = 0
        while seen < RESET_SCAN:
            chunk = cast("list[tuple[bytes, dict[bytes, bytes]]]",
                         self.r.xrevrange(key, max=end, min="-", count=CLAIM_COUNT))
            if not chunk:
                return None
            for eid, fields in chunk:
                try:
                    ev = decode_entry(fields)
                except MalformedEvent:
                    continue
                if ev.epoch != epoch:
                    return None
                if ev.op == Op.RESET:
                    return eid
            seen += len(chunk)
            ms, seq = chunk[-1][0].decode().split("-")
            if int(seq) > 0:
                end = f"{ms}-{int(seq) - 1}"
            elif int(ms) > 0:
                end = f"{int(ms) - 1}-{(1 << 64) - 1}"
            else:
                return None
        return None

    def _incarnation(self, node: str) -> _Incarnation | None:
        """``node``'s newest registration, None if it has none."""
        raw = self.r.hget(keys.NODES, node)
        if raw is None:
            return None
        d = json.loads(raw)
        return int(d["nid"]), int(d["epoch"]), int(d["prev"]) if d.get("prev") is not None else None

    def _still_owner(self, st: _Stream) -> bool:
        return self.r.get(keys.owner_key(st.node)) == self.name.encode()

    def _flush_acks(self) -> None:
        if not self._to_ack:
            return
        p = self.r.pipeline(transaction=False)
        for key, ids in self._to_ack.items():
            p.xack(key, GROUP, *ids)
        p.execute()
        self._to_ack.clear()

    def wait_caught_up(self, timeout: float = 30.0) -> bool:
        """Step until no owned stream has undelivered or pending entries (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.step() == 0 and self.streams and all(st.claimed for st in self.streams.values()):
                return True
        return False
