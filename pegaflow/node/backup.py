"""The node's side of the decode backup (docs/architecture.md, "Decode backup").

Every ``BACKUP_TICK_S`` the node tells the metaserver, through Redis
(``pegaflow/cluster/backup.py``), whether an engine is registered on it, and, when one is
and its pool is full, offers its oldest retained blocks (:func:`pick_candidates`); it reads
whether the planner made it a backup target and, as a target with no plan running, takes
one plan and pulls it (:meth:`BackupAgent.execute`, through the node's puller) at most at
``--backup-max-bandwidth`` (:class:`TokenBucket`); when the plan is pulled it reports again
and takes the next one at once, without waiting for the tick. The source side needs nothing more: the
planner's class notices demote what a target copied (``pegaflow/node/classes.py``).

Contracts:
- The candidates and the plan's pull run on the node's event loop (the index's thread);
  only the Redis calls run in a worker thread.
- A node offers only while an engine is registered: a target never offers.
- A plan runs only while the node has no engine; one that arrives after an engine
  registered is dropped (the planner re-plans its blocks once the node is no longer a
  target: the pass after its report says it has an engine).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from pegaflow.cluster import backup
from pegaflow.cluster.redis_conn import Client, error_text
from pegaflow.common.metric_alias import Alias, OriginalNames
from pegaflow.core.block_index import Block, BlockIndex
from pegaflow.node.sessions import Sessions
from pegaflow.node.tiers.remote.puller import Puller
from pegaflow.policy.backup import backup_candidates

log = structlog.get_logger("pegaflow.node.backup")

BACKUP_TICK_S = 1.0  # between reports (and offers, and looks for a plan)
OFFER_TTL_MS = 3000  # an offer outlives two missed ticks, not a node that stopped offering


@dataclass(frozen=True)
class BackupSettings:
    """The node's --backup-* options."""

    reclaimable_percent: int
    max_candidates: int
    pull_max_bytes: int
    max_bandwidth: int  # bytes per second; 0: unlimited


class TokenBucket:
    """Bytes per second on average, with bursts up to ``burst`` bytes.

    :meth:`take` charges ``n`` bytes and returns how long to wait before sending them; the
    balance may go negative (a plan larger than what is saved waits for the whole of it),
    so over any span ``t`` at most ``burst + rate * t`` bytes go. ``rate`` 0: no limit.
    """

    def __init__(self, rate: int, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = max(burst, 1)
        self.clock = clock
        self.tokens = float(self.burst)
        self.at = clock()

    def take(self, n: int) -> float:
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


def pick_candidates(index: BlockIndex, percent: int, most: int) -> list[backup.Candidates]:
    """The blocks a busy node offers now (the rule of ``pegaflow/policy/backup.py``, which
    ``pegaflow replay`` applies too), grouped by namespace."""
    return _grouped(backup_candidates(index, percent, most))


def _grouped(blocks: list[Block]) -> list[backup.Candidates]:
    by_ns: dict[int, backup.Candidates] = {}
    for b in blocks:
        c = by_ns.get(b.ns.id)
        if c is None:
            c = by_ns[b.ns.id] = backup.Candidates(b.ns.name, b.ns.page_bytes, [])
        c.hashes.append(b.hash)
    return list(by_ns.values())


class BackupMetrics:
    """``pegaflow_node_backup_*``, with the original's ``pegaflow_backup_*`` names as aliases."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.role = Gauge("pegaflow_node_backup_target", "1 while the planning metaserver treats this node as a "
                          "decode backup target, else 0", registry=registry)
        self.candidates = Counter("pegaflow_node_backup_candidates_offered", "Retained LRU-tail blocks this node "
                                  "offered for backup", registry=registry)
        self.missing = Counter("pegaflow_node_backup_missing_blocks", "Planned backup blocks the source no longer "
                               "held when this node pulled", registry=registry)
        self.pulled_blocks = Counter("pegaflow_node_backup_pulled_blocks", "Blocks this node copied as a decode "
                                     "backup target", registry=registry)
        self.pulled_bytes = Counter("pegaflow_node_backup_pulled_bytes", "Bytes this node copied as a decode backup "
                                    "target", registry=registry)
        OriginalNames(registry, [
            Alias("pegaflow_backup_role", "gauge", "1 while the MetaServer treats this node as a decode backup "
                  "target, else 0 (pegaflow_node_backup_target).", ("pegaflow_node_backup_target",)),
            Alias("pegaflow_backup_candidates_reported", "counter", "Retained LRU-tail blocks reported to the "
                  "MetaServer for backup (pegaflow_node_backup_candidates_offered_total).",
                  ("pegaflow_node_backup_candidates_offered",)),
            Alias("pegaflow_backup_pull_missing_blocks", "counter", "Planned backup blocks the source no longer "
                  "held when the target pulled (pegaflow_node_backup_missing_blocks_total).",
                  ("pegaflow_node_backup_missing_blocks",)),
        ])


class BackupAgent:
    """One node's backup tick (see the module docstring). ``connect`` makes its Redis client
    (called in a worker thread, again after a failure); ``puller`` None: this node cannot pull
    (no --metaserver-addr), so it reports and offers but takes no plan."""

    def __init__(self, settings: BackupSettings, index: BlockIndex, sessions: Sessions, node_id: str,
                 connect: Callable[[], Client], puller: Puller | None, metrics: BackupMetrics,
                 tick: float = BACKUP_TICK_S) -> None:
        self.settings = settings
        self.index = index
        self.sessions = sessions
        self.node_id = node_id
        self.connect = connect
        self.puller = puller
        self.metrics = metrics
        self.tick = tick
        burst = max(settings.pull_max_bytes, settings.max_bandwidth)
        self.bucket = TokenBucket(settings.max_bandwidth, burst)
        self.plan_task: asyncio.Task[None] | None = None
        self._r: Client | None = None
        self.target = False  # the planner's last word on this node's role
        self._offered = False
        self._failing = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            has_instance = bool(self.sessions.sessions)
            groups = pick_candidates(self.index, self.settings.reclaimable_percent,
                                     self.settings.max_candidates) if has_instance else []
            want_plan = self.puller is not None and not has_instance and (
                self.plan_task is None or self.plan_task.done())
            try:
                target, plan = await loop.run_in_executor(None, self._exchange, has_instance, groups, want_plan)
            except Exception as exc:  # Redis away: report again next tick
                self._r = None
                if not self._failing:
                    log.warning("backup_report_failed", error=error_text(exc))
                self._failing = True
            else:
                if self._failing:
                    log.info("backup_report_recovered")
                self._failing = False
                if target != self.target:
                    log.info("backup_role_changed", backup_target=target)
                    self.target = target
                self.metrics.role.set(float(target))
                self.metrics.candidates.inc(sum(len(g.hashes) for g in groups))
                if plan is not None:
                    self.plan_task = asyncio.create_task(self.execute(plan))
            task = self.plan_task
            if task is not None and not task.done():
                # A target takes its next plan as soon as this one is pulled, not at the next
                # tick: copies land sooner (the bucket still paces the bytes).
                await asyncio.wait({task}, timeout=self.tick)
            else:
                await asyncio.sleep(self.tick)

    def _exchange(self, has_instance: bool, groups: list[backup.Candidates],
                  want_plan: bool) -> tuple[bool, backup.Plan | None]:
        """Worker thread: report, offer, read the role, take a plan."""
        if self._r is None:
            self._r = self.connect()
        r = self._r
        backup.report(r, self.node_id, has_instance, self.settings.pull_max_bytes)
        if groups or self._offered:
            backup.offer(r, self.node_id, groups, OFFER_TTL_MS)
            self._offered = bool(groups)
        target = backup.is_target(r, self.node_id)
        plan = None
        if target and want_plan:
            try:
                plan = backup.pop_plan(r, self.node_id)
            except backup.MalformedBackup as exc:
                log.warning("backup_plan_malformed", error=str(exc))
        return target, plan

    async def execute(self, plan: backup.Plan) -> None:
        """Pull one plan (event loop), after the bandwidth allows its bytes."""
        assert self.puller is not None
        log.info("backup_plan_taken", source=plan.source, namespace=plan.blocks.namespace,
                 blocks=len(plan.blocks.hashes), first=plan.blocks.hashes[0].hex() if plan.blocks.hashes else "")
        if self.sessions.sessions:
            log.info("backup_plan_dropped", source=plan.source, reason="an engine registered")
            return
        wait = self.bucket.take(min(plan.nbytes, self.settings.pull_max_bytes))
        if wait > 0:
            await asyncio.sleep(wait)
            if self.sessions.sessions:  # one registered meanwhile: its pool is not a backup's
                log.info("backup_plan_dropped", source=plan.source, reason="an engine registered")
                return
        c = plan.blocks
        try:
            landed, nbytes, missing = await self.puller.backup(c.namespace, c.block_bytes, plan.source,
                                                                plan.address, c.hashes)
        except ValueError as exc:  # the namespace's page size differs here: nothing to copy
            log.warning("backup_plan_refused", source=plan.source, error=str(exc))
            return
        self.metrics.pulled_blocks.inc(landed)
        self.metrics.pulled_bytes.inc(nbytes)
        self.metrics.missing.inc(missing)
        log.info("backup_pulled", source=plan.source, namespace=c.namespace, planned=len(c.hashes),
                 blocks=landed, bytes=nbytes, missing=missing)

    async def close(self) -> None:
        if self.plan_task is not None and not self.plan_task.done():
            self.plan_task.cancel()
            await asyncio.gather(self.plan_task, return_exceptions=True)
