"""The replica's consumer (``events.consumer.Consumer``) in a process of its own, beside the gRPC server.

Why: applying updates is Python work (decoding entries, packing ``HSETNX`` batches, reading
replies) on the same interpreter lock as the gRPC handlers. With the consumer in the
server's process, QueryPrefix while updates were applied at full rate had a p99 of
15.6-16.3 ms; with it in a process of its own 8.4-9.0 ms, and the apply rate rose from
83-92k to 107-114k updates/s (a 2-core host, two interleaved runs each, the workload of
bench/meta.py).

Contracts:

- The child consumes under the replica's name, so a child restarted after a crash takes
  its own leases back at once (``events.consumer._ACQUIRE``); its entries were never acked, so
  nothing is lost (the module contracts of ``events/consumer.py``).
- It stops when :meth:`ConsumerProcess.stop` asks (releasing its leases, as the in-process
  consumer did), and dies with its parent: ``PR_SET_PDEATHSIG`` and a check of the parent
  every second, so a SIGKILLed metaserver leaves no consumer behind.
- Every ``REPORT_S`` it sends the values of its ``ConsumerMetrics``; the parent adds the
  increments to its own (``MetaMetrics.consumer``), so ``--http-addr`` serves the same series as
  before (at most ``REPORT_S`` late).
- A child that exits by itself is logged and started again after a delay that doubles up
  to ``RESTART_MAX_S`` (reset once a child lived ``RESTART_MAX_S``).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess

import structlog
from prometheus_client import Gauge

from pegaflow.common.priority import name_thread
from pegaflow.meta import apply_child
from pegaflow.meta.apply_child import Snapshot
from pegaflow.meta.events.consumer import ConsumerMetrics

log = structlog.get_logger("pegaflow.meta.apply_process")

RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
STOP_TIMEOUT_S = 15.0  # the consumer finishes its step and releases its leases

def fold(into: ConsumerMetrics, now: Snapshot, before: Snapshot) -> None:
    """Add what a child counted between two snapshots to ``into`` (gauges: set)."""
    series = apply_child.series(into)
    for (name, labels), value in now.items():
        target = series[name]
        if labels:
            target = target.labels(**dict(labels))
        if isinstance(target, Gauge):
            target.set(value)
        elif value > before.get((name, labels), 0.0):
            target.inc(value - before.get((name, labels), 0.0))


class ConsumerProcess:
    """Starts, supervises and stops the child; folds its series into ``metrics``."""

    def __init__(self, redis_url: str | Sequence[str], cluster: bool, name: str, lease_ms: int, metrics: ConsumerMetrics,
                 log_level: str = "info", log_format: str = "console") -> None:
        self.args = (redis_url, cluster, name, lease_ms, log_level, log_format)
        self.name = name
        self.metrics = metrics
        self._ctx = multiprocessing.get_context("spawn")  # the parent runs gRPC threads: no fork
        self._stop = self._ctx.Event()
        self._stopping = threading.Event()
        self._proc: SpawnProcess | None = None
        self._conn: Connection | None = None
        self._last: Snapshot = {}
        self._thread: threading.Thread | None = None
        self.restarts = 0

    def start(self) -> None:
        """Start the child and the thread that watches it (from the main thread: the child's
        death signal follows the thread that started it, and a restart comes from the same)."""
        self._spawn()
        self._thread = threading.Thread(target=self._supervise, name="pf-meta-apply-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the child to finish (it releases its leases) and wait until the supervisor has
        seen it end. Only the supervisor thread waits on the child: two threads polling one
        multiprocessing child race on its exit status (the loser sees it alive forever)."""
        self._stopping.set()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S + 10)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _spawn(self) -> None:
        here, there = self._ctx.Pipe(duplex=False)
        self._proc = self._ctx.Process(
            target=apply_child.main, args=(there, self._stop, *self.args, os.getpid()), name="pf-meta-apply",
            daemon=True,
        )
        self._proc.start()
        there.close()
        self._conn = here
        self._last = {}
        log.info("consumer_process_started", consumer=self.name, pid=self._proc.pid)

    def _drain(self, wait: float) -> None:
        conn = self._conn
        if conn is None:  # the child closed its end (it is ending): wait, do not spin
            self._stopping.wait(wait)
            return
        try:
            while conn is not None and conn.poll(wait):
                now = conn.recv()
                fold(self.metrics, now, self._last)
                self._last = now
                wait = 0
        except (EOFError, OSError):
            self._conn = None

    def _supervise(self) -> None:
        name_thread()
        delay = RESTART_MIN_S
        started = time.monotonic()
        while True:
            self._drain(0.2)
            if self._stopping.is_set():
                self._end_child()
                return
            assert self._proc is not None  # _spawn ran before the supervisor started
            if self._proc.is_alive():
                continue
            self._drain(0)
            lived = time.monotonic() - started
            if lived >= RESTART_MAX_S:
                delay = RESTART_MIN_S
            log.warning("consumer_process_exited", consumer=self.name, exitcode=self._proc.exitcode,
                        restart_in_s=delay)
            if self._stopping.wait(delay):
                return
            delay = min(delay * 2, RESTART_MAX_S)
            self.restarts += 1
            started = time.monotonic()
            self._spawn()

    def _end_child(self) -> None:
        proc = self._proc
        assert proc is not None  # _spawn ran before the supervisor started
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while proc.is_alive() and time.monotonic() < deadline:
            self._drain(0.1)  # its last report, and keep its pipe from filling
        if proc.is_alive():
            log.warning("consumer_process_killed", consumer=self.name, pid=proc.pid)
            proc.kill()
            proc.join(timeout=5)
        self._drain(0)
