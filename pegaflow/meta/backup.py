"""The decode backup's planner (``pegaflow-meta --enable-decode-backup``; docs/architecture.md,
"Decode backup").

One replica plans at a time (``keys.BACKUP_LOCK``); a pass every ``PASS_S``, and between
passes, while plans are in flight, step 2 alone every ``SETTLE_S``:

1. Roles: *targets* are the visible nodes whose report says no engine for
   ``--backup-target-delay-secs`` (Redis's clock); *sources* the visible nodes with an
   engine and an offer. The target set is stored for the nodes' ``pegaflow_backup_role``.
2. Settle the plans in flight: blocks whose target now holds them in the index (its insert
   events) are backed up: the source gets a ``BACKUP`` class notice for them
   (``pegaflow/cluster/notices.py``) and demotes them (:func:`back_up`). Plans of a target
   that is no longer one (it died, went invisible or got an engine) are forgotten at once,
   blocks the source no longer holds (evicted before the pull) too, and plans past
   ``PLAN_DEADLINE_S``; their blocks still retained on the source come back in its offers
   and are planned again.
3. Pair (:func:`pair`): per source, in name order, each offered block a target already
   holds is backed up at once (filtered ``has_backup``); blocks in flight are skipped; the
   rest go to the targets round robin, in plans of at most the target's
   ``--backup-pull-max-bytes``, while the target has fewer than ``MAX_QUEUED`` plans queued.

A backup notice goes out only in the same Redis step that finds a target holding the block
(:data:`_BACK`, a script in the namespace's slot with the index and the notice lists): a
target that evicts its copy between the planner's reads and the notice would otherwise leave
the source's last copy reclaimable. With the script the eviction comes either before (no
notice) or after it (the index's restore for the last holder, ``n1 == 1 < n0``, follows the
backup notice in the source's list).

The in-flight set lives in the planning replica's memory: a replica that takes over starts
without it, so a block may be planned twice (the target skips blocks it holds).
"""

from __future__ import annotations

import string
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from pegaflow.cluster import backup, keys, notices, registry
from pegaflow.cluster.redis_conn import RELEASE_IF_HELD, RENEW_IF_HELD, Client, Script, error_text, parallel
from pegaflow.common.metric_alias import Alias, OriginalNames
from pegaflow.core.identity import HASH_BYTES
from pegaflow.meta.index import Index, nid_bytes

log = structlog.get_logger("pegaflow.meta.backup")

PASS_S = 1.0
# Between passes, plans in flight are settled this often: until its source hears, a copy that
# landed is held twice (retained on the source and on the target), a page of the busy pool that
# the idle one holds already, so the idle pool adds that much less (bench/backup.py: the gain
# sat 2-3% under the idle pool's share at 0.1 s). Cheap: one script per (source, namespace),
# only while plans are out.
SETTLE_S = 0.02
LOCK_MS = 10_000  # a planner that died hands over after this long
PLAN_DEADLINE_S = 60.0  # a plan not landed in the index by then is forgotten (and re-planned)
PLAN_TTL_MS = 60_000  # plans queued for a target that stopped taking them expire
TARGETS_TTL_MS = 5_000  # the stored target set outlives a few passes, not a planner that stopped
MAX_QUEUED = 2  # plans queued per target: enough to keep it busy, few enough to stay fresh

HAS_BACKUP = "has_backup"
SOURCE_GONE = "source_gone"

# KEYS[1]: the namespace's anchor (its slot: the buckets and the notice lists are there too).
# ARGV: bucket prefix, the backers (holder ids, NID bytes each), the hashes, the source's
# notice list, the source's holder id. Of the hashes, those a backer holds now (any tier) get
# one backup notice on the source's list, kept as the index's scripts keep it. Returns them,
# and those of the rest the source no longer holds.
_BACK = Script(string.Template("""
local pre, blob, key, source = ARGV[1], ARGV[3], ARGV[4], ARGV[5]
local backers = {}
for j = 1, #ARGV[2], $NID do backers[ARGV[2]:sub(j, j + $NID - 1)] = true end
local out, gone = {}, {}
for off = 1, #blob, $HASH do
  local h = blob:sub(off, off + $HASH - 1)
  local v = redis.call('HGET', pre .. h:sub(1, $BUCKET), h:sub($BUCKET + 1)) or ''
  local backed, held = false, false
  for j = 1, #v, $NID do
    local c = v:sub(j, j + $NID - 1)
    c = string.char(c:byte(1) % $TOP) .. c:sub(2)
    if backers[c] then backed = true end
    if c == source then held = true end
  end
  if backed then out[#out + 1] = h elseif not held then gone[#gone + 1] = h end
end
if #out > 0 then
  redis.call('RPUSH', key, '$OP' .. table.concat(out))
  redis.call('LTRIM', key, -$MAX, -1)
  redis.call('PEXPIRE', key, $TTL)
end
return {table.concat(out), table.concat(gone)}
""").substitute(NID=keys.NID_BYTES, HASH=HASH_BYTES, BUCKET=keys.BUCKET_BYTES,
                TOP=keys.TIER_BIT >> (8 * (keys.NID_BYTES - 1)), OP=notices.BACKUP.decode(),
                MAX=notices.MAX_ENTRIES, TTL=notices.TTL_MS))


def _split(blob: bytes) -> list[bytes]:
    return [blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


def back_up(r: Client, namespace: str, source_nid: int, backers: Iterable[int], hashes: Sequence[bytes],
            prefix: str = keys.BUCKET_PREFIX) -> tuple[list[bytes], list[bytes]]:
    """Demote on the source (nid ``source_nid``) those of ``hashes`` that one of ``backers``
    (nids) holds in the index now, in one atomic step with the index (:data:`_BACK`). Returns
    them, and those of the rest the source no longer holds (nothing left to back up)."""
    if not hashes:
        return [], []
    tag = keys.ns_tag(namespace)
    backed, gone = _BACK(r, [keys.anchor_key(tag)],
                         [keys.bucket_prefix(tag, prefix), b"".join(map(nid_bytes, sorted(backers))), b"".join(hashes),
                          keys.notice_key(tag, source_nid), nid_bytes(source_nid)])
    return _split(backed), _split(gone)


@dataclass(frozen=True)
class Target:
    name: str
    nid: int
    max_bytes: int  # its --backup-pull-max-bytes
    queued: int = 0  # plans already waiting in its list


@dataclass(frozen=True)
class Source:
    name: str
    nid: int
    address: str
    offer: list[backup.Candidates]


@dataclass
class Pairing:
    plans: list[tuple[Target, backup.Plan]] = field(default_factory=list)
    backed: list[tuple[Source, str, list[bytes]]] = field(default_factory=list)  # (source, namespace, hashes)
    has_backup: int = 0  # candidates a target held already
    offered: int = 0  # candidates looked at
    next_rr: int = 0


def pair(sources: Sequence[Source], targets: Sequence[Target],
         holders: Callable[[str, list[bytes]], list[frozenset[int]]],
         in_flight: Callable[[str, str, bytes], bool], rr: int = 0) -> Pairing:
    """Plans for ``targets`` from the ``sources``' offers (see the module docstring, step 3).
    ``holders(namespace, hashes)``: the nids holding each block (the index);
    ``in_flight(source, namespace, hash)``: a plan for it is out; ``rr``: where the round robin
    starts (``Pairing.next_rr`` continues it next pass)."""
    out = Pairing(next_rr=rr)
    target_nids = {t.nid for t in targets}
    room = {t.name: MAX_QUEUED - t.queued for t in targets}
    for src in sorted(sources, key=lambda s: s.name):
        for c in src.offer:
            out.offered += len(c.hashes)
            todo = [h for h in c.hashes if not in_flight(src.name, c.namespace, h)]
            if not todo:
                continue
            backed: list[bytes] = []
            left: list[bytes] = []
            for h, held in zip(todo, holders(c.namespace, todo), strict=True):
                (backed if held & target_nids else left).append(h)
            if backed:
                out.backed.append((src, c.namespace, backed))
                out.has_backup += len(backed)
            i = 0
            while i < len(left) and targets:
                t = next((targets[(out.next_rr + j) % len(targets)] for j in range(len(targets))
                          if room[targets[(out.next_rr + j) % len(targets)].name] > 0), None)
                if t is None:
                    return out
                out.next_rr = (targets.index(t) + 1) % len(targets)
                n = max(1, t.max_bytes // max(1, c.block_bytes))
                chunk = left[i:i + n]
                i += len(chunk)
                room[t.name] -= 1
                out.plans.append((t, backup.Plan(src.name, src.address, src.nid,
                                                 backup.Candidates(c.namespace, c.block_bytes, chunk))))
    return out


def _same(labels: Mapping[str, str]) -> dict[str, str]:
    return dict(labels)


class BackupMetrics:
    """``pegaflow_meta_backup_*``, with the original's ``pegaflow_metaserver_backup_*`` names
    (its BackupPlanner's) as aliases."""

    def __init__(self, reg: CollectorRegistry) -> None:
        self.nodes = Gauge("pegaflow_meta_backup_nodes", "Live nodes by decode-backup role: source (an engine and "
                           "an offer), target, idle", ["role"], registry=reg)
        self.candidates = Gauge("pegaflow_meta_backup_candidates", "Candidate blocks in the sources' last offers",
                                registry=reg)
        self.filtered = Counter("pegaflow_meta_backup_candidates_filtered", "Backup candidates not planned "
                                "(reason=has_backup|source_gone)", ["reason"], registry=reg)
        self.dispatched_blocks = Counter("pegaflow_meta_backup_dispatched_blocks", "Backup blocks planned per "
                                         "source/target pair", ["source", "target"], registry=reg)
        self.dispatched_bytes = Counter("pegaflow_meta_backup_dispatched_bytes", "Backup bytes planned per "
                                        "source/target pair", ["source", "target"], registry=reg)
        self.pair = Gauge("pegaflow_meta_backup_pair", "1 per source/target pair with backup plans in flight",
                          ["source", "target"], registry=reg)
        for reason in (HAS_BACKUP, SOURCE_GONE):
            self.filtered.labels(reason)
        for role in ("source", "target", "idle"):
            self.nodes.labels(role)
        pairs = ("source", "target")
        OriginalNames(reg, [
            Alias("pegaflow_metaserver_backup_nodes", "gauge", "Live nodes by backup role "
                  "(pegaflow_meta_backup_nodes{role}).", ("pegaflow_meta_backup_nodes",), ("role",), relabel=_same),
            Alias("pegaflow_metaserver_backup_candidates", "gauge", "Queued backup candidate blocks across all "
                  "sources (pegaflow_meta_backup_candidates).", ("pegaflow_meta_backup_candidates",)),
            Alias("pegaflow_metaserver_backup_candidates_filtered", "counter", "Backup candidates dropped "
                  "(reason=has_backup|source_gone) (pegaflow_meta_backup_candidates_filtered_total).",
                  ("pegaflow_meta_backup_candidates_filtered",), ("reason",), relabel=_same),
            Alias("pegaflow_metaserver_backup_dispatched_blocks", "counter", "Backup blocks dispatched per "
                  "source/target pair (pegaflow_meta_backup_dispatched_blocks_total).",
                  ("pegaflow_meta_backup_dispatched_blocks",), pairs, relabel=_same),
            Alias("pegaflow_metaserver_backup_dispatched_bytes", "counter", "Estimated backup bytes dispatched per "
                  "source/target pair (pegaflow_meta_backup_dispatched_bytes_total).",
                  ("pegaflow_meta_backup_dispatched_bytes",), pairs, relabel=_same),
            Alias("pegaflow_metaserver_backup_pair", "gauge", "Current backup pairing; one series per source/target "
                  "pair (pegaflow_meta_backup_pair).", ("pegaflow_meta_backup_pair",), pairs, relabel=_same),
        ])


@dataclass
class _Flight:
    source: str
    source_nid: int
    target: str
    target_nid: int
    deadline: float


class Planner:
    """The passes of one replica (see the module docstring). ``clock``: monotonic seconds."""

    def __init__(self, r: Client, delay_ms: int, stale_ms: int | None, metrics: BackupMetrics, owner: str,
                 clock: Callable[[], float] = time.monotonic, lock_ms: int = LOCK_MS) -> None:
        self.r = r
        self.lock_ms = lock_ms  # how long the planning lock outlives a replica that died holding it
        self.delay_ms = delay_ms
        self.stale_ms = stale_ms
        self.metrics = metrics
        self.owner = owner
        self.clock = clock
        self.index = Index(r)
        self.flights: dict[tuple[str, str, bytes], _Flight] = {}  # (source, namespace, hash) -> plan out
        self.rr = 0
        self.pairs: set[tuple[str, str]] = set()
        self.targets: set[str] = set()  # the last pass's targets: settle_once settles against them

    def pass_once(self) -> Pairing | None:
        """One pass; None when another replica plans."""
        if (not self.r.set(keys.BACKUP_LOCK, self.owner, nx=True, px=self.lock_ms)
                and not RENEW_IF_HELD(self.r, [keys.BACKUP_LOCK], [self.owner, self.lock_ms])):
            return None
        nodes = registry.nodes(self.r)
        names = sorted(nodes)
        now_ms, visible = self._visible(names)
        reports = backup.reports(self.r)
        targets = [Target(n, visible[n], rep.pull_max_bytes, backup.queued(self.r, n))
                   for n in names if n in visible and (rep := reports.get(n)) is not None
                   and not rep.has_instance and now_ms - rep.since_ms >= self.delay_ms]
        backup.set_targets(self.r, [t.name for t in targets], TARGETS_TTL_MS)
        target_names = {t.name for t in targets}
        self.targets = target_names
        sources = []
        gone = 0
        for n in names:
            rep = reports.get(n)
            if n in target_names or rep is None or not rep.has_instance:
                continue
            try:
                offer = backup.read_offer(self.r, n)
            except backup.MalformedBackup as exc:
                log.warning("backup_offer_malformed", node=n, error=str(exc))
                continue
            if n not in visible:
                gone += sum(len(c.hashes) for c in offer)
            elif offer:
                sources.append(Source(n, visible[n], nodes[n].addr, offer))
        self._settle(target_names)
        now = self.clock()
        out = pair(sources, targets, self.index.holders,
                   lambda s, ns, h: (s, ns, h) in self.flights, self.rr)
        self.rr = out.next_rr
        has_backup = self._notify(out.backed, targets)
        by_target: dict[str, list[backup.Plan]] = {}
        for t, plan in out.plans:
            by_target.setdefault(t.name, []).append(plan)
            for h in plan.blocks.hashes:
                self.flights[(plan.source, plan.blocks.namespace, h)] = _Flight(
                    plan.source, plan.nid, t.name, t.nid, now + PLAN_DEADLINE_S)
            self.metrics.dispatched_blocks.labels(plan.source, t.name).inc(len(plan.blocks.hashes))
            self.metrics.dispatched_bytes.labels(plan.source, t.name).inc(plan.nbytes)
        for name, plans in by_target.items():
            backup.queue_plans(self.r, name, plans, PLAN_TTL_MS)
        m = self.metrics
        m.filtered.labels(HAS_BACKUP).inc(has_backup)
        m.filtered.labels(SOURCE_GONE).inc(gone)
        m.candidates.set(out.offered)
        m.nodes.labels("target").set(len(targets))
        m.nodes.labels("source").set(len(sources))
        m.nodes.labels("idle").set(len(visible) - len(targets) - len(sources))
        pairs = {(f.source, f.target) for f in self.flights.values()}
        for gone_pair in self.pairs - pairs:
            m.pair.remove(*gone_pair)
        for p in pairs:
            m.pair.labels(*p).set(1)
        self.pairs = pairs
        if out.plans:
            log.info("backup_planned", plans=len(out.plans), blocks=sum(len(p.blocks.hashes) for _, p in out.plans),
                     targets=sorted(by_target))
        return out

    def settle_once(self) -> None:
        """Step 2 alone, against the last pass's targets (between passes): the sources of
        copies that landed hear now rather than at the next pass. Nothing when no plan is out
        (a replica that does not plan has none)."""
        if self.flights:
            self._settle(self.targets)

    def _visible(self, names: list[str]) -> tuple[int, dict[str, int]]:
        """(Redis's clock in ms, name -> visible nid of the visible nodes among ``names``), one
        round trip. The visible nid is the one the index lists as holder."""
        if not names:
            return 0, {}
        (replies,) = parallel(self.r, [(keys.VERSION, registry.visibility_commands(names))])
        for rep in replies:
            if isinstance(rep, Exception):
                raise rep
        live, seen, now = replies
        now_ms = registry.redis_ms(now)
        return now_ms, {n: nid for nid, n in registry.fresh(names, live, seen, now_ms, self.stale_ms).items()}

    def _settle(self, targets: set[str]) -> None:
        """Plans in flight whose target holds the block now: notify the source (:func:`back_up`);
        drop those of blocks the source no longer holds, the overdue and those of nodes no
        longer ``targets``."""
        now = self.clock()
        groups: dict[tuple[str, int, str], tuple[set[int], list[bytes]]] = {}
        for k, f in list(self.flights.items()):
            if f.deadline < now or f.target not in targets:
                del self.flights[k]
            else:
                nids, hashes = groups.setdefault((f.source, f.source_nid, k[1]), (set(), []))
                nids.add(f.target_nid)
                hashes.append(k[2])
        for (source, nid, ns), (nids, hashes) in groups.items():
            backed, gone = back_up(self.r, ns, nid, nids, hashes)
            for h in backed + gone:
                del self.flights[(source, ns, h)]

    def _notify(self, backed: list[tuple[Source, str, list[bytes]]], targets: Sequence[Target]) -> int:
        """Back up blocks a target held when paired (still holds: :func:`back_up` checks again);
        returns how many."""
        nids = [t.nid for t in targets]
        return sum(len(back_up(self.r, ns, src.nid, nids, hashes)[0]) for src, ns, hashes in backed)

def run(planner: Planner, stop: threading.Event, interval: float = PASS_S, settle: float = SETTLE_S) -> None:
    """Plan every ``interval`` seconds and settle the plans in flight every ``settle`` seconds
    in between, until ``stop``."""
    failing = False
    next_pass = time.monotonic() + interval
    while not stop.wait(max(0.0, min(settle, next_pass - time.monotonic()))):
        try:
            if time.monotonic() >= next_pass:
                next_pass = time.monotonic() + interval
                planner.pass_once()
            else:
                planner.settle_once()
            if failing:
                log.info("backup_planning_recovered")
            failing = False
        except Exception as exc:  # a failed pass is retried at the next step
            if not failing:
                log.warning("backup_planning_failed", error=error_text(exc))
            failing = True
    try:  # hand over at once rather than after LOCK_MS
        RELEASE_IF_HELD(planner.r, [keys.BACKUP_LOCK], [planner.owner])
    except Exception as exc:  # noqa: BLE001 - the lock expires on its own
        log.info("backup_lock_not_released", error=error_text(exc))
