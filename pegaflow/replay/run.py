"""Drive a :class:`~pegaflow.replay.model.Cluster` with a trace and count what it hit.

``replay`` is the hot loop of ``pegaflow replay``: per request one ``Pool.serve`` (which
is the node's own ``BlockIndex`` calls) and a few integer additions; everything else
(windows, ceilings, tables) is computed afterwards from the per-request hit counts.

Counting contracts:

- A request of n blocks that hit h blocks as a prefix (across tiers) counts n block
  accesses and h hits; ``min(h * block_tokens, tokens)`` of its ``tokens`` prompt tokens
  hit (a partial last block is worth only the tokens it holds).
- Per tier: a block hits in the SSD tier if the prefix reached it through the SSD index;
  every other hit block was in L1. ``l1 + ssd == hit`` in blocks and in tokens.
- Load (the time model, :class:`~pegaflow.replay.model.TimeModel`): per request the
  instance it went to and its queueing delay. ``imbalance`` is max/mean requests per
  instance in each minute of the trace (from the first request), averaged over the minutes
  weighted by their requests; ``imbalance_max`` the worst minute's; delays are seconds.
"""

from __future__ import annotations

import gc
import heapq
import math
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field

import numpy as np

from pegaflow.core.tiers import Tier
from pegaflow.core.trace import Trace
from pegaflow.replay.model import Cluster, Pool, Scenario

# Progress is reported every this many requests: often enough for a smooth bar, rarely
# enough that the callback costs nothing measurable.
PROGRESS_EVERY = 512

Progress = Callable[[int], None]  # called with the number of requests done since the last call


@dataclass
class RunResult:
    """What one scenario hit on one trace."""

    scenario: Scenario
    l1_capacity_blocks: int
    blocks: int = 0
    hit_blocks: int = 0
    ssd_hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    ssd_hit_tokens: int = 0
    evictions: int = 0
    ssd_evictions: int = 0
    admission_rejections: int = 0
    seconds: float = 0.0  # wall time of the replay loop
    cpu_seconds: float = 0.0  # CPU time of this process in it (steadier on a busy machine)
    request_hits: list[int] = field(default_factory=list, repr=False)  # per request, trace order
    # Per namespace: [block accesses, prefix hit blocks] (from request_hits, after the run).
    namespaces: dict[str, list[int]] = field(default_factory=dict)
    request_instance: list[int] = field(default_factory=list, repr=False)  # per request, trace order
    queue_delays: list[float] = field(default_factory=list, repr=False)  # seconds, per request
    imbalance: float = 1.0  # max/mean requests per instance per minute, request-weighted mean
    imbalance_max: float = 1.0  # the worst minute's
    delay_mean: float = 0.0  # queueing delay, seconds
    delay_p99: float = 0.0
    load_redirects: int = 0  # kv-aware: requests the load bound sent off the pool that saves the most

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def l1_hit_blocks(self) -> int:
        return self.hit_blocks - self.ssd_hit_blocks

    @property
    def l1_hit_tokens(self) -> int:
        return self.hit_tokens - self.ssd_hit_tokens

    @property
    def accesses_per_second(self) -> float:
        return self.blocks / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        sc = asdict(self.scenario)
        sc["l1"] = str(self.scenario.l1)
        sc["ssd"] = str(self.scenario.ssd)
        sc["quotas"] = [str(q) for q in self.scenario.quotas]
        return {
            "scenario": sc,
            "label": self.scenario.label,
            "l1_capacity_blocks": self.l1_capacity_blocks,
            "blocks": self.blocks,
            "hit_blocks": self.hit_blocks,
            "l1_hit_blocks": self.l1_hit_blocks,
            "ssd_hit_blocks": self.ssd_hit_blocks,
            "hit_rate": self.hit_rate,
            "tokens": self.tokens,
            "hit_tokens": self.hit_tokens,
            "l1_hit_tokens": self.l1_hit_tokens,
            "ssd_hit_tokens": self.ssd_hit_tokens,
            "token_hit_rate": self.token_hit_rate,
            "evictions": self.evictions,
            "ssd_evictions": self.ssd_evictions,
            "admission_rejections": self.admission_rejections,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "accesses_per_second": self.accesses_per_second,
            "imbalance": self.imbalance,
            "imbalance_max": self.imbalance_max,
            "delay_mean_s": self.delay_mean,
            "delay_p99_s": self.delay_p99,
            "load_redirects": self.load_redirects,
            "namespaces": {
                name: {"blocks": n, "hit_blocks": hit, "hit_rate": hit / n if n else 0.0}
                for name, (n, hit) in self.namespaces.items()
            },
        }

    def namespace_hit_rate(self, name: str) -> float:
        n, hit = self.namespaces.get(name, (0, 0))
        return hit / n if n else 0.0


def replay(trace: Trace, scenario: Scenario, progress: Progress | None = None) -> RunResult:
    """Run ``scenario`` over every request of ``trace`` in order; see the module contracts."""
    cluster = Cluster(scenario, trace.unique, trace.namespaces, trace.storable)
    res = RunResult(scenario, cluster.l1_capacity_blocks)
    # The cyclic GC would walk every resident Block again and again as the index fills
    # (a third of the run on a large cache) and find nothing: the index makes no cycles.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        c0 = time.process_time()
        _drive(trace, cluster, res, progress)
        res.seconds = time.perf_counter() - t0
        res.cpu_seconds = time.process_time() - c0
    finally:
        if gc_was_enabled:
            gc.enable()
    res.hit_blocks = sum(res.request_hits)
    for r, hit in zip(trace.requests, res.request_hits, strict=True):
        acc = res.namespaces.get(r.namespace)
        if acc is None:
            acc = res.namespaces[r.namespace] = [0, 0]
        acc[0] += len(r.hashes)
        acc[1] += hit
    load_report(trace, res, cluster.instances)
    res.load_redirects = cluster.policy.redirected
    res.evictions = cluster.counter("evictions")
    res.ssd_evictions = cluster.counter("evictions", Tier.SSD)
    res.admission_rejections = cluster.counter("admission_rejections")
    return res


def load_report(trace: Trace, res: RunResult, instances: int) -> None:
    """Imbalance and queueing delay from the per-request instances and delays."""
    if not res.queue_delays:
        return
    d = np.asarray(res.queue_delays, dtype=np.float64)
    res.delay_mean = float(d.mean())
    res.delay_p99 = float(np.percentile(d, 99))
    times = np.fromiter((r.time for r in trace.requests), dtype=np.float64, count=len(trace.requests))
    minute = np.floor((times - times.min()) / 60.0).astype(np.int64)
    _, dense = np.unique(minute, return_inverse=True)
    inst = np.asarray(res.request_instance, dtype=np.int64)
    counts = np.bincount(dense * instances + inst, minlength=(int(dense.max()) + 1) * instances)
    per = counts.reshape(-1, instances)
    total = per.sum(axis=1)
    ratio = per.max(axis=1) * instances / np.maximum(total, 1)
    res.imbalance = float((ratio * total).sum() / total.sum())
    res.imbalance_max = float(ratio.max())


def _drive(trace: Trace, cluster: Cluster, res: RunResult, progress: Progress | None) -> None:
    """The hot loop: a routing decision, the Query, the queue arithmetic and the commit per
    request. A request's computed blocks become visible at its completion (its measured
    ``done`` if the trace has it, else its modelled end of prefill with
    ``commit_at_prefill_end``, else its arrival): at once when that is not after its
    arrival (zero service time), else from a heap drained before each later arrival."""
    append = res.request_hits.append
    put = res.request_instance.append
    waited = res.queue_delays.append
    instance_for = cluster.instance_for
    pool_of = cluster.pool_of
    kv = cluster.kv_aware
    choose = cluster.choose
    n = cluster.instances
    tm = cluster.scenario.time
    per_token = tm.prefill_us_per_token * 1e-6
    ssd_per_token = per_token * tm.ssd_cost
    decode = tm.decode_s
    at_end = tm.commit_at_prefill_end
    free_at = [-math.inf] * n  # when each instance's prefill queue drains
    done: list[deque[float]] = [deque() for _ in range(n)]  # kv-aware: each request's end, per instance
    # Commits not visible yet: (time, request number, pool, namespace, computed, saved).
    pending: list[tuple[float, int, Pool, str, list[bytes], list[bytes]]] = []
    push, pop = heapq.heappush, heapq.heappop
    blocks = tokens = hit_tokens = ssd_blocks = ssd_tokens = 0
    for i, r in enumerate(trace.requests):
        t = r.time
        bt = r.block_tokens
        tok = r.tokens
        while pending and pending[0][0] <= t:
            _, _, p, ns_name, computed, saved = pop(pending)
            p.commit(ns_name, computed, saved)
        if kv:
            for q in done:
                while q and q[0] <= t:
                    q.popleft()
            k = choose(r.namespace, r.hashes, tok, bt, [len(q) for q in done], t, r.hinted)
        else:
            k = instance_for(i, r.route)
        pool = pool_of[k]
        h, runs, promoted, computed = pool.query(r.namespace, r.hashes)
        append(h)
        held = min(h * bt, tok)
        blocks += len(r.hashes)
        tokens += tok
        hit_tokens += held
        from_ssd = 0
        if runs:
            for a, e in runs:
                ssd_blocks += e - a
                from_ssd += min(e * bt, tok) - min(a * bt, tok)
            ssd_tokens += from_ssd
        start = free_at[k]
        if start < t:
            start = t
        first = start + (tok - held) * per_token + from_ssd * ssd_per_token
        free_at[k] = first
        visible = r.done if r.done is not None else first if at_end else t
        if visible <= t:  # zero service time: as Pool.serve, at once
            pool.commit(r.namespace, promoted + computed if promoted else computed, r.saved)
        else:  # SSD hits are read into L1 now; what the engine computes lands at its end
            if promoted:
                pool.commit(r.namespace, promoted)
            push(pending, (visible, i, pool, r.namespace, computed, r.saved))
        if kv:
            done[k].append(first + decode if r.done is None else r.done)
        put(k)
        waited(start - t)
        if progress is not None and i % PROGRESS_EVERY == PROGRESS_EVERY - 1:
            progress(PROGRESS_EVERY)
    while pending:  # the last requests' blocks land after the trace
        _, _, p, ns_name, computed, saved = pop(pending)
        p.commit(ns_name, computed, saved)
    if progress is not None and len(trace.requests) % PROGRESS_EVERY:
        progress(len(trace.requests) % PROGRESS_EVERY)
    res.blocks = blocks
    res.tokens = tokens
    res.hit_tokens = hit_tokens
    res.ssd_hit_blocks = ssd_blocks
    res.ssd_hit_tokens = ssd_tokens


# What forked workers of replay_many read: set before the pool forks, so the trace is
# inherited copy-on-write instead of pickled to every worker.
_SHARED: tuple[Trace, Sequence[Scenario]] | None = None


def _run_shared(i: int) -> tuple[int, RunResult]:
    assert _SHARED is not None
    trace, scenarios = _SHARED
    return i, replay(trace, scenarios[i])


def replay_many(
    trace: Trace, scenarios: Sequence[Scenario], progress: Progress | None = None, jobs: int = 1
) -> list[RunResult]:
    """``[replay(trace, s) for s in scenarios]``, on up to ``jobs`` processes.

    Results are in the order of ``scenarios`` and equal to a sequential run (each replay is
    deterministic and independent). Workers are forked, so they share the parsed trace;
    where fork is not available the runs are sequential. With workers, ``progress``
    advances by a whole run as each one finishes.
    """
    jobs = max(1, min(jobs, len(scenarios)))
    if jobs == 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [replay(trace, sc, progress) for sc in scenarios]
    global _SHARED
    _SHARED = (trace, scenarios)
    out: list[RunResult | None] = [None] * len(scenarios)
    try:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            for fut in as_completed([pool.submit(_run_shared, i) for i in range(len(scenarios))]):
                i, res = fut.result()
                out[i] = res
                if progress is not None:
                    progress(len(trace.requests))
    finally:
        _SHARED = None
    return [r for r in out if r is not None]
