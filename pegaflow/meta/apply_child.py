"""The consumer's child process (``apply_process.ConsumerProcess`` spawns it): its entry and
the snapshots of its series it sends the parent.

A spawned child imports the module of its target before it runs it. This module imports
neither structlog nor what imports it, so :func:`main` hides ``rich`` from structlog before
anything loads structlog, as ``pegaflow-meta`` does for itself (``common/startup.py``; ~0.04 s
of CPU less per child start here), then imports the consumer.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from pegaflow.common.startup import set_on_signals, structlog_without_rich

if TYPE_CHECKING:
    from pegaflow.meta.events.consumer import ConsumerMetrics

REPORT_S = 1.0
PR_SET_PDEATHSIG = 1

Snapshot = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def series(metrics: ConsumerMetrics) -> dict[str, Counter | Gauge]:
    """Sample name -> the series, for every series ``ConsumerMetrics`` defines."""
    out: dict[str, Counter | Gauge] = {}
    for s in vars(metrics).values():
        if isinstance(s, Counter | Gauge):
            family = next(iter(s.describe()))
            out[family.name if isinstance(s, Gauge) else family.name + "_total"] = s
    return out


def snapshot(metrics: ConsumerMetrics) -> Snapshot:
    """The consumer series' current values, keyed by (sample name, labels)."""
    names = series(metrics)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in metrics.registry.collect()
        for s in m.samples
        if s.name in names
    }


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent check below still ends us
        pass


def main(conn: Connection, stop: Event, redis_url: str | Sequence[str], cluster: bool, name: str, lease_ms: int,
         log_level: str, log_format: str, parent: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (a terminal's ^C reaches both)
    structlog_without_rich()
    from pegaflow.cluster.redis_conn import connect
    from pegaflow.common.logging import configure_logging
    from pegaflow.meta.events.consumer import Consumer, ConsumerMetrics
    from pegaflow.meta.index import Index

    configure_logging(log_level, log_format)
    metrics = ConsumerMetrics()
    r = connect(redis_url, cluster)
    consumer = Consumer(r, Index(r), name, lease_ms=lease_ms, metrics=metrics)
    done = threading.Event()
    set_on_signals(done, signal.SIGTERM)  # a graceful end: the leases are released

    def watch() -> None:
        while not done.wait(REPORT_S):
            try:
                conn.send(snapshot(metrics))
            except (OSError, EOFError):
                done.set()
            if stop.is_set() or os.getppid() != parent:
                done.set()
        try:
            conn.send(snapshot(metrics))
        except (OSError, EOFError):
            pass

    watcher = threading.Thread(target=watch, name="pf-meta-report", daemon=True)
    watcher.start()
    consumer.run(done)
    done.set()
    watcher.join(timeout=2 * REPORT_S)
