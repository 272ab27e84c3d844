"""A PegaFlow cluster in replay: N nodes, each with L1 + an SSD tier, pulling from peers.

    python -m pegaflow.replay.cluster TRACE --nodes 3 --l1 4000blocks --ssd 16000blocks [--no-peers]
                                      [--min-reclaimable-owner-count 3] [--idle-nodes 1 --enable-decode-backup]

``pegaflow replay TRACE --nodes N`` runs the same model (:func:`cluster_lines`).

What is modelled (the node's rules, ``docs/p2p.md``):

- **Nodes**: each node is a :class:`~pegaflow.replay.model.Pool` (the node's own
  ``BlockIndex`` for L1, an LRU SSD tier fed by L1's commits, as the node's write-behind
  does, or by its evictions with ``--ssd-writes evictions``). Requests go
  to nodes round-robin, or by a stable hash of a trace field (``--route field:NAME``).
- **A request on node k** is served as the node's Query and the connector's re-Queries
  serve it: k's L1 prefix, then k's SSD continuation (promoted into k's L1), then the
  global index: like ``QueryPrefix``, it knows peers holding the request's leading blocks
  (from block 0, each in the peer's L1 or on its SSD); the peer whose prefix reaches
  furthest past k's, with fewest blocks only on SSD among equals (the puller's
  ``choose``), sends the blocks k lacks up to there into k's L1, and the loop goes on
  from there. The first block nobody can bring ends the prefix: the engine computes the
  rest and k stores it.
- **Placement**: blocks promoted from k's SSD and blocks pulled from a peer enter k's L1
  when they land, the pulled ones as *reclaimable* copies (the puller reserves them so:
  the index evicts them before any other block), then the computed rest; so which block
  a later request finds where (own L1, own SSD, a peer) follows the node's eviction order.
- **The serving peer** touches the L1 blocks it pins (its LRU sees the use) and reads the
  blocks it has only on SSD into pages of the pin, freed after the transfer (pins.py): on
  a full L1 those pages evict as many blocks first, as on the real node, and the served
  blocks stay on its SSD only.
- **Replacement classes by owner count** (docs/architecture.md, "Replacement classes"):
  a block's holders are the nodes holding it in L1 or on SSD; when a change moves their
  count, the metaserver's rule (``pegaflow.policy.classes``, the one its scripts apply)
  says which holders demote it to reclaimable (``--min-reclaimable-owner-count`` of them or
  more) or get it back as retained, and each node's index moves it (``BlockIndex.reclassify``)
  once the request that caused the change is served, as the real nodes do a moment later.
  A threshold above the number of nodes never demotes: the cluster as it was without them.
- **Idle nodes** (``idle``): the last ``idle`` nodes serve no requests (no engine: a decode
  node in P/D, a drained host); the requests go to the others. They hold blocks only as
  peers do: what they pull as backup targets.
- **Decode backup** (docs/architecture.md, "Decode backup"; :class:`BackupModel`), with
  idle nodes: after each request, each busy node whose pool is full offers its oldest
  retained blocks up to ``--backup-reclaimable-percent`` of its pool (the node's rule,
  ``pegaflow.policy.backup``); those an idle node holds already are demoted at once (the
  planner's ``has_backup``), the rest become plans: each idle node takes one plan a step, as
  a target pulls one plan a tick (one busy node's blocks of one namespace; the busy nodes
  take turns, the idle nodes round robin), copied into its L1 as retained blocks, evicting
  its oldest as any insert does; then the busy node demotes the copies the idle nodes hold
  to reclaimable (the planner's backup notice); what no plan took is offered again. A later miss there that
  an idle node holds is an ordinary peer pull (counted as a peer hit, the copy reclaimable).
  The owner counts run with the backup whatever the threshold, so when an idle node evicts
  the last other copy the busy node's is retained again (``n1 == 1 < n0``). The model has
  no clock: by default a copy lands as soon as the request that filled the pool is served;
  a caller that knows the request rate gives the tick in requests and the bandwidth in
  blocks per tick (:class:`BackupSettings`), as ``bench/backup.py`` does.
- **The index** is exact and immediate (the real one lags the node by the publisher's
  flush interval and the metaserver's apply, tens of milliseconds; class notices by the
  node's poll, a quarter of a second).

Counted per request: hit blocks by where they came from (own L1, own SSD, a peer's L1, a
peer's SSD) and the rest missed; ``ClusterResult.hit_rate`` is hits over block accesses,
the measure ``bench/p2p_ssd.py``'s cluster runs and ``pegaflow replay`` report.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import cast

from pegaflow.config.capacity import Capacity, parse_capacity, route_field
from pegaflow.config.options import META, NODE, default_of, options_for
from pegaflow.core.block_index import BlockIndex, IndexEvent, Listener, Namespace
from pegaflow.core.trace import Request, Trace, TraceError, read_trace
from pegaflow.policy.backup import backup_candidates
from pegaflow.policy.classes import MIN_OWNER_THRESHOLD, class_notices
from pegaflow.replay.model import SSD_WRITES, SSD_WRITES_COMMITS, Pool, route_hash


def _default(command: str, name: str) -> int:
    return cast(int, default_of(next(o for o in options_for(command) if o.name == name)))


# pegaflow-meta's and the node's options, read from the option table (one default each).
OWNER_THRESHOLD = _default(META, "min-reclaimable-owner-count")
BACKUP_PERCENT = _default(NODE, "backup-reclaimable-percent")
BACKUP_MAX_CANDIDATES = _default(NODE, "backup-max-candidates")
_L1, _SSD = 1, 2  # a holder's tiers, as bits


@dataclass
class ClusterResult:
    """Block counts of one cluster replay (``blocks`` = every hash of every request)."""

    nodes: int
    peers: bool
    blocks: int = 0
    l1: int = 0  # hits in the serving node's L1
    ssd: int = 0  # on its own SSD
    peer_l1: int = 0  # pulled from a peer's L1
    peer_ssd: int = 0  # pulled from a peer that had them only on SSD
    owner_threshold: int = 0  # --min-reclaimable-owner-count modelled
    demoted: int = 0  # blocks the owner counts moved from retained to reclaimable, all nodes
    restored: int = 0  # ... and back
    idle: int = 0  # nodes that served no requests
    backup: bool = False  # the decode backup modelled on them
    backed_up: int = 0  # blocks the idle nodes copied from the busy ones
    backup_demoted: int = 0  # blocks the busy nodes demoted as backed up
    request_hits: list[int] = field(default_factory=list, repr=False)

    @property
    def hits(self) -> int:
        return self.l1 + self.ssd + self.peer_l1 + self.peer_ssd

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        del d["request_hits"]
        d["hit_rate"] = self.hit_rate
        return d


class OwnerCounts:
    """The metaserver's owner counts over the pools (the module docstring): listens to every
    pool's L1 and SSD index, queues the notices the rule gives, and applies them on
    :meth:`settle`."""

    def __init__(self, pools: Sequence[Pool], threshold: int) -> None:
        if threshold < MIN_OWNER_THRESHOLD:
            raise ValueError(f"--min-reclaimable-owner-count must be at least {MIN_OWNER_THRESHOLD}, got {threshold}")
        self.threshold = threshold
        self.pools = pools
        self._held: dict[tuple[str, bytes], dict[int, int]] = {}  # block -> pool -> tiers (bits)
        self._queued: list[tuple[int, str, bytes, bool]] = []  # (pool, namespace, hash, reclaimable)
        self.demoted = self.restored = 0
        for k, p in enumerate(pools):
            p.l1.index.add_listener(self._listener(k, _L1))
            if p.ssd is not None:
                p.ssd.index.add_listener(self._listener(k, _SSD))

    def _listener(self, k: int, tier: int) -> Listener:
        def on_event(op: IndexEvent, ns: Namespace, hashes: list[bytes]) -> None:
            self._change(k, tier, op is IndexEvent.INSERT, ns.name, hashes)
        return on_event

    def _change(self, k: int, tier: int, add: bool, name: str, hashes: list[bytes]) -> None:
        held, queue, t = self._held, self._queued.append, self.threshold
        for h in hashes:
            key = (name, h)
            who = held.get(key)
            if who is None:
                if not add:
                    continue
                who = held[key] = {}
            before = who.get(k, 0)
            n0 = len(who)
            if add:
                who[k] = before | tier
                joined = [k] if (not before or tier == _L1) and not before & _L1 else []
                if not joined:
                    continue  # SSD copy of a block in DRAM, or already there: the node publishes nothing
            else:
                left = before & ~tier
                if left == before:
                    continue
                if left:
                    who[k] = left
                    continue  # out of DRAM onto SSD (a tier change) or off SSD while in DRAM: same holders
                del who[k]
                joined = []
                if not who:
                    del held[key]
            dem, res = class_notices(n0, who, joined, t)
            for j in dem:
                queue((j, name, h, True))
            for j in res:
                queue((j, name, h, False))

    def settle(self) -> None:
        """Apply the queued notices, in order, to each pool's L1."""
        q, self._queued = self._queued, []
        i = 0
        while i < len(q):  # runs of one (pool, namespace, class) in one call
            k, name, _, r = q[i]
            j = i
            while j < len(q) and q[j][0] == k and q[j][1] == name and q[j][3] == r:
                j += 1
            l1 = self.pools[k].l1
            index: BlockIndex = l1.index
            n = index.reclassify(l1.ns[name], [x[2] for x in q[i:j]], r)
            if r:
                self.demoted += n
            else:
                self.restored += n
            i = j


@dataclass(frozen=True)
class BackupSettings:
    """The busy nodes' ``--backup-reclaimable-percent`` and ``--backup-max-candidates``; the
    pace, where a caller knows it (the model has no clock): a backup step after every
    ``every`` requests (the tick), copying at most ``step_blocks`` blocks per idle node in
    one step (``--backup-max-bandwidth`` over a tick; 0: no limit), the source demoting a
    copied block ``delay`` steps later (blocks in flight meanwhile are not copied again)."""

    percent: int = BACKUP_PERCENT
    max_candidates: int = BACKUP_MAX_CANDIDATES
    every: int = 1
    step_blocks: int = 0
    delay: int = 0  # steps from a copy to the source's demotion (the planner's settle, the notice's poll)


class BackupModel:
    """The decode backup between ``sources`` (busy pools) and ``targets`` (idle pools): one
    :meth:`step` is every busy node's offer, the planner's pairing, the copies and the
    sources' demotions (the module docstring), at once."""

    def __init__(self, sources: Sequence[Pool], targets: Sequence[Pool], settings: BackupSettings) -> None:
        if not targets:
            raise ValueError("the decode backup needs an idle node")
        self.sources, self.targets, self.settings = sources, targets, settings
        self._next = 0  # the planner's round robin over the targets
        self._first = 0  # the source that plans first this step: they take turns
        self._since = 0  # requests since the last step
        self._steps = 0
        self._flight: list[tuple[int, Pool, str, list[bytes]]] = []  # (due step, source, namespace, copied)
        self._in_flight: set[tuple[int, str, bytes]] = set()  # (id(source), namespace, hash)
        self.copied = self.demoted = 0

    def _held(self, name: str, h: bytes) -> bool:
        return any(t.l1.index.contains(t.l1.ns[name], h)
                   or (t.ssd is not None and t.ssd.index.contains(t.ssd.ns[name], h)) for t in self.targets)

    def after_request(self) -> bool:
        """Count one request; True when a step is due (then run :meth:`step`)."""
        self._since += 1
        if self._since < self.settings.every:
            return False
        self._since = 0
        return True

    def _settle(self) -> None:
        """Demote on their sources the copies whose delay is over and which a target holds."""
        due = [f for f in self._flight if f[0] <= self._steps]
        self._flight = [f for f in self._flight if f[0] > self._steps]
        for _, src, name, hashes in due:
            self._in_flight.difference_update((id(src), name, h) for h in hashes)
            backed = [h for h in hashes if self._held(name, h)]
            self.demoted += src.l1.index.reclassify(src.l1.ns[name], backed, True)

    def step(self) -> None:
        """Every busy node offers; what a target holds already is demoted at once; the rest
        becomes plans, one per target a step (a target pulls one plan a tick), each of one
        source's blocks of one namespace, at most ``step_blocks``; the sources take turns."""
        s = self.settings
        self._steps += 1
        self._settle()
        free = list(self.targets)  # targets with no plan this step
        n = len(self.sources)
        for i in range(n):
            src = self.sources[(self._first + i) % n]
            offered = backup_candidates(src.l1.index, s.percent, s.max_candidates)
            by_ns: dict[str, list[bytes]] = {}
            for b in offered:
                by_ns.setdefault(b.ns.name, []).append(b.hash)
            for name, hashes in by_ns.items():
                flying = self._in_flight
                hashes = [h for h in hashes if (id(src), name, h) not in flying]
                backed = [h for h in hashes if self._held(name, h)]  # a target holds them: demoted at once
                self.demoted += src.l1.index.reclassify(src.l1.ns[name], backed, True)
                known = set(backed)
                copy = [h for h in hashes if h not in known]
                if not copy or not free:
                    continue  # offered again next step
                target = free.pop(self._next % len(free))
                self._next += 1
                if s.step_blocks:
                    copy = copy[: s.step_blocks]
                target.l1.index.insert(target.l1.ns[name], copy)  # the target's pull: retained copies
                target._flush_ssd()  # noqa: SLF001 - the target's write-behind, as on any commit
                self.copied += sum(target.l1.index.contains(target.l1.ns[name], h) for h in copy)
                self._flight.append((self._steps + s.delay, src, name, copy))
                flying.update((id(src), name, h) for h in copy)
        self._first = (self._first + 1) % max(n, 1)
        self._settle()  # delay 0: at once


class NodeCluster:
    """``nodes`` pools of ``l1`` / ``ssd`` each ((amount, in blocks) as ``Capacity.blocks_or_bytes``),
    peer pulls, and replacement classes by owner count (``owner_threshold``: pegaflow-meta's
    ``--min-reclaimable-owner-count``; above ``nodes``: none is ever reached); the last ``idle``
    nodes serve no requests, and with ``backup`` they back up the others."""

    def __init__(self, nodes: int, l1: tuple[int, bool], ssd: tuple[int, bool], page_bytes: dict[str, int],
                 peers: bool = True, ssd_writes: str = SSD_WRITES_COMMITS,
                 owner_threshold: int = OWNER_THRESHOLD, idle: int = 0,
                 backup: BackupSettings | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if not 0 <= idle < nodes:
            raise ValueError(f"idle nodes must be 0 to nodes - 1 ({nodes - 1}), got {idle}")
        if backup is not None and not peers:
            raise ValueError("the decode backup needs peer pulls: a busy node reads its copies back from a peer")
        self.pools = [Pool(l1, ssd, page_bytes, False, ssd_writes) for _ in range(nodes)]
        self.peers = peers
        self.busy = nodes - idle
        self.backup = BackupModel(self.pools[: self.busy], self.pools[self.busy :], backup) if backup else None
        # Counts only matter where they can reach the threshold, or restore a backed-up block's last copy.
        self.owners = OwnerCounts(self.pools, owner_threshold) if owner_threshold <= nodes or backup else None

    @staticmethod
    def _run(pool: Pool, namespace: str, rest: Sequence[bytes]) -> tuple[int, int]:
        """(leading blocks of ``rest`` ``pool`` holds in L1 or on SSD, how many only on SSD)."""
        l1, ns = pool.l1.index, pool.l1.ns[namespace]
        ssd = pool.ssd
        sidx, sns = (ssd.index, ssd.ns[namespace]) if ssd is not None else (None, None)
        n = only = 0
        for h in rest:
            if l1.contains(ns, h):
                n += 1
            elif sidx is not None and sns is not None and sidx.contains(sns, h):
                n += 1
                only += 1
            else:
                break
        return n, only

    def serve(self, k: int, namespace: str, hashes: list[bytes], saved: Sequence[bytes] = ()
              ) -> tuple[int, int, int, int]:
        """Serve one request on node ``k``; returns hit blocks (own L1, own SSD, peer L1, peer SSD)."""
        me = self.pools[k]
        l1, ns = me.l1.index, me.l1.ns[namespace]
        n = len(hashes)
        got = [0, 0, 0, 0]
        pos = len(l1.prefix(ns, hashes))
        got[0] = pos
        fetched: list[bytes] = []  # brought into L1 from our SSD or a peer (placed when they land)
        while pos < n:
            rest = hashes[pos:]
            if me.ssd is not None:
                s = len(me.ssd.index.prefix(me.ssd.ns[namespace], rest))
                if s:
                    got[1] += s
                    fetched += rest[:s]
                    l1.insert(ns, rest[:s])  # promoted: committed as the engine's own blocks
                    pos += s
                    continue
            if not self.peers:
                break
            best, key = -1, (0, 0)
            for j, p in enumerate(self.pools):
                if j == k:
                    continue
                c, only = self._run(p, namespace, hashes)  # its prefix_len and ssd_blocks
                if c > pos and (best < 0 or (c, -only) > key):
                    best, key = j, (c, -only)
            if best < 0:
                break
            c, only = key[0], -key[1]
            need = [h for h in hashes[pos:c] if not l1.contains(ns, h)]
            self._serve_peer(self.pools[best], namespace, need)
            got[3 if only else 2] += c - pos
            fetched += need
            l1.insert(ns, need, reclaimable=True)  # pulled copies: evicted first, as the puller reserves them
            pos = c
            # L1 again: blocks a pull skipped because they were here already
            more = len(l1.prefix(ns, hashes[pos:]))
            got[0] += more
            pos += more
        computed = hashes[pos:]
        if fetched or computed:
            l1.record_access(ns, fetched + computed)
        if computed:
            l1.insert(ns, computed)
        if saved:
            l1.insert(ns, list(saved))
        me._flush_ssd()  # noqa: SLF001 - the pool's own write-behind step, as Pool.serve runs it
        if self.owners is not None:
            self.owners.settle()
        if self.backup is not None and self.backup.after_request():
            self.backup_step()
        return got[0], got[1], got[2], got[3]

    def backup_step(self) -> None:
        """One step of the decode backup and the owner notices its copies cause."""
        assert self.backup is not None
        self.backup.step()
        if self.owners is not None:
            self.owners.settle()

    @staticmethod
    def _serve_peer(p: Pool, namespace: str, blocks: list[bytes]) -> None:
        """The peer pins ``blocks``: its L1 ones are touched; its SSD-only ones are read into
        pages of the pin (reserved, so a full L1 evicts for them) and freed after the
        transfer: they stay on its SSD only."""
        l1, ns = p.l1.index, p.l1.ns[namespace]
        resident = [b for h in blocks if (b := l1.get(ns, h)) is not None]
        l1.touch(resident)
        if len(resident) < len(blocks):
            l1.pin(resident)
            staged = l1.reserve(ns, [h for h in blocks if not l1.contains(ns, h)])
            l1.unpin(resident)
            l1.discard([b for b in staged if b is not None])
            p._flush_ssd()  # noqa: SLF001 - what the reservation evicted goes to SSD as on the node


def route(i: int, r: Request, nodes: int, by_field: bool) -> int:
    return route_hash(r.route or "") % nodes if by_field else i % nodes


def replay_cluster(trace: Trace, nodes: int, l1: Capacity, ssd: Capacity, *, page_bytes: int = 64 << 20,
                   peers: bool = True, route_by: str = "round-robin",
                   ssd_writes: str = SSD_WRITES_COMMITS, owner_threshold: int = OWNER_THRESHOLD,
                   idle: int = 0, backup: BackupSettings | None = None) -> ClusterResult:
    """Replay ``trace`` on ``nodes`` nodes with ``l1`` and ``ssd`` EACH (a percentage of the
    trace's distinct blocks, as in ``pegaflow replay``, is of the whole trace, per node); the
    requests go to the first ``nodes - idle``."""
    sizes = {name: size or page_bytes for name, size in trace.namespaces.items()}
    c = NodeCluster(nodes, l1.blocks_or_bytes(trace.unique, trace.storable),
                    ssd.blocks_or_bytes(trace.unique, trace.storable), sizes, peers,
                    ssd_writes, owner_threshold, idle, backup)
    by_field = route_field(route_by) is not None
    res = ClusterResult(nodes, peers, owner_threshold=owner_threshold, idle=idle, backup=backup is not None)
    put = res.request_hits.append
    for i, r in enumerate(trace.requests):
        a, b, x, y = c.serve(route(i, r, c.busy, by_field), r.namespace, r.hashes, r.saved)
        res.blocks += len(r.hashes)
        res.l1 += a
        res.ssd += b
        res.peer_l1 += x
        res.peer_ssd += y
        put(a + b + x + y)
    if c.owners is not None:
        res.demoted, res.restored = c.owners.demoted, c.owners.restored
    if c.backup is not None:
        res.backed_up, res.backup_demoted = c.backup.copied, c.backup.demoted
    return res


def cluster_lines(trace: Trace, nodes: int, l1: Capacity, ssd: Capacity, *, page_bytes: int = 64 << 20,
                  peers_modes: Sequence[bool] = (False, True), route_by: str = "round-robin",
                  ssd_writes: str = SSD_WRITES_COMMITS, owner_threshold: int = OWNER_THRESHOLD, idle: int = 0,
                  backup: BackupSettings | None = None) -> tuple[list[str], list[dict[str, object]]]:
    """The cluster report of ``python -m pegaflow.replay.cluster`` and ``pegaflow replay --nodes``:
    per peer mode, the hit rate as configured, beside it the run without the owner classes and,
    with ``backup``, the run without the decode backup. Returns (lines, every run as a dict)."""
    lines: list[str] = []
    runs: list[dict[str, object]] = []
    n = owner_threshold
    busy = nodes - idle
    for peers in peers_modes:
        on = backup if peers else None  # the backup needs peer pulls

        def run(threshold: int, bk: BackupSettings | None, peers: bool = peers) -> ClusterResult:
            r = replay_cluster(trace, nodes, l1, ssd, page_bytes=page_bytes, peers=peers, route_by=route_by,
                               ssd_writes=ssd_writes, owner_threshold=threshold, idle=idle, backup=bk)
            runs.append(r.to_dict())
            return r

        res = run(n, on)
        idle_text = f" ({idle} idle)" if idle else ""
        lines.append(f"{nodes} nodes{idle_text}, {'peer pulls' if peers else 'no peer pulls'}"
                     f"{', decode backup' if on else ''}: hit rate {res.hit_rate:.2%} (own L1 {res.l1}, "
                     f"own SSD {res.ssd}, peer L1 {res.peer_l1}, peer SSD {res.peer_ssd} of {res.blocks} blocks)")
        if n > nodes:
            lines.append(f"  no block can reach {n} owners on {nodes} nodes: no owner classes")
        else:
            off = run(nodes + 1, on)
            lines.append(f"  owner classes (--min-reclaimable-owner-count {n}): {res.demoted} blocks demoted, "
                         f"{res.restored} restored; without them {off.hit_rate:.2%} "
                         f"({(res.hit_rate - off.hit_rate) * 100:+.2f} pp from them)")
        if on is not None:
            off = run(n, None)
            lines.append(f"  decode backup ({idle} idle for {busy} busy, --backup-reclaimable-percent {on.percent}): "
                         f"{res.backed_up} blocks copied, {res.backup_demoted} demoted on the busy nodes; without it "
                         f"{off.hit_rate:.2%} ({(res.hit_rate - off.hit_rate) * 100:+.2f} pp from it)")
    return lines, runs


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pegaflow.replay.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--l1", type=parse_capacity, required=True, help="each node's L1: 4000blocks, 64gb or 10%% (of the trace's distinct blocks)")
    p.add_argument("--ssd", type=parse_capacity, default=Capacity(0, "bytes"), help="each node's SSD tier")
    p.add_argument("--no-peers", action="store_true", help="nodes never pull from each other")
    p.add_argument("--route", default="round-robin", help="round-robin or field:NAME")
    p.add_argument("--ssd-writes", choices=SSD_WRITES, default=SSD_WRITES_COMMITS)
    p.add_argument("--min-reclaimable-owner-count", type=int, default=OWNER_THRESHOLD, metavar="N",
                   help="pegaflow-meta's: a block N nodes hold is reclaimable (evicted first) on each; "
                        "the run without owner classes is printed beside it (default: %(default)s)")
    p.add_argument("--idle-nodes", type=int, default=0, metavar="N",
                   help="the last N nodes serve no requests (default: %(default)s)")
    p.add_argument("--enable-decode-backup", action="store_true",
                   help="the idle nodes back up the busy ones (pegaflow-meta's flag); the run without it beside")
    p.add_argument("--backup-reclaimable-percent", type=int, default=BACKUP_PERCENT, metavar="PERCENT",
                   help="the busy nodes' (default: %(default)s)")
    p.add_argument("--block-tokens", type=int, default=512)
    a = p.parse_args(argv)
    if a.nodes < 1:
        p.error("--nodes must be >= 1")
    if a.min_reclaimable_owner_count < MIN_OWNER_THRESHOLD:
        p.error(f"--min-reclaimable-owner-count must be at least {MIN_OWNER_THRESHOLD}")
    if not 0 <= a.idle_nodes < a.nodes:
        p.error("--idle-nodes must be 0 to --nodes - 1")
    if a.enable_decode_backup and not a.idle_nodes:
        p.error("--enable-decode-backup needs --idle-nodes (the backup targets)")
    if not 0 <= a.backup_reclaimable_percent <= 100:
        p.error("--backup-reclaimable-percent must be 0 to 100")
    try:
        with open(a.trace, encoding="utf-8") as f:
            trace = read_trace(f, block_tokens=a.block_tokens, route_field=route_field(a.route))
    except (OSError, TraceError) as exc:
        print(f"error: {a.trace}: {exc}", file=sys.stderr)
        return 2
    backup = BackupSettings(a.backup_reclaimable_percent) if a.enable_decode_backup else None
    lines, _ = cluster_lines(trace, a.nodes, a.l1, a.ssd, peers_modes=[False] if a.no_peers else [False, True],
                             route_by=a.route, ssd_writes=a.ssd_writes, owner_threshold=a.min_reclaimable_owner_count,
                             idle=a.idle_nodes, backup=backup)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
