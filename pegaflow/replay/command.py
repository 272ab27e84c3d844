"""``pegaflow replay TRACE``: read a trace, run the scenarios, print the report.

``--nodes N`` (> 1) runs the cluster model instead (pegaflow/replay/cluster.py): N nodes
with the capacities each, peer pulls, the replacement classes by owner count and, with
``--idle-nodes`` and ``--enable-decode-backup``, the decode backup; it prints the hit rate
with and without the classes (and the backup).

Exit codes: 0 done; 2 bad flags or a bad trace (one line on stderr, no traceback: the
line number of a malformed trace line is in it); 1 the trace or plot file cannot be read
or written.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

from pegaflow.config.capacity import KV_AWARE, route_field, split_routes
from pegaflow.config.commands import ReplayConfig, load
from pegaflow.config.options import REPLAY
from pegaflow.core.trace import Trace, TraceError, read_trace
from pegaflow.policy.classes import MIN_OWNER_THRESHOLD
from pegaflow.policy.quota import Quotas
from pegaflow.replay.cluster import BackupSettings, cluster_lines
from pegaflow.replay.files import iter_lines
from pegaflow.replay.model import ISOLATED, SHARED, Scenario, TimeModel, scenario_grid
from pegaflow.replay.report import Report, plot, render_table
from pegaflow.replay.run import replay_many
from pegaflow.replay.windows import ceiling_report

DESCRIPTION = (
    "Replay a request trace (Mooncake JSONL or the node's query trace) through the node's own "
    "block index and admission code; report prefix hit rates, the (N-U)/N ceiling, per-window "
    "ceilings, a capacity sweep and shared vs isolated pools."
)


def freeze_heap() -> None:
    """Move what exists now (the trace: ~10^5-10^7 objects that live for the whole run) out
    of the collector's sight: otherwise every collection the replay's allocations trigger
    scans it again. Measured: the L1 12.5% + SSD 50% case of bench/replay.py ran at
    0.6 M accesses/s right after reading the trace, 1.0 M/s after this."""
    gc.collect()
    gc.freeze()


class _Progress:
    """A tqdm bar on stderr when it is a terminal (and not --quiet); otherwise nothing."""

    def __init__(self, total: int, enabled: bool, desc: str, unit: str = "req") -> None:
        self.bar = None
        if enabled and total and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                unit_scale=unit == "B",
                file=sys.stderr,
                leave=False,
                dynamic_ncols=True,
            )

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _counted(lines: Iterator[bytes], bar: _Progress) -> Iterator[bytes]:
    """Pass lines through, advancing ``bar`` by their length every 4096 lines."""
    if bar.bar is None:
        yield from lines
        return
    n = 0
    for i, line in enumerate(lines, 1):
        n += len(line)
        if i % 4096 == 0:
            bar(n)
            n = 0
        yield line
    bar(n)


def _cluster_error(opts: ReplayConfig) -> str | None:
    """What the cluster model (``--nodes`` > 1) cannot run, in one line; None when it can or is off."""
    if opts.nodes == 1:
        return "--idle-nodes needs --nodes above 1" if opts.idle_nodes else None
    if opts.instances > 1:
        return "--nodes models one engine per busy node: leave --instances at 1"
    unmodelled = [flag for flag, given in (("--enable-lfu-admission", opts.enable_lfu_admission),
                                           ("--compare-admission", opts.compare_admission),
                                           ("--namespace-quota", bool(opts.namespace_quota)),
                                           ("--plot", bool(opts.plot))) if given]
    if unmodelled:
        return f"{', '.join(unmodelled)}: not in the cluster model (--nodes); run them without --nodes"
    if opts.idle_nodes >= opts.nodes:
        return f"--idle-nodes must be below --nodes ({opts.nodes}): some node serves the requests"
    if opts.enable_decode_backup and not opts.idle_nodes:
        return "--enable-decode-backup needs --idle-nodes (the backup targets)"
    if opts.min_reclaimable_owner_count < MIN_OWNER_THRESHOLD:
        return f"--min-reclaimable-owner-count must be at least {MIN_OWNER_THRESHOLD}"
    routes = split_routes(opts.route)
    if len(routes) > 1 or routes[0] == KV_AWARE:
        return "--nodes routes round-robin or by field:NAME, one rule"
    return None


def _cluster_report(opts: ReplayConfig, trace: Trace) -> int:
    """``--nodes`` > 1: the cluster model's runs (pegaflow/replay/cluster.py), printed."""
    backup = BackupSettings(percent=opts.backup_reclaimable_percent) if opts.enable_decode_backup else None
    lines, runs = cluster_lines(trace, opts.nodes, opts.l1_capacity, opts.ssd_capacity, page_bytes=opts.page_bytes,
                                peers_modes=(True,), route_by=opts.route, ssd_writes=opts.ssd_writes,
                                owner_threshold=opts.min_reclaimable_owner_count, idle=opts.idle_nodes,
                                backup=backup)
    if opts.json:
        sys.stdout.write(json.dumps({"trace": opts.trace, "requests": len(trace.requests), "cluster": runs}) + "\n")
    else:
        sys.stdout.write(f"{opts.trace}: {len(trace.requests)} requests, {trace.unique} distinct blocks; "
                         f"per node L1 {opts.l1_capacity}, SSD {opts.ssd_capacity}\n" + "\n".join(lines) + "\n")
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "pegaflow replay") -> int:
    opts: ReplayConfig = load(REPLAY, prog, argv, description=DESCRIPTION)

    def fail(msg: str, code: int = 2) -> int:
        sys.stderr.write(f"{prog}: error: {msg}\n")
        return code

    if opts.plot and importlib.util.find_spec("matplotlib") is None:  # before a long replay, not after
        return fail("--plot needs matplotlib: pip install 'pegaflow[plot]'")
    cluster = opts.nodes > 1
    if (bad := _cluster_error(opts)) is not None:
        return fail(bad)
    started = time.perf_counter()
    routes = split_routes(opts.route) if opts.instances > 1 or cluster else [opts.route]
    try:
        size = os.path.getsize(opts.trace) if not opts.trace.endswith(".gz") else 0
    except OSError:
        size = 0
    reading = _Progress(size, not opts.quiet, "read", "B")
    try:
        trace = read_trace(
            _counted(iter_lines(opts.trace), reading),
            opts.trace_format,
            block_tokens=opts.block_tokens,
            route_field=next(filter(None, map(route_field, routes)), None) if opts.instances > 1 or cluster else None,
            skip_bad=opts.skip_bad,
            namespace_field=opts.namespace_field or None,
        )
    except TraceError as exc:
        where = f"{opts.trace}:{exc.line}" if exc.line else opts.trace
        return fail(f"{where}: {exc.message}")
    except OSError as exc:
        return fail(f"cannot read trace {opts.trace}: {exc.strerror or exc}", 1)
    finally:
        reading.close()
    freeze_heap()
    if not trace.requests:
        return fail(
            f"{opts.trace}: no requests" + (f" ({trace.skipped} bad lines skipped)" if trace.skipped else "")
        )

    if cluster:
        return _cluster_report(opts, trace)
    try:  # what one flag cannot check: guarantees over the whole pool, a name given twice
        Quotas(opts.namespace_quota)
    except ValueError as exc:
        return fail(f"--namespace-quota: {exc}")
    base = Scenario(
        l1=opts.l1_capacity,
        ssd=opts.ssd_capacity,
        page_bytes=opts.page_bytes,
        instances=opts.instances,
        route=opts.route,
        tinylfu=opts.enable_lfu_admission,
        ssd_writes=opts.ssd_writes,
        quotas=opts.namespace_quota,
        time=TimeModel(opts.prefill_us_per_token, opts.decode_seconds, opts.load_bound, opts.load_window,
                       opts.ssd_hit_cost, opts.commit_at_prefill_end),
    )
    if opts.instances == 1:
        pools = [SHARED]
    else:
        pools = {"shared": [SHARED], "isolated": [ISOLATED], "both": [SHARED, ISOLATED]}[opts.pools]
    admission = [opts.enable_lfu_admission]
    if opts.compare_admission:
        admission = [False, True]
    scenarios = [replace(sc, route=r) for r in routes for sc in scenario_grid(base, pools, admission)]
    points = opts.sweep if trace.unique else []  # no blocks: no curve to draw
    total = len(trace.requests) * len(scenarios) * (1 + len(points))
    bar = _Progress(total, not opts.quiet, "replay")
    jobs = opts.jobs or os.cpu_count() or 1
    try:
        every = replay_many(
            trace, [*scenarios, *(replace(sc, l1=cap) for sc in scenarios for cap in points)], bar, jobs
        )
    finally:
        bar.close()
    runs, sweep = every[: len(scenarios)], every[len(scenarios) :]
    ceiling = ceiling_report(trace, runs[0].request_hits, opts.ceiling_windows)
    page = next((b for b in trace.namespaces.values() if b), opts.page_bytes)
    rep = Report(opts.trace, trace, ceiling, runs, sweep, page_bytes=page)
    rep.seconds = time.perf_counter() - started
    if opts.plot:
        try:
            plot(rep, opts.plot)
        except OSError as exc:
            return fail(f"cannot write plot {opts.plot}: {exc.strerror or exc}", 1)
    sys.stdout.write(rep.to_json() + "\n" if opts.json else render_table(rep))
    return 0
