"""The ceiling r* = (N - U) / N of a trace: exactly, and as the node's HLL estimator sees it.

Windows are tumbling and aligned to the first request: window j of length w holds the
requests with ``j = floor(t' / (w / buckets)) // buckets`` where ``t' = t - t0``. That is
bucket for bucket the window the node's
:class:`~pegaflow.policy.ceiling.CeilingEstimator` reads at the end of window j (its ring
of ``buckets`` sub-windows then covers exactly window j), so the exact and the estimated
columns describe the same requests. The estimator is the production one, fed exactly
as the node feeds it: one ``observe(keys, hits, now)`` per request, in time order.

Exact counts use the trace's dense block ids (numpy unique over (window, id) pairs), so
they cost O(N log N) per window length whatever the trace's span.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from pegaflow.core.durations import format_duration
from pegaflow.core.trace import Trace
from pegaflow.policy.ceiling import DEFAULT_BUCKETS, CeilingEstimator


@dataclass(frozen=True)
class WindowRow:
    """One tumbling window of one length."""

    window: str  # label, e.g. "15m"
    index: int  # j
    start: float  # seconds since the first request
    blocks: int  # N
    unique: int  # U, exact
    ceiling: float  # (N - U) / N, exact
    ceiling_hll: float  # the estimator's r* for the same window
    hit_rate: float  # measured hits / N of the primary run in this window


@dataclass(frozen=True)
class CeilingReport:
    blocks: int  # N
    unique: int  # U
    ceiling: float  # exact (N - U) / N over the whole trace
    ceiling_hll: float  # HLL estimate over the whole trace
    hll_lg_k: int
    windows: list[WindowRow]

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["windows"] = [asdict(w) for w in self.windows]
        return d


def _window_index(rel: np.ndarray, window: float, buckets: int) -> np.ndarray:
    """floor(t / length) // buckets with the estimator's own float operations."""
    length = window / buckets
    return np.floor(rel / length).astype(np.int64) // buckets


def ceiling_report(
    trace: Trace,
    request_hits: Sequence[int],
    windows: Sequence[float],
    buckets: int = DEFAULT_BUCKETS,
) -> CeilingReport:
    """Exact and estimated ceilings, whole-trace and per window; see the module docstring.

    ``request_hits`` are the primary run's hit blocks per request (trace order); they give
    each window's measured hit rate.
    """
    reqs = trace.requests
    n_blocks = trace.blocks
    if not reqs or n_blocks == 0:
        return CeilingReport(0, 0, 0.0, 0.0, 0, [])
    times = np.fromiter((r.time for r in reqs), dtype=np.float64, count=len(reqs))
    t0 = float(times.min())
    rel = times - t0
    order = np.argsort(rel, kind="stable")  # the estimator wants time order
    lengths = np.fromiter((len(r.ids) for r in reqs), dtype=np.int64, count=len(reqs))
    ids = np.fromiter((i for r in reqs for i in r.ids), dtype=np.int64, count=n_blocks)
    hits = np.asarray(request_hits, dtype=np.int64)
    unique = trace.unique

    # Whole trace: one bucket longer than the span, so every request falls in bucket 0.
    whole_len = float(rel.max()) + 1.0
    whole = CeilingEstimator([whole_len], buckets=1, clock=lambda: 0.0)
    est = CeilingEstimator(list(windows), buckets=buckets, clock=lambda: 0.0) if windows else None
    # Window index of each request for each length, and where the estimator must be read.
    per_window = {w: _window_index(rel, w, buckets) for w in (est.windows if est else ())}
    rows: list[WindowRow] = []
    hll: dict[tuple[float, int], float] = {}
    current: dict[float, int | None] = {w: None for w in per_window}
    for k in order.tolist():
        r = reqs[k]
        t = float(rel[k])
        if est is not None:
            for w, idx in per_window.items():
                j = int(idx[k])
                cur = current[w]
                if cur is not None and j != cur:
                    hll[(w, cur)] = _read(est, w, cur, buckets)
                current[w] = j
            est.observe(r.ids, int(hits[k]), now=t)
        whole.observe(r.ids, int(hits[k]), now=t)
    for w, cur in current.items():  # empty without an estimator
        if cur is not None and est is not None:
            hll[(w, cur)] = _read(est, w, cur, buckets)

    for w, idx in per_window.items():
        # Only windows that hold requests are counted (dense numbering): a trace spanning
        # years of mostly empty windows costs what its requests cost, not one slot per window.
        present, dense = np.unique(idx, return_inverse=True)
        acc_win = np.repeat(dense, lengths)
        n_per = np.bincount(dense, weights=lengths, minlength=len(present)).astype(np.int64)
        h_per = np.bincount(dense, weights=hits, minlength=len(present)).astype(np.int64)
        pairs = np.unique(acc_win * np.int64(unique) + ids)
        u_per = np.bincount(pairs // np.int64(unique), minlength=len(present))
        label = format_duration(w)
        for d, j in enumerate(present.tolist()):
            n = int(n_per[d])
            if n == 0:
                continue
            u = int(u_per[d])
            rows.append(
                WindowRow(label, j, j * w, n, u, (n - u) / n, hll.get((w, j), math.nan), int(h_per[d]) / n)
            )
    return CeilingReport(
        blocks=n_blocks,
        unique=unique,
        ceiling=(n_blocks - unique) / n_blocks,
        ceiling_hll=whole.ceiling(whole_len, now=0.0),
        hll_lg_k=whole.lg_k,
        windows=rows,
    )


def _read(est: CeilingEstimator, window: float, j: int, buckets: int) -> float:
    """The estimator's r* for tumbling window j: read in the middle of its last bucket."""
    length = window / buckets
    return est.ceiling(window, now=((j + 1) * buckets - 0.5) * length)
